"""``--remote`` end to end through the real CLI: two machines (two workspaces, two
repositories) share one run through a bare repository served by ``git daemon``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import remote_helpers
from conftest import SANDBOXES, Gitrun, git
from helpers import one_line, stopped
from remote_helpers import Daemon, hermetic_git

from gitrun.core.errors import Exit
from gitrun.store.keys import load_keyring

pytestmark = pytest.mark.timeout(120)

FIX_MEDIAN = SANDBOXES / "fix-median"
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


class Machines(remote_helpers.Machines):
    """Machine A and machine B: each its own workspace (and sandbox repository); one
    keyring file shared out of band; one remote."""

    def cli(self, machine: str) -> Gitrun:
        return Gitrun(self.tmp / machine)


@pytest.fixture
def machines(tmp_path: Path, git_daemon: Daemon) -> Machines:
    return Machines(tmp_path, git_daemon)


def test_a_run_killed_on_machine_a_is_resumed_on_machine_b_and_every_write_lands_once(
    machines: Machines,
) -> None:
    a, b = machines.cli("a"), machines.cli("b")
    killed = a.run(
        ["run", str(FIX_MEDIAN), "--run-id", "r1", "--remote", machines.url, *machines.args("a")],
        {"GITRUN_CRASH_AT": "after_file_sync", **FAST},
    )
    assert killed.code == -9, killed.err
    first = machines.writes_on_remote("r1")
    assert len(first) == 1  # the first write landed on the remote before the kill
    resumed = b.run(
        ["resume", "r1", "--remote", machines.url, "--task", str(FIX_MEDIAN),
         "--takeover-after", "0", *machines.args("b")],
        FAST,
    )  # fmt: skip
    assert resumed.code == Exit.DONE, resumed.err
    keys = machines.writes_on_remote("r1")
    assert keys[:1] == first
    assert len(keys) == len(set(keys))  # each write once
    # The same task run on one machine without a remote makes the same writes.
    local = Gitrun(machines.tmp / "c")
    (machines.tmp / "c").mkdir()
    alone = local.run(["run", str(FIX_MEDIAN), "--run-id", "r1", *machines.args("c")], FAST)
    assert alone.code == Exit.DONE, alone.err
    repo = machines.tmp / "c" / "repos"
    task_repo = next(repo.iterdir())
    tree_alone = hermetic_git("-C", str(task_repo), "rev-parse", "gitrun/r1^{tree}").strip()
    tree_remote = hermetic_git(f"--git-dir={machines.bare}", "rev-parse", "gitrun/r1^{tree}")
    assert tree_remote.strip() == tree_alone
    count = hermetic_git("-C", str(task_repo), "rev-list", "--count", "main..gitrun/r1").strip()
    assert int(count) == len(keys)
    # Machine A, resumed later, finds the run finished by B and writes nothing more.
    again = a.run(["resume", "r1", *machines.args("a")], FAST)
    assert again.code == Exit.DONE, again.err
    assert machines.writes_on_remote("r1") == keys


def _refs(git_dir: str, run_id: str) -> dict[str, str]:
    out = hermetic_git(
        f"--git-dir={git_dir}", "for-each-ref", "--format=%(refname) %(objectname)",
        f"refs/heads/gitrun/{run_id}", f"refs/gitrun/runs/{run_id}/checkpoints/",
    )  # fmt: skip
    return dict(line.split() for line in out.splitlines())


def test_a_partition_mid_run_exits_9_naming_the_remote_and_the_run_resumes_once_it_heals(
    machines: Machines, git_daemon: Daemon
) -> None:
    a = machines.cli("a")
    args = ["run", str(FIX_MEDIAN), "-q", "--run-id", "r2", "--remote", machines.url]
    proc = a.popen(*args, *machines.args("a"), GITRUN_PAUSE_AT="after_file_sync", **FAST)
    try:
        deadline = time.monotonic() + 60
        while not stopped(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stopped(proc.pid), "the run never reached its pause point"
        git_daemon.stop()  # the partition, while the worker is between two steps
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == Exit.REMOTE_UNAVAILABLE, err
    line = one_line(err)
    assert line.startswith("gitrun: remote ")
    assert machines.url in line
    assert "unavailable" in line
    # Nothing local claims a step the remote did not take: cache refs == remote refs.
    repo = next((machines.tmp / "a" / "repos").iterdir())
    assert _refs(str(repo / ".git"), "r2") == _refs(str(machines.bare), "r2")
    landed = machines.writes_on_remote("r2")
    git_daemon.start()
    up = a.run(["resume", "r2", *machines.args("a")], FAST)
    assert up.code == Exit.DONE, up.err
    keys = machines.writes_on_remote("r2")
    assert keys[: len(landed)] == landed
    assert len(keys) == len(set(keys))


def test_resume_with_another_remote_than_the_run_s_own_is_refused(machines: Machines) -> None:
    a = machines.cli("a")
    local = a.run(["run", str(FIX_MEDIAN), "--run-id", "r3", *machines.args("a")], FAST)
    assert local.code == Exit.DONE, local.err
    refused = a.run(["resume", "r3", "--remote", machines.url, *machines.args("a")], FAST)
    assert refused.code == Exit.BAD_INPUT
    assert "local run" in one_line(refused.err)


def test_machine_b_needs_the_shared_keyring_and_registers_nothing_without_it(
    machines: Machines,
) -> None:
    a, b = machines.cli("a"), machines.cli("b")
    take = ["run", str(FIX_MEDIAN), "--run-id", "r4", "--remote", machines.url]
    crash = {"GITRUN_CRASH_AT": "after_file_sync", **FAST}
    # 3 s: long enough for A to reach its crash point on a loaded machine (1 s expired first)
    killed = a.run([*take, "--lease-seconds", "3", *machines.args("a")], crash)
    assert killed.code == -9, killed.err
    time.sleep(3.2)  # A's lease expires: from another machine A cannot be known dead
    where = ["--workspace", str(machines.tmp / "b")]
    missing = b.run([*take, *where, "--key-file", str(machines.tmp / "none.keyring")], FAST)
    assert missing.code == Exit.BAD_INPUT, missing.err
    assert "none.keyring" in one_line(missing.err)
    other = machines.tmp / "other.keyring"
    load_keyring(other)  # a keyring of its own: it knows none of A's keys
    refused = b.run([*take, *where, "--key-file", str(other)], FAST)
    assert refused.code == Exit.REFUSED, refused.err
    assert "unknown-key" in one_line(refused.err)
    assert not list((machines.tmp / "b").glob("runs/*.json"))  # nothing registered
    assert not (machines.tmp / "b" / "worktrees" / "r4").exists()
    done = b.run([*take, *where, "--key-file", str(machines.key)], FAST)
    assert done.code == Exit.DONE, done.err
    keys = machines.writes_on_remote("r4")
    assert len(keys) == len(set(keys))


def test_the_workspace_config_remote_is_the_default_for_new_runs(machines: Machines) -> None:
    (machines.tmp / "a" / "config.toml").write_text(f'remote = "{machines.url}"\n')
    a = machines.cli("a")
    done = a.run(["run", str(FIX_MEDIAN), "-q", "--run-id", "r5", *machines.args("a")], FAST)
    assert done.code == Exit.DONE, done.err
    assert machines.writes_on_remote("r5")


def test_a_bad_local_ref_is_named_as_such_not_as_remote_unavailable(machines: Machines) -> None:
    """A ref git cannot read in the local repository (issue #27 §6: one made by hand, or
    by an older gitrun from a key like 'abcdefgh.') is the cause the refusal names."""
    a = machines.cli("a")
    first = a.run(["run", str(FIX_MEDIAN), "-q", "--run-id", "r5", "--remote", machines.url,
                   *machines.args("a")], FAST)  # fmt: skip
    assert first.code == Exit.DONE, first.err
    repo = next((machines.tmp / "a" / "repos").iterdir())
    bad = "refs/gitrun/runs/r5/receipts/abcdefgh."
    tip = git(repo, "rev-parse", "HEAD").strip()
    (repo / ".git" / bad).parent.mkdir(parents=True, exist_ok=True)
    (repo / ".git" / bad).write_text(tip + "\n")
    second = a.run(["run", str(FIX_MEDIAN), "-q", "--run-id", "r6", "--remote", machines.url,
                    *machines.args("a")], FAST)  # fmt: skip
    assert second.code == Exit.REFUSED, second.err
    line = one_line(second.err)
    assert bad in line
    assert "unavailable" not in line
    assert "update-ref -d" in line
