"""The one durable write API: a journaled multi-ref :class:`Transaction` (see
:mod:`gitrun.store.gitstore` and docs/design.md §5).

A move is made durable by one record in the repository's journal
(:mod:`gitrun.store.journal`: the new objects' bytes and the ref's value, one
``fdatasync``), or, for a move too large for it, by the barrier of
:mod:`gitrun.store.durable`; then the staged objects are published and the ref's
``.lock`` is renamed over the ref (the commit point). The file that rename replaces is
kept (``gitrun/spare/``) and becomes the ref's next ``.lock`` (:func:`take_lock`).
Two moves may share one journal record (a step's intent checkpoint riding with its
write); see "Two moves, one record" below and docs/design.md §4-§5.
"""

from __future__ import annotations

import contextlib
import os
import random
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pygit2

from gitrun.core import faults
from gitrun.core.errors import CasFailed, GitrunError, RefLocked, Refused
from gitrun.store import durable, journal, reflog
from gitrun.store.oslock import unshared
from gitrun.store.reflocks import (
    Guard,
    common_dir,
    os_locks,
    read_ref,
    ref_lock_file,
    spare_file,
)


class Transaction:
    """One journaled multi-ref transaction: the store's only durable write.

    Stores stage into a transaction the caller holds: :meth:`guard` (a ref re-read under
    its OS lock and checked, never moved: the lease a write is fenced by), :meth:`move`
    (a compare-and-swap, in order: the first moved first), :meth:`index` (a cache ref,
    best effort: it rides in the last move's record and is renamed after it, or is moved
    on its own when its lock is busy). :meth:`commit` then takes the sorted OS locks,
    compares, writes one journal record (or the barrier, for a move too large for it),
    publishes the staged objects and renames. Two moves share one record: the first is
    renamed and its locks let go, then the second is compared again and renamed with no
    sync of its own (docs/design.md §4-§5); a move that does not fit is made durable on
    its own, in order. A transaction commits once; :meth:`moved` says which refs did.
    """

    def __init__(self, repo: pygit2.Repository) -> None:
        self.repo = repo
        self._moves: list[_Move] = []
        self._guards: list[Guard] = []
        self._entries: list[tuple[str, pygit2.Oid]] = []
        self._moved: set[str] = set()
        self.committed = False

    def guard(self, guard: Guard) -> Transaction:
        """Refuse the whole transaction unless ``guard`` passes under its ref's OS lock
        (a guard equal to one staged already is checked once)."""
        if guard not in self._guards:
            self._guards.append(guard)
        return self

    def move(
        self,
        name: str,
        expected: pygit2.Oid | None,
        new: pygit2.Oid | None,
        *,
        message: str = "gitrun",
        what: str = "",
        crash_prefix: str = "",
        after: tuple[str, ...] = (),
    ) -> Transaction:
        """Move ``name`` from ``expected`` to ``new`` (None: absent, a delete). ``what``
        names it in a refusal, ``crash_prefix`` names its crash points, ``after`` are the
        crash points passed right after its rename."""
        if self.committed:
            raise GitrunError("a committed transaction takes no more moves")
        self._moves.append(_Move(name, expected, new, message, what, crash_prefix, after))
        return self

    def index(self, name: str, new: pygit2.Oid) -> Transaction:
        """Point the cache ref ``name`` at ``new`` (a receipt index entry), best effort."""
        self._entries.append((name, new))
        return self

    def moved(self, name: str) -> bool:
        """Whether the move of ``name`` happened (its rename is done)."""
        return name in self._moved

    def commit(self) -> None:
        """Make every staged move durable and visible, in order (see the class); a guard
        that refuses or a compare that fails raises, and nothing of that move is seen."""
        if self.committed:
            raise GitrunError("a transaction commits once")
        self.committed = True
        moves, entries = list(self._moves), list(self._entries)
        if moves and entries and moves[-1].new is not None and entries[0][1] == moves[-1].new:
            moves[-1] = replace(moves[-1], follow=entries.pop(0)[0])
        followed = True
        shared = len(moves) == 2 and None not in (moves[0].new, moves[1].new)
        if shared and journal.of(common_dir(self.repo)).usable():
            followed = self._led(moves[0], moves[1])
        else:
            for move in moves:
                followed = self._alone(move)
        if not followed:  # its lock was busy: the entry on its own, as any other
            entries.insert(0, (moves[-1].follow, moves[-1].new))  # type: ignore[arg-type]
        for name, value in entries:
            self._index_alone(name, value)

    def _renamed(self, move: _Move) -> None:
        self._moved.add(move.name)
        for point in move.after:
            faults.point(point)

    def _names(self, *moves: _Move) -> list[str]:
        names = [m.name for m in moves] + [g.name for g in self._guards]
        return names + [m.follow for m in moves if m.follow]

    def _alone(self, move: _Move) -> bool:
        """``move`` made durable by a record (or the barrier) of its own; the follower's
        result (True without one)."""
        repo, guards = self.repo, self._guards
        if move.new is None:
            _locked(repo, self._names(move), move.name, lambda: _delete(repo, move, guards))
            followed = True
        else:
            followed = _locked(
                repo, self._names(move), move.name, lambda: _swap(repo, move, guards), move
            )
        self._renamed(move)
        return followed

    def _led(self, first: _Move, second: _Move) -> bool:
        """Two moves in one record, two lock scopes (see "Two moves, one record" below)."""
        repo, guards, names = self.repo, self._guards, self._names(first, second)
        first_scope = lambda: _lead_first(repo, first, second, guards, self._moved)  # noqa: E731
        try:
            _locked(repo, names, second.name, first_scope)
        except NoRoom:  # one record cannot hold both: each on its own, in order
            self._alone(first)
            return self._alone(second)
        self._renamed(first)  # the first durable and renamed, nothing locked
        # The first is done: the second scope locks the second's refs and the guards only.
        again = self._names(second)
        followed = _locked(repo, again, second.name, lambda: _lead_second(repo, second, guards))
        self._renamed(second)
        return followed

    def _index_alone(self, name: str, new: pygit2.Oid) -> None:
        """A cache entry moved on its own: a lost race leaves the other writer's value
        (the index is rebuilt from history and never trusted over it)."""
        current = read_ref(self.repo, name)
        if current == new:
            return
        move = _Move(name, current, new, "gitrun receipt index", "", "", cache=True)
        with contextlib.suppress(CasFailed):
            _locked(self.repo, [name], name, lambda: _swap(self.repo, move, ()), move)


