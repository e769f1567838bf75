"""Attacks on the write-ahead journal (:mod:`gitrun.store.journal`): power cuts the
emulation in tests/test_journal.py does not make, and journals an agent planted.

A power cut may keep any subset of what was written since the last sync: a ref's rename
may reach the disk while a worktree file's data does not (ext4 commits metadata every
few seconds, delayed allocation writes data later). Each test runs real ``gitrun``
processes, takes away what such a cut may take, and resumes under a new boot id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SANDBOXES
from test_crash import RUN_ID, Baseline, Cli, make_baseline, run_invariants
from test_durable import LINE, STRACE, needs_strace
from test_journal import BOOT, REBOOT, SANDBOX, booted, git

from gitrun.core import faults
from gitrun.store import journal, journal_recovery


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return make_baseline(SANDBOX, tmp_path_factory.mktemp("journal-attack-baseline"))


REPAIR_CALLS = "rename,renameat,renameat2,syncfs,unlink"


def empty_files(worktree: Path, gitdir: Path, since: str | None, tip: str) -> int:
    """Empty every worktree file the commits ``since..tip`` changed (their data lost)."""
    base = since or git(gitdir, "hash-object", "-t", "tree", "/dev/null").strip()
    n = 0
    for path in git(gitdir, "diff", "--name-only", "--no-renames", base, tip).splitlines():
        target = worktree / path
        if target.is_file() and not target.is_symlink():
            target.write_bytes(b"")
            n += 1
    return n


def test_a_cut_that_keeps_the_refs_but_not_the_worktree_files_loses_no_step(
    baseline: Baseline, tmp_path: Path
) -> None:
    """The refs' renames reached the disk, the worktree files' data did not: recovery
    changes no ref, and must still put the run's files back."""
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    ran = cli("run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q")
    assert ran.returncode == baseline.code, ran.stderr[-600:]
    gitdir = (cli.repo(SANDBOX) / ".git").resolve()
    held = journal_recovery.contents(gitdir)
    branch = f"refs/heads/gitrun/{RUN_ID}"
    assert branch in held.refs
    since = held.first_old[branch]  # None: the branch is new, checked out (and synced) at base
    base = since.hex() if since else cli.record(RUN_ID)["base_commit"]
    tip = git(gitdir, "rev-parse", branch).strip()
    worktree = Path(cli.record(RUN_ID)["worktree"])
    assert empty_files(worktree, gitdir, base, tip) > 0
    resumed = booted(cli, REBOOT)("resume", RUN_ID, "-q")
    assert resumed.returncode == baseline.code, resumed.stdout + resumed.stderr[-800:]
    assert run_invariants(baseline, RUN_ID, booted(cli, REBOOT)) == []


