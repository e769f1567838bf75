"""A power cut, emulated at its worst: everything the journal covers is taken away.

Since a ref move is made durable by one ``fdatasync`` of the repository's journal
(:mod:`gitrun.store.journal`), the objects it names, their names in ``objects/``, the
ref's new value and the worktree files a step wrote are on disk only in the journal until
the kernel writes them back. These tests run real ``gitrun`` processes (killed with
SIGKILL at crash points, or left to finish), then do what a power cut may do to every
such file at once: each journaled object's file emptied (torn) or gone, each journaled
ref back at the value it had before the journal's epoch (or gone), the stage's unsynced
objects emptied, the worktree files the lost writes made emptied. Only the journal and
what was fsynced on its own (the witness, the run registry, keys) are left as they were.
The next ``gitrun`` process sees a new boot id, recovers, and the run must then end
exactly like an uninterrupted one: same tree, each idempotency key once, every receipt,
``git fsck --strict`` clean, the worktree clean.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from conftest import SANDBOXES
from helpers import stopped
from test_crash import RUN_ID, Baseline, Cli, killed, make_baseline, run_invariants

from gitrun.core import faults
from gitrun.store import journal, journal_recovery

BOOT = {journal.TEST_BOOT_VAR: "00000000-0000-4000-8000-000000000001"}
REBOOT = {journal.TEST_BOOT_VAR: "00000000-0000-4000-8000-000000000002"}
SANDBOX = "slugify-unicode"  # two writes (a file, a patch), verified, done


def booted(cli: Cli, boot: dict[str, str]) -> Cli:
    return dataclasses.replace(cli, env={**cli.env, **boot})


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return make_baseline(SANDBOX, tmp_path_factory.mktemp("journal-baseline"))


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout


def power_cut(cli: Cli, sandbox: str, run_id: str) -> dict[str, int]:
    """Take away every name and byte the journal covers (see the module docstring)."""
    gitdir = (cli.repo(sandbox) / ".git").resolve()
    held = journal_recovery.contents(gitdir)
    lost = {"objects": 0, "refs": 0, "worktree": 0}
    branch = f"refs/heads/gitrun/{run_id}"
    since = held.first_old.get(branch)
    worktree = Path(cli.record(run_id)["worktree"])
    if branch in held.refs and worktree.exists():
        tip = git(gitdir, "rev-parse", branch).strip()
        base = (
            since.hex() if since else git(gitdir, "hash-object", "-t", "tree", "/dev/null").strip()
        )
        for path in git(gitdir, "diff", "--name-only", "--no-renames", base, tip).splitlines():
            target = worktree / path
            if target.is_file() and not target.is_symlink():
                target.write_bytes(b"")  # a write whose data never reached the disk
                lost["worktree"] += 1
    for n, oid in enumerate(held.objects):
        loose = gitdir / "objects" / oid.hex()[:2] / oid.hex()[2:]
        if loose.exists():
            loose.chmod(0o644)
            if n % 2:
                loose.write_bytes(b"")  # torn: its name reached the disk, its bytes did not
            else:
                loose.unlink()  # its name never reached the disk
            lost["objects"] += 1
    for name, old in held.first_old.items():
        ref = gitdir / name
        if old is None:
            ref.unlink(missing_ok=True)
        else:
            ref.write_text(old.hex() + "\n")
        lost["refs"] += 1
    for staged in (gitdir / "gitrun" / "stage").rglob("*"):
        if staged.is_file():
            staged.chmod(0o644)
            staged.write_bytes(b"")  # unacknowledged and unsynced: torn
    return lost


def _status(cli: Cli) -> tuple[object, ...]:
    shown = cli("status", RUN_ID, "--json")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    return info["phase"], info["generation"], info["head"], info["pending"], info["receipts"]


def cut_and_resume(
    baseline: Baseline, root: Path, crash_at: str, journal_bytes: int = 0
) -> list[str]:
    cli = booted(Cli.at(root), BOOT)
    if journal_bytes:  # small: it rotates (syncfs, new epoch) every few moves
        cli = booted(cli, {journal.SIZE_VAR: str(journal_bytes)})
    ran = cli("run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q", crash_at=crash_at)
    if crash_at:
        assert killed(ran.returncode), (crash_at, ran.returncode, ran.stderr[-600:])
    else:
        assert ran.returncode == baseline.code, ran.stderr[-600:]
    before = _status(cli)
    gitdir = (cli.repo(SANDBOX) / ".git").resolve()
    journaled = journal_recovery.contents(gitdir).refs.get(f"refs/heads/gitrun/{RUN_ID}")
    lost = power_cut(cli, SANDBOX, RUN_ID)
    assert lost["objects"] > 0, lost  # the cut took something
    assert lost["refs"] > 0, lost
    after = booted(cli, REBOOT)
    # The first command after the reboot may be a status: it recovers (through the
    # pygit2 path) and says what it said before the cut, not a rollback.
    settled = _status(after)
    if crash_at and settled != before:
        # Killed between the renames of a step's one record (its intent's checkpoint
        # renamed, the branch not yet): recovery completes the move, the write is then
        # shown done and unrecorded (window 3), as after a kill just past the rename.
        assert journaled is not None
        assert journaled.new is not None
        assert settled[:2] == before[:2], (settled, before)
        assert (settled[2], settled[3]) == (journaled.new.hex(), None), (settled, before)
    else:
        assert settled == before
    resumed = after("resume", RUN_ID, "-q")
    assert resumed.returncode == baseline.code, resumed.stdout + resumed.stderr[-800:]
    return run_invariants(baseline, RUN_ID, after)


@pytest.mark.parametrize(
    "crash_at",
    ["", "after_intent_checkpoint:2", "write_ref_moved:2", "checkpoint_ref_moved:3"],
    ids=["finished", "intent-2", "write-2", "checkpoint-3"],
)
def test_a_power_cut_that_takes_everything_the_journal_covers_loses_no_acknowledged_step(
    baseline: Baseline, tmp_path: Path, crash_at: str
) -> None:
    assert cut_and_resume(baseline, tmp_path / "home", crash_at) == []


def test_a_power_cut_after_the_journal_rotated_many_times_loses_no_acknowledged_step(
    baseline: Baseline, tmp_path: Path
) -> None:
    """16 KiB: a rotation every few moves (so the cut takes only the newest epoch's
    records; older ones were made durable in place by the rotation's syncfs), and a move
    whose objects pass 4 KiB takes the barrier instead: both kinds on the same refs."""
    home = tmp_path / "home"
    assert cut_and_resume(baseline, home, "", journal_bytes=16 * 1024) == []
    gitdir = (home / "repos" / SANDBOX / ".git").resolve()
    assert (gitdir / "gitrun" / "journal").stat().st_size == 16 * 1024


def test_without_a_reboot_nothing_is_recovered_and_a_cut_shows_as_drift(
    baseline: Baseline, tmp_path: Path
) -> None:
    """The emulation is not a no-op: the same cut, resumed under the same boot id (no
    recovery runs), leaves the run refusing to go on."""
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    ran = cli(
        "run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q", crash_at="write_ref_moved:2"
    )
    assert killed(ran.returncode)
    power_cut(cli, SANDBOX, RUN_ID)
    resumed = cli("resume", RUN_ID, "-q")
    assert resumed.returncode != 0


def _loose(data: bytes) -> tuple[bytes, bytes]:
    """A loose object's file and id."""
    import hashlib

    raw = b"blob %d\0" % len(data) + data
    return hashlib.sha1(raw, usedforsecurity=False).digest(), zlib.compress(raw)


def test_recovery_takes_only_objects_that_hash_to_their_names_and_well_formed_refs(
    tmp_path: Path,
) -> None:
    """A planted journal record (the agent can write the file) restores nothing it could
    not have written directly: an object under another's id, a ref outside refs/ or with
    `..` in it are passed over; the good entries in the same record are restored."""
    repo = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(repo))
    cdir = (repo / ".git").resolve()
    good_id, good = _loose(b"good\n")
    bad_id, _ = _loose(b"claimed\n")
    _, other = _loose(b"something else\n")
    script = f"""
import os, sys
from pathlib import Path
from gitrun.core import faults
from gitrun.store import journal, journal_recovery
cdir = Path({str(cdir)!r})
assert journal.of(cdir).usable()
with journal.of(cdir).recording([({good_id!r}, {good!r}), ({bad_id!r}, {other!r})], [
    journal.RefEntry("refs/gitrun/ok", {good_id!r}, None, "t"),
    journal.RefEntry("refs/../../escape", {good_id!r}, None, "t"),
    journal.RefEntry("HEAD", {good_id!r}, None, "t"),
]):
    pass
"""
    env = {**os.environ, **BOOT}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    recover = "import sys; from gitrun.store import gitstore; gitstore.open_repo(sys.argv[1])"
    env = {**os.environ, **REBOOT}
    subprocess.run([sys.executable, "-c", recover, str(repo)], env=env, check=True, timeout=60)
    assert (cdir / "objects" / good_id.hex()[:2] / good_id.hex()[2:]).exists()
    assert not (cdir / "objects" / bad_id.hex()[:2] / bad_id.hex()[2:]).exists()
    assert (cdir / "refs" / "gitrun" / "ok").read_text().strip() == good_id.hex()
    assert not (tmp_path / "escape").exists()
    assert git(repo, "symbolic-ref", "HEAD").strip().startswith("refs/heads/")


