"""Objects in git's pack files, read without pygit2 (for :mod:`gitrun.store.gitread`).

A repository cloned, fetched or ``git gc``'d keeps its objects in packs; a run on a
user's repository walks down to a packed base commit, so ``gitrun status`` reads packs
too (issue #15). Index version 2 (fan-out, sorted names, 31-bit offsets and the large
offset table) locates an object; its pack entry is inflated, and an offset or ref delta
is applied on its base, chain by chain. Nothing here is trusted: the caller hashes what
comes out and compares it with the id asked for, and anything malformed, oversized or
unknown (another index version, a delta chain deeper than git ever writes) raises
:class:`Unsupported`, upon which pygit2 answers instead.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zlib
from collections.abc import Callable

__all__ = ["PackSet", "Unsupported"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_IDX_NAME = re.compile(r"pack-[0-9a-f]{40}\.idx")
_IDX_MAGIC = b"\xfftOc\x00\x00\x00\x02"
_FANOUT = 8  # where the fan-out table starts, after the magic and version
_NAMES = _FANOUT + 256 * 4
_KINDS = {1: b"commit", 2: b"tree", 3: b"blob", 4: b"tag"}
_OFS_DELTA, _REF_DELTA = 6, 7
_MAX_DEPTH = 4096  # git writes chains of 50 (--depth); 4,095 is its hard limit
_MAX_OBJECT = 64 << 20
_CACHE = 128  # resolved bases kept per pack (trees of one walk share them)


Lookup = Callable[[str], tuple[bytes, bytes]]


class Unsupported(Exception):
    """The pure-Python reader cannot answer exactly as libgit2 would: ask pygit2."""


class PackSet:
    """Every ``objects/pack/pack-*.idx`` of one repository (``dfd``: that directory)."""

    def __init__(self, dfd: int) -> None:
        self._packs: list[_Pack] = []
        try:
            with os.scandir(dfd) as entries:
                names = sorted(e.name[:-4] for e in entries if _IDX_NAME.fullmatch(e.name))
            for name in names:
                self._packs.append(_Pack(dfd, name))
        except OSError as exc:
            self.close()
            raise Unsupported(f"a pack is unreadable: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for pack in self._packs:
            pack.close()
        self._packs = []

    def read(self, oid: str, lookup: Lookup) -> tuple[bytes, bytes] | None:
        """(type, body) of ``oid`` from the first pack that indexes it, else None;
        ``lookup`` reads a ref delta's base that is not in the same pack."""
        raw = bytes.fromhex(oid)
        for pack in self._packs:
            offset = pack.find(raw)
            if offset is not None:
                return pack.resolve(offset, lookup)
        return None


