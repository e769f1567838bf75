"""The git store: opening repositories durably, and the one durable write API.

Every durable change gitrun makes to a repository is a :class:`Transaction`
(:func:`transaction`; :mod:`gitrun.store.refmove`): stores stage their moves into one
the caller holds (a fence as a guard, a receipt index entry as a best-effort cache
entry) and :meth:`Transaction.commit` then

1. takes an OS-level lock (``flock``) per ref the transaction names, in sorted order, so
   a ``*.lock`` file left by a killed gitrun writer is provably stale for whoever holds
   that OS lock next (the kernel drops an flock when its process dies);
2. removes such stale ref lock files, but only once they are older than a grace
   period, so a foreign ``git`` process that holds a lock for a few milliseconds is
   never disturbed;
3. creates ``<ref>.lock`` (git's own lock protocol, so git and libgit2 keep out), re-reads
   every guard and the ref, compares, writes the new value, then makes the move durable
   before its commit point: one record in the repository's journal
   (:mod:`gitrun.store.journal`: the bytes of every new object the value reaches and the
   value itself, one ``fdatasync``), or for a move too large for it the barrier of
   :mod:`gitrun.store.durable`; then it publishes the staged objects, appends the reflog
   line and renames the lock over the ref (the commit point). A guard ref is re-read
   under its OS lock, which every gitrun writer of that ref holds while it writes, so it
   cannot change in between; its git lock file is not taken.
   A delete is journaled, then goes through libgit2 (it may rewrite ``packed-refs``;
   libgit2 fsyncs that itself).

Multi-ref transactions are not crash-atomic on the files backend (renames happen one by
one): the moves of one transaction are renamed in order, the first durable and visible
before the second is, so each step has one commit point and what comes after it is
derived (docs/design.md §5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pygit2
from pygit2.enums import ObjectType, Option

from gitrun.core.errors import EnvironmentDrift
from gitrun.store import durable, journal, journal_recovery
from gitrun.store.atomicfile import fsync_dir as fsync_dir  # noqa: PLC0414 - re-export for callers
from gitrun.store.oslock import flock as flock  # noqa: PLC0414 - re-export
from gitrun.store.oslock import set_worker as set_worker  # noqa: PLC0414 - re-export
from gitrun.store.reflocks import LOCK_TIMEOUT_SECONDS as LOCK_TIMEOUT_SECONDS  # noqa: PLC0414
from gitrun.store.reflocks import Guard as Guard  # noqa: PLC0414 - re-export
from gitrun.store.reflocks import common_dir as common_dir  # noqa: PLC0414 - re-export
from gitrun.store.reflocks import os_locks as os_locks  # noqa: PLC0414 - re-export
from gitrun.store.reflocks import read_ref as read_ref  # noqa: PLC0414 - re-export
from gitrun.store.refmove import Transaction as Transaction  # noqa: PLC0414 - re-export

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
    held = journal.of(cdir)
    held.recover_if_needed()  # a power cut's lost names back before any ref is read
    restored = held.take_restored()
    if restored:
        with os_locks(repo, restored):  # clears the locks the cut writers left
            pass
    return repo


def transaction(repo: pygit2.Repository) -> Transaction:
    """A new transaction on ``repo``: stage guards, moves and index entries, then commit."""
    return Transaction(repo)


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


# -- durability the callers above the store ask for (docs/design.md §5, §6) --------------
# The adapter and the app reach the journal, its recovery and the barrier only through
# these (tests/test_seams.py): what they mean, not how the store does it.


def sync_all(repo: pygit2.Repository) -> None:
    """Everything written so far on the repository's filesystem durable now (a ``syncfs``):
    for writes no journal record covers (a new worktree's files, files put back on disk
    for a branch that moved in an earlier process, an exec step's tree restored)."""
    durable.sync_filesystem(common_dir(repo))


@contextlib.contextmanager
def covering(repo: pygit2.Repository) -> Iterator[None]:
    """Files the block writes unsynced after a ref move it makes (a step's worktree files)
    are as durable as that move (:meth:`gitrun.store.journal.Journal.covering`)."""
    with journal.of(common_dir(repo)).covering():
        yield


def power_cut_branches(repo: pygit2.Repository) -> dict[str, str | None]:
    """Branch -> the commit it held before writes a power cut took and recovery put back
    (None: the branch was new); empty when no recovery left a note."""
    return journal_recovery.recovered_branches(common_dir(repo))


def power_cut_repaired(repo: pygit2.Repository, branch: str) -> None:
    """The worktree of ``branch`` is repaired and synced: drop the recovery's note."""
    journal_recovery.clear_recovered(common_dir(repo), branch)