STAGE_AND_MOVE = """
import sys
from gitrun.store import gitstore
repo = gitstore.open_repo(sys.argv[1])
blob = repo.create_blob(sys.argv[2].encode())
if sys.argv[3:] == ["move"]:
    name = "refs/gitrun/" + str(blob)[:8]
    gitstore.transaction(repo).move(name, None, blob, message="t").commit()
print(blob)
"""


def _stage(repo: Path, content: str, boot: dict[str, str], *move: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", STAGE_AND_MOVE, str(repo), content, *move],
        env={**os.environ, **boot}, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return done.stdout.strip()


def test_a_staged_object_a_power_cut_tore_is_never_published_by_a_later_move(
    tmp_path: Path,
) -> None:
    """libgit2 writes no object it finds, so a torn staged copy left by a cut would pass
    for the object and be published by the next move naming it: recovery drops the stage."""
    repo = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(repo))
    _stage(repo, "another object\n", BOOT, "move")  # the repository has a journal now
    oid = _stage(repo, "staged, never named\n", BOOT)  # unacknowledged, unsynced
    staged = repo / ".git" / "gitrun" / "stage" / oid[:2] / oid[2:]
    staged.chmod(0o644)
    staged.write_bytes(b"")  # what the cut left of it
    assert _stage(repo, "staged, never named\n", REBOOT, "move") == oid
    assert git(repo, "cat-file", "blob", oid) == "staged, never named\n"
    git(repo, "fsck", "--strict")


