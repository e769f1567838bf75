"""Attacks on the write-ahead journal (:mod:`gitrun.store.journal`): power cuts the
emulation in tests/test_journal.py does not make, and journals an agent planted.

A power cut may keep any subset of what was written since the last sync: a ref's rename
may reach the disk while a worktree file's data does not (ext4 commits metadata every
few seconds, delayed allocation writes data later). Each test runs real ``gitrun``
processes, takes away what such a cut may take, and resumes under a new boot id.
"""

from __future__ import annotations

import os
import re
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


REPAIR_CALLS = "rename,renameat,renameat2,syncfs,unlink,unlinkat"
NOTE = re.compile(r'"[0-9a-f]{32}\.json"')  # a recovery's note (gitrun/recovered/)


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
    _resumed_after_reboot_like_baseline(cli, baseline)


def _resumed_after_reboot_like_baseline(cli: Cli, baseline: Baseline) -> None:
    """``gitrun resume`` under a new boot id (recovery runs), then the uninterrupted
    run's invariants."""
    after = booted(cli, REBOOT)
    resumed = after("resume", RUN_ID, "-q")
    assert resumed.returncode == baseline.code, resumed.stdout + resumed.stderr[-800:]
    assert run_invariants(baseline, RUN_ID, after) == []


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
    note = [i for i, (c, a) in enumerate(calls) if c.startswith("unlink") and NOTE.search(a)]
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
    gitstore.transaction(repo).move("refs/gitrun/rotate", old, blob, message="rotate").commit()
    n += 1
"""


def _stopped(log: Path, tracer: subprocess.Popen[str]) -> int:
    """The pid strace saw stop at its pause point (SIGSTOP)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert tracer.poll() is None, "the run ended before its pause point"
        found = re.search(
            r"^(\d+)\s+--- stopped by SIGSTOP", log.read_text() if log.exists() else "", re.M
        )
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    tail = log.read_text().splitlines()[-8:] if log.exists() else []
    raise AssertionError(f"the run never reached its pause point: {tail}")


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
        run = _stopped(log, tracer)
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
    _resumed_after_reboot_like_baseline(cli, baseline)


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


# -- a planted journal, stage or temp file never makes recovery touch another file -----

PLANT = """
import os, sys
from pathlib import Path
from gitrun.store import journal
cdir, oid, data = Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
held = journal.of(cdir)
if not held.usable():
    raise SystemExit("no journal")
with held.recording([(oid, data)], [journal.RefEntry("refs/gitrun/x", oid, None, "")]):
    pass
"""
OPEN = "import sys; from gitrun.store import gitstore; gitstore.open_repo(sys.argv[1])"


def _repo_with_a_planted_record(tmp_path: Path) -> tuple[Path, Path, str]:
    import hashlib
    import zlib

    repo = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(repo))
    cdir = (repo / ".git").resolve()
    raw = b"blob 7\0planted"
    oid = hashlib.sha1(raw, usedforsecurity=False).hexdigest()
    argv = [sys.executable, "-c", PLANT, str(cdir), oid, zlib.compress(raw).hex()]
    subprocess.run(argv, env={**os.environ, **BOOT}, check=True, timeout=60)
    victim = tmp_path / "outside"
    victim.mkdir()
    (victim / "precious").mkdir()
    (victim / "precious" / "file").write_text("keep me\n")
    (victim / "note").write_text("keep me\n")
    return repo, cdir, oid


def _recover(repo: Path) -> None:
    env = {**os.environ, **REBOOT}
    subprocess.run([sys.executable, "-c", OPEN, str(repo)], env=env, check=True, timeout=60)


def _intact(victim: Path) -> None:
    assert (victim / "precious" / "file").read_text() == "keep me\n"
    assert (victim / "note").read_text() == "keep me\n"


def test_recovery_never_empties_a_directory_the_stage_links_to(tmp_path: Path) -> None:
    repo, cdir, _ = _repo_with_a_planted_record(tmp_path)
    stage = cdir / "gitrun" / "stage"
    assert not stage.exists()  # the planting process opened no repository
    stage.symlink_to(tmp_path / "outside")
    _recover(repo)
    _intact(tmp_path / "outside")


def test_recovery_never_writes_through_a_planted_temp_file_link(tmp_path: Path) -> None:
    repo, cdir, oid = _repo_with_a_planted_record(tmp_path)
    victim = tmp_path / "outside" / "note"
    (cdir / "refs" / "gitrun").mkdir(parents=True, exist_ok=True)
    (cdir / "refs" / "gitrun" / "x.recover").symlink_to(victim)
    (cdir / "objects" / oid[:2]).mkdir(exist_ok=True)
    (cdir / "objects" / oid[:2] / f".{oid[2:]}.recover").symlink_to(victim)
    _recover(repo)
    _intact(tmp_path / "outside")
    assert git(repo, "cat-file", "blob", "refs/gitrun/x") == "planted"


