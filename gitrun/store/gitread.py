"""A read-only git reader in pure Python, for what ``gitrun status`` reads (issue #15).

Loose refs, ``packed-refs``, loose objects and packed ones (:mod:`gitrun.store.gitpack`,
whose pack format dulwich parses): enough for a run's refs, checkpoint, lease and write
commits without loading pygit2 (~80 ms of a fresh process). Every object's content is
hashed and compared with the id asked for. It answers only what it can answer exactly
as libgit2 would, and raises :class:`Unsupported` for anything else, upon which the
caller asks pygit2 instead: an object in no pack and not loose (missing, or behind
``objects/info/alternates``), a symbolic or malformed ref, a symlink anywhere under the
git dir on the way to a ref or object, an unusual repository layout (a linked worktree,
``extensions``, config includes), an object whose content does not hash to its id, a
commit with an encoding header or a NUL in its message.

Every file is opened relative to the git dir, one path component at a time, with
``O_NOFOLLOW`` (a planted symlink cannot lead the reader out of the git dir) and
``O_NONBLOCK`` (a planted FIFO cannot stall it), and must be a regular file.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path

from gitrun.core.git_trailers import message_trailers
from gitrun.store.gitpack import PackSet, Unsupported

__all__ = ["Commit", "GitReader", "TreeEntry", "Unsupported"]


_OID = re.compile(rb"[0-9a-f]{40}")
_OID_TEXT = re.compile(r"[0-9a-f]{40}")
_REF_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_PERSON = rb"[^<>\n]* <[^<>\n]*> ([0-9]{1,18}) [+-][0-9]{4}"
_AUTHOR = re.compile(rb"author " + _PERSON)
_COMMITTER = re.compile(rb"committer " + _PERSON)
_MODES = {b"40000": 0o040000, b"100644": 0o100644, b"100755": 0o100755}
_MODES |= {b"120000": 0o120000, b"160000": 0o160000}
TREE_MODE = 0o040000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_FILE = 16 << 20
_MAX_OBJECT = 64 << 20


class Commit:
    """A parsed commit, as pygit2 shows it (``raw_message``: leading newlines dropped).
    (Plain classes, not dataclasses: making a dataclass costs a fresh process ~0.5 ms.)"""

    __slots__ = ("commit_time", "oid", "parents", "raw_message", "tree")

    def __init__(
        self, oid: str, tree: str, parents: tuple[str, ...], commit_time: int, raw_message: bytes
    ) -> None:
        self.oid = oid
        self.tree = tree
        self.parents = parents
        self.commit_time = commit_time
        self.raw_message = raw_message

    @property
    def message_trailers(self) -> dict[str, str]:
        return message_trailers(self.raw_message)


class TreeEntry:
    """One entry of a tree: its name, object id and (canonical) mode."""

    __slots__ = ("mode", "name", "oid")

    def __init__(self, name: str, oid: str, mode: int) -> None:
        self.name = name
        self.oid = oid
        self.mode = mode

    @property
    def is_tree(self) -> bool:
        return self.mode == TREE_MODE


def _valid_ref(name: str) -> bool:
    parts = name.split("/")
    return len(parts) >= 2 and parts[0] == "refs" and all(_valid_part(p) for p in parts[1:])


def _valid_part(part: str) -> bool:
    return bool(_REF_PART.fullmatch(part)) and ".." not in part and not _bad_end(part)


def _bad_end(part: str) -> bool:
    return part.endswith((".lock", "."))


class GitReader:
    """One repository's git dir, read without pygit2; :meth:`close` when done."""

    def __init__(self, path: str | Path) -> None:
        self.gitdir = _find_gitdir(Path(path))
        try:
            self._fd = os.open(self.gitdir, _DIR)
        except OSError as exc:
            raise Unsupported(f"cannot open {self.gitdir}: {exc}") from exc
        self._packed_refs: dict[str, str] | None = None
        self._packs: PackSet | None = None
        self._resolving: set[str] = set()
        try:
            self._check_layout()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._packs is not None:
            self._packs.close()
            self._packs = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_layout(self) -> None:
        """The plain layout libgit2 opens as gitrun made it: a HEAD, no linked-worktree
        ``commondir``, no reftable, no extensions or includes in the config."""
        head = self._read(["HEAD"])
        if head is None or not (
            _OID.fullmatch(head.rstrip(b"\n")) or re.fullmatch(rb"ref: refs/[^\s]+\n", head)
        ):
            raise Unsupported("HEAD is not a plain ref or id")
        if self._read(["commondir"]) is not None or self._exists("reftable"):
            raise Unsupported("a linked worktree or a reftable repository")
        config = (self._read(["config"]) or b"").lower()
        if b"extensions" in config or b"include" in config:
            raise Unsupported("the config names extensions or includes")
        version = re.search(rb"repositoryformatversion\s*=\s*(\S*)", config)
        if version is not None and version.group(1) not in (b"0", b"1"):
            raise Unsupported("a repository format libgit2 may not open")
        if os.fstat(self._fd).st_uid != os.geteuid():
            raise Unsupported("the git dir is owned by another user")

    # -- files ---------------------------------------------------------------------------

    def _open(self, parts: list[str], flags: int) -> int | None:
        """A descriptor of ``parts`` under the git dir, each component opened without
        following symlinks; None when a component does not exist."""
        fd = self._fd
        try:
            for i, part in enumerate(parts):
                nxt = os.open(part, flags if i == len(parts) - 1 else _DIR, dir_fd=fd)
                if fd != self._fd:
                    os.close(fd)
                fd = nxt
        except FileNotFoundError:
            if fd != self._fd:
                os.close(fd)
            return None
        except OSError as exc:  # a symlink (ELOOP), a file where a directory is, ...
            if fd != self._fd:
                os.close(fd)
            raise Unsupported(f"{'/'.join(parts)}: {exc.strerror}") from exc
        return fd

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _read(self, parts: list[str], limit: int = _MAX_FILE) -> bytes | None:
        fd = self._open(parts, _FILE)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                raise Unsupported(f"{'/'.join(parts)} is not a regular file of sane size")
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    # -- refs ----------------------------------------------------------------------------

    def read_ref(self, name: str) -> str | None:
        """The object id the direct ref ``name`` holds, None when it does not exist."""
        if not _valid_ref(name):
            raise Unsupported(f"ref name {name!r}")
        raw = self._read(name.split("/"))
        if raw is None:
            return self.packed().get(name)
        if not _OID.fullmatch(raw.removesuffix(b"\n")) or not raw.endswith(b"\n"):
            raise Unsupported(f"{name} is symbolic or malformed")
        return raw[:40].decode()

    def packed(self) -> dict[str, str]:
        """``packed-refs`` as name -> id (peeled lines skipped); Unsupported if odd."""
        if self._packed_refs is None:
            self._packed_refs = _parse_packed(self._read(["packed-refs"]) or b"")
        return self._packed_refs

    def refs_under(self, prefix: str) -> list[str]:
        """Every ref whose name starts with ``prefix`` (which ends in ``/``), sorted."""
        if not prefix.endswith("/") or not _valid_ref(prefix.rstrip("/")):
            raise Unsupported(f"ref prefix {prefix!r}")
        found = {n for n in self.packed() if n.startswith(prefix)}
        fd = self._open(prefix.rstrip("/").split("/"), _DIR)
        if fd is not None:
            self._walk(fd, prefix, found)
        return sorted(found)

    def _walk(self, fd: int, prefix: str, found: set[str]) -> None:
        """Loose refs under the directory ``fd`` (closed here); Unsupported on a symlink,
        a name libgit2 might skip or refuse, or a lock file (a writer at work)."""
        todo = [(fd, prefix)]
        try:
            while todo:
                dfd, where = todo.pop()
                try:
                    with os.scandir(dfd) as entries:
                        self._level(dfd, where, entries, todo, found)
                finally:
                    os.close(dfd)
        finally:
            for dfd, _ in todo:
                os.close(dfd)

    @staticmethod
    def _level(
        dfd: int,
        where: str,
        entries: Iterator[os.DirEntry[str]],
        todo: list[tuple[int, str]],
        found: set[str],
    ) -> None:
        for entry in entries:
            if not _valid_part(entry.name) or entry.is_symlink():
                raise Unsupported(f"{where}{entry.name}: not a plain ref")
            if entry.is_dir(follow_symlinks=False):
                todo.append((os.open(entry.name, _DIR, dir_fd=dfd), f"{where}{entry.name}/"))
            elif entry.is_file(follow_symlinks=False):
                found.add(where + entry.name)
            else:
                raise Unsupported(f"{where}{entry.name}: not a file")

    # -- objects -------------------------------------------------------------------------

    def object(self, oid: str) -> tuple[bytes, bytes]:
        """(type, body) of the loose object ``oid``, its content hashed to its id."""
        if not _OID_TEXT.fullmatch(oid):
            raise Unsupported(f"object id {oid!r}")
        raw = self._read(["objects", oid[:2], oid[2:]], _MAX_OBJECT)
        if raw is None:
            kind, body = self._packed(oid)
            data = kind + b" " + str(len(body)).encode() + b"\0" + body
        else:
            data = _inflate_loose(oid, raw)
            header, _, body = data.partition(b"\0")
            kind = header.partition(b" ")[0]
        if hashlib.sha1(data).hexdigest() != oid:  # noqa: S324 - git's object ids
            raise Unsupported(f"object {oid} does not hash to its id")
        return kind, body

    def _packed(self, oid: str) -> tuple[bytes, bytes]:
        """``oid`` from the packs (not hashed yet); Unsupported when no pack has it."""
        if self._packs is None:
            fd = self._open(["objects", "pack"], _DIR)
            if fd is None:
                raise Unsupported(f"object {oid} is neither loose nor packed")
            try:
                self._packs = PackSet(fd)
            finally:
                os.close(fd)
        if oid in self._resolving:
            raise Unsupported(f"object {oid} is its own delta base")
        self._resolving.add(oid)
        try:
            found = self._packs.read(oid, self.object)
        finally:
            self._resolving.discard(oid)
        if found is None:
            raise Unsupported(f"object {oid} is neither loose nor packed")
        return found

    def blob(self, oid: str) -> bytes:
        kind, body = self.object(oid)
        if kind != b"blob":
            raise Unsupported(f"{oid} is not a blob")
        return body

    def commit(self, oid: str) -> Commit:
        kind, body = self.object(oid)
        if kind != b"commit":
            raise Unsupported(f"{oid} is not a commit")
        return _parse_commit(oid, body)

    def tree(self, oid: str) -> list[TreeEntry]:
        kind, body = self.object(oid)
        if kind != b"tree":
            raise Unsupported(f"{oid} is not a tree")
        return _parse_tree(oid, body)