RANDOM_CUTS = int(os.environ.get("GITRUN_RANDOM_CUTS", "6"))


def test_power_cuts_at_random_moments_lose_no_acknowledged_step(
    baseline: Baseline, tmp_path: Path
) -> None:
    """``gitrun run`` SIGKILLed at a random moment (uniform over an uninterrupted run's
    time here), then the worst power cut, then a resume under a new boot id: each ends
    as the uninterrupted run did (``GITRUN_RANDOM_CUTS``, default 6)."""
    rng = random.Random(4243)
    problems: list[str] = []
    cut = 0
    for n in range(RANDOM_CUTS):
        cli = booted(Cli.at(tmp_path / f"home-{n}"), BOOT)
        args = ["run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, "-q"]
        proc = cli.popen(*args)
        try:
            proc.communicate(timeout=rng.uniform(0.0, baseline.seconds))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        registered = (cli.home / "runs" / f"{RUN_ID}.json").exists()
        journaled = (cli.repo(SANDBOX) / ".git" / "gitrun" / "journal").exists()
        if not (registered and journaled):
            continue  # killed before the run existed: nothing to cut
        cut += 1
        power_cut(cli, SANDBOX, RUN_ID)
        after = booted(cli, REBOOT)
        resumed = after("resume", RUN_ID, "-q")
        if resumed.returncode != baseline.code:
            problems.append(f"cut {n}: resume exit {resumed.returncode}: {resumed.stderr[-400:]}")
            continue
        problems += [f"cut {n}: {p}" for p in run_invariants(baseline, RUN_ID, after)]
    assert problems == []
    assert cut > 0


def test_a_stopped_holder_of_the_journal_lock_is_named_at_once_not_waited_on(
    tmp_path: Path,
) -> None:
    """A run stopped (SIGSTOP) while it holds the repository's journal lock (between its
    record and its renames: a checkpoint's, here its first write's intent riding with
    it) must not hang every other run of that repository: the next one exits 4 naming
    the stopped pid and what to do, changes nothing, and runs once the first goes on."""
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    sandbox = str(SANDBOXES / SANDBOX)
    paused = booted(cli, {faults.PAUSE_VAR: "checkpoint_ref_synced:2"})
    first = paused.popen("run", sandbox, "--run-id", "first", "-q")
    try:
        deadline = time.monotonic() + 60
        while not stopped(first.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped(first.pid)
        second = cli("run", sandbox, "--run-id", "second", "-q", timeout=60)
        assert second.returncode == 4, second.stderr
        assert f"kill -CONT {first.pid}" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
    finally:
        os.kill(first.pid, signal.SIGCONT)
        first.communicate(timeout=120)
    assert first.returncode == 0
    again = cli("run", sandbox, "--run-id", "second", "-q")
    assert again.returncode == 0, again.stderr
