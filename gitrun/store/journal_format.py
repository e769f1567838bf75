"""The journal's on-disk format (:mod:`gitrun.store.journal`): its header block, the
records after it (epoch, sequence number, length, CRC-32, payload), and a record's
payload: each new object's raw id and loose-file bytes, then each ref's new and old value.
Pure functions of bytes and a descriptor's reads: no lock, no state."""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

HEADER = 4096
JOURNAL_FILE = "gitrun/journal"  # under the common dir
REF_NAME = re.compile(r"refs/[A-Za-z0-9._/@+-]{1,1000}")  # a name recovery may restore
_MAGIC = b"GITRUNJ1"
_HEAD = struct.Struct("<8sQ36sI")  # magic, epoch, boot id, crc32
REC = struct.Struct("<IQQII")  # magic, epoch, seq, payload length, crc32
REC_MAGIC = 0x4A525447
_ZERO = b"\0" * 20


@dataclass(frozen=True)
class RefEntry:
    """A ref's new value (None: deleted), its value before, and its reflog message."""

    name: str
    new: bytes | None
    old: bytes | None
    message: str


@dataclass
class Tail:
    epoch: int
    seq: int
    offset: int


@dataclass
class Replay:
    objects: dict[bytes, bytes] = field(default_factory=dict)
    refs: dict[str, RefEntry] = field(default_factory=dict)
    first_old: dict[str, bytes | None] = field(default_factory=dict)
    values: dict[str, set[bytes | None]] = field(default_factory=dict)  # every old and new


def header(epoch: int, boot: str) -> bytes:
    raw = boot.encode("ascii", "replace")[:36].ljust(36, b"\0")
    crc = zlib.crc32(_MAGIC + epoch.to_bytes(8, "little") + raw)
    return _HEAD.pack(_MAGIC, epoch, raw, crc).ljust(HEADER, b"\0")


def read_header(fd: int) -> tuple[int, str] | None:
    raw = os.pread(fd, _HEAD.size, 0)
    if len(raw) < _HEAD.size:
        return None
    magic, epoch, boot, crc = _HEAD.unpack(raw)
    if magic != _MAGIC or zlib.crc32(_MAGIC + epoch.to_bytes(8, "little") + boot) != crc:
        return None
    return epoch, boot.rstrip(b"\0").decode("ascii", "replace")


def records(fd: int, epoch: int, start: Tail, limit: int = 0) -> Iterator[tuple[Tail, bytes]]:
    """The valid records from ``start`` on, each with the tail after it."""
    seq, offset = start.seq, start.offset
    limit = limit or os.fstat(fd).st_size
    while offset + REC.size <= limit:
        raw = os.pread(fd, REC.size, offset)
        if len(raw) < REC.size:
            return
        magic, rec_epoch, rec_seq, length, crc = REC.unpack(raw)
        if magic != REC_MAGIC or rec_epoch != epoch or rec_seq != seq:
            return
        if offset + REC.size + length > limit:
            return
        payload = os.pread(fd, length, offset + REC.size)
        if len(payload) != length or zlib.crc32(raw[:24] + payload) != crc:
            return
        seq, offset = seq + 1, align(offset + REC.size + length)
        yield Tail(epoch, seq, offset), payload


def align(n: int) -> int:
    return (n + 7) & ~7


def encode(objects: Sequence[tuple[bytes, bytes]], refs: Sequence[RefEntry]) -> bytes:
    """A record's payload: each object (raw id, loose-file bytes), then each ref."""
    parts: list[bytes] = []
    for oid, data in objects:
        parts += [b"O", oid, len(data).to_bytes(4, "little"), data]
    for ref in refs:
        name, msg = ref.name.encode(), ref.message.encode()[:4000]
        parts += [b"D" if ref.new is None else b"R", len(name).to_bytes(2, "little"), name]
        parts += [ref.new or _ZERO, ref.old or _ZERO, len(msg).to_bytes(2, "little"), msg]
    return b"".join(parts)


def decode(payload: bytes, into: Replay) -> None:
    """Fold one record into ``into`` (raises ValueError on a malformed payload)."""
    i = 0
    while i < len(payload):
        kind = payload[i : i + 1]
        if kind == b"O":
            oid, n = payload[i + 1 : i + 21], int.from_bytes(payload[i + 21 : i + 25], "little")
            into.objects[oid] = payload[i + 25 : i + 25 + n]
            i += 25 + n
            continue
        if kind not in (b"R", b"D"):
            raise ValueError(f"unknown journal entry {kind!r}")
        n = int.from_bytes(payload[i + 1 : i + 3], "little")
        name = payload[i + 3 : i + 3 + n].decode()
        j = i + 3 + n
        new, old = payload[j : j + 20], payload[j + 20 : j + 40]
        m = int.from_bytes(payload[j + 40 : j + 42], "little")
        message = payload[j + 42 : j + 42 + m].decode("utf-8", "replace")
        new_value = None if kind == b"D" else new
        entry = RefEntry(name, new_value, None if old == _ZERO else old, message)
        into.first_old.setdefault(name, entry.old)
        into.values.setdefault(name, set()).update((entry.old, new_value))
        into.refs[name] = entry
        i = j + 42 + m