@needs_strace
def test_the_repair_after_a_cut_is_durable_before_the_recovery_note_goes(
    baseline: Baseline, tmp_path: Path
) -> None:
    """The repair writes the lost files back (after the recovery's sync: no journal record
    covers them) and drops the recovery's note: a second cut must not keep the note's
    removal and lose the files, so a ``syncfs`` comes between the last write and it."""
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    ran = cli("run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q")
    assert ran.returncode == baseline.code, ran.stderr[-600:]
    gitdir = (cli.repo(SANDBOX) / ".git").resolve()
    tip = git(gitdir, "rev-parse", f"refs/heads/gitrun/{RUN_ID}").strip()
    worktree = Path(cli.record(RUN_ID)["worktree"])
    assert empty_files(worktree, gitdir, cli.record(RUN_ID)["base_commit"], tip) > 0
    log = tmp_path / "strace.log"
    traced = [str(STRACE), "-f", "-qq", "-e", f"trace={REPAIR_CALLS}", "-o", str(log)]
    done = subprocess.run(
        [*traced, *cli.argv("resume", RUN_ID, "-q")], env=booted(cli, REBOOT).env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == baseline.code, done.stderr[-800:]
    calls = [m.group(2, 3) for line in log.read_text().splitlines() if (m := LINE.match(line))]
    note = [i for i, (c, a) in enumerate(calls) if c == "unlink" and "/gitrun/recovered/" in a]
    assert note, "the repair dropped no note"
    renames = [i for i, (c, _) in enumerate(calls[: note[0]]) if c.startswith("rename")]
    synced = [i for i, (c, _) in enumerate(calls[: note[0]]) if c == "syncfs"]
    assert synced, "no syncfs before the note's removal"
    assert renames, "the repair wrote nothing"
    assert synced[-1] > renames[-1], (renames[-3:], synced[-3:])
    assert run_invariants(baseline, RUN_ID, booted(cli, REBOOT)) == []


ROTATE = """
import os, sys
from pathlib import Path
from gitrun.store import gitstore, journal
repo = gitstore.open_repo(sys.argv[1])
cdir = gitstore.common_dir(repo)
def epoch():
    fd = os.open(cdir / journal.JOURNAL_FILE, os.O_RDONLY)
    try:
        return journal.read_header(fd)[0]
    finally:
        os.close(fd)
first, n = epoch(), 0
while epoch() == first:
    blob = repo.create_blob(b"rotate %d\\n" % n)
    old = gitstore.read_ref(repo, "refs/gitrun/rotate")
    gitstore.update_ref(repo, "refs/gitrun/rotate", old, blob, message="rotate")
    n += 1
"""


def _traced_child(tracer: subprocess.Popen[str]) -> int:
    """The pid of the process ``strace`` started (its one child)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{tracer.pid}/task").iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.02)
    raise AssertionError("strace started nothing")


@needs_strace
def test_a_rotation_between_a_branch_move_and_its_file_sync_loses_no_step(
    baseline: Baseline, tmp_path: Path
) -> None:
    """Another process (a batch's other worker, the lease heartbeat) rotates the journal
    after the branch moved and before the step wrote its files: the rotation's syncfs
    made the branch durable and its record is gone from the epoch recovery replays; the
    files, written after that sync, must be made durable before the checkpoint that
    acknowledges the step (traced), and a cut after it must lose nothing."""
    cli = booted(Cli.at(tmp_path / "home"), {**BOOT, journal.SIZE_VAR: str(16 * 1024)})
    paused = booted(cli, {faults.PAUSE_VAR: "after_receipt_index:2"})
    log = tmp_path / "strace.log"
    traced = [str(STRACE), "-f", "-qq", "-e", f"trace={REPAIR_CALLS}", "-o", str(log)]
    argv = [*traced, *cli.argv("run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q")]
    tracer = subprocess.Popen(argv, env=paused.env, text=True, cwd=tmp_path)
    try:
        run = _traced_child(tracer)
        deadline = time.monotonic() + 60
        while "stopped by SIGSTOP" not in log.read_text() and time.monotonic() < deadline:
            assert tracer.poll() is None, "the run ended before its pause point"
            time.sleep(0.05)
        repo = cli.repo(SANDBOX)
        branch = f"refs/heads/gitrun/{RUN_ID}"
        tip = git(repo, "rev-parse", branch).strip()
        rotate = [sys.executable, "-c", ROTATE, str(repo)]
        subprocess.run(rotate, env={**os.environ, **BOOT}, check=True, timeout=120)
        os.kill(run, signal.SIGCONT)
        assert tracer.wait(timeout=120) == baseline.code
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()
    gitdir = (repo / ".git").resolve()
    assert branch not in journal_recovery.contents(gitdir).refs  # its record is gone
    calls = [m.group(2, 3) for line in log.read_text().splitlines() if (m := LINE.match(line))]
    files = [i for i, (c, a) in enumerate(calls) if c == "renameat" and ".gitrun-tmp-" in a]
    after = calls[files[-1] :]
    ack = next(i for i, (c, a) in enumerate(after) if c == "rename" and "/refs/gitrun/" in a)
    assert any(c == "syncfs" for c, _ in after[:ack]), "the files were never made durable"
    worktree = Path(cli.record(RUN_ID)["worktree"])
    assert git(worktree, "diff", "--name-only", f"{tip}^", tip)
    resumed = booted(cli, REBOOT)("resume", RUN_ID, "-q")
    assert resumed.returncode == baseline.code, resumed.stdout + resumed.stderr[-800:]
    assert run_invariants(baseline, RUN_ID, booted(cli, REBOOT)) == []


@needs_strace
def test_a_resume_that_finishes_a_file_sync_after_a_rotation_makes_it_durable(
    baseline: Baseline, tmp_path: Path
) -> None:
    """Killed after its branch move, before its files; the journal rotates (other runs of
    the repository); the resume writes the files: no record of the branch covers them."""
    cli = booted(Cli.at(tmp_path / "home"), {**BOOT, journal.SIZE_VAR: str(16 * 1024)})
    ran = cli(
        "run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q", crash_at="write_ref_moved:2"
    )
    assert ran.returncode == -signal.SIGKILL, ran.stderr[-600:]
    repo = cli.repo(SANDBOX)
    subprocess.run(
        [sys.executable, "-c", ROTATE, str(repo)], env={**os.environ, **BOOT}, check=True,
        timeout=120,
    )  # fmt: skip
    assert f"refs/heads/gitrun/{RUN_ID}" not in journal_recovery.contents(repo / ".git").refs
    log = tmp_path / "strace.log"
    traced = [str(STRACE), "-f", "-qq", "-e", f"trace={REPAIR_CALLS}", "-o", str(log)]
    done = subprocess.run(
        [*traced, *cli.argv("resume", RUN_ID, "-q")], env=cli.env, capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == baseline.code, done.stderr[-800:]
    calls = [m.group(2, 3) for line in log.read_text().splitlines() if (m := LINE.match(line))]
    files = [i for i, (c, a) in enumerate(calls) if c == "renameat" and ".gitrun-tmp-" in a]
    after = calls[files[0] :]  # the resume's first file write is the repair's
    ack = next(i for i, (c, a) in enumerate(after) if c == "rename" and "/checkpoints/" in a)
    assert any(c == "syncfs" for c, _ in after[:ack]), "the repaired files were never synced"
    assert run_invariants(baseline, RUN_ID, cli) == []
