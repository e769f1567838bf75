"""A ref move led by another, both in one journal record: a step's intent checkpoint riding
with its write (:mod:`gitrun.engine.riding`), one ``fdatasync`` for both.

Two transactions, each under the OS locks of every ref involved:

1. :func:`first`: the lead's ``.lock`` taken, the guards checked and both refs compared;
   one journal record holds both moves' new objects and all three values (lead, led ref,
   follower); the objects published, the lead renamed. Its locks are then let go: the
   intent is durable, no evidence of the write exists, and nothing is locked (window 2 of
   docs/design.md §6 looks as it always did; its crash points are passed between the two);
2. :func:`second`: the led ref's ``.lock`` taken, the guards checked and the ref compared
   again (a writer that moved it in between wins: the record's value for it is pinned
   back to the real one, so no recovery completes it, and the move fails), then renamed
   with no sync of its own: the record holds its value (and should another process
   rotate the journal in between, the caller's :func:`gitrun.store.journal.covering`
   makes it durable with a ``syncfs``), then the follower.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pygit2

from gitrun.core import faults
from gitrun.core.errors import GitrunError
from gitrun.store import durable, journal
from gitrun.store.reflocks import Guard, common_dir, read_ref
from gitrun.store.refmove import (
    NoRoom,
    _commit_point,
    _compare,
    _entry,
    _lock_follower,
    _Move,
    _release,
    _rename_follower,
    take_ref_lock,
)


class Lead:
    """A ref moved first, in the same journal record as the move it leads. ``moved``
    says whether its rename happened; ``on_moved`` and the crash points ``after`` follow
    that rename at once."""

    def __init__(
        self,
        name: str,
        expected: pygit2.Oid | None,
        new: pygit2.Oid,
        *,
        message: str,
        what: str,
        crash_prefix: str,
        after: tuple[str, ...] = (),
    ) -> None:
        self.move = _Move(name, expected, new, message, what, crash_prefix, cache=False)
        self.after = after
        self.moved = False
        self.on_moved: Callable[[], None] | None = None

    def renamed(self) -> None:
        """Its rename happened: ``on_moved``, then its crash points."""
        self.moved = True
        if self.on_moved is not None:
            self.on_moved()
        for point in self.after:
            faults.point(point)


def first(repo: pygit2.Repository, move: _Move, guards: Sequence[Guard], lead: Lead) -> None:
    """Transaction 1 (the caller holds the OS locks): the record, the lead's rename.
    :class:`gitrun.store.refmove.NoRoom` when one record cannot hold both: nothing written."""
    cdir, head = common_dir(repo), lead.move
    lead_lock, fd = take_ref_lock(cdir, head)
    handed = False
    try:
        try:
            actual = _compare(repo, move.name, move.expected, guards, move.what)
            was = _compare(repo, head.name, head.expected, (), head.what)
            os.write(fd, f"{head.new}\n".encode())
        finally:
            os.close(fd)
        objects: list[str] = []
        for new, old in ((head.new, was), (move.new, actual)):
            objects += [o for o in durable.staged_closure(repo, cdir, new, old) if o not in objects]
        staged = durable.read_staged(cdir, objects)
        if not journal.fits(cdir, sum(len(d) for _, d in staged)):
            raise NoRoom
        handed = True  # from here _recorded releases the lock itself if it fails
        _recorded(repo, cdir, (lead, was, lead_lock), move, actual, (objects, staged))
    finally:
        if not handed:
            _release(lead_lock)


def _recorded(
    repo: pygit2.Repository,
    cdir: Path,
    led: tuple[Lead, pygit2.Oid | None, Path],
    move: _Move,
    actual: pygit2.Oid | None,
    objects: tuple[list[str], list[tuple[bytes, bytes]]],
) -> None:
    lead, was, lead_lock = led
    known = read_ref(repo, move.follow) if move.follow else None
    entries = [
        _entry(lead.move.name, was, lead.move.new, lead.move.message),
        _entry(move.name, actual, move.new, move.message),
    ]
    if move.follow and known != move.new:
        entries.append(_entry(move.follow, known, move.new, "gitrun receipt index"))
    try:
        with journal.recording(cdir, objects[1], entries):
            durable.publish(cdir, objects[0])
            _commit_point(repo, cdir, lead.move, was, lead_lock)
            lead.moved = True
    except BaseException:
        if lead_lock.exists():  # not renamed: nothing moved, and no recovery may move it
            _release(lead_lock)
            _pin(cdir, [(lead.move.name, was), (move.name, actual)])
        raise
    if lead.move.crash_prefix:
        faults.point(f"{lead.move.crash_prefix}_moved")


def second(repo: pygit2.Repository, move: _Move, guards: Sequence[Guard]) -> bool:
    """Transaction 2 (the caller holds the OS locks again): the led ref's rename, its
    value already journaled; the follower's result (as :func:`gitrun.store.refmove._swap`)."""
    cdir = common_dir(repo)
    lock, fd = take_ref_lock(cdir, move)
    follower = None
    try:
        try:
            os.write(fd, f"{move.new}\n".encode())
        finally:
            os.close(fd)
        try:
            actual = _compare(repo, move.name, move.expected, guards, move.what)
        except GitrunError:  # moved meanwhile (or the lease lost): the record's value goes
            _pin(cdir, [(move.name, read_ref(repo, move.name))])
            raise
        follower = _lock_follower(repo, cdir, move.follow, move.new) if move.follow else None
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
            journal.pin(cdir, name, value.raw if value is not None else None)


__all__ = ["Lead", "first", "second"]
