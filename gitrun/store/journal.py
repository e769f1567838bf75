"""The repository's write-ahead journal: one ``fdatasync`` makes a ref move durable.

Every ref move gitrun makes (:class:`gitrun.store.refmove.Transaction`) writes one
*record* here before the move's commit point: the bytes of every new object the new value
reaches (the raw loose-object files, as git would keep them) and the ref's new value.
One ``pwrite`` and one ``fdatasync`` of this preallocated file make all of it durable;
the objects are then renamed from the stage into ``objects/`` and the ref's ``.lock``
over the ref, with no sync of their own: the kernel writes those names back in its own
time, and until it has, the journal holds everything a power cut could take from them.

- The file (``<common dir>/gitrun/journal``, ``SIZE`` bytes allocated once) starts
  with a header block: a magic, an *epoch* and the *boot id* of the kernel that last
  opened it. A record carries the epoch, a sequence number, its length and a CRC-32: the
  journal is the longest run of records of the header's epoch with consecutive sequence
  numbers and good checksums. A torn record (a kill or power cut mid-``pwrite``) ends it.
- A power cut is a reboot: the boot id (``/proc/sys/kernel/random/boot_id``) changes.
  The first gitrun process that opens the repository under a new boot id *recovers*
  before anything reads a ref: every journaled object whose file is missing or does not
  hash to its id is written again (each journaled object is hash-checked first), every
  journaled ref is set to its last journaled value (a value naming a missing object is
  left alone), every journaled branch is listed for its worktree's repair (a cut may
  keep a ref's rename and lose the files written after it; :func:`recovered_branches`),
  then ``syncfs`` and a new epoch. Worktree files a step writes after its branch move
  are covered by that record (:func:`covering`: a ``syncfs`` when another process
  rotated the journal in between); the repair syncs its own writes before its note goes.
- When a record does not fit, the journal *rotates*: ``syncfs`` (every name it covered is
  durable now), then a new epoch in the header, and records start again at the top.
- Appends, rotation and recovery hold the journal's ``flock``, and an append keeps it until
  its move's renames are done: a rotation never starts between a record and the renames
  it covers (their names would be durable neither in the journal nor on disk).
- A move killed between its record and its rename left its ``.lock`` behind; the next
  writer of that ref clears it and journals the ref's real value (:func:`pin`), so no
  later recovery completes the dead move. Without a later writer a recovery may complete
  it: the state is then the one a kill just after the rename leaves, a crash window the
  step protocol already covers.

The journal holds no key and decides nothing a ref could not: whoever can write it can
write refs and objects directly (the checkpoint's HMAC and the witness judge those), and
recovery takes from it only objects that hash to their names and well-formed ref names.
A move too large for it (a multi-megabyte file), or a system without a boot id, takes the
barrier of :mod:`gitrun.store.durable` instead (three ``syncfs`` per move).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from gitrun.core.errors import StorageFailed
from gitrun.store import oslock
from gitrun.store.atomicfile import atomic_file
from gitrun.store.journal_format import (  # the format's names are the journal's too
    HEADER,
    JOURNAL_FILE,
    REC,
    REC_MAGIC,
    RefEntry,
    Replay,
    Tail,
    align,
    decode,
    encode,
    header,
    read_header,
    records,
)

LOCK_FILE = "gitrun/locks/journal.flock"
LOCK_SECONDS = 30.0  # as a ref's OS lock (gitrun.store.reflocks)
SIZE = 4 << 20
SIZE_VAR = "GITRUN_JOURNAL_BYTES"  # a new journal's size (tests shrink it to rotate often)
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
TEST_BOOT_VAR = "GITRUN_TEST_BOOT_ID"  # the power-loss tests' reboot; see tests/test_journal.py


_boot: list[str] = []  # the kernel's boot id: the same for every process of this boot
_journals: dict[Path, Journal] = {}  # common dir -> this process's handle on its journal


def boot_id() -> str:
    """This kernel's boot id ('' when the system has none: the journal is not used)."""
    if not _boot:
        found = os.environ.get(TEST_BOOT_VAR, "")
        if not found:
            try:
                with open(BOOT_ID_FILE, encoding="ascii") as f:
                    found = f.read().strip()
            except OSError:
                found = ""
        _boot.append(found[:36])
    return _boot[0]


def of(cdir: Path) -> Journal:
    """This process's one handle on the journal of the repository ``cdir``. A forked child
    makes its own at its first use (it must not share its parent's open file, nor a lock
    a thread of its parent held at the fork): the handle knows the process it is for."""
    found = _journals.get(cdir)
    if found is None or found.pid != os.getpid():
        if found is not None:
            found.disown()
        found = _journals[cdir] = Journal(cdir)
    return found


