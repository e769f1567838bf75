"""OS-level locks (``flock``) that tell a live gitrun writer from a dead one.

The kernel drops an ``flock`` when its process dies, so a ``*.lock`` file left by a killed
writer is provably stale for whoever holds the OS lock next. Each flock file starts with
a holder record (pid, host, since, worker) so a busy lock can say who holds it, and a
holder seen stopped (SIGSTOP, a debugger) is reported at once instead of waited on.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gitrun.core.errors import LeaseHeld, Refused

STOPPED_HOLDER_SECONDS = 0.5  # a lock holder seen stopped (SIGSTOP) this long is reported
HOLDER_BYTES = 256  # the holder record at the start of every flock file, space-padded
WAIT_NOTICE_SECONDS = 1.0  # a running holder this long: one stderr line names it, then wait on

_worker = ""
_host = os.uname().nodename  # gethostname(2) on Linux, without importing socket


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

    def __init__(self, path: Path | str, holder: Holder | None, stopped: bool) -> None:
        super().__init__(str(path))
        self.holder = holder
        self.stopped = stopped


_record_head: list[tuple[int, str, bytes]] = []  # (pid, worker, b"pid=... host=... since=")


def _holder_record() -> bytes:
    pid = os.getpid()
    if not _record_head or _record_head[0][:2] != (pid, _worker):
        _record_head[:] = [(pid, _worker, f"pid={pid} host={_host} since=".encode())]
    line = _record_head[0][2] + f"{time.time():.3f} worker={_worker}".encode()
    return line[: HOLDER_BYTES - 1].ljust(HOLDER_BYTES - 1) + b"\n"


def read_holder(path: Path | str) -> Holder | None:
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


def _busy_holder(path: Path | str, seen: Holder | None) -> tuple[Holder | None, bool]:
    """Re-read the holder; stopped only when seen stopped twice with the same record."""
    holder = read_holder(path)
    return holder, holder is not None and holder == seen and holder.stopped()


@contextmanager
def flock(
    path: Path | str, timeout: float, on_wait: Callable[[Holder | None], None] | None = None
) -> Iterator[int]:
    """:func:`acquire` as a block: the lock is held until the block ends (its descriptor
    closed) or the process dies. The block gets the descriptor: a process it is passed
    to holds the lock for as long as it lives."""
    fd = acquire(path, timeout, on_wait)
    try:
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def acquire(
    path: Path | str,
    timeout: float,
    on_wait: Callable[[Holder | None], None] | None = None,
    *,
    make_dir: bool = True,
) -> int:
    """An exclusive kernel lock on ``path`` (the same lock ``filelock`` takes on POSIX),
    held until the returned descriptor is closed or the process dies; its holder (pid,
    worker, host, since) is written at the start of the file. :class:`LockBusy` after
    ``timeout``, or at once once the holder is seen stopped: a paused process would hold
    it for ever. A running holder is waited on, ``on_wait(holder)`` called once after
    :data:`WAIT_NOTICE_SECONDS`.

    A bare ``flock`` on a fresh descriptor: ~10x cheaper than a FileLock object, and it
    sits on every write path (the holder record is one ``pwrite``, no fsync). Never
    opened through a planted link (the holder record would overwrite its target). A
    missing directory of the lock file is made (``make_dir``), or FileNotFoundError.
    """
    try:
        fd = _open_lock_file(path)
    except FileNotFoundError:  # the locks directory is new (or was removed)
        if not make_dir:
            raise
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = _open_lock_file(path)
    try:
        if not _try(fd):
            _wait(fd, path, timeout, on_wait)
        os.pwrite(fd, _holder_record(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _wait(
    fd: int, path: Path | str, timeout: float, on_wait: Callable[[Holder | None], None] | None
) -> None:
    """The lock is taken: wait for it (see :func:`acquire`)."""
    start = time.monotonic()
    next_look, seen = start + STOPPED_HOLDER_SECONDS / 2, None
    while True:
        now = time.monotonic()
        if now >= next_look:
            seen, stopped = _busy_holder(path, seen)
            if stopped:
                raise LockBusy(path, seen, stopped=True)
            next_look = now + STOPPED_HOLDER_SECONDS / 2
        if on_wait is not None and now - start >= WAIT_NOTICE_SECONDS:
            tell, on_wait = on_wait, None  # once
            tell(read_holder(path))
        if now - start >= timeout:
            raise LockBusy(path, read_holder(path), stopped=False)
        time.sleep(0.005)
        if _try(fd):
            return


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_lock_file(path: Path | str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if not os.path.islink(path):
            raise
        raise Refused(
            f"{path} is a symbolic link, not gitrun's lock file (something planted it): "
            "remove it, then retry"
        ) from exc


def busy_error(name: str, exc: LockBusy, timeout: float, what: str = "ref") -> LeaseHeld:
    """Who holds ``name``'s OS lock, and what to do about it (exit 4, like a held lease).
    ``what`` names the kind of thing locked (a ref, the witness of a run)."""
    holder = exc.holder
    who = holder.describe() if holder else "a process that left no holder record"
    owner = (holder.worker or f"pid {holder.pid}") if holder else "unknown"
    if exc.stopped and holder is not None:
        message = (
            f"{what} {name} is locked by a stopped process: {who}; it keeps the lock while "
            f"paused: let it go on (kill -CONT {holder.pid}) or end it (kill -KILL {holder.pid}), "
            "then retry"
        )
    else:
        end = f" (or end it: kill -KILL {holder.pid})" if holder else ""
        message = (
            f"{what} {name} is held by a live gitrun process for over "
            f"{timeout:.0f}s: {who}; try again when it finishes{end}"
        )
    return LeaseHeld(owner, 0.0, message)


__all__ = [
    "Holder",
    "LockBusy",
    "acquire",
    "busy_error",
    "flock",
    "read_holder",
    "set_worker",
    "unshared",
]


def waiting(name: str, timeout: float) -> Callable[[Holder | None], None]:
    """One stderr line: who holds ``name``'s lock, and that gitrun waits (then exit 4)."""

    def say(holder: Holder | None) -> None:
        who = holder.describe() if holder else "a process that left no holder record"
        sys.stderr.write(
            f"gitrun: waiting for ref {name}: locked by {who}; gitrun waits up to "
            f"{timeout:.0f}s for it, then exits 4 naming it\n"
        )
        sys.stderr.flush()

    return say


def unshared(spare: str, dir_fd: int | None = None) -> bool:
    """Whether no process has the file ``spare`` open. A spare (a ref's or a worktree
    file's replaced file, reused in place) is written only then: a process that opened
    it before the rename replaced it must never see the next value written into it. A
    write lease (an OS lock on the file) is granted only on a file nobody else has open;
    it is dropped at once (its break signal, were anyone to open it meanwhile, is one the
    process ignores). False too where the filesystem grants no leases."""
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(spare, flags, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)  # ignored unless handled
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