def test_recovery_never_writes_through_a_linked_ref_directory(tmp_path: Path) -> None:
    repo, cdir, _ = _repo_with_a_planted_record(tmp_path)
    assert not (cdir / "refs" / "gitrun").exists()
    (cdir / "refs" / "gitrun").symlink_to(tmp_path / "outside")
    _recover(repo)
    assert not (tmp_path / "outside" / "x").exists()
    _intact(tmp_path / "outside")


MAKE_JOURNAL = """
import os, sys
from pathlib import Path
from gitrun.store import journal
cdir = Path(sys.argv[1])
(cdir / "gitrun").mkdir(exist_ok=True)
os.link(sys.argv[2], cdir / "gitrun" / f".journal.tmp-{os.getpid()}")  # a guessed pid
journal.of(cdir).usable()
"""


def test_a_hard_link_planted_at_the_journals_temp_name_is_never_truncated(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(repo))
    victim = tmp_path / "key"
    victim.write_text("secret key\n")
    argv = [sys.executable, "-c", MAKE_JOURNAL, str(repo / ".git"), str(victim)]
    subprocess.run(argv, env={**os.environ, **BOOT}, check=True, timeout=60)
    assert victim.read_text() == "secret key\n"


INDEX_CALLS = "openat,fdatasync,fsync,syncfs,rename,renameat"
OPENED = re.compile(r'^openat\(AT_FDCWD, "([^"]+)".*\)\s+=\s+(\d+)')  # one process: no pid
CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+)")


@needs_strace
def test_the_worktree_index_is_durable_before_its_base_file_says_it_is_synced(
    baseline: Baseline, tmp_path: Path
) -> None:
    """The index base file (fsynced) tells status which commit the index holds: if it
    reached the disk and the index's bytes did not (written after the journal last
    rotated, with no record of the branch to repair it after a cut), status would read
    a stale or torn index as HEAD's. Traced: each index write is synced before the base."""
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    log = tmp_path / "strace.log"
    traced = [str(STRACE), "-qq", "-e", f"trace={INDEX_CALLS}", "-o", str(log)]  # gitrun only
    argv = [*traced, *cli.argv("run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q")]
    done = subprocess.run(
        argv, env=cli.env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == baseline.code, done.stderr[-800:]
    index_fds: set[str] = set()
    pending = False  # an index written, not yet synced
    checked = 0
    for line in log.read_text().splitlines():
        opened = OPENED.match(line)
        if opened:
            if opened.group(1).endswith("/worktrees/gitrun-crash/index"):
                index_fds.add(opened.group(2))
            continue
        m = CALL.match(line)
        if m is None:
            continue
        call, args = m.group(1), m.group(2)
        if call == "rename" and args.split(",")[-1].strip().endswith('/gitrun-crash/index"'):
            pending = True
        elif call == "syncfs" or (call in ("fsync", "fdatasync") and args in index_fds):
            pending = False
        elif call == "renameat" and '"gitrun-index-base"' in args:
            checked += 1
            assert not pending, "the index base file moved on before the index was durable"
    assert checked > 0


@needs_strace
def test_an_exec_steps_put_back_worktree_is_durable_before_the_next_checkpoint(
    tmp_path: Path,
) -> None:
    """Killed after its command ran, before its commit: the resume puts the worktree back
    to the precondition tree (unsynced writes no journal record names: the branch does
    not move for them), then runs the command again. A cut after the next checkpoint
    must not find the discarded effects back on disk, so a sync comes in between."""
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    task = str(SANDBOXES / "rename-api")
    ran = cli("run", task, "--run-id", RUN_ID, "-q", crash_at="exec_done")
    assert ran.returncode == -signal.SIGKILL, ran.stderr[-600:]
    log = tmp_path / "strace.log"
    traced = [str(STRACE), "-qq", "-e", f"trace={INDEX_CALLS}", "-o", str(log)]  # gitrun only
    done = subprocess.run(
        [*traced, *cli.argv("resume", RUN_ID, "-q")], env=cli.env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-800:]
    calls = [m.group(1, 2) for line in log.read_text().splitlines() if (m := CALL.match(line))]
    files = [i for i, (c, a) in enumerate(calls) if c == "renameat" and ".gitrun-tmp-" in a]
    assert files, "the resume put nothing back"
    after = calls[files[0] :]
    ack = next(i for i, (c, a) in enumerate(after) if c == "rename" and "/checkpoints/" in a)
    assert any(c == "syncfs" for c, _ in after[:ack]), "the put-back files were never synced"
