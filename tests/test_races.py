"""Setup, registration and ownership races, with real processes and real git.

Each test drives the real CLI: runs killed with SIGKILL (``GITRUN_CRASH_AT``), workers
stopped at a named point and paused with SIGSTOP, several first runs at once. What it
checks is what a user depends on: an acknowledged step is never redone nor its worktree
deleted, a stale worker changes nothing, every run stays verifiable and resumable
without hand-editing ``.git``, and ``gitrun run`` of an existing run either continues it
(same inputs) or names what differs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import spawn
from conftest import SANDBOXES, Gitrun, git, snapshot
from helpers import PAUSING_WORKER, one_line

from gitrun.app import opening, service
from gitrun.app.workspace import Workspace
from gitrun.core.errors import Exit
from gitrun.core.records import DONE

pytestmark = pytest.mark.timeout(120)

FIX_MEDIAN = SANDBOXES / "fix-median"
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the verifier's pytest: no unrelated plugins
INSTANCE = Path(".git/worktrees/gitrun-r/gitrun-instance.json")


@pytest.fixture
def paused(
    gitrun: Gitrun, tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> Callable[..., tuple[subprocess.Popen[str], Path]]:
    """Start the CLI paused (SIGSTOP) at a fault point; returns it and its go file."""

    def start(point: str, *args: str) -> tuple[subprocess.Popen[str], Path]:
        marker, go = tmp_path / f"paused-{point}", tmp_path / f"go-{point}"
        proc = spawn.popen(
            [sys.executable, "-c", PAUSING_WORKER, point, str(marker), str(go), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=gitrun.env(**FAST),
            cwd=gitrun.home.parent,
        )
        reap.append(proc)
        wait_until(lambda: marker.exists() or proc.poll() is not None, f"the worker at {point}")
        if proc.poll() is not None:
            raise AssertionError(f"worker never reached {point}: {proc.communicate()}")
        os.kill(proc.pid, signal.SIGSTOP)
        return proc, go

    return start


def wake(proc: subprocess.Popen[str], go: Path) -> tuple[int, str, str]:
    go.write_text("go")
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=90)
    return proc.returncode, out, err


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def verified(gitrun: Gitrun, run_id: str) -> None:
    check = gitrun("checkpoint", "verify", run_id)
    assert check.code == 0, check.err


def write_keys(gitrun: Gitrun, run_id: str) -> list[str]:
    """Every idempotency key on the run's branch (git log): each write appears once."""
    record = json.loads((gitrun.home / "runs" / f"{run_id}.json").read_text())
    out = git(
        Path(record["repo"]),
        "log",
        "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly,separator=)",
        f"{record['base_commit']}..{record['branch']}",
    )
    return [line for line in out.splitlines() if line]


# -- 10.1: a missing high-water mark never destroys work ---------------------------------


def test_a_run_whose_checkpoint_ref_and_branch_were_deleted_is_refused_and_nothing_is_deleted(
    gitrun: Gitrun,
) -> None:
    crashed = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", GITRUN_CRASH_AT="before_verify")
    assert crashed.code == -signal.SIGKILL, crashed.err  # one write acknowledged
    repo = gitrun.repo("fix-median")
    worktree = gitrun.home / "worktrees" / "r"
    (worktree / "notes.txt").write_text("a human's notes, untracked\n")
    (ckpt,) = git(
        repo, "for-each-ref", "--format=%(refname)", "refs/gitrun/runs/r/checkpoints"
    ).split()
    git(repo, "update-ref", "-d", ckpt.strip())
    git(repo, "update-ref", "-d", "refs/heads/gitrun/r")
    before = snapshot(repo)

    again = gitrun("resume", "r", **FAST)
    assert again.code == Exit.REFUSED, (again.code, again.err)
    line = one_line(again.err)
    assert "high-water-mark-missing" in line
    assert "refs/heads/gitrun/r" in line  # names the missing branch too
    assert "nothing was changed" in line
    assert (worktree / "notes.txt").read_text() == "a human's notes, untracked\n"
    assert snapshot(repo) == before  # no branch rebuilt, no step re-executed

    status = gitrun("status", "r", "--json")
    assert json.loads(status.out)["phase"] == "unknown"


