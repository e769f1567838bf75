"""The git store: opening repositories durably, and the one atomic ref-update path.

Every durable change gitrun makes ends in :func:`update_ref`, which

1. takes an OS-level lock (``flock``, as filelock does) per ref it will lock, in sorted order, so a
   ``*.lock`` file left by a killed gitrun writer is provably stale for whoever holds
   that OS lock next (the kernel drops an flock when its process dies);
2. removes such stale ref lock files, but only once they are older than a grace
   period, so a foreign ``git`` process that holds a lock for a few milliseconds is
   never disturbed;
3. creates ``<ref>.lock`` (git's own lock protocol, so git and libgit2 keep out), re-reads
   the ref and every ref it only fences on (the lease), compares, writes the new value
   and its reflog line, then runs the durability barrier (:mod:`gitrun.store.durable`:
   every object this process wrote, and the lock's bytes, durable under names no reader
   trusts yet), renames the lock over the ref (the commit point) and syncs once more, so
   the move is durable before the caller acknowledges it. A fencing ref is re-read under
   its OS lock, which every gitrun writer of that ref holds while it writes, so it
   cannot change in between; its git lock file is not taken (that would cost a file
   create and unlink on every step and protect only against foreign git). A delete goes
   through libgit2 (it may rewrite ``packed-refs``; libgit2 fsyncs that itself).

Only one ref moves per call: multi-ref transactions are not crash-atomic on the files
backend, so each step has exactly one commit point and everything else is derived.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pygit2
from pygit2.enums import ObjectType, Option

from gitrun.core import faults
from gitrun.core.errors import CasFailed, EnvironmentDrift, RefLocked, Refused
from gitrun.store import durable, reflog
from gitrun.store.atomicfile import fsync_dir as fsync_dir  # noqa: PLC0414 - re-export for callers
from gitrun.store.oslock import LockBusy, busy_error, waiting
from gitrun.store.oslock import flock as flock  # noqa: PLC0414 - re-export
from gitrun.store.oslock import set_worker as set_worker  # noqa: PLC0414 - re-export

STALE_LOCK_GRACE_SECONDS = 1.0
LOCK_TIMEOUT_SECONDS = 30.0

_configured = False

# libgit2 keeps parsed objects up to these sizes in its (bounded) object cache, keyed by
# object id. Its defaults (4 KiB commits and trees, no blobs) leave a checkpoint commit
# (~6.5 KB) and the lease blob to be re-read, inflated and re-hashed several times a step,
# and a wide directory's tree (a 1,000-entry one is ~40 KB; 1 MiB holds ~25,000 entries)
# at every lookup through it.
# A cached object is the one its id names (ids are hashes; libgit2 verifies them on read),
# so a file planted or changed on disk cannot make the cache answer stale content.
CACHE_LIMITS = {ObjectType.COMMIT: 64 * 1024, ObjectType.TREE: 1 << 20, ObjectType.BLOB: 4096}


def configure_git() -> None:
    """libgit2's per-object fsync off (a step's objects are staged and made durable
    together by :mod:`gitrun.store.durable`) and its object cache sized for gitrun's
    records; must run before any Repository opens."""
    global _configured  # noqa: PLW0603 - a process-wide libgit2 option, set once
    if not _configured:
        pygit2.option(Option.ENABLE_FSYNC_GITDIR, False)
        for kind, limit in CACHE_LIMITS.items():
            pygit2.settings.cache_object_limit(kind, limit)
        _configured = True


def open_repo(path: Path | str) -> pygit2.Repository:
    """Open a repository durably; a clear error if it is not one.

    Its ref database is made while libgit2's fsync is on (libgit2 reads the option once,
    there), so every ref libgit2 itself writes (a delete, a rewritten ``packed-refs``, a
    worktree's HEAD) is fsynced as before; object writes read the option each time and
    find it off: they go to this process's stage, made durable by the next barrier.
    """
    configure_git()
    pygit2.option(Option.ENABLE_FSYNC_GITDIR, True)
    try:
        repo = pygit2.Repository(str(path))
        repo.references.get("HEAD")  # loads the ref database now, with fsync on
    except pygit2.GitError as exc:
        raise EnvironmentDrift(
            "not-a-repository", f"{path} is not a git repository: {exc}"
        ) from exc
    finally:
        pygit2.option(Option.ENABLE_FSYNC_GITDIR, False)
    cdir = common_dir(repo)
    durable.watch(cdir)
    durable.attach_stage(repo, cdir)
    return repo


_common_dirs: dict[str, Path] = {}  # a repository's git dir -> its common dir (every move asks)


def common_dir(repo: pygit2.Repository) -> Path:
    """The repository's common git dir (shared by all its worktrees)."""
    found = _common_dirs.get(repo.path)
    if found is None:
        gitdir = Path(repo.path)
        commondir_file = gitdir / "commondir"
        if commondir_file.is_file():
            found = (gitdir / commondir_file.read_text().strip()).resolve()
        else:
            found = gitdir.resolve()
        _common_dirs[repo.path] = found
    return found


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
    return Path(f"{cdir}/gitrun/locks/{digest}.flock")


def _ref_lock_file(cdir: Path, refname: str) -> Path:
    return Path(f"{cdir}/{refname}.lock")


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


@contextmanager
def os_locks(repo: pygit2.Repository, refnames: Sequence[str]) -> Iterator[None]:
    """Hold the OS-level lock of every named ref (sorted, so no deadlock)."""
    cdir = common_dir(repo)
    with ExitStack() as stack:
        for name in sorted(set(refnames)):
            path = _lock_path(cdir, name)
            try:
                try:
                    stack.enter_context(_ref_flock(path, name))
                except FileNotFoundError:  # the locks directory is new (or was removed)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    stack.enter_context(_ref_flock(path, name))
            except LockBusy as exc:
                raise busy_error(name, exc, LOCK_TIMEOUT_SECONDS) from exc
            _clear_stale_lock(cdir, name)
        yield


def _ref_flock(path: Path, name: str) -> AbstractContextManager[None]:
    return flock(path, LOCK_TIMEOUT_SECONDS, waiting(name, LOCK_TIMEOUT_SECONDS))


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
    cache: bool = False,
    follow: str = "",
) -> bool:
    """Compare-and-swap ``name`` from ``expected`` to ``new`` (None = absent/delete).

    Every guard ref is re-read under its OS lock and its check called with its value;
    a check that raises aborts, nothing moves. A move is durable when this returns, and
    so is every object this process wrote before it (:mod:`gitrun.store.durable`).
    A ``cache`` ref (a receipt index entry) skips the final sync: its bytes are durable
    before its rename, and the next move's barrier makes the rename durable (a power cut
    may lose the newest entry, never tear it; lookups rebuild it from the history).

    ``follow`` names such a cache ref to point at ``new`` too, riding this move's final
    sync instead of a barrier of its own: its lock's bytes are written after the commit
    point and made durable by that sync, and it is renamed only once the move is durable
    (so it never names a commit the durable ref does not). False when the follower's
    lock was taken by someone else: nothing was written for it, the caller moves it alone.
    """
    names = [name, *(g.name for g in guards), *([follow] if follow else [])]
    with os_locks(repo, names):
        for attempt in range(50):
            try:
                if new is None:
                    _delete(repo, name, expected, guards, what, crash_prefix)
                    return True
                move = _Move(name, expected, new, message, what, crash_prefix, cache, follow)
                _swap(repo, move, guards)
            except (pygit2.GitError, _LockTaken) as exc:
                # A foreign process holds a ref lock for a moment: retry with jitter.
                if attempt == 49:
                    raise RefLocked(name, f"could not lock {name}: {exc}") from exc
                time.sleep(random.uniform(0.005, 0.03))  # noqa: S311 - jitter, not crypto
                continue
            return _finish(repo, move)  # outside the retries: the move has happened
    return True  # not reached: the last attempt returns or raises


