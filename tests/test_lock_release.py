"""Every OS lock gitrun takes (:func:`gitrun.store.oslock.acquire`: a ref's, the
journal's, a witness's) is let go on every way out: a later lock of the same set busy, a
foreign ``<ref>.lock`` that stays, the block raising, an interrupt while waiting. A lock
leaked by a process that lives on would make the next writer wait 30 s and exit 4, and
a stale ``.lock`` look live. Each test probes the lock with a fresh descriptor (``flock``
is per open file: a leaked descriptor of this process conflicts with it too)."""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pygit2
import pytest

from gitrun.core.errors import GitrunError
from gitrun.store import journal, oslock, reflocks
from gitrun.store.keys import Keyring
from gitrun.store.witness import Witness

HOLD = "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
HOLD += "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n"


def free(path: str | Path) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@contextmanager
def held_elsewhere(path: str | Path) -> Iterator[None]:
    """``path``'s flock held by another (running) process."""
    argv = [sys.executable, "-c", HOLD, str(path)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        try:
            if proc.stdout is None or proc.stdout.readline() != "held\n":
                raise AssertionError("the holder never took the lock")
            yield
        finally:
            proc.kill()


def open_fds() -> set[str]:
    """This process's open lock files (flock files and ``.lock`` files): other
    descriptors (the journal, a cached one, another test's thread) come and go. Garbage
    is collected first: an earlier test's dropped runtime closes its owner locks only
    when collected, which under xdist could fall inside the block measured."""
    gc.collect()
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith((".flock", ".lock")):
            found.add(f"{fd}:{target}")
    return found


@pytest.fixture
def repo(tmp_path: Path) -> pygit2.Repository:
    return pygit2.init_repository(str(tmp_path / "repo"))


def test_a_busy_later_ref_lock_lets_go_of_the_earlier_ones(
    repo: pygit2.Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reflocks, "LOCK_TIMEOUT_SECONDS", 0.3)
    cdir = reflocks.common_dir(repo)
    first, second = reflocks.lock_path(cdir, "refs/a"), reflocks.lock_path(cdir, "refs/b")
    first.parent.mkdir(parents=True, exist_ok=True)
    with held_elsewhere(second):
        before = open_fds()
        with pytest.raises(GitrunError), reflocks.os_locks(repo, ["refs/b", "refs/a"]):
            pytest.fail("took a lock another process holds")
        assert free(first)
        assert open_fds() == before
    assert free(second)


def test_a_foreign_ref_lock_that_stays_lets_go_of_every_os_lock(
    repo: pygit2.Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reflocks, "STALE_LOCK_GRACE_SECONDS", 0.1)
    cdir = reflocks.common_dir(repo)
    foreign = reflocks.ref_lock_file(cdir, "refs/b")
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_text("x\n")
    future = time.time() + 3600  # always fresh: a foreign git's, never cleared
    os.utime(foreign, (future, future))
    before = open_fds()
    with pytest.raises(GitrunError), reflocks.os_locks(repo, ["refs/a", "refs/b"]):
        pytest.fail("went on over a live foreign lock")
    assert free(reflocks.lock_path(cdir, "refs/a"))
    assert free(reflocks.lock_path(cdir, "refs/b"))
    assert open_fds() == before
    assert foreign.exists()


def test_a_stale_ref_lock_is_still_cleared_under_the_os_lock(repo: pygit2.Repository) -> None:
    cdir = reflocks.common_dir(repo)
    stale = reflocks.ref_lock_file(cdir, "refs/heads/x")
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("x\n")
    past = time.time() - 60
    os.utime(stale, (past, past))
    with reflocks.os_locks(repo, ["refs/heads/x"]):
        assert not stale.exists()
        assert not free(reflocks.lock_path(cdir, "refs/heads/x"))
    assert free(reflocks.lock_path(cdir, "refs/heads/x"))


def test_a_block_raising_lets_go_of_the_ref_journal_and_witness_locks(
    repo: pygit2.Repository, tmp_path: Path
) -> None:
    cdir = reflocks.common_dir(repo)
    before = open_fds()
    with pytest.raises(ZeroDivisionError), reflocks.os_locks(repo, ["refs/a", "refs/b"]):
        _ = 1 / 0
    assert free(reflocks.lock_path(cdir, "refs/a"))
    assert free(reflocks.lock_path(cdir, "refs/b"))
    held = journal.of(cdir)
    assert held.usable()
    before = open_fds()  # the journal keeps its own descriptor open
    with pytest.raises(ZeroDivisionError), held.locked():
        _ = 1 / 0
    assert free(cdir / journal.LOCK_FILE)
    taken: list[bool] = []

    def take() -> None:
        taken.append(held.thread_lock.acquire(timeout=1))
        held.thread_lock.release()

    other = threading.Thread(target=take)
    other.start()
    other.join()
    assert taken == [True]
    witness = Witness(tmp_path / "witness", Keyring.__new__(Keyring))
    with pytest.raises(ZeroDivisionError), witness.locked("r1"):
        _ = 1 / 0
    assert free(tmp_path / "witness" / ".r1.lock")
    assert open_fds() == before


def test_an_interrupt_while_waiting_closes_the_lock_file(tmp_path: Path) -> None:
    lock = tmp_path / "x.flock"

    def interrupt(_: object) -> None:
        raise KeyboardInterrupt

    with held_elsewhere(lock):
        before = open_fds()
        with pytest.raises(KeyboardInterrupt):
            oslock.acquire(str(lock), 5.0, interrupt)
        assert open_fds() == before
    assert free(lock)


def test_a_planted_link_as_a_lock_file_is_refused_and_its_target_left_alone(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine\n")
    lock = tmp_path / "x.flock"
    lock.symlink_to(victim)
    before = open_fds()
    with pytest.raises(GitrunError, match="symbolic link"):
        oslock.acquire(str(lock), 1.0)
    assert victim.read_bytes() == b"mine\n"
    assert open_fds() == before