def test_a_deleted_run_branch_alone_is_refused_with_the_command_that_restores_it(
    gitrun: Gitrun,
) -> None:
    crashed = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", GITRUN_CRASH_AT="before_verify")
    assert crashed.code == -signal.SIGKILL, crashed.err
    repo = gitrun.repo("fix-median")
    tip = git(repo, "rev-parse", "refs/heads/gitrun/r").strip()
    git(repo, "update-ref", "-d", "refs/heads/gitrun/r")
    before = snapshot(repo)

    again = gitrun("resume", "r", **FAST)
    assert again.code == Exit.REFUSED, again.err
    line = one_line(again.err)
    assert "branch-missing" in line
    assert f"update-ref refs/heads/gitrun/r {tip}" in line
    assert snapshot(repo) == before

    git(repo, "update-ref", "refs/heads/gitrun/r", tip)  # what the message says to do
    done = gitrun("resume", "r", "-q", **FAST)
    assert done.code == Exit.DONE, done.err
    assert len(write_keys(gitrun, "r")) == 1


# -- 10.2 (setup): a stale worker never touches the instance id or the registry ----------


def test_a_worker_stopped_while_setting_up_is_named_at_once_and_no_one_undoes_its_setup(
    gitrun: Gitrun, paused: Callable[..., tuple[subprocess.Popen[str], Path]]
) -> None:
    a, go = paused(
        "setup_worktree_added",
        *("run", str(FIX_MEDIAN), "--run-id", "r", "-q", "--worker-id", "worker-a"),
    )
    repo = gitrun.repo("fix-median")
    before = snapshot(repo)

    started = time.monotonic()
    b = gitrun("resume", "r", "-q", "--worker-id", "worker-b", "--takeover-after", "0", **FAST)
    assert b.code == Exit.OWNED, b.err
    assert time.monotonic() - started < 15  # not a 30 s wait on a lock
    line = one_line(b.err)
    assert "worker-a" in line
    assert str(a.pid) in line
    assert f"kill -CONT {a.pid}" in line
    assert snapshot(repo) == before

    code, out, err = wake(a, go)
    assert code == Exit.DONE, err
    assert "done" in out
    verified(gitrun, "r")
    assert gitrun("resume", "r", "-q", **FAST).code == Exit.DONE


def test_a_stale_worker_woken_after_a_takeover_of_its_setup_exits_6_and_changes_nothing(
    gitrun: Gitrun, paused: Callable[..., tuple[subprocess.Popen[str], Path]]
) -> None:
    a, go = paused(
        "setup_lease_taken",
        *("run", str(FIX_MEDIAN), "--run-id", "r", "-q", "--worker-id", "worker-a"),
    )
    b = gitrun("resume", "r", "-q", "--worker-id", "worker-b", "--takeover-after", "0", **FAST)
    assert b.code == Exit.DONE, b.err
    repo = gitrun.repo("fix-median")
    instance = (repo / INSTANCE).read_bytes()
    registry = (gitrun.home / "runs" / "r.json").read_bytes()
    before = snapshot(repo)

    code, out, err = wake(a, go)
    assert code == Exit.LEASE_LOST, err
    assert out == ""
    assert "worker-b" in one_line(err)
    assert (repo / INSTANCE).read_bytes() == instance
    assert (gitrun.home / "runs" / "r.json").read_bytes() == registry
    assert snapshot(repo) == before

    again = gitrun("resume", "r", "-q", **FAST)
    assert again.code == Exit.DONE, again.err
    verified(gitrun, "r")
    assert len(write_keys(gitrun, "r")) == 1


