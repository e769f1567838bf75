"""What a whole-worktree scan may skip: files whose stat is unchanged since gitrun hashed
them, and the tree it compares with when that tree was read before.

A tool step (one per Claude Code tool call) scans the whole worktree twice per call;
reading and hashing every file of a 10,000-file repository each time costs seconds. Like
git's index, this cache keeps per path the stat key (mode, size, mtime, ctime, inode) of
the file as it was hashed and the blob id; a file whose key is unchanged is taken as that
blob without being read. As in git's "racily clean" rule, an entry whose mtime or ctime is
not strictly older than the cache file itself is never trusted (a write in the same clock
tick could leave the key unchanged). ctime cannot be set by a user, so a file rewritten
with its old size and mtime restored still shows up.

The cache is kept in the worktree's private git dir, is not durable (a lost or garbled
file only means a full scan), and holds nothing a step trusts beyond "this file was not
touched since": a process that can rewrite it can rewrite the worktree and refs too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Protocol

import pygit2

from gitrun.store.atomicfile import replace_unsynced

Entry = tuple[int, pygit2.Oid | None]
TreeEntry = tuple[int, pygit2.Oid]  # a blob or link of a tree: always a blob id
_VERSION = "gitrun-scan-cache/1"


def _key(st: os.stat_result) -> str:
    return f"{st.st_mode} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


class Watch(Protocol):
    """What knows where the worktree may have changed (:mod:`gitrun.adapter.fswatch`)."""

    def changes(self) -> frozenset[str] | None:
        """The directories that may have changed since the last call; None: unknown."""
        ...


class ScanCache:
    """Stat keys of hashed files and the entries of one tree (see the module docstring).

    On disk: a version line, the tree line, then one line per file (``F``) and per tree
    entry (``T``), fields split by NUL (no path holds one): plain text, read and written
    in a few milliseconds for 10,000 files."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._known: dict[str, tuple[str, str, str]] = {}  # path -> (stat key, mode, oid)
        self._seen: dict[str, tuple[str, str, str]] = {}
        self._trusted_before = 0
        self._tree = ""
        self._entries: dict[str, TreeEntry] = {}
        self.watch: Watch | None = None  # a resident process's: see since()
        self._base = ""  # the tree the worktree was found equal to (with a watch) ...
        self._dirty: set[str] = set()  # ... but in files of these directories, maybe
        self._memo: tuple[tuple[str, bool, bool], dict[str, Entry | None]] | None = None

    @classmethod
    def load(cls, path: Path) -> ScanCache:
        cache = cls(path)
        with suppress(OSError, ValueError, IndexError):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > 256 << 20:
                    return cache
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
            finally:
                os.close(fd)
            lines = b"".join(chunks).decode("utf-8", "surrogateescape").split("\n")
            if lines[0] != _VERSION or lines[-1] != "":
                return cache  # torn or foreign: a full scan
            known: dict[str, tuple[str, str, str]] = {}
            entries: dict[str, TreeEntry] = {}
            for line in lines[2:-1]:
                kind, name, mode, rest = line.split("\0", 3)
                if kind == "F":
                    key, oid = rest.rsplit("\0", 1)
                    known[name] = (key, mode, oid)
                elif kind == "T":
                    entries[name] = (int(mode), pygit2.Oid(hex=rest))
            cache._known, cache._entries, cache._tree = known, entries, lines[1]
            cache._trusted_before = st.st_mtime_ns
        return cache

    def since(self, tree: str) -> frozenset[str] | None:
        """The directories in which the worktree may differ from ``tree`` (empty: it is
        exactly ``tree``), when a walk (or the commit of what a walk found) left it equal
        to ``tree`` and the watch has seen only file events since; else None (walk all).
        Without a watch, always None."""
        if self.watch is None:
            return None
        dirs = self.watch.changes()
        if dirs is None or dirs:
            self._memo = None  # something happened since the last scan's answer
        if dirs is None:
            self._base = ""
            return None
        self._dirty |= dirs
        return frozenset(self._dirty) if self._base == tree else None

    def answered(
        self, key: tuple[str, bool, bool], dirs: frozenset[str] | None
    ) -> dict[str, Entry | None] | None:
        """The answer of a scan with ``key`` (tree, write, fix_modes) known without a walk:
        nothing (``dirs``, from :meth:`since`, empty), or what the last scan with that key
        found when the watch has seen nothing since (a step scans twice: to know whether
        the call changed anything, then to commit it). None: walk."""
        if dirs is not None and not dirs:
            return {}
        if self.watch is not None and self._memo is not None and self._memo[0] == key:
            return dict(self._memo[1])
        return None

    def found(self, key: tuple[str, bool, bool], changes: dict[str, Entry | None]) -> None:
        """What a walk for ``key`` found: nothing (the worktree is that tree), or the
        answer to give again while the watch sees nothing."""
        if not changes:
            self.clean_at(key[0])
        elif self.watch is not None:
            self._memo = (key, dict(changes))

    def clean_at(self, tree: str) -> None:
        """The walk that just ran found the worktree equal to ``tree``."""
        if self.watch is not None:
            self._base, self._dirty = tree, set()

    def lookup(self, path: str, st: os.stat_result) -> Entry | None:
        """The entry of the regular file ``path`` if its stat is unchanged since hashed."""
        found = self._known.get(path)
        if found is None or found[0] != _key(st):
            return None
        if st.st_mtime_ns >= self._trusted_before or st.st_ctime_ns >= self._trusted_before:
            return None  # racily clean: hashed in the tick it may still have been written
        self._seen[path] = found
        return (int(found[1]), pygit2.Oid(hex=found[2]))

    def remember(self, path: str, st: os.stat_result, entry: Entry) -> None:
        if entry[1] is not None:
            self._seen[path] = (_key(st), str(entry[0]), str(entry[1]))

    def entries_of(
        self, tree: pygit2.Tree, compute: Callable[[pygit2.Tree], dict[str, TreeEntry]]
    ) -> dict[str, TreeEntry]:
        """``tree``'s entries: the ones held when they are that tree's, else computed."""
        if str(tree.id) == self._tree and self._entries:
            return self._entries
        self._entries = dict(compute(tree))
        self._tree = str(tree.id)
        return self._entries

    def advance(self, old: pygit2.Tree, new: pygit2.Oid, changes: dict[str, Entry | None]) -> None:
        """The entries of ``new``: ``old``'s (when they are the ones held) with ``changes``;
        the worktree, as walked, is ``new`` now."""
        self.clean_at(str(new))
        if str(old.id) != self._tree:
            return
        for path, found in changes.items():
            if found is None or found[1] is None:
                self._entries.pop(path, None)
            else:
                self._entries[path] = (found[0], found[1])
        self._tree = str(new)

    def settle(self) -> None:
        """A long-lived process, after a call: what it saw becomes what it knows, trusted
        from now on (the racily-clean rule against the time of this call, as a save and
        load would); the file is not written (:meth:`save` does, now and then)."""
        if not self._seen:
            return  # no walk: what is known holds
        self._known.update(self._seen)  # a walk of a few directories saw only their files
        self._seen = {}
        stamp = self.path.with_name(self.path.name + ".stamp") if self.path else None
        if stamp is None:
            return
        with suppress(OSError):
            replace_unsynced(stamp, b"")
            self._trusted_before = os.stat(stamp).st_mtime_ns

    def save(self) -> None:
        """Write what this process saw (not durable: a cache)."""
        if self.path is None:
            return
        if not self._seen:
            self._seen = dict(self._known)  # settled already: what is known is current
        parts = [_VERSION, "\n", self._tree, "\n"]
        for name, (key, mode, oid) in self._seen.items():
            parts += ["F\0", name, "\0", mode, "\0", key, "\0", oid, "\n"]
        for name, (emode, eoid) in self._entries.items():
            parts += ["T\0", name, "\0", str(emode), "\0", str(eoid), "\n"]
        data = "".join(parts).encode("utf-8", "surrogateescape")
        with suppress(OSError):
            replace_unsynced(self.path, data)
