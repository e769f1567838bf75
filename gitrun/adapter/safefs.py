"""Worktree file access that never follows a symlink in any path component.

The agent can plant a symlink anywhere in its worktree, at any moment, hidden from
``git status`` through ``info/exclude``. So every path is walked one component at a
time from a directory file descriptor, each directory opened with ``O_NOFOLLOW``, and
the last component is created, renamed over or unlinked relative to its parent's
descriptor: a link planted between gitrun's check and its write is refused, never
followed. A symlink (or a file) where a directory should be is environment drift.

Temp files get a name no user file plausibly has (``.NAME.gitrun-tmp-<16 hex>``), next
to their target, so a crash between the temp write and the rename leaves a leftover the
next owner can recognise and remove (:func:`leftovers`).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gitrun.adapter import filespare
from gitrun.core import faults
from gitrun.core.errors import EnvironmentDrift

BLOB, EXEC, TREE, LINK = 0o100644, 0o100755, 0o040000, 0o120000
OTHER = 0  # a fifo, socket or device where a file should be
State = tuple[int, bytes]  # (git file mode, content or link target); directories: (TREE, b"")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.gitrun-tmp-[0-9a-f]{16}$")


def realpath(path: str | os.PathLike[str]) -> str:
    """``os.path.realpath(path)``, asked of the kernel when the path exists: an ``O_PATH``
    descriptor's name in ``/proc/self/fd`` (three system calls instead of a Python walk
    with an ``lstat`` per component, ~6x cheaper; the gate and the instance check ask
    four times a step). Anything else (absent, a loop, no ``/proc``) takes realpath."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return os.path.realpath(path)
    try:
        found = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)
    finally:
        os.close(fd)
    if not found.startswith("/") or found.endswith(" (deleted)"):
        return os.path.realpath(path)
    return found


def temp_name(name: str) -> str:
    """A fresh temp file name for ``name`` in the same directory."""
    return f".{name}.gitrun-tmp-{secrets.token_hex(8)}"


def is_temp_of(candidate: str, name: str) -> bool:
    """Whether ``candidate`` is a gitrun temp file name made for ``name``."""
    match = _TEMP_RE.match(candidate)
    return match is not None and match.group("name") == name


def _in_the_way(dfd: int, name: str, path: str, prefix: str) -> EnvironmentDrift:
    try:
        mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        mode = 0
    if stat.S_ISLNK(mode):
        return EnvironmentDrift(
            "symlink-in-path",
            f"{path} goes through {prefix}, a symlink on disk that gitrun never follows; "
            f"remove {prefix} from the worktree and resume",
        )
    return EnvironmentDrift(
        "file-in-path",
        f"{path} needs {prefix} to be a directory, but it is a file on disk; "
        f"remove {prefix} from the worktree and resume",
    )


@contextmanager
def _parents(root: Path, path: str, *, create: bool) -> Iterator[list[int] | None]:
    """Descriptors of ``root`` and every parent directory of ``path``, walked without
    following links; None when a parent is missing (and ``create`` is False)."""
    parts = path.split("/")
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for i, name in enumerate(parts[:-1]):
            prefix = "/".join(parts[: i + 1])
            fd = _open_dir(fds[-1], name, path, prefix, create=create)
            if fd is None:
                yield None
                return
            fds.append(fd)
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def _open_dir(dfd: int, name: str, path: str, prefix: str, *, create: bool) -> int | None:
    for _ in range(3):  # a directory made or removed concurrently: look again
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=dfd)
            except FileExistsError:
                continue
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _in_the_way(dfd, name, path, prefix) from exc
            raise
    raise EnvironmentDrift("path-racing", f"{prefix} keeps changing on disk while gitrun writes")


def inspect(root: Path, path: str) -> State | None:
    """What is at ``path`` on disk, links not followed: None when absent.

    A symlink or a file in place of a parent directory raises :class:`EnvironmentDrift`.
    """
    with _parents(root, path, create=False) as fds:
        if fds is None:
            return None
        return _state(fds[-1], path.rsplit("/", 1)[-1])