def _inflate_loose(oid: str, raw: bytes) -> bytes:
    """A loose object's inflated bytes (header and body), its header checked."""
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(raw, _MAX_OBJECT)
    except zlib.error as exc:
        raise Unsupported(f"object {oid} does not inflate") from exc
    if not inflate.eof or inflate.unused_data or inflate.unconsumed_tail:
        raise Unsupported(f"object {oid} is truncated, oversized or has trailing bytes")
    header, nul, body = data.partition(b"\0")
    size = header.partition(b" ")[2]
    if not nul or not re.fullmatch(rb"0|[1-9][0-9]*", size) or int(size) != len(body):
        raise Unsupported(f"object {oid} has a malformed header")
    return data


def _find_gitdir(path: Path) -> Path:
    """The git dir libgit2 opens for ``path``: ``path/.git`` if it is a directory, else
    ``path`` itself if it is one (a bare or ``.git`` path); anything else is Unsupported."""
    dotgit = path / ".git"
    try:
        st = os.lstat(dotgit)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise Unsupported(f"{dotgit}: {exc.strerror}") from exc
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise Unsupported(f"{dotgit} is not a directory")
        if os.stat(path).st_uid != os.geteuid():
            raise Unsupported(f"{path} is owned by another user")
        return dotgit
    if not (path / "objects").is_dir() or not (path / "refs").is_dir():
        raise Unsupported(f"{path} is not a plain git dir")
    return path


