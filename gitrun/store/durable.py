"""Durability barriers: a step's git objects become durable together, before a ref names them.

libgit2's own fsync costs two syncs per loose object (the file, then its directory) and
a write step makes five objects. Instead, every :class:`pygit2.Repository` gitrun opens
writes its new objects unsynced into a private *stage* (``<common dir>/gitrun/stage/
<pid>-<token>/``, a loose-object store added to the repository's odb ahead of the real
one, so this process reads them back at once; no other process can see them, and no
ref names them). The one ref compare-and-swap path (:func:`gitrun.store.gitstore.update_ref`)
then runs one barrier for all of them:

1. ``syncfs`` of the repository's filesystem: the staged objects' bytes, the new ref's
   ``.lock`` file and its reflog line are on disk, under names no reader trusts yet;
2. the staged objects are hard-linked to their real names in ``objects/xx/`` (an object
   is never visible under its name before its bytes are durable: a power cut can leave
   no empty object file that libgit2 would later take for the real one), then a second
   ``syncfs`` makes the names durable;
3. the ``.lock`` is renamed over the ref (the commit point), then a third ``syncfs``
   makes it durable before the caller acknowledges anything.

That is the same order libgit2's per-file fsync gives (data, then name, then the ref that
names it, each durable before the next), in three syncs per ref move instead of two per
object plus two per ref. ``syncfs`` also flushes what libgit2 never syncs (a new
worktree's admin files, the index) before the next ref move. Its return value is checked:
since Linux 5.8 it reports writeback errors on the filesystem since the descriptor was
opened, and that descriptor is opened when the repository is, and kept.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import os
import secrets
import shutil
import time
from pathlib import Path

import pygit2

from gitrun.core.errors import StorageFailed

STAGE_DIR = "gitrun/stage"
STAGE_PRIORITY = 100  # above the packed (2) and loose (1) backends: new objects land here
STALE_STAGE_SECONDS = 60.0  # a stage whose owner is gone is removed after this long
_OBJECT_NAME = 38  # hex digits of a loose object's file name below its fan-out directory

_libc = ctypes.CDLL(None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)
_watched: dict[int, int] = {}  # st_dev -> a descriptor kept open, so syncfs reports errors
_stages: dict[tuple[Path, int], Path] = {}  # (common dir, pid) -> this process's stage


def watch(path: Path) -> None:
    """Keep a descriptor on ``path``'s filesystem: syncfs reports errors seen since then."""
    dev = os.stat(path).st_dev
    if dev not in _watched:
        _watched[dev] = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def sync_filesystem(path: Path) -> None:
    """Everything written to ``path``'s filesystem is durable when this returns."""
    watch(path)
    fd = _watched[os.stat(path).st_dev]
    if _syncfs is None:  # not Linux: sync(2) flushes every filesystem
        os.sync()
        return
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise StorageFailed(
            f"the disk holding {path} reported a write error ({os.strerror(err)}): the last "
            "change is not acknowledged; check the disk, then resume the run"
        )


def attach_stage(repo: pygit2.Repository, cdir: Path) -> None:
    """Send ``repo``'s new objects to this process's stage (unsynced until a barrier)."""
    stage = _stage(cdir)
    repo.odb.add_backend(pygit2.OdbBackendLoose(str(stage), -1, False), STAGE_PRIORITY)


def _stage(cdir: Path) -> Path:
    key = (cdir, os.getpid())
    stage = _stages.get(key)
    if stage is None:
        root = cdir / STAGE_DIR
        root.mkdir(parents=True, exist_ok=True)
        _clear_dead_stages(root)
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        lock = root / f"{name}.flock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held (the descriptor kept) while this process lives
        stage = root / name
        stage.mkdir()
        _stages[key] = stage
        atexit.register(_remove_stage, stage, lock)
    return stage


def _remove_stage(stage: Path, lock: Path) -> None:
    """At exit: what is still staged was never published, so no ref names it."""
    shutil.rmtree(stage, ignore_errors=True)
    lock.unlink(missing_ok=True)


def _clear_dead_stages(root: Path) -> None:
    """Remove the stages of processes that died: what they staged was never published,
    so no ref names it (their ``.flock`` is free and old enough to be no newcomer's)."""
    for lock in root.glob("*.flock"):
        try:
            if time.time() - lock.stat().st_mtime < STALE_STAGE_SECONDS:
                continue
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        shutil.rmtree(root / lock.stem, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)


def staged(cdir: Path) -> list[tuple[str, str]]:
    """The (fan-out directory, file name) of every object this process has staged."""
    stage = _stages.get((cdir, os.getpid()))
    if stage is None:
        return []
    out = []
    for fan in os.scandir(stage):
        if len(fan.name) == 2 and fan.is_dir():
            out += [(fan.name, f.name) for f in os.scandir(fan.path) if len(f.name) == _OBJECT_NAME]
    return out


def barrier(cdir: Path) -> None:
    """Steps 1 and 2 of the protocol above: all written so far durable, every staged
    object durable under its real name. The caller then moves its ref (step 3)."""
    sync_filesystem(cdir)
    objects = staged(cdir)
    if not objects:
        return
    stage = _stages[(cdir, os.getpid())]
    for fan, name in objects:
        target = cdir / "objects" / fan
        target.mkdir(exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another writer published it first
            os.link(stage / fan / name, target / name)
    sync_filesystem(cdir)
    for fan, name in objects:
        (stage / fan / name).unlink(missing_ok=True)
    for fan in {fan for fan, _ in objects}:
        with contextlib.suppress(OSError):
            (stage / fan).rmdir()


__all__ = ["attach_stage", "barrier", "staged", "sync_filesystem", "watch"]