def _locked(
    repo: pygit2.Repository,
    names: list[str],
    name: str,
    attempt: Callable[[], bool | None],
    move: _Move | None = None,
) -> bool:
    """Under the OS locks of ``names``: ``attempt`` (retried while a foreign process holds
    a ref lock for a moment), then, once it moved ``move``, :func:`_finish` when owed."""
    with os_locks(repo, names):
        for tries in range(50):
            try:
                followed = attempt()
            except (pygit2.GitError, _LockTaken) as exc:
                if tries == 49:
                    raise RefLocked(name, f"could not lock {name}: {exc}") from exc
                time.sleep(random.uniform(0.005, 0.03))  # noqa: S311 - jitter, not crypto
                continue
            # Outside the retries: the move has happened.
            if followed is None and move is not None:
                return _finish(repo, move)
            return True if followed is None else followed
    return True  # not reached: the last attempt returns or raises


class _LockTaken(Exception):
    """``<ref>.lock`` exists: a foreign git process holds the ref for a moment."""


class NoRoom(Exception):
    """Two moves do not fit in one journal record: nothing was written."""


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
    new: pygit2.Oid | None
    message: str
    what: str
    crash_prefix: str
    after: tuple[str, ...] = ()
    cache: bool = False  # a cache ref moved alone: a barrier move skips its final sync
    follow: str = ""  # a cache ref riding in this move's record, renamed after it

    @property
    def value(self) -> pygit2.Oid:
        """The new value of a move that is not a delete."""
        if self.new is None:
            raise GitrunError(f"the move of {self.name} is a delete")
        return self.new


