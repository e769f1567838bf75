"""The one atomic write path: whole or absent, exclusive under real races, crash-safe,
private from creation, and never through a planted symlink."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pygit2
import pytest
from conftest import git

from gitrun.adapter.environment import Environment
from gitrun.adapter.worktree import INDEX_BASE_FILE
from gitrun.store import atomicfile, gitstore, keys
from gitrun.store.atomicfile import atomic_file, atomic_write, temp_prefix
from gitrun.store.evidence import new_keypair
from gitrun.store.lease import LeaseManager

ROOT = Path(__file__).resolve().parent.parent


def _temps(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{temp_prefix(path.name)}*"))


def _race_create(path: str, index: int, barrier: object, results: object) -> None:
    """One racer: wait for all, then create ``path`` exclusively with its own bytes."""
    barrier.wait()  # type: ignore[attr-defined]
    try:
        atomic_write(Path(path), f"writer {index}\n".encode() * 20_000, exclusive=True)
    except FileExistsError:
        results.put((index, "lost"))  # type: ignore[attr-defined]
    else:
        results.put((index, "won"))  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_of_eight_processes_creating_one_file_exactly_one_wins_and_it_holds_its_bytes(
    tmp_path: Path,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    target = tmp_path / "registry.json"
    for _round in range(2):
        target.unlink(missing_ok=True)
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [
            ctx.Process(target=_race_create, args=(str(target), i, barrier, results))
            for i in range(8)
        ]
        for p in procs:
            p.start()
        outcomes = dict(results.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        winners = [i for i, what in outcomes.items() if what == "won"]
        assert len(winners) == 1, outcomes
        assert target.read_bytes() == f"writer {winners[0]}\n".encode() * 20_000
        assert _temps(target) == []


def test_an_exception_mid_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    atomic_write(target, b"old")

    def half_then_fail() -> None:
        with atomic_file(target) as fh:
            fh.write(b"half of the new")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        half_then_fail()
    assert target.read_bytes() == b"old"
    assert _temps(target) == []


def test_an_exclusive_create_of_an_existing_file_fails_and_leaves_it(tmp_path: Path) -> None:
    target = tmp_path / "instance.json"
    atomic_write(target, b"first", exclusive=True)
    with pytest.raises(FileExistsError, match="not replaced"):
        atomic_write(target, b"second", exclusive=True)
    assert target.read_bytes() == b"first"
    assert _temps(target) == []


_WRITER = """
import sys, time
from pathlib import Path
from gitrun.store.atomicfile import atomic_file
target, ready, loop = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "loop"
chunk = b"N" * (1 << 20)
if loop:
    i = 0
    while True:
        with atomic_file(target) as fh:
            for _ in range(4):
                fh.write(bytes([65 + i % 2]) * (1 << 20))
        i += 1
        ready.touch()
with atomic_file(target) as fh:
    fh.write(chunk)
    ready.touch()
    time.sleep(60)
    fh.write(chunk)
