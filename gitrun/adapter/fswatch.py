"""Whether anything may have changed under a worktree since the last look: Linux inotify,
one watch per directory, held by a long-lived process (the Claude Code hook helper).

A scan of a 10,000-file worktree stats every file (tens of milliseconds in Python); a
tool call that changed nothing should not pay it. :class:`DirWatch` answers "was there
any event under the worktree since you last asked?" by draining its inotify queue; the
scan cache (:mod:`gitrun.adapter.scancache`) skips the walk only when the answer is no
AND the last walk (or commit) left the worktree equal to the tree now compared with.

What inotify does not see, so what this can miss (and a full scan would not): writes
through ``mmap``, writes through a second hard link to a worktree file made from outside
the worktree, changes on network or FUSE file systems made by another machine. The
helper that holds a watch therefore also walks in full now and then
(:data:`FULL_SCAN_EVERY` calls). Any doubt — a queue overflow, a watch that could not be
added (the ``max_user_watches`` limit), a directory created, moved or removed — counts as
a change: the next scan walks in full and watches are set up again first.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import sys
from contextlib import suppress
from pathlib import Path

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
        | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW)  # fmt: skip
RESHAPE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_Q_OVERFLOW  # watches to set again
_EVENT = struct.Struct("iIII")
FULL_SCAN_EVERY = 20  # calls between walks that do not trust the watch (what it cannot see)


class DirWatch:
    """An inotify watch on every directory under a worktree but its top-level ``.git``."""

    def __init__(self, root: Path, fd: int, libc: ctypes.CDLL) -> None:
        self.root = root
        self.fd = fd
        self._libc = libc
        self._broken = False
        self._reshape = True  # set the watches up at the first look
        self._asked = 0
        self._paths: dict[int, str] = {}  # watch descriptor -> directory (relative)

    @classmethod
    def start(cls, root: Path) -> DirWatch | None:
        """A watch on ``root``, or None where inotify is not available."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = int(libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        watch = cls(root, fd, libc)
        watch.changes()  # watches set up now: what happens from here on is seen
        return watch

    def close(self) -> None:
        if self.fd >= 0:
            with suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def _add(self, path: str) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), MASK)
        if wd >= 0:
            rel = os.path.relpath(path, self.root)
            self._paths[wd] = "" if rel == "." else rel.replace(os.sep, "/")
        elif ctypes.get_errno() not in (errno.ENOENT, errno.ENOTDIR):
            self._broken = True  # ENOSPC (max_user_watches), EACCES ...: never trusted

    def _watch_all(self) -> None:
        """A watch on every directory (set again: inotify returns the same watch for a
        directory it already has)."""
        self._broken = False
        self._paths = {}
        todo = [str(self.root)]
        while todo:
            here = todo.pop()
            self._add(here)
            try:
                entries = list(os.scandir(here))
            except OSError:
                continue  # gone since: its parent's event said so
            for entry in entries:
                if here == str(self.root) and entry.name == ".git":
                    continue
                with suppress(OSError):
                    if stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
                        todo.append(entry.path)

    def changes(self) -> frozenset[str] | None:
        """The directories (relative, ``""`` the root) in which a file may have changed
        since the last call — empty: nothing happened — or None when that is not known:
        a directory came, went or moved, the queue overflowed, a watch is missing, or
        it is time for a walk that does not trust the watch (module docstring). The
        queue is drained; watches are set up again when directories came or went."""
        if self.fd < 0:
            return None
        dirs: set[str] = set()
        unknown = reshape = self._reshape
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                self.close()
                return None
            if not data:
                break
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                where = self._paths.get(wd)
                if mask & (RESHAPE | IN_ISDIR) or where is None:
                    unknown = True
                    reshape = reshape or bool(mask & (RESHAPE | IN_CREATE | IN_MOVED_TO))
                else:
                    dirs.add(where)
        if reshape:
            self._watch_all()
            self._reshape = self._broken  # a watch missing: try again at the next look
        self._asked += 1
        if self._asked % FULL_SCAN_EVERY == 0:
            unknown = True  # now and then a full walk: what inotify cannot see (module doc)
        return None if unknown or self._broken else frozenset(dirs)
