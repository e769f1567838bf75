"""The worktree's ``.git`` file: gitrun's own, checked after every exec, never opened.

``git worktree add`` (libgit2's) leaves one file at ``<worktree>/.git`` naming the
worktree's admin dir (``<common dir>/worktrees/gitrun-<run>``). An exec's command can
replace it — with a repository of its own, say, whose ``core.fsmonitor`` the user's next
``git status`` in the worktree would run outside any sandbox. So gitrun records the
file's bytes when it makes the worktree (:func:`record`, in the admin dir, which no
sandbox shows), opens the worktree's repository by its admin dir and never through the
``.git`` entry (:func:`gitrun.adapter.environment.Environment.wt`), and after every exec
requires the entry to be exactly that file again (:func:`problem`), putting it back
(:func:`put_back`) and refusing the step otherwise.

Without its ``.git`` file the worktree looks gone to ``git worktree prune``, which would
delete its admin dir (instance id, record, HEAD) and end the run. So gitrun's worktrees
are locked the way ``git worktree lock`` does it (:func:`lock`): prune keeps a locked
worktree's admin dir whatever its ``.git``, and ``git worktree remove``/``move`` refuse
with the reason. Every gitrun path that removes a worktree on purpose unlocks it first
(:func:`unlock`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path

from gitrun.adapter import safefs, shell
from gitrun.store.atomicfile import atomic_write

RECORD = "gitrun-dotgit"  # in the admin dir: the bytes of the worktree's .git file
LOCKED = "locked"  # git's own lock file in the admin dir; it holds the reason
DOTGIT = ".git"


def admin_dir(common_dir: Path, run_id: str) -> Path:
    """The worktree's admin dir: where gitrun made it (:meth:`Environment.create`)."""
    return common_dir / "worktrees" / f"gitrun-{run_id}"


def lock(admin: Path, run_id: str) -> None:
    """Lock the worktree as ``git worktree lock --reason`` does, unless it is already
    (a worktree made before gitrun locked them is locked when next opened)."""
    if not os.path.lexists(admin / LOCKED):
        reason = f"gitrun run {run_id}; `gitrun rm {run_id}` removes it\n"
        atomic_write(admin / LOCKED, reason.encode())


def unlock(admin: Path) -> None:
    """``git worktree unlock``: before gitrun removes the worktree on purpose (libgit2's
    prune refuses a locked one)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(admin / LOCKED)


def _read_file(path: Path) -> tuple[os.stat_result, bytes | None]:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
        return st, None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return st, os.read(fd, 4097)
    finally:
        os.close(fd)


def record(admin: Path, worktree: Path) -> None:
    """Keep the ``.git`` file git just made for ``worktree`` (called right after)."""
    _, data = _read_file(worktree / DOTGIT)
    if data is None:
        raise OSError(f"{worktree / DOTGIT} is not the file git makes for a worktree")
    atomic_write(admin / RECORD, data)


def expected(admin: Path) -> bytes:
    """The bytes of gitrun's ``.git`` file: as recorded, or (a worktree made before the
    record) the form libgit2 writes, ``gitdir: <admin dir>/``."""
    try:
        return (admin / RECORD).read_bytes()
    except FileNotFoundError:
        return b"gitdir: " + os.fsencode(str(admin)) + b"/\n"


def _names_admin(data: bytes, admin: Path) -> bool:
    found = re.fullmatch(rb"gitdir: (/[^\n]*)\n?", data)
    return found is not None and os.path.realpath(os.fsdecode(found.group(1))) == os.path.realpath(
        admin
    )


def problem(worktree: Path, admin: Path, want: bytes | None = None) -> str | None:
    """What is wrong with the worktree's ``.git`` entry (None: it is exactly gitrun's);
    ``want``: :func:`expected` read before (it never changes for a worktree)."""
    try:
        st, data = _read_file(worktree / DOTGIT)
    except FileNotFoundError:
        return "is missing"
    kinds = {
        stat.S_IFLNK: "is a symbolic link",
        stat.S_IFDIR: "is a directory (a repository of its own)",
        stat.S_IFREG: "is a hard link" if st.st_nlink != 1 else "",
    }
    wrong = kinds.get(stat.S_IFMT(st.st_mode), "is a special file")
    if wrong:
        return wrong
    if data == (want if want is not None else expected(admin)):
        return None
    if data is not None and not (admin / RECORD).exists() and _names_admin(data, admin):
        return None
    return "is not the file gitrun made (other bytes)"


def put_back(worktree: Path, admin: Path) -> bool:
    """Make the worktree's ``.git`` gitrun's file again (whatever stands there removed
    unread, a directory whole); whether anything had to change."""
    if problem(worktree, admin) is None:
        return False
    fd = os.open(worktree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        shell.remove_at(fd, DOTGIT)
    finally:
        os.close(fd)
    safefs.write_file(worktree, DOTGIT, expected(admin), executable=False)
    return True