"""


def _writer(target: Path, ready: Path, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(target), str(ready), mode], env=env)


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the writer never got under way")
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_write_leaves_the_old_file_and_a_temp_the_next_write_removes(
    tmp_path: Path,
) -> None:
    target, ready = tmp_path / "registry.json", tmp_path / "ready"
    atomic_write(target, b"old")
    proc = _writer(target, ready, "once")
    _wait_for(ready, proc)
    (temp,) = _temps(target)  # the live writer's, half written
    atomic_write(target, b"meanwhile")  # a live writer's temp is left alone
    assert temp.exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert target.read_bytes() == b"meanwhile"
    assert temp.stat().st_size == 1 << 20
    atomic_write(target, b"new")  # too young to judge: ignored, never read
    assert target.read_bytes() == b"new"
    old = time.time() - 2 * atomicfile.STALE_SECONDS
    os.utime(temp, (old, old))
    atomic_write(target, b"newer")
    assert target.read_bytes() == b"newer"
    assert _temps(target) == []


@pytest.mark.timeout(60)
def test_writers_killed_at_random_moments_leave_the_old_or_the_new_content_whole(
    tmp_path: Path,
) -> None:
    target, ready = tmp_path / "big", tmp_path / "ready"
    atomic_write(target, b"old")
    whole = {b"old", b"A" * (4 << 20), b"B" * (4 << 20)}
    for delay in (0.0, 0.005, 0.02, 0.05, 0.1):
        ready.unlink(missing_ok=True)
        proc = _writer(target, ready, "loop")
        if delay >= 0.05:
            _wait_for(ready, proc)  # killed after at least one whole write
        else:
            time.sleep(0.2 + delay)  # killed while starting or during its first write
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert target.read_bytes() in whole
        left = _temps(target)
        assert len(left) <= 1  # the killed writer's at most: the one before it was removed
        old = time.time() - 2 * atomicfile.STALE_SECONDS
        for temp in left:
            os.utime(temp, (old, old))


def test_a_secret_is_0600_from_its_creation_even_with_an_open_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        target = tmp_path / "secret.key"
        with atomic_file(target, mode=0o600) as fh:
            assert stat.S_IMODE(fh.temp_path.stat().st_mode) == 0o600
            fh.write(b"secret")
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        ring = tmp_path / "home" / "keys" / "checkpoint.keyring"
        keys.load_keyring(ring)
        assert stat.S_IMODE(ring.stat().st_mode) == 0o600
        assert stat.S_IMODE(ring.parent.stat().st_mode) == 0o700
        keys.rotate_keyring(ring)
        assert stat.S_IMODE(ring.stat().st_mode) == 0o600
        key, _ = new_keypair("approver", "alice", tmp_path / "ks", tmp_path / "ks" / "roots.json")
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    finally:
        os.umask(previous)


def test_a_symlink_planted_at_the_target_is_replaced_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    target = tmp_path / "state.json"
    target.symlink_to(outside)
    with pytest.raises(FileExistsError):
        atomic_write(target, b"x", exclusive=True)
    atomic_write(target, b"mine")
    assert outside.read_bytes() == b"precious"
    assert not target.is_symlink()
    assert target.read_bytes() == b"mine"


def test_a_symlink_planted_at_the_temp_name_is_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    target = tmp_path / "state.json"
    names = iter(["planted", "fresh"])
    monkeypatch.setattr("gitrun.store.atomicfile._temp_token", lambda: next(names))
    planted = tmp_path / f"{temp_prefix(target.name)}planted"
    planted.symlink_to(outside)
    os.utime(planted, follow_symlinks=False)
    atomic_write(target, b"mine")
    assert outside.read_bytes() == b"precious"
    assert target.read_bytes() == b"mine"


def test_adding_a_trust_root_never_writes_through_a_planted_temp_symlink(tmp_path: Path) -> None:
    """The trust roots used a fixed temp name (``roots.json.tmp``) and followed it."""
    outside = tmp_path / "outside"
    outside.write_text("precious")
    roots = tmp_path / "ks" / "roots.json"
    roots.parent.mkdir()
    roots.with_name("roots.json.tmp").symlink_to(outside)
    new_keypair("approver", "alice", roots.parent, roots)
    assert outside.read_text() == "precious"
    assert "alice" in roots.read_text()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Environment]:
    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    (repo_dir / "a.txt").write_text("a\n")
    git(tmp_path, "init", "-q", "-b", "main", str(repo_dir))
    git(repo_dir, "add", ".")
    git(repo_dir, "commit", "-q", "-m", "base")
    repo = gitstore.open_repo(repo_dir)
    lease = LeaseManager(repo, "run-1", "worker-1", 120)
    lease.acquire(0)
    base = repo.head.peel(pygit2.Commit).id
    yield Environment.create(repo, "run-1", base, tmp_path / "wt", "t@1")
    lease.release()


def test_the_index_base_marker_is_never_written_through_a_symlink_the_agent_planted(
    env: Environment, tmp_path: Path
) -> None:
    """The agent can write the repository's git dir: a planted ``gitrun-index-base.tmp``
    symlink made gitrun write a commit id into any file it points at."""
    outside = tmp_path / "outside"
    outside.write_text("precious")
    gitdir = Path(env.wt.path)
    (gitdir / INDEX_BASE_FILE).unlink()
    (gitdir / f"{INDEX_BASE_FILE}.tmp").symlink_to(outside)
    env.sync_index()
    assert outside.read_text() == "precious"
    assert (gitdir / INDEX_BASE_FILE).read_text() == str(env.head().id)
    assert _temps(gitdir / INDEX_BASE_FILE) == []
