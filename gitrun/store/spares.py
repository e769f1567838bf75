"""Spare ref files (``<common dir>/gitrun/spare/``): the file a ref's rename replaced,
kept to become that ref's next ``.lock`` (see :func:`take_lock`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
from pathlib import Path


def take_lock(lock: Path, spare: str = "", size: int = 0) -> int | None:
    """Create ``<ref>.lock`` exclusively, as git and libgit2 do, and return its open
    descriptor (the new value is written through it); None when it exists.

    With a ``spare`` (the ref's file its last move replaced, :func:`keep_replaced`) of
    exactly ``size`` bytes, the lock is that file, linked to the lock's name (as
    exclusive as ``O_EXCL``) and overwritten in place: a move then allocates no inode and
    frees no block — on a filesystem mounted with ``discard`` freeing a ref's block costs
    more than the rest of its rename. A spare some process still has open (a reader of
    the ref's old value), or that is anything but gitrun's own single-link regular file
    of that size (a link planted there, a hard link to someone's file, a crash's leftover
    still linked as the ref) is never written: the lock is then created as usual.
    """
    if spare:
        reused = _reuse_spare(lock, spare, size)
        if reused != _NO_SPARE:
            return None if reused == _TAKEN else reused
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        try:
            return os.open(lock, flags, 0o644)
        except FileNotFoundError:  # the ref's directory is new
            lock.parent.mkdir(parents=True, exist_ok=True)
            return os.open(lock, flags, 0o644)
    except FileExistsError:
        return None


_NO_SPARE, _TAKEN = -1, -2


def _reuse_spare(lock: Path, spare: str, size: int) -> int:
    """The spare as the ref's lock (an open descriptor), :data:`_TAKEN` when the lock
    exists, or :data:`_NO_SPARE` (nothing left behind) when the spare cannot serve."""
    if not unshared(spare):
        return _NO_SPARE
    try:
        os.link(spare, lock)
    except FileExistsError:
        return _TAKEN
    except OSError:
        return _NO_SPARE  # no spare yet (or the ref's directory is new)
    with contextlib.suppress(OSError):
        os.unlink(spare)
    try:
        # O_NONBLOCK: a FIFO swapped in after the probe would wait for a reader for ever
        # (the ref's OS lock held), a lease taken meanwhile for its break: refused at once
        fd = os.open(lock, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        _discard(lock)  # a link, a FIFO, a leased file: never written through
        return _NO_SPARE
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_size != size:
        os.close(fd)
        _discard(lock)
        return _NO_SPARE
    return fd


def _discard(lock: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(lock)


def unshared(spare: str, dir_fd: int | None = None) -> bool:
    """Whether no process has the spare open: one that opened the ref's file before the
    rename replaced it (a reader between its open and its read) must never see the next
    value written into it. A write lease is granted only on a file nobody else has open;
    it is dropped at once (its break signal, were anyone to open it meanwhile, is one
    the process ignores). False too where the filesystem grants no leases."""
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


def keep_replaced(target: Path, spare: str) -> None:
    """Keep the ref's current file as its spare before the rename replaces it (best
    effort: a packed or absent ref has none, a spare already kept stays)."""
    try:
        os.link(target, spare, follow_symlinks=False)
    except FileNotFoundError:
        if not os.path.lexists(target):
            return
        os.makedirs(os.path.dirname(spare), exist_ok=True)
        with contextlib.suppress(OSError):
            os.link(target, spare, follow_symlinks=False)
    except OSError:
        pass


__all__ = ["keep_replaced", "take_lock", "unshared"]
