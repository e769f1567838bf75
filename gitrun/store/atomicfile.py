"""The one atomic write path for every durable file gitrun keeps outside git's objects.

A write goes to a fresh temp file beside the target (``.NAME.tmp-<random>``, created
``O_EXCL | O_NOFOLLOW`` relative to the directory's descriptor, at its final mode), is
fsynced, then renamed over the target (replace) or hard-linked to it (``exclusive``:
``link`` refuses an existing name where ``rename`` would replace it), and the directory
is fsynced. Any exception removes the temp file and leaves the target as it was. A
writer killed mid-write leaves at most its temp file, which it held ``flock``ed while
alive: the next write of the same target removes it. dulwich's ``file.py``
(``_GitFile``) is the model.

Not for the agent's worktree (:mod:`gitrun.adapter.safefs` writes those, synced from git) nor
for the witness's in-place slot updates (:mod:`gitrun.store.witness`), which are deliberately
a ``pwrite`` + ``fdatasync`` with no rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

TEMP_INFIX = ".tmp-"
# A temp file younger than this is never judged stale, even unlocked: its writer may sit
# between creating it and locking it.
STALE_SECONDS = 60.0
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_TEMP_TRIES = 8


def read_bytes(path: Path | str) -> bytes:
    """The whole file, as ``Path.read_bytes`` gives it, in an open, the reads and a close
    (``open()`` adds a stat, a tty check and two seeks: this sits on every step)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def temp_prefix(name: str) -> str:
    """The prefix of every temp file of the target ``name`` (hidden: a leading dot)."""
    return f".{name}{TEMP_INFIX}"


class AtomicFile:
    """The temp file being written; it becomes the target when the block ends cleanly."""

    def __init__(self, fd: int, directory: Path, temp_name: str) -> None:
        self._fd = fd
        self.temp_path = directory / temp_name

    def fileno(self) -> int:
        """The temp file's descriptor (to size or place bytes in it before it is published)."""
        return self._fd

    def write(self, data: bytes) -> None:
        """Write all of ``data`` (``os.write`` may write less than asked)."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]


@contextlib.contextmanager
def atomic_file(
    path: Path,
    *,
    mode: int = 0o644,
    exclusive: bool = False,
    parent_mode: int | None = None,
    writers_locked: bool = False,
) -> Iterator[AtomicFile]:
    """Write ``path`` whole or not at all; see the module docstring.

    ``mode`` is the file's mode from its creation (the umask can only narrow it), so a
    0600 secret is never briefly wider. ``exclusive`` creates a new file only: a target
    that exists (a symlink too) raises :class:`FileExistsError` and is left untouched.
    ``parent_mode`` creates missing parent directories with that mode.
    ``writers_locked``: the caller holds a lock every writer of ``path`` takes, so an
    unlocked temp file is a dead writer's however young, and removed at once.
    """
    directory = path.parent
    if parent_mode is not None and not directory.is_dir():
        _make_dirs(directory, parent_mode)
    dfd = os.open(directory, _DIR_FLAGS)
    try:
        _remove_stale(dfd, path.name, 0.0 if writers_locked else STALE_SECONDS)
        fd, temp = _create_temp(dfd, path.name, mode)
        published = False
        try:
            # Held until the file is published: a live writer's temp is never "stale".
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield AtomicFile(fd, directory, temp)
            os.fsync(fd)
            _publish(dfd, temp, path.name, exclusive)
            published = True
        finally:
            os.close(fd)
            if not published:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp, dir_fd=dfd)
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write(
    path: Path,
    data: bytes,
    *,
    mode: int = 0o644,
    exclusive: bool = False,
    parent_mode: int | None = None,
) -> None:
    """Write ``data`` to ``path`` atomically and durably (:func:`atomic_file`)."""
    with atomic_file(path, mode=mode, exclusive=exclusive, parent_mode=parent_mode) as fh:
        fh.write(data)


def replace_in(dfd: int, name: str, data: bytes, *, mode: int = 0o644, sync: bool = True) -> None:
    """Write ``data`` whole as ``name`` in the directory ``dfd`` (one the caller walked to
    without following a link): a fresh ``O_EXCL | O_NOFOLLOW`` temp file beside it,
    written, renamed over it; fsynced with the directory unless ``sync`` is False (the
    caller makes the whole filesystem durable itself: a recovery ends with a ``syncfs``).
    On any error the temp file is removed and the target left as it was."""
    fd, temp = _create_temp(dfd, name, mode)
    renamed = False
    try:
        try:
            AtomicFile(fd, Path("."), temp).write(data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        renamed = True
    finally:
        if not renamed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=dfd)
    if sync:
        os.fsync(dfd)


def replace_unsynced(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` whole as ``path`` for what need not survive a power cut (a cache, a
    note a crash may lose): as :func:`replace_in`, never through a planted link, no fsync."""
    dfd = os.open(path.parent, _DIR_FLAGS)
    try:
        replace_in(dfd, path.name, data, mode=mode, sync=False)
    finally:
        os.close(dfd)


