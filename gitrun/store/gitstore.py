"""The git store: opening repositories durably, and the one atomic ref-update path.

Every durable change gitrun makes ends in :func:`update_ref`, which

1. takes an OS-level lock (``flock``, as filelock does) per ref it will lock, in sorted order, so a
   ``*.lock`` file left by a killed gitrun writer is provably stale for whoever holds
   that OS lock next (the kernel drops an flock when its process dies);
2. removes such stale ref lock files, but only once they are older than a grace
   period, so a foreign ``git`` process that holds a lock for a few milliseconds is
   never disturbed;
3. opens one libgit2 ref transaction, locks the ref it moves, re-reads it and every ref
   it only fences on (the lease), compares, then moves exactly one ref. A fencing ref is
   re-read under its OS lock, which every gitrun writer of that ref holds while it
   writes, so it cannot change in between; its git lock file is not taken (that would
   cost a file create and unlink on every step and protect only against foreign git).

Only one ref moves per call: multi-ref transactions are not crash-atomic on the files
backend, so each step has exactly one commit point and everything else is derived.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pygit2
from pygit2.enums import Option

from gitrun.core import faults
from gitrun.core.errors import CasFailed, EnvironmentDrift, LeaseHeld, RefLocked, Refused
from gitrun.store.atomicfile import fsync_dir as fsync_dir  # noqa: PLC0414 - re-export for callers

STALE_LOCK_GRACE_SECONDS = 1.0
LOCK_TIMEOUT_SECONDS = 30.0
STOPPED_HOLDER_SECONDS = 0.5  # a lock holder seen stopped (SIGSTOP) this long is reported
HOLDER_BYTES = 256  # the holder record at the start of every flock file, space-padded
WAIT_NOTICE_SECONDS = 1.0  # a running holder this long: one stderr line names it, then wait on

_configured = False


def configure_git() -> None:
    """Turn on libgit2's fsync of the git dir; must run before any Repository opens."""
    global _configured  # noqa: PLW0603 - a process-wide libgit2 option, set once
    if not _configured:
        pygit2.option(Option.ENABLE_FSYNC_GITDIR, True)
        _configured = True


def open_repo(path: Path | str) -> pygit2.Repository:
    """Open a repository with durability on; a clear error if it is not one."""
    configure_git()
    try:
        return pygit2.Repository(str(path))
    except pygit2.GitError as exc:
        raise EnvironmentDrift(
            "not-a-repository", f"{path} is not a git repository: {exc}"
        ) from exc


def common_dir(repo: pygit2.Repository) -> Path:
    """The repository's common git dir (shared by all its worktrees)."""
    gitdir = Path(repo.path)
    commondir_file = gitdir / "commondir"
    if commondir_file.is_file():
        return (gitdir / commondir_file.read_text().strip()).resolve()
    return gitdir.resolve()


def read_ref(repo: pygit2.Repository, name: str) -> pygit2.Oid | None:
    """The direct target of ``name``, or None when the ref does not exist."""
    ref = repo.references.get(name)
    if ref is None:
        return None
    target = ref.target
    if not isinstance(target, pygit2.Oid):
        raise Refused(f"ref {name} is symbolic; gitrun expects a direct ref")
    return target


@dataclass(frozen=True)
class Guard:
    """A ref re-read under its OS lock inside the transaction but not changed (fencing)."""

    name: str
    check: Callable[[pygit2.Oid | None], None]


def _lock_path(cdir: Path, refname: str) -> Path:
    digest = hashlib.sha256(refname.encode()).hexdigest()[:32]
    return cdir / "gitrun" / "locks" / f"{digest}.flock"


def _ref_lock_file(cdir: Path, refname: str) -> Path:
    return cdir / (refname + ".lock")


def _clear_stale_lock(cdir: Path, refname: str) -> None:
    """Remove ``<ref>.lock`` when we hold the ref's OS lock and the file is not fresh.

    Holding the OS lock proves no live gitrun writer holds the ref lock; the grace
    period keeps us off a lock a foreign git command holds for a few milliseconds.
    """
    lockfile = _ref_lock_file(cdir, refname)
    deadline = time.monotonic() + STALE_LOCK_GRACE_SECONDS + 1.0
    while lockfile.exists():
        try:
            age = time.time() - lockfile.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= STALE_LOCK_GRACE_SECONDS:
            lockfile.unlink(missing_ok=True)
            return
        if time.monotonic() > deadline:
            raise RefLocked(refname, f"ref {refname} stays locked by a process that is not gitrun")
        time.sleep(0.05)