def _state(dfd: int, name: str) -> State | None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return LINK, os.fsencode(os.readlink(name, dir_fd=dfd))
    if stat.S_ISDIR(st.st_mode):
        return TREE, b""
    if not stat.S_ISREG(st.st_mode):
        return OTHER, b""
    # O_NONBLOCK: a fifo swapped in after the stat must not hang the reader
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        data = read_all(fd, st.st_size)
    finally:
        os.close(fd)
    return (EXEC if st.st_mode & stat.S_IXUSR else BLOB), data


def read_all(fd: int, size: int) -> bytes:
    """Every byte to end of file (bare reads: no file object, its fstat, ioctl, lseeks)."""
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, max(size + 1, 65536))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def write_file(root: Path, path: str, data: bytes, *, executable: bool, spare: str = "") -> None:
    """Put ``data`` at ``path`` via a temp file renamed over it (never through a link).

    With ``spare`` (a path outside the worktree, on its filesystem: see
    :mod:`gitrun.adapter.filespare`) the file the rename replaces is kept there and is
    the temp file of the path's next write: no inode is allocated and no block freed."""

    def make(dfd: int, tmp: str) -> None:
        fd = filespare.reuse(spare, dfd, tmp) if spare else -1
        reused = fd >= 0
        if not reused:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if reused:
                os.ftruncate(fd, len(data))  # the spare may have held more
            os.fchmod(fd, 0o755 if executable else 0o644)
        finally:
            os.close(fd)

    _replace(root, path, make, spare)


def write_link(root: Path, path: str, target: bytes) -> None:
    """Put a symlink to ``target`` at ``path`` (the caller has checked the target)."""
    _replace(root, path, lambda dfd, tmp: os.symlink(target, tmp, dir_fd=dfd))


def _replace(root: Path, path: str, make: Callable[[int, str], None], spare: str = "") -> None:
    name = path.rsplit("/", 1)[-1]
    with _parents(root, path, create=True) as fds:
        if fds is None:
            raise EnvironmentDrift("path-racing", f"the directories of {path} vanished")
        dfd = fds[-1]
        tmp = temp_name(name)
        make(dfd, tmp)
        faults.point("temp_file_written")
        if spare:
            filespare.keep(dfd, name, spare)
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            os.unlink(tmp, dir_fd=dfd)
            if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise EnvironmentDrift(
                    "path-is-directory", f"{path} is a directory on disk; gitrun writes a file"
                ) from exc
            raise


def remove(root: Path, path: str) -> None:
    """Delete the file or link at ``path`` (absent is fine), then its emptied parents."""
    name = path.rsplit("/", 1)[-1]
    with _parents(root, path, create=False) as fds:
        if fds is None:
            return
        try:
            os.unlink(name, dir_fd=fds[-1])
        except FileNotFoundError:
            pass
        except IsADirectoryError as exc:
            raise EnvironmentDrift(
                "path-is-directory", f"{path} is a directory on disk; gitrun deletes files"
            ) from exc
        parts = path.split("/")[:-1]
        for i in range(len(parts), 0, -1):  # prune directories the delete emptied
            try:
                os.rmdir(parts[i - 1], dir_fd=fds[i - 1])
            except OSError:
                break


def leftovers(root: Path, paths: Iterable[str]) -> list[str]:
    """gitrun temp files next to ``paths`` (regular files with a temp name for one of
    them), repo-relative and sorted. Directories with a link in the way are skipped."""
    found: set[str] = set()
    by_dir: dict[str, set[str]] = {}
    for path in paths:
        parent, _, name = path.rpartition("/")
        by_dir.setdefault(parent, set()).add(name)
    for parent, names in by_dir.items():
        probe = f"{parent}/x" if parent else "x"
        try:
            with _parents(root, probe, create=False) as fds:
                if fds is None:
                    continue
                for entry in os.listdir(fds[-1]):
                    if any(is_temp_of(entry, n) for n in names):
                        st = os.stat(entry, dir_fd=fds[-1], follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                            found.add(f"{parent}/{entry}" if parent else entry)
        except EnvironmentDrift:
            continue
    return sorted(found)