class Journal:
    """The journal of one repository as this process holds it: its open file, its size,
    where the next record goes, and the refs its last recovery put back."""

    def __init__(self, cdir: Path) -> None:
        self.cdir = cdir
        self.pid = os.getpid()
        self.fd = -1  # open once usable
        self.size = SIZE  # the journal file's size (its creator's SIZE)
        self.tail: Tail | None = None
        self.unusable = False  # read-only or full: the barrier still makes moves durable
        self.restored: list[str] = []  # refs the last recovery set, for their stale locks
        # flock is per open file: the threads of one process need this too
        self.thread_lock = threading.RLock()

    def disown(self) -> None:
        """In a forked child: close the parent's descriptor (this copy of it)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def recover_if_needed(self) -> None:
        """At open, before any ref is read: recover a journal another boot left (a
        repository without one has nothing to recover; it gets one at its first move)."""
        if self.fd >= 0 or self.unusable or not boot_id():
            return
        if os.path.lexists(self.cdir / JOURNAL_FILE):
            self.usable()

    def usable(self) -> bool:
        """The journal is open (created and recovered if need be)."""
        if self.fd >= 0:
            return True
        if self.unusable or not boot_id():
            return False
        try:
            fd = _open(self.cdir)
            self.size = os.fstat(fd).st_size
            self.fd = fd
        except OSError:
            self.unusable = True
            return False
        head = read_header(self.fd)  # unlocked: a reader (a refused resume) writes nothing
        if head is None or head[1] != boot_id():
            with self.locked() as locked_fd:
                self._check_boot(locked_fd)
        return True

    @contextlib.contextmanager
    def locked(self) -> Iterator[int]:
        """The journal's lock: an OS lock with a holder record, as every ref's (a holder
        seen stopped is named at once, a running one after 30 s: exit 4), never a silent
        wait. Yields the journal's descriptor."""
        lock, name = f"{self.cdir}/{LOCK_FILE}", f"{self.cdir}/{JOURNAL_FILE}"
        with self.thread_lock:
            try:
                held = oslock.acquire(lock, LOCK_SECONDS, oslock.waiting(name, 30))
            except oslock.LockBusy as exc:
                raise oslock.busy_error(name, exc, LOCK_SECONDS) from exc
            try:
                yield self.fd
            finally:
                os.close(held)  # closing the descriptor releases the lock

    def _check_boot(self, fd: int) -> None:
        """Under the lock: recover when the journal was last opened by another boot."""
        head = read_header(fd)
        if head is not None and head[1] == boot_id():
            return
        if head is not None:
            from gitrun.store import journal_recovery  # only after a reboot

            self.restored = journal_recovery.recover(self.cdir, fd, head[0])
        self._new_epoch(fd)

    def take_restored(self) -> list[str]:
        """The refs the recovery this process just ran put back (once): their ``.lock``
        files, left by writers the power cut killed, are stale (the caller clears them)."""
        restored, self.restored = self.restored, []
        return restored

    def _new_epoch(self, fd: int) -> None:
        """``syncfs`` (everything the journal covered is durable in place), then a fresh
        random epoch: no record of an earlier one is ever read as part of the journal."""
        from gitrun.store import durable  # loads pygit2: not at import (status's reader)

        durable.sync_filesystem(self.cdir)
        epoch = _random_epoch()
        self._write(fd, header(epoch, boot_id()), 0)
        self.tail = Tail(epoch, 0, HEADER)

    def _tail(self, fd: int) -> Tail:
        """Under the lock: where the next record goes (others may have appended)."""
        head = read_header(fd)
        if head is None or head[1] != boot_id():  # damaged (nothing to trust), or a reboot
            self._check_boot(fd)
            head = (self.tail.epoch if self.tail else 0, boot_id())
        tail = self.tail
        if tail is None or tail.epoch != head[0]:
            tail = Tail(head[0], 0, HEADER)
        for after, _ in records(fd, head[0], tail, self.size):
            tail = after
        return tail

    @contextlib.contextmanager
    def recording(
        self, objects: Sequence[tuple[bytes, bytes]], refs: Sequence[RefEntry]
    ) -> Iterator[None]:
        """Journal ``objects`` and ``refs`` durably, then run the block (the renames) while
        still holding the journal's lock, so no rotation starts before they are done."""
        payload = encode(objects, refs)
        with self.locked() as fd:
            tail = self._tail(fd)
            if tail.offset + REC.size + len(payload) > self.size:
                self._new_epoch(fd)
                tail = self.tail or tail
            head = struct.pack("<IQQI", REC_MAGIC, tail.epoch, tail.seq, len(payload))
            crc = zlib.crc32(head + payload)
            self._write(fd, head + crc.to_bytes(4, "little") + payload, tail.offset)
            end = align(tail.offset + REC.size + len(payload))
            self.tail = Tail(tail.epoch, tail.seq + 1, end)
            yield

    def fits(self, size: int) -> bool:
        """A move of ``size`` bytes of objects goes through the journal (else the barrier)."""
        return size + REC.size <= self.size // 4

    def _write(self, fd: int, data: bytes, offset: int) -> None:
        """One record written and made durable, or StorageFailed (nothing acknowledged)."""
        try:
            written = os.pwrite(fd, data, offset)
        except OSError as exc:
            raise self._failed(exc) from exc
        if written != len(data):
            raise self._failed(OSError(errno.EIO, "short write"))
        try:
            os.fdatasync(fd)
        except OSError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: OSError) -> StorageFailed:
        return StorageFailed.on(self.cdir, exc.strerror or str(exc))

    def epoch(self) -> int | None:
        """The journal's epoch now (-1: a damaged header; None: no journal, the barrier)."""
        if not self.usable():
            return None
        with self.locked() as fd:
            head = read_header(fd)
        return -1 if head is None else head[0]

    def _epoch_now(self) -> int | None:
        """:meth:`epoch` read without the lock (-1 for a header torn by a rotation writing
        it): enough to compare with an epoch read under the lock after the block."""
        if not self.usable():
            return None
        head = read_header(self.fd)
        return -1 if head is None else head[0]

    @contextlib.contextmanager
    def covering(self) -> Iterator[None]:
        """Files the block writes unsynced after a ref move it makes (a step's worktree
        files) are as durable as the move: recovery repairs the paths of every branch the
        epoch journals. When another process rotated the journal in between (the move's
        record is gone), a ``syncfs`` makes them durable now; a rotation after it synced
        them itself."""
        before = self._epoch_now()
        yield
        if before is not None and self.epoch() != before:
            from gitrun.store import durable  # loads pygit2: not at import (status's reader)

            durable.sync_filesystem(self.cdir)

    def pin(self, name: str, value: bytes | None) -> None:
        """Journal ``name``'s real value: a dead move's record for it is never completed."""
        if not self.usable():
            return
        with self.recording((), [RefEntry(name, value, value, "gitrun: stale lock cleared")]):
            pass


