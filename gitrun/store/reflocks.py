"""Refs under gitrun's OS locks: reading a ref, the ``flock`` per ref every gitrun writer
holds, and the stale ``<ref>.lock`` files a killed writer leaves (see
:mod:`gitrun.store.gitstore` for the protocol they serve).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pygit2

from gitrun.core.errors import RefLocked, Refused
from gitrun.store import journal
from gitrun.store.oslock import LockBusy, acquire, busy_error, waiting

STALE_LOCK_GRACE_SECONDS = 1.0
LOCK_TIMEOUT_SECONDS = 30.0

_common_dirs: dict[str, Path] = {}  # a repository's git dir -> its common dir (every move asks)


def common_dir(repo: pygit2.Repository) -> Path:
    """The repository's common git dir (shared by all its worktrees)."""
    found = _common_dirs.get(repo.path)
    if found is None:
        gitdir = Path(repo.path)
        commondir_file = gitdir / "commondir"
        if commondir_file.is_file():
            found = (gitdir / commondir_file.read_text().strip()).resolve()
        else:
            found = gitdir.resolve()
        _common_dirs[repo.path] = found
    return found


def read_ref(repo: pygit2.Repository, name: str) -> pygit2.Oid | None:
    """The direct target of ``name``, or None when the ref does not exist."""
    ref = repo.references.get(name)
    if ref is None:
        return None
    target = ref.target
    if not isinstance(target, pygit2.Oid):
        raise Refused(f"ref {name} is symbolic; gitrun expects a direct ref")
    return target


@dataclass(frozen=True)
class Guard:
    """A ref re-read under its OS lock inside the transaction but not changed (fencing)."""

    name: str
    check: Callable[[pygit2.Oid | None], None]


# (common dir, ref) -> its flock path and its ``.lock`` path: a step names ~15 of them and
# building a Path costs more than the flock itself. Bounded: receipt keys are new each step.
_lock_paths: dict[tuple[Path, str], tuple[str, Path, str]] = {}
SPARE_DIR = "gitrun/spare"  # a ref's replaced file, kept to be its next lock
_LOCK_PATHS_KEPT = 256


def _lock_paths_of(cdir: Path, refname: str) -> tuple[str, Path, str]:
    found = _lock_paths.get((cdir, refname))
    if found is None:
        digest = hashlib.sha256(refname.encode()).hexdigest()[:32]
        found = (
            f"{cdir}/gitrun/locks/{digest}.flock",
            Path(f"{cdir}/{refname}.lock"),
            f"{cdir}/{SPARE_DIR}/{digest}",
        )
        if len(_lock_paths) >= _LOCK_PATHS_KEPT:
            _lock_paths.clear()
        _lock_paths[(cdir, refname)] = found
    return found


def lock_path(cdir: Path, refname: str) -> Path:
    return Path(_lock_paths_of(cdir, refname)[0])


def ref_lock_file(cdir: Path, refname: str) -> Path:
    return _lock_paths_of(cdir, refname)[1]


def spare_file(cdir: Path, refname: str) -> str:
    """Where the ref's previous file is kept for its next lock (see :mod:`refmove`)."""
    return _lock_paths_of(cdir, refname)[2]


def _clear_stale_lock(repo: pygit2.Repository, cdir: Path, refname: str) -> None:
    """Remove ``<ref>.lock`` when we hold the ref's OS lock and the file is not fresh.

    Holding the OS lock proves no live gitrun writer holds the ref lock; the grace
    period keeps us off a lock a foreign git command holds for a few milliseconds.
    The ref's real value is journaled first (:meth:`gitrun.store.journal.Journal.pin`): the
    dead writer's record of a move it never made is then never completed by recovery.
    """
    lockfile = ref_lock_file(cdir, refname)
    deadline = time.monotonic() + STALE_LOCK_GRACE_SECONDS + 1.0
    while lockfile.exists():
        try:
            age = time.time() - lockfile.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= STALE_LOCK_GRACE_SECONDS:
            if refname.startswith("refs/"):  # not the index: it is no ref and never journaled
                current = read_ref(repo, refname)
                journal.of(cdir).pin(refname, None if current is None else current.raw)
            lockfile.unlink(missing_ok=True)
            return
        if time.monotonic() > deadline:
            raise RefLocked(refname, f"ref {refname} stays locked by a process that is not gitrun")
        time.sleep(0.05)


@contextmanager
def os_locks(repo: pygit2.Repository, refnames: Sequence[str]) -> Iterator[None]:
    """Hold the OS-level lock of every named ref (sorted, so no deadlock)."""
    cdir = common_dir(repo)
    held: list[int] = []
    try:
        for name in sorted(set(refnames)):
            flock_file, ref_lock, _ = _lock_paths_of(cdir, name)
            held.append(_ref_flock(flock_file, name))
            if os.path.exists(ref_lock):  # a killed writer's, or a foreign git's for a moment
                _clear_stale_lock(repo, cdir, name)
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing the descriptor releases its lock


def _ref_flock(path: str, name: str) -> int:
    try:
        return acquire(path, LOCK_TIMEOUT_SECONDS, waiting(name, LOCK_TIMEOUT_SECONDS))
    except LockBusy as exc:
        raise busy_error(name, exc, LOCK_TIMEOUT_SECONDS) from exc