def _swap(repo: pygit2.Repository, move: _Move, guards: Sequence[Guard]) -> bool | None:
    """Take ``<ref>.lock`` (git's own lock protocol), compare, write the new value, make
    it and the objects it names durable (the journal's one sync, or the barrier), reflog
    line, rename (the commit point). The follower's result (True without one), or None
    when the barrier ran and :func:`_finish` still owes the final sync."""
    cdir, point = common_dir(repo), move.crash_prefix
    lock, fd = take_ref_lock(cdir, move)
    moved = False
    try:
        try:
            actual = _compare(repo, move.name, move.expected, guards, move.what)
            os.write(fd, f"{move.value}\n".encode())
        finally:
            os.close(fd)
        objects = durable.staged_closure(repo, cdir, move.value, actual)
        staged = durable.read_staged(cdir, objects) if journal.of(cdir).usable() else None
        if staged is not None and journal.of(cdir).fits(sum(len(d) for _, d in staged)):
            moved = True  # from here _journaled releases the lock itself if it fails
            return _journaled(repo, cdir, move, actual, lock, objects, staged)
        entry = _entry(move.name, actual, move.value, move.message)
        barrier(repo, cdir, objects)
        if journal.of(cdir).usable():  # the ref's value, so no recovery rolls it back
            with journal.of(cdir).recording((), [entry]):
                _commit_point(repo, cdir, move, actual, lock)
        else:
            _commit_point(repo, cdir, move, actual, lock)
        moved = True
    finally:
        if not moved and lock.exists():
            _release(lock)
    if point:
        faults.point(f"{point}_moved")
    return None


def take_ref_lock(cdir: Path, move: _Move) -> tuple[Path, int]:
    """``move``'s ``<ref>.lock`` taken (its spare reused where it can be) and open for its
    new value, then its ``_locked`` crash point; :class:`_LockTaken` when it exists."""
    lock = ref_lock_file(cdir, move.name)
    fd = take_lock(lock, spare_file(cdir, move.name), len(str(move.value)) + 1)
    if fd is None:
        raise _LockTaken(f"{move.name}.lock exists")
    if move.crash_prefix:
        faults.point(f"{move.crash_prefix}_locked")
    return lock, fd


def _release(lock: Path) -> None:
    lock.unlink(missing_ok=True)  # nothing moved: release the ref


def _entry(name: str, old: pygit2.Oid | None, new: pygit2.Oid, message: str) -> journal.RefEntry:
    return journal.RefEntry(name, new.raw, None if old is None else old.raw, message)


def _commit_point(
    repo: pygit2.Repository, cdir: Path, move: _Move, actual: pygit2.Oid | None, lock: Path
) -> None:
    if move.crash_prefix:
        faults.point(f"{move.crash_prefix}_synced")
    # After the objects are published: a reflog line never names an object still in the
    # stage (git fsck would call it invalid). A barrier move's final sync makes it durable;
    # a journaled move's line is written back by the kernel in its own time (a power cut
    # may cut the reflog's tail, which git fsck accepts; recovery does not rewrite it).
    reflog.append(repo, cdir, move.name, actual, move.value, move.message)
    target = cdir / move.name
    keep_replaced(target, spare_file(cdir, move.name))
    os.rename(lock, target)


def _journaled(
    repo: pygit2.Repository,
    cdir: Path,
    move: _Move,
    actual: pygit2.Oid | None,
    lock: Path,
    objects: list[str],
    staged: list[tuple[bytes, bytes]],
) -> bool:
    """The move made durable by one journal record (its objects' bytes, its value and its
    follower's), then published and renamed with no sync (:mod:`gitrun.store.journal`)."""
    follower = _lock_follower(repo, cdir, move.follow, move.value) if move.follow else None
    entries = [_entry(move.name, actual, move.value, move.message)]
    if follower is not None and follower[1] != move.new:
        entries.append(_entry(move.follow, follower[1], move.value, "gitrun receipt index"))
    try:
        with journal.of(cdir).recording(staged, entries):
            publish_staged(cdir, objects)
            _commit_point(repo, cdir, move, actual, lock)
            if move.crash_prefix:
                faults.point(f"{move.crash_prefix}_moved")
            if follower is not None:
                _rename_follower(repo, cdir, move, follower)
    except BaseException:
        if lock.exists():  # the rename did not happen (we hold the ref's OS lock)
            _release(lock)
        if follower is not None:
            follower[0].unlink(missing_ok=True)
        raise
    return follower is not None or not move.follow


def _finish(repo: pygit2.Repository, move: _Move) -> bool:
    """After a barrier move's commit point: the follower's lock written, the final sync,
    then the follower's rename. False when its lock could not be taken (nothing written
    for it)."""
    cdir = common_dir(repo)
    follower = _lock_follower(repo, cdir, move.follow, move.value) if move.follow else None
    if not move.cache:
        durable.sync_filesystem(cdir)  # the move is durable before anyone is told of it
    if follower is None:
        return not move.follow
    if journal.of(cdir).usable() and follower[1] != move.new:
        with journal.of(cdir).recording((), [_entry(move.follow, follower[1], move.value, "")]):
            _rename_follower(repo, cdir, move, follower)
        return True
    _rename_follower(repo, cdir, move, follower)
    return True


