"""Spare worktree files: the file a write's rename replaced, kept to be the temp file of
that path's next write.

Renaming a temp file over a worktree file frees the replaced file's inode and blocks; on
a filesystem mounted with ``discard`` (most cloud disks) freeing a block is a synchronous
discard that costs more than the rest of the step's file write. So the replaced file is
first linked to the path's spare (``<worktree git dir>/gitrun-spare/<digest>``, outside
the worktree, where no ``git status`` sees it), and the path's next write takes the spare
as its temp file and overwrites it in place: one inode per path goes back and forth, and
no block is freed unless the file shrinks.

The agent can reach that directory, so a spare is trusted for nothing: it is linked to
the temp name first (as exclusive as ``O_EXCL``), opened without following a link or
waiting (a FIFO or a leased file a racing process swapped in is refused at once), and
written only when it is a regular file with that one link that no process has open (an
agent's reader of the path's old content, or its mmap, keeps what it sees; see
:func:`gitrun.store.oslock.unshared`). Anything else (a link planted there, a hard link
to another file, a crash's leftover still linked as the worktree file) is unlinked from
the temp name and never written: the temp file is then created as usual. A write killed
between the reuse and its rename leaves a temp file, as before: a leftover the next owner
removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat

from gitrun.store.oslock import unshared

SPARE_DIR = "gitrun-spare"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def spare_of(gitdir: str, path: str) -> str:
    """Where the worktree file ``path`` keeps its spare (``gitdir``: the worktree's own)."""
    digest = hashlib.sha256(path.encode()).hexdigest()[:32]
    return f"{gitdir.rstrip('/')}/{SPARE_DIR}/{digest}"


def reuse(spare: str, dfd: int, tmp: str) -> int:
    """The spare as the temp file ``tmp`` (in directory ``dfd``), open for writing; -1
    (nothing left behind) when there is none or it cannot serve."""
    sdir, _, name = spare.rpartition("/")
    try:
        sfd = os.open(sdir, _DIR_FLAGS)  # a link planted as the directory: no spare
    except OSError:
        return -1
    try:
        return _reuse_in(sfd, name, dfd, tmp)
    finally:
        os.close(sfd)


def _reuse_in(sfd: int, name: str, dfd: int, tmp: str) -> int:
    if not unshared(name, sfd):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=sfd)  # held open, or no file of ours: room for the next
        return -1
    try:
        os.link(name, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return -1  # another filesystem, a temp name taken, the spare gone meanwhile
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=sfd)
    try:
        # O_NONBLOCK: a FIFO swapped in after the probe would wait for a reader for ever,
        # a lease taken meanwhile for its break (45 s); both are refused at once instead
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        _discard(dfd, tmp)  # a link, a FIFO, a leased file: never written through
        return -1
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        _discard(dfd, tmp)
        return -1
    return fd


def _discard(dfd: int, tmp: str) -> None:
    """Unlink the temp name a spare was linked to (the racer may have moved it on)."""
    with contextlib.suppress(OSError):
        os.unlink(tmp, dir_fd=dfd)


def keep(dfd: int, name: str, spare: str) -> None:
    """Keep the file at ``name`` (in directory ``dfd``) as its path's spare before a
    rename replaces it (best effort: an absent file has none, a spare already kept
    stays, a worktree on another filesystem than its git dir keeps none). The spare's
    directory is opened without following a link: a link planted in its place never
    gets a worktree file linked into the directory it names."""
    sdir, _, spare_name = spare.rpartition("/")
    try:
        sfd = os.open(sdir, _DIR_FLAGS)
    except FileNotFoundError:
        try:
            os.makedirs(sdir, exist_ok=True)
            sfd = os.open(sdir, _DIR_FLAGS)
        except OSError:
            return
    except OSError:
        return
    try:
        os.link(name, spare_name, src_dir_fd=dfd, dst_dir_fd=sfd, follow_symlinks=False)
    except OSError:
        pass
    finally:
        os.close(sfd)


__all__ = ["SPARE_DIR", "keep", "reuse", "spare_of"]
