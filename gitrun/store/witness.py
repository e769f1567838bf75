"""The freshness witness: a second, MAC'd record of each run's high-water mark.

A checkpoint's HMAC proves who wrote it, not that it is the newest: whoever can write
refs (the agent, in any worktree of the repository) can move the checkpoint ref back to
an older, validly signed generation. The witness lives outside the repository
(``$GITRUN_HOME/witness/<run_id>``) and records (run, ref, generation, commit) under an
HMAC of the checkpoint keyring, so a rolled-back ref no longer matches it.

The file has two fixed-size slots, A and B; generation ``g`` lives in slot ``g % 2``. An
advance moves the checkpoint ref first, then overwrites the older slot in place
(``pwrite`` + ``fdatasync``: no rename, no directory fsync), so a crash at any point
leaves the witness at ``g`` or ``g - 1`` and the other slot intact. Each slot carries a
plain checksum (a torn write fails it) and the MAC (a forged slot passes the checksum
and fails the MAC). One ``flock`` per run orders every writer and checker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gitrun.core import faults
from gitrun.core.errors import CheckpointRejected, GitrunError, StorageFailed
from gitrun.store.atomicfile import atomic_file, fsync_dir, read_bytes
from gitrun.store.keys import Keyring
from gitrun.store.oslock import LockBusy, acquire, busy_error

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

DOMAIN = b"gitrun-witness/1\n"
VERSION = 1
SLOT_SIZE = 1024
TEAR_AT = 128  # where the crash point splits a slot write: inside every record
LOCK_TIMEOUT_SECONDS = 30.0
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Mark:
    """One witnessed high-water mark: ``ref`` held ``commit`` at ``generation``."""

    run_id: str
    ref: str
    generation: int
    commit: str


@dataclass(frozen=True)
class Reading:
    """What the witness file holds: the best valid slot, and whether the other is torn."""

    mark: Mark | None
    other_valid: bool
    torn: bool  # a slot fails its checksum: a write was cut short (or bytes were edited)


def _signed(mark: Mark) -> bytes:
    fields = (mark.run_id, mark.ref, str(mark.generation), mark.commit)
    return DOMAIN + "\n".join(fields).encode()


class Witness:
    """The witness records of every run in one workspace directory."""

    def __init__(self, directory: Path, keyring: Keyring) -> None:
        self.directory = directory
        self.keyring = keyring
        self._paths: dict[str, Path] = {}  # an advance asks four times
        self._locks: dict[str, str] = {}  # run -> its lock file
        # (run, slot index, the slot's exact bytes) -> the mark they verified as: a slot
        # this process wrote or checked is not parsed and MAC-checked again (an advance
        # reads both slots; one of them it wrote itself, the other it read last time).
        self._verified: dict[tuple[str, int, bytes], Mark] = {}
        self._pending: dict[str, Future[None]] = {}  # run -> its deferred slot sync
        self._settled: set[str] = set()  # runs whose witness this process made durable
        self._syncer: ThreadPoolExecutor | None = None  # the deferred syncs' one thread
        self._pid = os.getpid()

    def path(self, run_id: str) -> Path:
        found = self._paths.get(run_id)
        if found is None:
            if not _RUN_RE.match(run_id):
                raise GitrunError(f"run id {run_id!r} cannot name a witness file")
            found = self._paths[run_id] = self.directory / run_id
        return found

    @contextlib.contextmanager
    def locked(self, run_id: str) -> Iterator[None]:
        """Hold the run's witness lock: checks and writes never interleave."""
        lock = self._locks.get(run_id)
        if lock is None:
            lock = self._locks[run_id] = f"{self.path(run_id).parent}/.{run_id}.lock"
        try:
            try:
                fd = acquire(lock, LOCK_TIMEOUT_SECONDS, make_dir=False)
            except FileNotFoundError:  # the first run of this workspace: its own 0700 dir
                self._ensure_dir()
                fd = acquire(lock, LOCK_TIMEOUT_SECONDS, make_dir=False)
        except LockBusy as exc:  # a stopped holder at once, a running one after the wait
            raise busy_error(run_id, exc, LOCK_TIMEOUT_SECONDS, "the witness of run") from exc
        try:
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _ensure_dir(self) -> None:
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fsync_dir(self.directory.parent)

    # -- reading -----------------------------------------------------------------------

    def read(self, run_id: str) -> Reading | None:
        """The witness as stored, None when there is no file (caller holds the lock)."""
        path = self.path(run_id)
        try:
            raw = read_bytes(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointRejected(
                "witness-corrupt", f"the witness {path} is unreadable: {exc.strerror}"
            ) from exc
        if len(raw) != 2 * SLOT_SIZE:
            raise CheckpointRejected(
                "witness-corrupt",
                f"the witness {path} is {len(raw)} bytes, not {2 * SLOT_SIZE}; it was truncated "
                "or replaced",
            )
        slots = [self._slot(raw[i * SLOT_SIZE : (i + 1) * SLOT_SIZE], i, run_id) for i in (0, 1)]
        valid = [s for s in slots if isinstance(s, Mark)]
        torn = any(s == "torn" for s in slots)
        best = max(valid, key=lambda m: m.generation, default=None)
        others = [m for m in valid if m is not best]
        other_ok = bool(others) and best is not None and others[0].generation == best.generation - 1
        return Reading(best, other_ok or (best is not None and _fresh(best, slots)), torn)

    def _slot(self, data: bytes, index: int, run_id: str) -> Mark | str:
        """A valid mark, "empty" (never written), or "torn" (fails its checksum)."""
        known = self._verified.get((run_id, index, data))
        if known is not None:
            return known
        found = self._check_slot(data, index, run_id)
        if isinstance(found, Mark):
            self._remember(run_id, index, data, found)
        return found

    def _remember(self, run_id: str, index: int, data: bytes, mark: Mark) -> None:
        if len(self._verified) >= 16:
            self._verified.clear()
        self._verified[(run_id, index, data)] = mark

    def _check_slot(self, data: bytes, index: int, run_id: str) -> Mark | str:
        if not data.strip(b"\0"):
            return "empty"
        body, sep, rest = data.rstrip(b"\0").partition(b"\n")
        if not sep or rest != hashlib.sha256(body).hexdigest().encode() + b"\n":
            return "torn"
        try:
            doc = json.loads(body)
            mark = Mark(doc["run_id"], doc["ref"], int(doc["generation"]), doc["commit"])
            key_id, mac, version = str(doc["key_id"]), str(doc["mac"]), doc["v"]
        except (ValueError, KeyError, TypeError) as exc:
            raise _forged(self.path(run_id), f"slot {'AB'[index]} is not a witness") from exc
        if version != VERSION or mark.run_id != run_id or mark.generation % 2 != index:
            raise _forged(self.path(run_id), f"slot {'AB'[index]} is not this run's")
        verdict = self.keyring.verify(key_id, _signed(mark), mac)
        if verdict is None:
            raise CheckpointRejected(
                "witness-unknown-key",
                f"the witness {self.path(run_id)} is signed with key {key_id!r}, not in the "
                "keyring; use the keyring that signed this run's checkpoints",
            )
        if not verdict:
            raise _forged(self.path(run_id), f"slot {'AB'[index]} does not verify")
        return mark

    def hint(self, run_id: str) -> str:
        """What the witness says a missing checkpoint ref held (for a refusal), or ""."""
        try:
            reading = self.read(run_id)
        except CheckpointRejected:
            return ""
        if reading is None or reading.mark is None:
            return ""
        mark = reading.mark
        return (
            f" (the witness records generation {mark.generation}: restore it with "
            f"`git update-ref {mark.ref} {mark.commit}`)"
        )

    # -- writing -----------------------------------------------------------------------

    def write(self, mark: Mark, *, defer: bool = False) -> None:
        """Make ``mark`` durable (caller holds the lock). Generation 1 creates the file.

        ``defer``: its ``fdatasync`` runs on a background thread, and :meth:`settle` waits
        for it. An advance defers (its checkpoint is durable already, and a witness one
        generation behind its ref is the crash window the reader admits); the run's next
        checkpoint settles first, so the witness is never two generations behind."""
        self._own()
        slot = self._encode(mark)
        path = self.path(mark.run_id)
        if mark.generation == 1:
            self._create(path, slot)
            self._settled.add(mark.run_id)
            return
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            offset = (mark.generation % 2) * SLOT_SIZE
            # Two writes, cut inside the record, so the crash matrix can tear a slot for
            # real: a torn slot is a case the reader handles, never a hypothetical.
            os.pwrite(fd, slot[:TEAR_AT], offset)
            faults.point("checkpoint_witness_torn")
            os.pwrite(fd, slot[TEAR_AT:], offset + TEAR_AT)
            if defer:
                self.settle(mark.run_id)  # never two pending: each error is raised
                self._pending[mark.run_id] = self._thread().submit(_sync_and_close, fd, path)
                fd = -1
            else:
                _sync(fd, path)
                self._settled.add(mark.run_id)
        finally:
            if fd >= 0:
                os.close(fd)
        self._remember(mark.run_id, mark.generation % 2, slot, mark)
        faults.point("checkpoint_witness_written")

    def settle(self, run_id: str) -> None:
        """Every witness write of ``run_id`` durable: the deferred one this process made
        waited for (its error raised), or, the first time for the run in this process,
        the file synced (a process killed before its deferred sync ran may have left it
        unsynced). Called before anything of the run's next checkpoint is written."""
        self._own()
        pending = self._pending.pop(run_id, None)
        if pending is not None:
            pending.result()
        elif run_id not in self._settled:
            path = self.path(run_id)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return  # no witness yet: the first advance creates it, synced
            try:
                _sync(fd, path)
            finally:
                os.close(fd)
        self._settled.add(run_id)

    def _own(self) -> None:
        """In a forked child (threads do not survive a fork): no deferred sync of the
        parent's is this process's to wait for, and nothing is known settled here (each
        run's file is synced at its first settle); a thread of its own when it needs one."""
        if self._pid != os.getpid():
            self._pid, self._pending, self._settled, self._syncer = os.getpid(), {}, set(), None

    def _thread(self) -> ThreadPoolExecutor:
        """The one background thread for deferred witness syncs (made at the first)."""
        if self._syncer is None:
            from concurrent.futures import ThreadPoolExecutor  # writers only: not at import

            self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gitrun-witness")
        return self._syncer

    def _create(self, path: Path, slot: bytes) -> None:
        """The first mark: made aside and renamed in, so the file is whole or absent."""
        self.replace(path, (bytes(SLOT_SIZE), slot))

    def reset(self, mark: Mark, parent: Mark | None) -> None:
        """Anchor the witness at ``mark`` whatever it held (a human's recovery; caller
        holds the lock). Its parent fills the other slot, as after a normal advance."""
        slots = [bytes(SLOT_SIZE), bytes(SLOT_SIZE)]
        slots[mark.generation % 2] = self._encode(mark)
        if parent is not None:
            slots[parent.generation % 2] = self._encode(parent)
        self.replace(self.path(mark.run_id), (slots[0], slots[1]))

    def replace(self, path: Path, slots: tuple[bytes, bytes]) -> None:
        """Write the whole file through the one atomic path (aside, fsync, rename over,
        fsync the directory): it is whole or absent, never torn (caller holds the lock)."""
        self._ensure_dir()
        data = slots[0] + slots[1]
        with atomic_file(path, mode=0o600, writers_locked=True) as fh:  # we hold its lock
            fh.write(data[: SLOT_SIZE + TEAR_AT])
            faults.point("checkpoint_witness_torn")
            fh.write(data[SLOT_SIZE + TEAR_AT :])
        faults.point("checkpoint_witness_written")

    def _encode(self, mark: Mark) -> bytes:
        key_id, mac = self.keyring.sign(_signed(mark))
        doc = {
            "commit": mark.commit,
            "generation": mark.generation,
            "key_id": key_id,
            "mac": mac,
            "ref": mark.ref,
            "run_id": mark.run_id,
            "v": VERSION,
        }
        body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        slot = body + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n"
        if len(slot) > SLOT_SIZE:
            raise GitrunError(f"witness record of {mark.ref} is longer than {SLOT_SIZE} bytes")
        return slot.ljust(SLOT_SIZE, b"\0")


def _sync(fd: int, path: Path) -> None:
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise StorageFailed.on(path, exc.strerror or str(exc)) from exc


def _sync_and_close(fd: int, path: Path) -> None:
    try:
        faults.point("witness_sync_deferred")
        _sync(fd, path)
    finally:
        os.close(fd)


def admit(path: Path, reading: Reading | None, here: Mark, parent: str | None) -> bool:
    """May the checkpoint ``here`` (whose parent is ``parent``) be trusted as the newest?

    True: yes, and the witness must be rolled forward to it (the crash window between
    the ref move and the witness write). False: yes, the witness already says so.
    Anything else raises :class:`CheckpointRejected` naming both generations.
    """
    resume = f"gitrun checkpoint rewitness {here.run_id} --generation {here.generation}"
    if reading is None:
        return _admit_unwitnessed(path, here, parent, resume)
    mark = reading.mark
    if mark is None:
        raise CheckpointRejected(
            "witness-corrupt", f"the witness {path} holds no valid record; restore it from a backup"
        )
    at = f"generation {here.generation} ({here.commit[:12]})"
    witnessed = f"generation {mark.generation} ({mark.commit})"
    if mark.ref == here.ref and here.generation < mark.generation:
        raise CheckpointRejected(
            "rolled-back",
            f"{here.ref} is at {at} but the witness records {witnessed}: the ref was moved "
            f"back; restore it with `git update-ref {here.ref} {mark.commit}`, or if you "
            f"restored this repository from a backup on purpose, accept it with: {resume}",
        )
    if mark.ref == here.ref and here.generation == mark.generation and here.commit == mark.commit:
        if reading.torn or not reading.other_valid:
            raise CheckpointRejected(
                "witness-corrupt",
                f"the witness {path} agrees with {at} but its other slot is damaged, which no "
                "crash leaves behind; restore it from a backup",
            )
        return False
    if mark.ref == here.ref and here.generation == mark.generation + 1 and parent == mark.commit:
        return True  # killed between the ref move and the witness write: roll forward
    raise CheckpointRejected(
        "witness-diverged",
        f"{here.ref} is at {at} but the witness records {witnessed} on {mark.ref}, and the "
        "one is not the other's successor; restore the ref with `git update-ref "
        f"{mark.ref} {mark.commit}`, or accept the ref's checkpoint with: {resume}",
    )


def _admit_unwitnessed(path: Path, here: Mark, parent: str | None, resume: str) -> bool:
    """No witness file: only a first checkpoint may be admitted (and witnessed now), since
    a missing witness is never re-created silently for a later one."""
    if here.generation == 1 and parent is None:
        return True  # the first advance: killed after its ref move, before the witness
    raise CheckpointRejected(
        "witness-missing",
        f"{here.ref} is at generation {here.generation} but the run's witness {path} is "
        "missing (it is never re-created silently); restore it from a backup, or if "
        f"generation {here.generation} is really the newest, run: {resume}",
    )


def _fresh(best: Mark, slots: list[Mark | str]) -> bool:
    """A file that holds only generation 1, its other slot never written."""
    return best.generation == 1 and slots[0] == "empty"


def _forged(path: Path, what: str) -> CheckpointRejected:
    return CheckpointRejected(
        "witness-forged",
        f"the witness {path}: {what} (its checksum holds, its MAC does not: edited by someone "
        "without the key); nothing can be trusted, restore the workspace from a backup",
    )


__all__ = ["Mark", "Reading", "Witness", "admit"]