def _open(cdir: Path) -> int:
    path = cdir / JOURNAL_FILE
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    # Made aside and linked in exclusively (the one atomic file path): never a file (a
    # hard link) planted in its place, and one journal even when processes race to make
    # it (a loser's link fails; it uses the winner's).
    size = max(HEADER * 4, int(os.environ.get(SIZE_VAR) or SIZE))
    with contextlib.suppress(FileExistsError), atomic_file(path, mode=0o600, exclusive=True) as fh:
        os.posix_fallocate(fh.fileno(), 0, size)  # no room: refused now, not at a record
        _zero_fill(fh.fileno(), size)
        os.pwrite(fh.fileno(), header(_random_epoch(), boot_id()), 0)
    return os.open(path, flags)


def _zero_fill(fd: int, size: int) -> None:
    """Write the whole file once (zeros: no record): an allocated, never-written block is
    an unwritten extent, and the first record over it would make its ``fdatasync`` write
    the extent's conversion too (measured ~0.05 ms more a record on ext4); over written
    blocks a record's sync writes its own bytes only, as a database's reused log does."""
    chunk = b"\0" * (1 << 20)
    for offset in range(0, size, len(chunk)):
        os.pwrite(fd, chunk[: size - offset], offset)


def _random_epoch() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def recovery_pending(cdir: Path) -> bool:
    """The repository's journal was last opened by another boot: until a gitrun process
    that opens the repository (:func:`gitrun.store.gitstore.open_repo`) recovers it, its
    refs and objects may not be what was acknowledged (``gitrun status``'s reader asks)."""
    if not boot_id():
        return False
    try:
        fd = os.open(cdir / JOURNAL_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        head = read_header(fd)
    finally:
        os.close(fd)
    return head is None or head[1] != boot_id()


__all__ = [
    "HEADER",
    "JOURNAL_FILE",
    "Journal",
    "RefEntry",
    "Replay",
    "Tail",
    "boot_id",
    "decode",
    "encode",
    "of",
    "read_header",
    "records",
    "recovery_pending",
]
