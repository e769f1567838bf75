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


_fds: dict[Path, int] = {}
_sizes: dict[Path, int] = {}  # the journal file's size (its creator's SIZE)
_tails: dict[Path, Tail] = {}
_unusable: set[Path] = set()
_boot: list[str] = []
_thread_lock = threading.RLock()  # flock is per open file: threads of one process need this


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


def recover_if_needed(cdir: Path) -> None:
    """At open, before any ref is read: recover a journal another boot left (a
    repository without one has nothing to recover; it gets one at its first move)."""
    if cdir in _fds or cdir in _unusable or not boot_id():
        return
    if os.path.lexists(cdir / JOURNAL_FILE):
        usable(cdir)


def usable(cdir: Path) -> bool:
    """The journal of ``cdir`` is open (created and recovered if need be)."""
    if cdir in _fds:
        return True
    if cdir in _unusable or not boot_id():
        return False
    try:
        fd = _open(cdir)
        _sizes[cdir] = os.fstat(fd).st_size
        _fds[cdir] = fd
    except OSError:
        _unusable.add(cdir)  # read-only or full: the barrier still makes moves durable
        return False
    head = read_header(_fds[cdir])  # unlocked: a reader (a refused resume) writes nothing
    if head is None or head[1] != boot_id():
        with _locked(cdir) as fd:
            _check_boot(cdir, fd)
    return True


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


@contextlib.contextmanager
def _locked(cdir: Path) -> Iterator[int]:
    """The journal's lock: an OS lock with a holder record, as every ref's (a holder seen
    stopped is named at once, a running one after 30 s: exit 4), never a silent wait."""
    lock, name = f"{cdir}/{LOCK_FILE}", f"{cdir}/{JOURNAL_FILE}"
    with _thread_lock:
        try:
            held = oslock.acquire(lock, LOCK_SECONDS, oslock.waiting(name, 30))
        except oslock.LockBusy as exc:
            raise oslock.busy_error(name, exc, LOCK_SECONDS) from exc
        try:
            yield _fds[cdir]
        finally:
            os.close(held)  # closing the descriptor releases the lock


def _check_boot(cdir: Path, fd: int) -> None:
    """Under the lock: recover when the journal was last opened by another boot."""
    head = read_header(fd)
    if head is not None and head[1] == boot_id():
        return
    if head is not None:
        from gitrun.store import journal_recovery  # only after a reboot

        journal_recovery.recover(cdir, fd, head[0])
    _new_epoch(cdir, fd)


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


def _new_epoch(cdir: Path, fd: int) -> None:
    """``syncfs`` (everything the journal covered is durable in place), then a fresh
    random epoch: no record of an earlier one is ever read as part of the journal."""
    from gitrun.store import durable  # loads pygit2: not at import (status's reader)

    durable.sync_filesystem(cdir)
    epoch = _random_epoch()
    _write(cdir, fd, header(epoch, boot_id()), 0)
    _tails[cdir] = Tail(epoch, 0, HEADER)


def _tail(cdir: Path, fd: int) -> Tail:
    """Under the lock: where the next record goes (others may have appended)."""
    head = read_header(fd)
    if head is None or head[1] != boot_id():  # damaged (nothing to trust), or a reboot
        _check_boot(cdir, fd)
        head = (_tails[cdir].epoch, boot_id())
    tail = _tails.get(cdir)
    if tail is None or tail.epoch != head[0]:
        tail = Tail(head[0], 0, HEADER)
    for after, _ in records(fd, head[0], tail, _sizes[cdir]):
        tail = after
    return tail


