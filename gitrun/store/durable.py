"""Durability barriers: a step's git objects become durable together, before a ref names them.

Most moves no longer take this barrier: one record in the repository's journal makes
their objects and value durable with one ``fdatasync`` (:mod:`gitrun.store.journal`).
The barrier remains for a move too large for the journal and where the journal cannot be
used (no boot id, a read-only journal); the stage below serves both.

libgit2's own fsync costs two syncs per loose object (the file, then its directory) and
a write step makes five objects. Instead, every :class:`pygit2.Repository` gitrun opens
writes its new objects unsynced into the repository's *stage* (``<common dir>/gitrun/
stage/``, a loose-object store added to the odb ahead of the real one, so they read back
at once; git itself never looks there, and no ref names a staged object). The one ref
compare-and-swap path (:mod:`gitrun.store.refmove`, which publishes staged objects and
runs the barrier) then runs one barrier for all the objects its new value reaches:

1. the staged objects the new value reaches are found by comparing it with the ref's
   old value (only changed tree entries are followed: the cost is the change's, not
   the tree's); then ``syncfs`` of the repository's filesystem: their bytes and the new
   ref's ``.lock`` are on disk, under names no reader trusts yet;
2. the staged objects are renamed to their real names in ``objects/xx/`` (an object is
   never visible under its name before its bytes are durable: a power cut leaves no
   empty object file that libgit2 would later take for the real one, since libgit2
   skips writing an object whose file exists), then a second ``syncfs`` makes the names
   durable;
3. the reflog line is appended, the ``.lock`` is renamed over the ref (the commit
   point), then a third ``syncfs`` makes both durable before the caller acknowledges
   anything.

That is the order libgit2's per-file fsync gives (bytes, then the name, then the ref that
names it, each durable before the next), in three syncs per ref move, however many
objects it names, instead of two per object plus two per ref. Staged objects nothing
names (a lost compare-and-swap, a killed process) stay in the stage, never in
``objects/``. ``syncfs`` also flushes what libgit2 never syncs (a new worktree's admin
files, the index) before the next ref move. Its result is checked: since Linux 5.8 it
reports writeback errors on the filesystem since the descriptor was opened, and that
descriptor is opened with the first repository and kept.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pygit2

from gitrun.core.errors import StorageFailed
from gitrun.store import trees

STAGE_DIR = "gitrun/stage"
STAGE_PRIORITY = 100  # above the packed (2) and loose (1) backends: new objects land here
# zlib level of the staged (then published) loose objects: git's own default for loose
# objects (core.looseCompression = 1, best speed); libgit2's default (6) costs about twice
# the CPU on a step's few kilobytes. Object ids do not depend on it.
LOOSE_COMPRESSION = 1

_libc = ctypes.CDLL(None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)
_watched: dict[int, int] = {}  # st_dev -> a descriptor kept open, so syncfs reports errors
_stages: dict[Path, str] = {}  # common dir -> its stage (a string: every move asks)


def watch(path: Path) -> int:
    """Keep a descriptor on ``path``'s filesystem: syncfs reports errors seen since then."""
    dev = os.stat(path).st_dev
    fd = _watched.get(dev)
    if fd is None:
        fd = _watched[dev] = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return fd


def sync_filesystem(path: Path) -> None:
    """Everything written to ``path``'s filesystem is durable when this returns."""
    fd = watch(path)  # the filesystem ``path`` is on now (one stat, every time)
    if _syncfs is None:  # not Linux: sync(2) flushes every filesystem
        os.sync()
        return
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise StorageFailed.on(path, os.strerror(err))


def attach_stage(repo: pygit2.Repository, cdir: Path) -> None:
    """Send ``repo``'s new objects to the repository's stage (unsynced until a barrier)."""
    stage = _stages.get(cdir)
    if stage is None:
        stage = f"{cdir}/{STAGE_DIR}"
        os.makedirs(stage, exist_ok=True)
        _stages[cdir] = stage
    backend = pygit2.OdbBackendLoose(stage, LOOSE_COMPRESSION, False)
    repo.odb.add_backend(backend, STAGE_PRIORITY)


def stage_of(cdir: Path) -> str:
    """The stage's directory (a string: every move asks)."""
    return _stages.get(cdir) or f"{cdir}/{STAGE_DIR}"


def staged_closure(
    repo: pygit2.Repository, cdir: Path, new: pygit2.Oid, old: pygit2.Oid | None
) -> list[str]:
    """The staged objects ``new`` reaches, found by comparing it with ``old`` (what the ref
    held): only changed entries are followed, so the cost is the change's, not the tree's.
    An object not in the stage is published already, and so is everything it reaches."""
    staged = _Stage(stage_of(cdir))
    out: list[str] = []
    todo: list[tuple[pygit2.Oid, pygit2.Oid | None]] = [(new, old)]
    seen: set[pygit2.Oid] = set()
    while todo:
        oid, base = todo.pop()
        if oid in seen or not staged.holds(oid):
            continue
        seen.add(oid)
        out.append(str(oid))
        todo += _children(repo, repo[oid], base, staged)
    return out


class _Stage:
    """Which objects are in the stage, each asked of the file system once per closure."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.known: dict[pygit2.Oid, bool] = {}

    def holds(self, oid: pygit2.Oid) -> bool:
        found = self.known.get(oid)
        if found is None:
            hexid = str(oid)
            found = self.known[oid] = os.path.exists(f"{self.path}/{hexid[:2]}/{hexid[2:]}")
        return found


def _children(
    repo: pygit2.Repository, obj: pygit2.Object, base: pygit2.Oid | None, staged: _Stage
) -> list[tuple[pygit2.Oid, pygit2.Oid | None]]:
    """What ``obj`` names, each with its counterpart under ``base`` (None: no counterpart).
    A commit's counterpart tree is looked up only when its own tree is staged (an intent
    checkpoint names the published empty tree: its parent commit is never read)."""
    if isinstance(obj, pygit2.Commit):
        parents: list[tuple[pygit2.Oid, pygit2.Oid | None]] = [(p, None) for p in obj.parent_ids]
        if not staged.holds(obj.tree_id):
            return parents
        before = repo.get(base) if base is not None else None
        prior = before.tree_id if isinstance(before, pygit2.Commit) else None
        return [(obj.tree_id, prior), *parents]
    if isinstance(obj, pygit2.Tree):
        before = repo.get(base) if base is not None else None
        if not isinstance(before, pygit2.Tree):
            return [(e.id, None) for e in obj if e.filemode != pygit2.enums.FileMode.COMMIT]
        return [
            (e.id, None if o is None else o.id)
            for _, o, e in trees.level_changes(before, obj)
            if e is not None
            and (o is None or o.id != e.id)
            and e.filemode != pygit2.enums.FileMode.COMMIT
        ]
    if isinstance(obj, pygit2.Tag):
        return [(obj.target, None)]
    return []


def read_staged(cdir: Path, objects: list[str]) -> list[tuple[bytes, bytes]]:
    """Each staged object's raw id and loose-file bytes, for the journal."""
    stage = stage_of(cdir)
    out = []
    for hexid in objects:
        fd = os.open(f"{stage}/{hexid[:2]}/{hexid[2:]}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
        out.append((bytes.fromhex(hexid), b"".join(chunks)))
    return out


__all__ = [
    "STAGE_DIR",
    "attach_stage",
    "read_staged",
    "stage_of",
    "staged_closure",
    "sync_filesystem",
    "watch",
]