def _rename_follower(
    repo: pygit2.Repository, cdir: Path, move: _Move, follower: tuple[Path, pygit2.Oid | None]
) -> None:
    lock, old = follower
    if old == move.new:
        return
    try:
        faults.point("receipt_index_locked")
        reflog.append(repo, cdir, move.follow, old, move.value, "gitrun receipt index")
        os.rename(lock, cdir / move.follow)  # no sync of its own: a cache ref (see above)
    except BaseException:
        lock.unlink(missing_ok=True)
        raise


def _lock_follower(
    repo: pygit2.Repository, cdir: Path, name: str, new: pygit2.Oid
) -> tuple[Path, pygit2.Oid | None] | None:
    """Take the follower's ``.lock``, write ``new`` in it (the move's final sync makes it
    durable): (the lock, the follower's value). None when that fails (taken, unreadable):
    nothing is left, and the caller moves the follower on its own, as before."""
    lock = ref_lock_file(cdir, name)
    try:
        fd = take_lock(lock)
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


def _delete(repo: pygit2.Repository, move: _Move, guards: Sequence[Guard]) -> None:
    """Remove the ref through libgit2 (it may rewrite ``packed-refs``, fsynced), its
    removal journaled first so that no recovery brings back an older journaled value."""
    cdir, name = common_dir(repo), move.name
    # covering: a rotation by another process between the record and libgit2's removal
    # would leave the removal in no record; the block then ends with a syncfs.
    with journal.of(cdir).covering(), repo.transaction() as tx:
        tx.lock_ref(name)
        if move.crash_prefix:
            faults.point(f"{move.crash_prefix}_locked")
        actual = _compare(repo, name, move.expected, guards, move.what)
        if journal.of(cdir).usable() and actual is not None:
            with journal.of(cdir).recording((), [journal.RefEntry(name, None, actual.raw, "")]):
                pass
        tx.remove(name)
    with contextlib.suppress(OSError):
        os.unlink(spare_file(cdir, name))  # no next move to serve
    if move.crash_prefix:
        faults.point(f"{move.crash_prefix}_moved")


def _hex(oid: pygit2.Oid | None) -> str | None:
    return None if oid is None else str(oid)


# -- Objects named: the stage published ----------------------------------------------


def publish_staged(cdir: Path, objects: list[str]) -> None:
    """Rename staged objects to their real names in ``objects/`` (no sync: the caller
    made their bytes durable first, by the journal or by a ``syncfs``)."""
    stage, published = durable.stage_of(cdir), f"{cdir}/objects"
    for hexid in objects:
        fan, name = hexid[:2], hexid[2:]
        source, target = f"{stage}/{fan}/{name}", f"{published}/{fan}/{name}"
        try:
            os.rename(source, target)
        except FileNotFoundError:
            if os.path.exists(source):  # the fan-out directory is new
                Path(published, fan).mkdir(exist_ok=True)
                os.rename(source, target)
            # else another writer published it at this moment: it is in objects/ now


def barrier(repo: pygit2.Repository, cdir: Path, objects: list[str]) -> None:
    """Steps 1 and 2 of :mod:`gitrun.store.durable`'s barrier for the staged ``objects``
    a move too large for the journal names:
    everything written so far durable, then every one of them durable under its real
    name. The caller then moves its ref (step 3)."""
    durable.sync_filesystem(cdir)
    if not objects:
        return
    publish_staged(cdir, objects)
    durable.sync_filesystem(cdir)


# -- Spare ref files ------------------------------------------------------------------
# The file a ref's rename replaced (``<common dir>/gitrun/spare/``), kept to become that
# ref's next ``.lock``.


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


# -- Two moves, one record -------------------------------------------------------------
# Two ref moves in one journal record: a step's intent checkpoint riding with its write
# (:mod:`gitrun.engine.riding`), one ``fdatasync`` for both.
#
# Two lock scopes, each under the OS locks of every ref involved:
#
# 1. :func:`_lead_first`: the first move's ``.lock`` taken, the guards checked and both refs
#    compared; one journal record holds both moves' new objects and all three values
#    (both refs and the second's follower); the objects published, the first renamed.
#    Its locks are then let go: the intent is durable, no evidence of the write exists,
#    and nothing is locked (window 2 of docs/design.md §6 looks as it always did; the
#    first move's ``after`` crash points are passed between the two);
# 2. :func:`_lead_second`: the second's ``.lock`` taken, the guards checked and the ref
#    compared again (a writer that moved it in between wins: the record's value for it
#    is pinned back to the real one, so no recovery completes it, and the move fails),
#    then renamed with no sync of its own: the record holds its value (and should another
#    process rotate the journal in between, the caller's
#    :meth:`gitrun.store.journal.Journal.covering` makes it durable with a ``syncfs``), then the
#    follower.