_worker = ""
_host = socket.gethostname()


def set_worker(worker: str) -> None:
    """Name this process's worker in the flock files it takes (who holds what)."""
    global _worker  # noqa: PLW0603 - one worker per process, named once
    _worker = " ".join(worker.split())


@dataclass(frozen=True)
class Holder:
    """Who holds an flock, as its holder wrote it when taking it."""

    pid: int
    host: str
    since: float
    worker: str

    def stopped(self) -> bool:
        """True when the holder runs on this host and is stopped (SIGSTOP, a debugger)."""
        if self.host != _host:
            return False
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        who = f"worker {self.worker}, " if self.worker else ""
        return f"pid {self.pid} ({who}host {self.host}, since {since})"


class LockBusy(TimeoutError):
    """An flock stays taken; ``holder`` is who took it (None when unknown)."""

    def __init__(self, path: Path, holder: Holder | None, stopped: bool) -> None:
        super().__init__(str(path))
        self.holder = holder
        self.stopped = stopped


def _holder_record() -> bytes:
    line = f"pid={os.getpid()} host={_host} since={time.time():.3f} worker={_worker}"
    return line.encode()[: HOLDER_BYTES - 1].ljust(HOLDER_BYTES - 1) + b"\n"


def read_holder(path: Path) -> Holder | None:
    """The holder record of an flock file, or None when absent or unreadable."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(HOLDER_BYTES).decode("utf-8", "replace")
        fields = dict(part.partition("=")[::2] for part in raw.split(" ", 3))
        return Holder(
            int(fields["pid"]), fields["host"], float(fields["since"]), fields["worker"].strip()
        )
    except (OSError, KeyError, ValueError):
        return None


def _busy_holder(path: Path, seen: Holder | None) -> tuple[Holder | None, bool]:
    """Re-read the holder; stopped only when seen stopped twice with the same record."""
    holder = read_holder(path)
    return holder, holder is not None and holder == seen and holder.stopped()


@contextmanager
def flock(
    path: Path, timeout: float, on_wait: Callable[[Holder | None], None] | None = None
) -> Iterator[None]:
    """An exclusive kernel lock on ``path`` (the same lock ``filelock`` takes on POSIX),
    held until the block ends or the process dies; its holder (pid, worker, host, since)
    is written at the start of the file. :class:`LockBusy` after ``timeout``, or at once
    once the holder is seen stopped: a paused process would hold it for ever. A running
    holder is waited on, ``on_wait(holder)`` called once after :data:`WAIT_NOTICE_SECONDS`.

    A bare ``flock`` on a fresh descriptor: ~10x cheaper than a FileLock object, and it
    sits on every write path (the holder record is one ``pwrite``, no fsync).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_look, seen = start + STOPPED_HOLDER_SECONDS / 2, None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= next_look:
                    seen, stopped = _busy_holder(path, seen)
                    if stopped:
                        raise LockBusy(path, seen, stopped=True) from None
                    next_look = now + STOPPED_HOLDER_SECONDS / 2
                if on_wait is not None and now - start >= WAIT_NOTICE_SECONDS:
                    tell, on_wait = on_wait, None  # once
                    tell(read_holder(path))
                if now - start >= timeout:
                    raise LockBusy(path, read_holder(path), stopped=False) from None
                time.sleep(0.005)
        os.pwrite(fd, _holder_record(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _busy_error(name: str, exc: LockBusy) -> LeaseHeld:
    """Who holds ``name``'s OS lock, and what to do about it (exit 4, like a held lease)."""
    holder = exc.holder
    who = holder.describe() if holder else "a process that left no holder record"
    owner = (holder.worker or f"pid {holder.pid}") if holder else "unknown"
    if exc.stopped and holder is not None:
        message = (
            f"ref {name} is locked by a stopped process: {who}; it keeps the lock while "
            f"paused: let it go on (kill -CONT {holder.pid}) or end it (kill -KILL {holder.pid}), "
            "then retry"
        )
    else:
        end = f" (or end it: kill -KILL {holder.pid})" if holder else ""
        message = (
            f"ref {name} is held by a live gitrun process for over "
            f"{LOCK_TIMEOUT_SECONDS:.0f}s: {who}; try again when it finishes{end}"
        )
    return LeaseHeld(owner, 0.0, message)


def _waiting(name: str) -> Callable[[Holder | None], None]:
    """One stderr line: who holds ``name``'s lock, and that gitrun waits (then exit 4)."""

    def say(holder: Holder | None) -> None:
        who = holder.describe() if holder else "a process that left no holder record"
        sys.stderr.write(
            f"gitrun: waiting for ref {name}: locked by {who}; gitrun waits up to "
            f"{LOCK_TIMEOUT_SECONDS:.0f}s for it, then exits 4 naming it\n"
        )
        sys.stderr.flush()

    return say


@contextmanager
def os_locks(repo: pygit2.Repository, refnames: Sequence[str]) -> Iterator[None]:
    """Hold the OS-level lock of every named ref (sorted, so no deadlock)."""
    cdir = common_dir(repo)
    with ExitStack() as stack:
        for name in sorted(set(refnames)):
            path = _lock_path(cdir, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                stack.enter_context(flock(path, LOCK_TIMEOUT_SECONDS, _waiting(name)))
            except LockBusy as exc:
                raise _busy_error(name, exc) from exc
            _clear_stale_lock(cdir, name)
        yield


def update_ref(
    repo: pygit2.Repository,
    name: str,
    expected: pygit2.Oid | None,
    new: pygit2.Oid | None,
    *,
    guards: Sequence[Guard] = (),
    message: str = "gitrun",
    what: str = "",
    crash_prefix: str = "",
) -> None:
    """Compare-and-swap ``name`` from ``expected`` to ``new`` (None = absent/delete).

    Every guard ref is locked in the same transaction and its check called with its
    value under the lock; a check that raises aborts the transaction, nothing moves.
    """
    names = [name, *(g.name for g in guards)]
    with os_locks(repo, names):
        for attempt in range(50):
            try:
                _transact(repo, name, expected, new, guards, message, what, crash_prefix)
            except pygit2.GitError as exc:
                # A foreign process holds a ref lock for a moment: retry with jitter.
                if attempt == 49:
                    raise RefLocked(name, f"could not lock {name}: {exc}") from exc
                time.sleep(random.uniform(0.005, 0.03))  # noqa: S311 - jitter, not crypto
                continue
            return


def _transact(
    repo: pygit2.Repository,
    name: str,
    expected: pygit2.Oid | None,
    new: pygit2.Oid | None,
    guards: Sequence[Guard],
    message: str,
    what: str,
    crash_prefix: str,
) -> None:
    with repo.transaction() as tx:
        tx.lock_ref(name)
        if crash_prefix:
            faults.point(f"{crash_prefix}_locked")
        for guard in guards:
            guard.check(read_ref(repo, guard.name))
        actual = read_ref(repo, name)
        if actual != expected:
            raise CasFailed(name, _hex(expected), _hex(actual), what)
        if new is None:
            tx.remove(name)
        else:
            tx.set_target(name, new, message=message)
    if crash_prefix:
        faults.point(f"{crash_prefix}_moved")


def _hex(oid: pygit2.Oid | None) -> str | None:
    return None if oid is None else str(oid)


def read_blob(repo: pygit2.Repository, oid: pygit2.Oid) -> bytes:
    """The bytes of the blob ``oid``; ValueError when it is missing or not a blob."""
    obj = repo.get(oid)
    if not isinstance(obj, pygit2.Blob):
        raise ValueError(f"{oid} is not a blob")  # noqa: TRY004 - callers treat it as bad data
    data: bytes = obj.data
    return data


def write_blob(repo: pygit2.Repository, data: bytes) -> pygit2.Oid:
    """Write one blob object (durable when fsync is on)."""
    oid: pygit2.Oid = repo.create_blob(data)
    return oid