class _LockTaken(Exception):
    """``<ref>.lock`` exists: a foreign git process holds the ref for a moment."""


def _compare(
    repo: pygit2.Repository,
    name: str,
    expected: pygit2.Oid | None,
    guards: Sequence[Guard],
    what: str,
) -> pygit2.Oid | None:
    """Under the ref's lock: every guard's check, then the ref must hold ``expected``."""
    for guard in guards:
        guard.check(read_ref(repo, guard.name))
    actual = read_ref(repo, name)
    if actual != expected:
        raise CasFailed(name, _hex(expected), _hex(actual), what)
    return actual


@dataclass(frozen=True)
class _Move:
    name: str
    expected: pygit2.Oid | None
    new: pygit2.Oid
    message: str
    what: str
    crash_prefix: str
    cache: bool
    follow: str = ""


def _swap(repo: pygit2.Repository, move: _Move, guards: Sequence[Guard]) -> None:
    """Take ``<ref>.lock`` (git's own lock protocol), compare, write the new value,
    barrier (objects and lock durable), reflog line, rename (the commit point); the
    final sync follows in :func:`_finish`."""
    cdir, point = common_dir(repo), move.crash_prefix
    lock = _ref_lock_file(cdir, move.name)
    fd = _take_lock(lock)
    if fd is None:
        raise _LockTaken(f"{move.name}.lock exists")
    moved = False
    try:
        try:
            if point:
                faults.point(f"{point}_locked")
            actual = _compare(repo, move.name, move.expected, guards, move.what)
            os.write(fd, f"{move.new}\n".encode())
        finally:
            os.close(fd)
        durable.barrier(repo, cdir, move.new, actual)
        if point:
            faults.point(f"{point}_synced")
        # After the barrier: a reflog line never names an object still in the stage
        # (git fsck would call it invalid); the final sync makes it durable with the move.
        reflog.append(repo, cdir, move.name, actual, move.new, move.message)
        os.rename(lock, cdir / move.name)
        moved = True
    finally:
        if not moved:
            lock.unlink(missing_ok=True)  # nothing moved: release the ref
    if point:
        faults.point(f"{point}_moved")