class _Pack:
    def __init__(self, dfd: int, name: str) -> None:
        self.idx = self.pack = -1
        self.fanout: tuple[int, ...] = ()
        self.n = 0
        try:
            self.idx = _open_regular(dfd, name + ".idx")
            self.pack = _open_regular(dfd, name + ".pack")
            self._check(name)
        except BaseException:
            self.close()
            raise
        self._cache: dict[int, tuple[bytes, bytes]] = {}

    def _check(self, name: str) -> None:
        head = os.pread(self.idx, _NAMES, 0)
        if len(head) != _NAMES or head[:_FANOUT] != _IDX_MAGIC:
            raise Unsupported(f"{name}.idx is not a version 2 pack index")
        self.fanout = struct.unpack(">256I", head[_FANOUT:])
        self.n = self.fanout[255]
        if os.fstat(self.idx).st_size < _NAMES + self.n * 28 + 40:
            raise Unsupported(f"{name}.idx is truncated")
        if os.pread(self.pack, 12, 0)[:8] not in (b"PACK\0\0\0\2", b"PACK\0\0\0\3"):
            raise Unsupported(f"{name}.pack is not a version 2 or 3 pack")

    def close(self) -> None:
        for fd in (self.idx, self.pack):
            if fd >= 0:
                os.close(fd)
        self.idx = self.pack = -1

    def find(self, raw: bytes) -> int | None:
        """The pack offset of the object named ``raw`` (20 bytes), None if not here."""
        lo = self.fanout[raw[0] - 1] if raw[0] else 0
        hi = self.fanout[raw[0]]
        while lo < hi:
            mid = (lo + hi) // 2
            name = os.pread(self.idx, 20, _NAMES + 20 * mid)
            if name == raw:
                return self._offset(mid)
            if name < raw:
                lo = mid + 1
            else:
                hi = mid
        return None

    def _offset(self, i: int) -> int:
        at = _NAMES + self.n * 24 + 4 * i
        (small,) = struct.unpack(">I", os.pread(self.idx, 4, at))
        if not small & 0x80000000:
            return int(small)
        at = _NAMES + self.n * 28 + 8 * (small & 0x7FFFFFFF)
        (large,) = struct.unpack(">Q", os.pread(self.idx, 8, at))
        return int(large)

    def resolve(self, offset: int, lookup: Lookup) -> tuple[bytes, bytes]:
        """The object at ``offset``, its delta chain applied."""
        try:
            return self._resolve(offset, lookup)
        except (IndexError, ValueError, struct.error, zlib.error) as exc:
            raise Unsupported(f"pack entry at {offset} is malformed: {exc}") from exc

    def _resolve(self, offset: int, lookup: Lookup) -> tuple[bytes, bytes]:
        deltas: list[tuple[int, bytes]] = []
        while True:
            if offset in self._cache:
                kind, body = self._cache[offset]
                break
            code, size, data_at, base = self._header(offset)
            data = self._inflate(data_at, size)
            if code in _KINDS:
                kind, body = _KINDS[code], data
                break
            deltas.append((offset, data))
            if len(deltas) > _MAX_DEPTH:
                raise Unsupported(f"a delta chain deeper than {_MAX_DEPTH}")
            if isinstance(base, int):
                offset = base
                continue
            found = self.find(base)
            if found is None:
                kind, body = lookup(base.hex())
                break
            offset = found
        for at, delta in reversed(deltas):
            body = _apply(body, delta)
            if len(self._cache) >= _CACHE:
                self._cache.clear()
            self._cache[at] = (kind, body)
        return kind, body

    def _header(self, offset: int) -> tuple[int, int, int, int | bytes]:
        """(type code, inflated size, where the zlib data starts, the delta's base: a
        pack offset or an object id) of the entry at ``offset``."""
        head = os.pread(self.pack, 64, offset)
        c = head[0]
        code, size, shift, i = (c >> 4) & 7, c & 15, 4, 1
        while c & 0x80:
            c = head[i]
            size |= (c & 0x7F) << shift
            shift, i = shift + 7, i + 1
        if size > _MAX_OBJECT:
            raise Unsupported(f"pack entry at {offset} is over {_MAX_OBJECT} bytes")
        if code == _REF_DELTA:
            return code, size, offset + i + 20, head[i : i + 20]
        if code != _OFS_DELTA:
            if code not in _KINDS:
                raise Unsupported(f"pack entry at {offset} has type {code}")
            return code, size, offset + i, 0
        c = head[i]
        back, i = c & 0x7F, i + 1
        while c & 0x80:
            c = head[i]
            back, i = ((back + 1) << 7) | (c & 0x7F), i + 1
        if not 0 < back < offset:
            raise Unsupported(f"pack entry at {offset} points outside the pack")
        return code, size, offset + i, offset - back

    def _inflate(self, at: int, size: int) -> bytes:
        inflate = zlib.decompressobj()
        out = bytearray()
        while not inflate.eof:
            chunk = os.pread(self.pack, 1 << 16, at)
            if not chunk:
                raise Unsupported("a pack entry runs past the end of its pack")
            at += len(chunk)
            out += inflate.decompress(chunk, size + 1 - len(out))
            if len(out) > size or inflate.unconsumed_tail:
                raise Unsupported("a pack entry inflates past its size")
        if len(out) != size:
            raise Unsupported("a pack entry inflates short of its size")
        return bytes(out)


def _open_regular(dfd: int, name: str) -> int:
    fd = os.open(name, _FILE, dir_fd=dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Unsupported(f"{name} is not a regular file")
    return fd


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        c = data[i]
        value |= (c & 0x7F) << shift
        shift, i = shift + 7, i + 1
        if not c & 0x80:
            return value, i


def _apply(base: bytes, delta: bytes) -> bytes:
    """``delta`` (git's copy/insert instructions) applied to ``base``."""
    src, i = _varint(delta, 0)
    dst, i = _varint(delta, i)
    if src != len(base) or dst > _MAX_OBJECT:
        raise Unsupported("a delta does not fit its base")
    out = bytearray()
    while i < len(delta):
        op = delta[i]
        i += 1
        if op & 0x80:
            start = length = 0
            for bit in range(4):
                if op & (1 << bit):
                    start, i = start | delta[i] << (8 * bit), i + 1
            for bit in range(3):
                if op & (0x10 << bit):
                    length, i = length | delta[i] << (8 * bit), i + 1
            length = length or 0x10000
            if start + length > len(base):
                raise Unsupported("a delta copies from past its base")
            out += base[start : start + length]
        elif op:
            if i + op > len(delta):
                raise Unsupported("a delta inserts past its end")
            out += delta[i : i + op]
            i += op
        else:
            raise Unsupported("a delta has the reserved instruction 0")
    if len(out) != dst:
        raise Unsupported("a delta's result is not the size it names")
    return bytes(out)