def _parse_packed(raw: bytes) -> dict[str, str]:
    refs: dict[str, str] = {}
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        raise Unsupported("packed-refs does not end in a newline")
    if lines and lines[0].startswith(b"# pack-refs with:"):
        lines = lines[1:]
    for line in lines:
        if line.startswith(b"^") and _OID.fullmatch(line[1:]):
            continue
        oid, sp, name = line.partition(b" ")
        text = name.decode("ascii", "replace")
        if not sp or not _OID.fullmatch(oid) or not _valid_ref(text) or text in refs:
            raise Unsupported("packed-refs has a line this reader does not know")
        refs[text] = oid.decode()
    return refs


def _parse_commit(oid: str, body: bytes) -> Commit:
    """A commit in the plain form git and libgit2 write: tree, parents, author,
    committer, optional headers other than ``encoding``, a blank line, the message."""
    header, sep, message = body.partition(b"\n\n")
    lines = header.split(b"\n")
    if not sep or len(lines) < 3 or not lines[0].startswith(b"tree "):
        raise Unsupported(f"commit {oid} is not in the plain form")
    tree = lines[0][5:]
    i = 1
    parents = []
    while i < len(lines) and lines[i].startswith(b"parent "):
        parents.append(lines[i][7:])
        i += 1
    if i + 1 >= len(lines) or not _AUTHOR.fullmatch(lines[i]):
        raise Unsupported(f"commit {oid} has no plain author")
    committer = _COMMITTER.fullmatch(lines[i + 1])
    extra = lines[i + 2 :]
    if committer is None or any(x.startswith(b"encoding ") for x in extra):
        raise Unsupported(f"commit {oid} has no plain committer, or an encoding")
    if not all(_OID.fullmatch(x) for x in (tree, *parents)) or b"\0" in message:
        raise Unsupported(f"commit {oid} has a malformed id or a NUL in its message")
    return Commit(
        oid,
        tree.decode(),
        tuple(p.decode() for p in parents),
        int(committer.group(1)),
        message.lstrip(b"\n"),
    )


def _parse_tree(oid: str, body: bytes) -> list[TreeEntry]:
    """Entries of canonical modes and plain UTF-8 names, each name once."""
    out: list[TreeEntry] = []
    names: set[str] = set()
    i = 0
    while i < len(body):
        sp = body.find(b" ", i)
        nul = body.find(b"\0", sp + 1) if sp >= 0 else -1
        if nul < 0 or nul + 21 > len(body) or body[i:sp] not in _MODES:
            raise Unsupported(f"tree {oid} has an entry this reader does not know")
        try:
            name = body[sp + 1 : nul].decode()
        except UnicodeDecodeError:
            raise Unsupported(f"tree {oid} has a name that is not UTF-8") from None
        if name in ("", ".", "..") or "/" in name or name in names:
            raise Unsupported(f"tree {oid} has an odd or repeated name")
        names.add(name)
        out.append(TreeEntry(name, body[nul + 1 : nul + 21].hex(), _MODES[body[i:sp]]))
        i = nul + 21
    return out
