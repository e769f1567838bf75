"""The packs of one repository for :class:`gitrun.store.gitread.GitReader`, parsed by dulwich.

Issue #29: the pack format (index lookup, entry headers, inflating, ofs- and ref-delta
chains) is dulwich's (``dulwich.pack``), not a hand-written parser; what stays here is
the part that is gitrun's: which files are opened. Each ``pack-*.idx`` and its ``.pack``
are opened relative to the pack directory without following a symlink and without
blocking on a FIFO, must be regular files, and reach dulwich as open files (it never
opens a path itself). Anything dulwich cannot read, or reads oddly, raises
:class:`Unsupported`, upon which ``gitrun status`` asks pygit2. The reader hashes every
object it returns against the id it asked for (:meth:`GitReader.object`).

dulwich is imported only when a pack is opened: a young run's objects are all loose and
``gitrun status`` then never loads it (benchmarks/bench_status_reader.py measures both).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from dulwich.pack import Pack

__all__ = ["PackSet", "Unsupported"]

_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_IDX_NAME = re.compile(r"pack-[0-9a-f]{40}\.idx")
_KINDS = {1: b"commit", 2: b"tree", 3: b"blob", 4: b"tag"}
_NUMS = {kind: num for num, kind in _KINDS.items()}
_MAX_OBJECT = 64 << 20


Lookup = Callable[[str], tuple[bytes, bytes]]


class Unsupported(Exception):
    """The pure-Python reader cannot answer exactly as libgit2 would: ask pygit2."""


class PackSet:
    """Every ``objects/pack/pack-*.idx`` of one repository (``dfd``: that directory)."""

    def __init__(self, dfd: int) -> None:
        self._packs: list[Pack] = []
        self._files: list[IO[bytes]] = []
        self._lookup: Lookup | None = None
        try:
            with os.scandir(dfd) as entries:
                names = sorted(e.name[:-4] for e in entries if _IDX_NAME.fullmatch(e.name))
            for name in names:
                self._packs.append(self._open(dfd, name))
        except Unsupported:
            self.close()
            raise
        except Exception as exc:  # OSError, and whatever dulwich says of a bad pack
            self.close()
            raise Unsupported(f"a pack is unreadable: {exc!r}") from exc
        except BaseException:
            self.close()
            raise

    def _open(self, dfd: int, name: str) -> Pack:
        from dulwich.object_format import SHA1
        from dulwich.pack import Pack, PackData, load_pack_index_file

        idx = self._regular(dfd, name + ".idx")
        data = self._regular(dfd, name + ".pack")
        index = load_pack_index_file(name + ".idx", idx, SHA1)
        pack = Pack.from_objects(PackData(name + ".pack", SHA1, file=data), index)
        pack.resolve_ext_ref = self._external
        return pack

    def _regular(self, dfd: int, name: str) -> IO[bytes]:
        fd = os.open(name, _FILE, dir_fd=dfd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise Unsupported(f"{name} is not a regular file")
        os.set_blocking(fd, True)
        file = os.fdopen(fd, "rb")
        self._files.append(file)
        return file

    def close(self) -> None:
        packs, self._packs = self._packs, []
        for pack in packs:
            pack.close()
        files, self._files = self._files, []
        for file in files:
            file.close()

    def read(self, oid: str, lookup: Lookup) -> tuple[bytes, bytes] | None:
        """(type, body) of ``oid`` from the first pack that indexes it, else None;
        ``lookup`` reads a ref delta's base that is not in the same pack."""
        from dulwich.objects import RawObjectID

        raw = RawObjectID(bytes.fromhex(oid))
        for pack in self._packs:
            try:
                pack.index.object_offset(raw)
            except KeyError:
                continue
            outer, self._lookup = self._lookup, lookup  # a base's read may nest a read
            try:
                num, body = pack.get_raw(raw)
            except Unsupported:
                raise
            except Exception as exc:  # a malformed entry, a broken delta, a short pack
                raise Unsupported(f"object {oid} in a pack is unreadable: {exc!r}") from exc
            finally:
                self._lookup = outer
            if num not in _KINDS or len(body) > _MAX_OBJECT:
                raise Unsupported(f"pack entry {oid} has type {num} or is over {_MAX_OBJECT}")
            return _KINDS[num], body
        return None

    def _external(self, base: bytes) -> tuple[int, list[bytes]]:
        """A ref delta's base outside its pack: through the reader (loose, or another pack)."""
        if self._lookup is None:
            raise Unsupported("a ref delta read outside a lookup")
        oid = base.hex() if len(base) == 20 else base.decode()
        kind, body = self._lookup(oid)
        return _NUMS[kind], [body]