@contextlib.contextmanager
def atomic_dir(path: Path, *, mode: int = 0o755) -> Iterator[Path]:
    """Build a directory aside (``.NAME.tmp-<random>``) and rename it in whole, durably.

    Any exception removes the scratch directory and leaves ``path`` as it was. The
    caller holds a lock that orders every builder of ``path``: a killed builder's
    scratch directory is then provably stale, and removed first.
    """
    import shutil

    for stale in path.parent.glob(f"{temp_prefix(path.name)}*"):
        shutil.rmtree(stale, ignore_errors=True)
    scratch = path.parent / f"{temp_prefix(path.name)}{_temp_token()}"
    scratch.mkdir(mode=mode)
    try:
        yield scratch
        os.rename(scratch, path)  # over an empty directory at most, never a full one
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    fsync_dir(path.parent)


def _temp_token() -> str:
    """The random part of a temp name (os.urandom, as secrets.token_hex reads it: the
    secrets module is not loaded for `gitrun status`, issue #15)."""
    return os.urandom(8).hex()


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or create inside it survives a crash."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(directory: Path, mode: int) -> None:
    """Create ``directory`` (and missing parents) with ``mode``, each entry durable."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True, mode=mode)
    for made in reversed(missing):
        fsync_dir(made.parent)


def _create_temp(dfd: int, name: str, mode: int) -> tuple[int, str]:
    """A new temp file beside ``name`` (never an existing one, never through a link)."""
    for _ in range(_TEMP_TRIES):
        temp = f"{temp_prefix(name)}{_temp_token()}"
        try:
            return os.open(temp, _TEMP_FLAGS, mode, dir_fd=dfd), temp
        except FileExistsError:
            continue  # something sits at that name (planted?): never open it, pick another
    raise FileExistsError(f"no free temp file name beside {name} after {_TEMP_TRIES} tries")


def _publish(dfd: int, temp: str, name: str, exclusive: bool) -> None:
    """Move the complete temp file to ``name``: replace it, or create it only if absent."""
    if not exclusive:
        os.rename(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return
    try:
        os.link(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileExistsError as exc:
        raise FileExistsError(exc.errno, f"{name} already exists; it was not replaced") from None
    os.unlink(temp, dir_fd=dfd)


def _remove_stale(dfd: int, name: str, min_age: float) -> None:
    """Remove temp files of ``name`` whose writer died (unlocked, older than ``min_age``)."""
    prefix = temp_prefix(name)
    for entry in os.listdir(dfd):
        if entry.startswith(prefix) and _is_stale(dfd, entry, min_age):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=dfd)


def _is_stale(dfd: int, entry: str, min_age: float) -> bool:
    try:
        st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return True  # a link or other thing at a temp name is no writer's: remove it
        if time.time() - st.st_mtime < min_age:
            return False
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its writer is alive and still writing
    finally:
        os.close(fd)
    return True