def _finish(repo: pygit2.Repository, move: _Move) -> bool:
    """After the commit point: the follower's lock written, the final sync, then the
    follower's rename. False when its lock could not be taken (nothing written for it)."""
    cdir = common_dir(repo)
    follower = _lock_follower(repo, cdir, move.follow, move.new) if move.follow else None
    if not move.cache:
        durable.sync_filesystem(cdir)  # the move is durable before anyone is told of it
    if follower is None:
        return not move.follow
    lock, old = follower
    if old == move.new:
        return True
    try:
        faults.point("receipt_index_locked")
        reflog.append(repo, cdir, move.follow, old, move.new, "gitrun receipt index")
        os.rename(lock, cdir / move.follow)  # no sync of its own: a cache ref (see above)
    except BaseException:
        lock.unlink(missing_ok=True)
        raise
    return True


def _lock_follower(
    repo: pygit2.Repository, cdir: Path, name: str, new: pygit2.Oid
) -> tuple[Path, pygit2.Oid | None] | None:
    """Take the follower's ``.lock``, write ``new`` in it (the move's final sync makes it
    durable): (the lock, the follower's value). None when that fails (taken, unreadable):
    nothing is left, and the caller moves the follower on its own, as before."""
    lock = _ref_lock_file(cdir, name)
    try:
        fd = _take_lock(lock)
    except OSError:
        return None
    if fd is None:
        return None
    try:
        old = read_ref(repo, name)
        if old != new:
            os.write(fd, f"{new}\n".encode())
    except (pygit2.GitError, OSError, Refused):
        os.close(fd)
        lock.unlink(missing_ok=True)
        return None
    os.close(fd)
    if old == new:
        lock.unlink()
    return lock, old


def _take_lock(lock: Path) -> int | None:
    """Create ``<ref>.lock`` exclusively, as git and libgit2 do, and return its open
    descriptor (the new value is written through it); None when it exists."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        try:
            return os.open(lock, flags, 0o644)
        except FileNotFoundError:  # the ref's directory is new
            lock.parent.mkdir(parents=True, exist_ok=True)
            return os.open(lock, flags, 0o644)
    except FileExistsError:
        return None


def _delete(
    repo: pygit2.Repository,
    name: str,
    expected: pygit2.Oid | None,
    guards: Sequence[Guard],
    what: str,
    crash_prefix: str,
) -> None:
    """Remove ``name`` through libgit2 (it may rewrite ``packed-refs``, fsynced)."""
    with repo.transaction() as tx:
        tx.lock_ref(name)
        if crash_prefix:
            faults.point(f"{crash_prefix}_locked")
        _compare(repo, name, expected, guards, what)
        tx.remove(name)
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
    """Write one blob object (staged: durable with the next ref move, which names it)."""
    oid: pygit2.Oid = repo.create_blob(data)
    return oid