def test_a_resume_that_read_no_checkpoint_ref_just_before_the_first_was_written_resumes_it(
    gitrun: Gitrun, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run's first checkpoint (ref, then witness) is written, its setup mark not yet.
    killed = gitrun(
        "run", str(FIX_MEDIAN), "--run-id", "r", GITRUN_CRASH_AT="checkpoint_witness_written"
    )
    assert killed.code == -signal.SIGKILL, killed.err
    # A resume that read the refs just before its owner wrote them, and the witness after:
    # the interleaving, made certain by answering the first look at the refs as then.
    real, looks = opening.the_ref, list[str | None]()

    def stale_first(opened: service.Opened) -> str | None:
        looks.append(None if not looks else real(opened))
        return looks[-1]

    monkeypatch.setattr(service, "the_ref", stale_first)
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    state = service.resume("r", service.Options(Workspace(gitrun.home)))
    assert state.phase == DONE, state.stop_reason
    assert looks[0] is None
    assert looks[1] is not None  # looked again before refusing: not a missing ref
    verified(gitrun, "r")
    assert len(write_keys(gitrun, "r")) == 1


@pytest.mark.parametrize("point", ["setup_lease_taken", "setup_worktree_added"])
def test_a_run_killed_during_setup_is_set_up_again_by_resume(gitrun: Gitrun, point: str) -> None:
    killed = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", GITRUN_CRASH_AT=point)
    assert killed.code == -signal.SIGKILL, killed.err
    resumed = gitrun("resume", "r", "-q", **FAST)
    assert resumed.code == Exit.DONE, resumed.err
    verified(gitrun, "r")
    assert len(write_keys(gitrun, "r")) == 1


# -- 10.3: the keyring is created once ----------------------------------------------------


def test_concurrent_first_runs_in_a_fresh_workspace_all_stay_verifiable(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    # A repository of the user's (--repo): no sandbox creation to serialise the starts.
    repo = tmp_path / "repo"
    shutil.copytree(FIX_MEDIAN / "repo", repo)
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    runs = [f"r{i}" for i in range(8)]
    procs = [
        gitrun.popen(
            "run", str(FIX_MEDIAN), "--repo", str(repo), "--run-id", rid,
            GITRUN_CRASH_AT="before_propose",
        )
        for rid in runs
    ]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, err  # killed after its first checkpoint
    ws = service.Options(Workspace(gitrun.home))
    for rid in runs:
        stored = service.verify(rid, ws, None)  # the same check as `gitrun checkpoint verify`
        assert stored.state.generation == 1


KEYRING_RACER = """
import os, sys, time
from pathlib import Path
from gitrun.store.keys import load_keyring

path, go = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
print(load_keyring(path).active)
"""


def test_processes_creating_the_keyring_at_the_same_instant_all_read_one_keyring(
    tmp_path: Path,
) -> None:
    keyring, go = tmp_path / "keys" / "checkpoint.keyring", tmp_path / "go"
    racers = [
        spawn.popen(
            [sys.executable, "-c", KEYRING_RACER, str(keyring), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    time.sleep(1.5)  # every racer imported and spinning at the barrier
    go.write_text("go")
    seen = set()
    for racer in racers:
        out, err = racer.communicate(timeout=60)
        assert racer.returncode == 0, err
        seen.add(out.strip())
    (active,) = seen  # one keyring, whoever made it
    assert json.loads(keyring.read_text())["active"] == active
    assert not list(keyring.parent.glob("*.tmp-*"))


def test_a_missing_keyring_in_a_workspace_with_runs_is_an_error_not_a_fresh_key(
    gitrun: Gitrun,
) -> None:
    first = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", "-q", **FAST)
    assert first.code == Exit.DONE, first.err
    keyring = gitrun.home / "keys" / "checkpoint.keyring"
    keyring.unlink()

    second = gitrun("run", str(FIX_MEDIAN), "--run-id", "s", "-q", **FAST)
    assert second.code == Exit.BAD_INPUT, second.err
    line = one_line(second.err)
    assert str(keyring) in line
    assert "restore" in line
    assert not keyring.exists()
    assert not (gitrun.home / "runs" / "s.json").exists()


@pytest.mark.parametrize(
    "doc",
    [
        {"schema": 1, "active": "hk-1", "keys": {"hk-1": ""}},
        {"schema": 1, "active": "hk-1", "keys": {"hk-1": "00ff"}},
        {"schema": 1, "active": "", "keys": {"": "ab" * 32}},
    ],
    ids=["empty-secret", "short-secret", "empty-key-id"],
)
def test_an_empty_or_malformed_key_is_refused(gitrun: Gitrun, doc: dict[str, object]) -> None:
    keyring = gitrun.home / "keys" / "checkpoint.keyring"
    keyring.parent.mkdir(parents=True)
    keyring.write_text(json.dumps(doc))
    keyring.chmod(0o600)
    refused = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", "-q", **FAST)
    assert refused.code == Exit.BAD_INPUT, refused.err
    assert str(keyring) in one_line(refused.err)
    assert not (gitrun.home / "runs" / "r.json").exists()


# -- 10.4: registration is exclusive ---------------------------------------------------------


def test_two_runs_registering_one_run_id_at_once_the_loser_names_the_winner_and_changes_nothing(
    gitrun: Gitrun, paused: Callable[..., tuple[subprocess.Popen[str], Path]], tmp_path: Path
) -> None:
    a, go = paused(
        "setup_before_register",
        *("run", str(FIX_MEDIAN), "--run-id", "r", "-q", "--worker-id", "worker-a"),
    )
    patch = tmp_path / "model.patch"
    patch.write_bytes((FIX_MEDIAN / "model.patch").read_bytes())
    b = gitrun(
        "run", str(FIX_MEDIAN), "--run-id", "r", "-q", "--worker-id", "worker-b",
        "--agent", f"patch:{patch}", **FAST,
    )  # fmt: skip
    assert b.code == Exit.DONE, b.err
    registry = (gitrun.home / "runs" / "r.json").read_bytes()
    before = snapshot(gitrun.repo("fix-median"))

    code, _, err = wake(a, go)
    assert code == Exit.CONFLICT, err
    line = one_line(err)
    assert "worker-b" in line
    assert "gitrun resume r" in line
    assert (gitrun.home / "runs" / "r.json").read_bytes() == registry
    assert snapshot(gitrun.repo("fix-median")) == before
    again = gitrun("resume", "r", "-q", **FAST)
    assert again.code == Exit.DONE, again.err  # not agent-changed: the registry is B's


def test_a_start_that_saw_no_run_and_then_finds_its_branch_made_by_another_reports_that_run(
    gitrun: Gitrun, paused: Callable[..., tuple[subprocess.Popen[str], Path]]
) -> None:
    # A looked (no run r registered) and stopped; B started r and finished it, branch and
    # all. A must see B's run as a later `gitrun run` of the same inputs would, never a
    # branch of unknown origin ("pick another --run-id", the CI failure of two swebench
    # commands on one run id under load).
    a, go = paused(
        "setup_unregistered",
        *("run", str(FIX_MEDIAN), "--run-id", "r", "-q", "--worker-id", "worker-a"),
    )
    b = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", "-q", "--worker-id", "worker-b", **FAST)
    assert b.code == Exit.DONE, b.err
    registry = (gitrun.home / "runs" / "r.json").read_bytes()
    before = snapshot(gitrun.repo("fix-median"))

    code, out, err = wake(a, go)
    assert code == Exit.DONE, err
    assert out == b.out  # B's result, reported again
    assert (gitrun.home / "runs" / "r.json").read_bytes() == registry
    assert snapshot(gitrun.repo("fix-median")) == before
    assert len(write_keys(gitrun, "r")) == 1


# -- 10.6: a stopped lock holder is named at once --------------------------------------------


def test_a_takeover_of_a_worker_stopped_holding_a_ref_lock_answers_at_once_naming_it(
    gitrun: Gitrun, paused: Callable[..., tuple[subprocess.Popen[str], Path]]
) -> None:
    a, _ = paused(
        "write_ref_locked",
        *("run", str(FIX_MEDIAN), "--run-id", "r", "-q", "--worker-id", "worker-a"),
    )
    repo = gitrun.repo("fix-median")
    before = snapshot(repo)
    started = time.monotonic()
    b = gitrun("resume", "r", "-q", "--worker-id", "worker-b", "--takeover-after", "0", **FAST)
    took = time.monotonic() - started
    assert b.code == Exit.OWNED, b.err
    assert took < 15, f"took {took:.1f}s"
    line = one_line(b.err)
    assert "refs/gitrun/runs/r/lease" in line
    assert str(a.pid) in line
    assert "worker-a" in line
    assert f"kill -KILL {a.pid}" in line
    assert snapshot(repo) == before

    os.kill(a.pid, signal.SIGKILL)
    a.communicate(timeout=30)
    done = gitrun("resume", "r", "-q", "--worker-id", "worker-b", **FAST)
    assert done.code == Exit.DONE, done.err
    assert len(write_keys(gitrun, "r")) == 1


# -- 10.7: the worktree's HEAD must be the run's branch ----------------------------------------


@pytest.mark.parametrize("how", ["detached", "other-branch"])
def test_a_worktree_not_on_the_run_branch_is_refused_before_any_write(
    gitrun: Gitrun, how: str
) -> None:
    crashed = gitrun(
        "run", str(FIX_MEDIAN), "--run-id", "r", GITRUN_CRASH_AT="after_intent_checkpoint"
    )
    assert crashed.code == -signal.SIGKILL, crashed.err
    worktree = gitrun.home / "worktrees" / "r"
    if how == "detached":
        git(worktree, "checkout", "-q", "--detach")
    else:
        git(worktree, "checkout", "-q", "-b", "elsewhere")
    repo = gitrun.repo("fix-median")
    before = snapshot(repo)

    refused = gitrun("resume", "r", **FAST)
    assert refused.code == Exit.REFUSED, refused.err
    line = one_line(refused.err)
    assert "head-not-on-branch" in line
    assert f"git -C {worktree} checkout gitrun/r" in line
    assert snapshot(repo) == before  # refused before writing

    git(worktree, "checkout", "-q", "gitrun/r")
    done = gitrun("resume", "r", "-q", **FAST)
    assert done.code == Exit.DONE, done.err
    assert len(write_keys(gitrun, "r")) == 1


# -- idempotent start --------------------------------------------------------------------


def test_run_again_of_a_done_run_reports_its_result_again_and_executes_nothing(
    gitrun: Gitrun,
) -> None:
    first = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", "-q", **FAST)
    assert first.code == Exit.DONE, first.err
    before = snapshot(gitrun.repo("fix-median"))
    again = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", "-q", **FAST)
    assert again.code == Exit.DONE, again.err
    assert again.out == first.out
    assert snapshot(gitrun.repo("fix-median")) == before


def test_run_again_of_a_crashed_run_continues_it_exactly_once(gitrun: Gitrun) -> None:
    crashed = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", GITRUN_CRASH_AT="write_ref_moved")
    assert crashed.code == -signal.SIGKILL, crashed.err
    again = gitrun("run", str(FIX_MEDIAN), "--run-id", "r", "-q", **FAST)
    assert again.code == Exit.DONE, again.err
    assert len(write_keys(gitrun, "r")) == 1
    verified(gitrun, "r")


def test_run_again_with_other_inputs_exits_2_naming_what_differs(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    task = sandbox_copy("fix-median")
    crashed = gitrun("run", str(task), "--run-id", "r", GITRUN_CRASH_AT="after_intent_checkpoint")
    assert crashed.code == -signal.SIGKILL, crashed.err
    repo = gitrun.repo("fix-median")
    registry = (gitrun.home / "runs" / "r.json").read_bytes()
    before = snapshot(repo)

    def differs(*args: str) -> str:
        result = gitrun("run", *args, "--run-id", "r", **FAST)
        assert result.code == Exit.BAD_INPUT, result.err
        assert snapshot(repo) == before
        assert (gitrun.home / "runs" / "r.json").read_bytes() == registry
        return one_line(result.err)

    patch = tmp_path / "model.patch"
    patch.write_bytes((FIX_MEDIAN / "model.patch").read_bytes())
    assert "agent" in differs(str(task), "--agent", f"patch:{patch}")
    assert "task dir" in differs(str(FIX_MEDIAN))
    other = tmp_path / "other-repo"
    git(tmp_path, "init", "-q", "-b", "main", str(other))
    (other / "f.txt").write_text("f\n")
    git(other, "add", ".")
    git(other, "commit", "-q", "-m", "base")
    assert "repo" in differs(str(task), "--repo", str(other))
    toml = task / "task.toml"
    original = toml.read_text()
    toml.write_text(original.replace("max_steps = 10", "max_steps = 11"))
    assert "budgets" in differs(str(task))
    toml.write_text(original)
    plan = task / "plan.toml"
    plan.write_text(plan.read_text().replace("instead of the upper one", "(edited)"))
    assert "agent" in differs(str(task))