@contextlib.contextmanager
def recording(
    cdir: Path, objects: Sequence[tuple[bytes, bytes]], refs: Sequence[RefEntry]
) -> Iterator[None]:
    """Journal ``objects`` and ``refs`` durably, then run the block (the renames) while
    still holding the journal's lock, so no rotation starts before they are done."""
    payload = encode(objects, refs)
    with _locked(cdir) as fd:
        tail = _tail(cdir, fd)
        if tail.offset + REC.size + len(payload) > _sizes[cdir]:
            _new_epoch(cdir, fd)
            tail = _tails[cdir]
        head = struct.pack("<IQQI", REC_MAGIC, tail.epoch, tail.seq, len(payload))
        crc = zlib.crc32(head + payload)
        _write(cdir, fd, head + crc.to_bytes(4, "little") + payload, tail.offset)
        end = align(tail.offset + REC.size + len(payload))
        _tails[cdir] = Tail(tail.epoch, tail.seq + 1, end)
        yield


def fits(cdir: Path, size: int) -> bool:
    """A move of ``size`` bytes of objects goes through the journal (else the barrier)."""
    return size + REC.size <= _sizes.get(cdir, SIZE) // 4


def _write(cdir: Path, fd: int, data: bytes, offset: int) -> None:
    """One record written and made durable, or StorageFailed (nothing acknowledged)."""
    try:
        written = os.pwrite(fd, data, offset)
    except OSError as exc:
        raise _failed(cdir, exc) from exc
    if written != len(data):
        raise _failed(cdir, OSError(errno.EIO, "short write"))
    _sync(cdir, fd)


def _failed(cdir: Path, exc: OSError) -> StorageFailed:
    return StorageFailed.on(cdir, exc.strerror or str(exc))


def _sync(cdir: Path, fd: int) -> None:
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise _failed(cdir, exc) from exc


def epoch(cdir: Path) -> int | None:
    """The journal's epoch now (-1: a damaged header; None: no journal, the barrier)."""
    if not usable(cdir):
        return None
    with _locked(cdir) as fd:
        head = read_header(fd)
    return -1 if head is None else head[0]


def _epoch_now(cdir: Path) -> int | None:
    """:func:`epoch` read without the lock (-1 for a header torn by a rotation writing
    it): enough to compare with an epoch read under the lock after the block."""
    if not usable(cdir):
        return None
    head = read_header(_fds[cdir])
    return -1 if head is None else head[0]


@contextlib.contextmanager
def covering(cdir: Path) -> Iterator[None]:
    """Files the block writes unsynced after a ref move it makes (a step's worktree files)
    are as durable as the move: recovery repairs the paths of every branch the epoch
    journals. When another process rotated the journal in between (the move's record is
    gone), a ``syncfs`` makes them durable now; a rotation after it synced them itself."""
    before = _epoch_now(cdir)
    yield
    if before is not None and epoch(cdir) != before:
        from gitrun.store import durable  # loads pygit2: not at import (status's reader)

        durable.sync_filesystem(cdir)


def pin(cdir: Path, name: str, value: bytes | None) -> None:
    """Journal ``name``'s real value: a dead move's record for it is never completed."""
    if not usable(cdir):
        return
    with recording(cdir, (), [RefEntry(name, value, value, "gitrun: stale lock cleared")]):
        pass


def forget() -> None:
    """Close every journal: a forked child must not share its parent's open file (and
    with it the parent's ``flock``); it opens its own at its first move."""
    global _thread_lock  # noqa: PLW0603 - a fork's child gets a fresh, unheld lock
    for fd in _fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _fds.clear()
    _sizes.clear()
    from gitrun.store import journal_recovery

    journal_recovery.restored.clear()
    _tails.clear()
    _unusable.clear()
    _boot.clear()
    _thread_lock = threading.RLock()


os.register_at_fork(after_in_child=forget)


__all__ = [
    "HEADER",
    "JOURNAL_FILE",
    "RefEntry",
    "Replay",
    "Tail",
    "boot_id",
    "covering",
    "decode",
    "encode",
    "epoch",
    "fits",
    "forget",
    "pin",
    "read_header",
    "recording",
    "records",
    "recover_if_needed",
    "recovery_pending",
    "usable",
]