def _lead_first(
    repo: pygit2.Repository, head: _Move, move: _Move, guards: Sequence[Guard], moved: set[str]
) -> None:
    """Scope 1 (the caller holds the OS locks): the record, the first move's rename (its
    name added to ``moved`` at once). :class:`NoRoom` when one record cannot hold both:
    nothing written."""
    cdir = common_dir(repo)
    lead_lock, fd = take_ref_lock(cdir, head)
    handed = False
    try:
        try:
            actual = _compare(repo, move.name, move.expected, guards, move.what)
            was = _compare(repo, head.name, head.expected, (), head.what)
            os.write(fd, f"{head.value}\n".encode())
        finally:
            os.close(fd)
        objects: list[str] = []
        for new, old in ((head.value, was), (move.value, actual)):
            objects += [o for o in durable.staged_closure(repo, cdir, new, old) if o not in objects]
        staged = durable.read_staged(cdir, objects)
        if not journal.of(cdir).fits(sum(len(d) for _, d in staged)):
            raise NoRoom
        handed = True  # from here _recorded releases the lock itself if it fails
        _recorded(repo, (head, was, lead_lock), move, actual, (objects, staged), moved)
    finally:
        if not handed:
            _release(lead_lock)


def _recorded(
    repo: pygit2.Repository,
    led: tuple[_Move, pygit2.Oid | None, Path],
    move: _Move,
    actual: pygit2.Oid | None,
    objects: tuple[list[str], list[tuple[bytes, bytes]]],
    moved: set[str],
) -> None:
    cdir = common_dir(repo)
    head, was, lead_lock = led
    known = read_ref(repo, move.follow) if move.follow else None
    entries = [
        _entry(head.name, was, head.value, head.message),
        _entry(move.name, actual, move.value, move.message),
    ]
    if move.follow and known != move.new:
        entries.append(_entry(move.follow, known, move.value, "gitrun receipt index"))
    try:
        with journal.of(cdir).recording(objects[1], entries):
            publish_staged(cdir, objects[0])
            _commit_point(repo, cdir, head, was, lead_lock)
            moved.add(head.name)
    except BaseException:
        if lead_lock.exists():  # not renamed: nothing moved, and no recovery may move it
            _release(lead_lock)
            _pin(cdir, [(head.name, was), (move.name, actual)])
        raise
    if head.crash_prefix:
        faults.point(f"{head.crash_prefix}_moved")


def _lead_second(repo: pygit2.Repository, move: _Move, guards: Sequence[Guard]) -> bool:
    """Scope 2 (the caller holds the OS locks again): the second ref's rename, its
    value already journaled; the follower's result (as :func:`_swap`)."""
    cdir = common_dir(repo)
    lock, fd = take_ref_lock(cdir, move)
    follower = None
    try:
        try:
            os.write(fd, f"{move.value}\n".encode())
        finally:
            os.close(fd)
        try:
            actual = _compare(repo, move.name, move.expected, guards, move.what)
        except GitrunError:  # moved meanwhile (or the lease lost): the record's value goes
            _pin(cdir, [(move.name, read_ref(repo, move.name))])
            raise
        follower = _lock_follower(repo, cdir, move.follow, move.value) if move.follow else None
        _commit_point(repo, cdir, move, actual, lock)
    except BaseException:
        if lock.exists():
            _release(lock)
        if follower is not None:
            follower[0].unlink(missing_ok=True)
        raise
    if move.crash_prefix:
        faults.point(f"{move.crash_prefix}_moved")
    if follower is not None:
        _rename_follower(repo, cdir, move, follower)
    return follower is not None or not move.follow


def _pin(cdir: Path, refs: list[tuple[str, pygit2.Oid | None]]) -> None:
    """Journal each ref's real value (its record's move never happened)."""
    for name, value in refs:
        with contextlib.suppress(GitrunError, OSError):  # the move's own error is the one
            journal.of(cdir).pin(name, value.raw if value is not None else None)
