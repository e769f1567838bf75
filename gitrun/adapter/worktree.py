"""The run's worktree on disk: files synced from commits, the index kept close behind.

A write step only writes the files its commit changed; rewriting the worktree's index
costs time in proportion to the repository, so it is synced every few writes and when a
run stops (:meth:`WorktreeFiles.sync_index`). :meth:`WorktreeFiles.status` judges the
paths the index lags on directly, so observations are exact either way, and
:meth:`WorktreeFiles.repair_sync` finishes a file sync a crash interrupted.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import pygit2
from pygit2.enums import FileMode, FileStatus

from gitrun.adapter import filespare, safefs
from gitrun.core import faults
from gitrun.core.errors import EnvironmentDrift, StorageFailed
from gitrun.store import gitstore, trees
from gitrun.store.atomicfile import atomic_write
from gitrun.store.lease import Fence

INDEX_BASE_FILE = "gitrun-index-base"  # the commit the worktree's index was last synced to


class WorktreeFiles(ABC):
    """Files and index of one worktree; :class:`gitrun.adapter.environment.Environment` is one."""

    repo: pygit2.Repository
    worktree: Path
    branch: str

    @property
    @abstractmethod
    def wt(self) -> pygit2.Repository:
        """The worktree's own repository handle (its HEAD, index and status)."""

    @abstractmethod
    def head(self) -> pygit2.Commit:
        """The run branch's tip."""

    @abstractmethod
    def receipt_of_trailers_only(self, commit: pygit2.Commit) -> str | None:
        """The idempotency key of a write commit of this run, else None."""

    @abstractmethod
    def fenced(self, fence: Fence) -> AbstractContextManager[None]:
        """Hold the lease ref's OS lock with ``fence`` checked current under it: the new
        owner takes the same lock to write the lease, so no stale worker writes files."""

    def sync_files(
        self,
        old: pygit2.Tree,
        new: pygit2.Tree,
        changes: dict[str, trees.Change],
        fence: Fence,
    ) -> None:
        """Make the worktree files match ``new`` for the changed paths, as the lease holder.

        Nothing follows a symlink (:mod:`gitrun.adapter.safefs`). The worktree's index is not
        rewritten here: that costs O(files in the repo) per step; :meth:`sync_index`
        brings it up to HEAD before anything reads status.
        """
        with self.fenced(fence):
            for n, path in enumerate(sorted(changes)):
                obj = trees.entry(new, path)
                mode = trees.entry_mode(new, path)
                if isinstance(obj, pygit2.Blob) and mode == trees.LINK:
                    safefs.write_link(self.worktree, path, obj.data)
                elif isinstance(obj, pygit2.Blob):
                    spare = filespare.spare_of(self.wt.path, path)
                    exe = mode == trees.EXEC
                    safefs.write_file(self.worktree, path, obj.data, executable=exe, spare=spare)
                else:
                    safefs.remove(self.worktree, path)
                if n == 0:
                    faults.point("mid_file_sync")
        del old

    def leftovers(self, paths: Iterable[str]) -> list[str]:
        """gitrun's own temp files a killed sync left next to ``paths``."""
        return safefs.leftovers(self.worktree, paths)

    def remove_leftovers(self, paths: Iterable[str], fence: Fence) -> list[str]:
        """Delete gitrun's temp files next to ``paths``, as the lease holder."""
        with self.fenced(fence):
            found = self.leftovers(paths)
            for path in found:
                safefs.remove(self.worktree, path)
        return found

    def _index_base(self) -> pygit2.Commit | None:
        base_file = Path(self.wt.path) / INDEX_BASE_FILE
        base = base_file.read_text().strip() if base_file.is_file() else ""
        commit = self.repo.get(base) if base else None
        return commit if isinstance(commit, pygit2.Commit) else None

    def status(self, skip: Collection[str] = ()) -> list[tuple[str, int]]:
        """``git status`` of the worktree against HEAD, sorted, without writing anything.

        For paths the steps changed since the index was last synced, libgit2's answer
        compares against a stale index, so those are judged directly: a path is clean
        exactly when what is on disk (file type, exec bit, bytes or link target) is
        HEAD's, or absent when HEAD has none. ``skip`` names paths not to report.
        """
        head = self.head()
        raw = self.wt.status(untracked_files="all", ignored=False)
        base = self._index_base()
        if base is None or base.id == head.id:
            if base is None and raw:
                self.sync_index()  # no record of the index: rebuild it, then ask again
                raw = self.wt.status(untracked_files="all", ignored=False)
            return sorted((p, int(f)) for p, f in raw.items() if p not in skip)
        lagging = trees.changed_paths(base.tree, head.tree)
        out = []
        for path, flags in raw.items():
            if path in skip:
                continue
            if path not in lagging:
                out.append((path, int(flags)))
            elif not self.matches(head.tree, path):
                out.append((path, int(FileStatus.WT_MODIFIED)))
        return sorted(out)

    def matches(self, tree: pygit2.Tree, path: str) -> bool:
        """Whether the disk holds exactly ``tree``'s entry at ``path`` (links unfollowed)."""
        try:
            return self.same(safefs.inspect(self.worktree, path), trees.entry_state(tree, path))
        except EnvironmentDrift:
            return False  # a link or a file where a directory should be

    def same(self, disk: safefs.State | None, entry: safefs.State | None) -> bool:
        """Disk state equals a tree entry: type, bytes, and the exec bit unless the
        repository says its file modes mean nothing (``core.filemode = false``, as git)."""
        if disk == entry:
            return True
        regular = (trees.BLOB, trees.EXEC)
        if disk is None or entry is None or disk[0] not in regular or entry[0] not in regular:
            return False
        return disk[1] == entry[1] and not self._filemode()

    def _filemode(self) -> bool:
        try:
            return bool(self.wt.config.get_bool("core.filemode"))
        except KeyError:
            return True

    def sync_index(self) -> None:
        """Bring the worktree's index up to HEAD for the paths changed since it was last
        written (recorded in the worktree's git dir). A file whose content on disk is
        HEAD's is staged with its stat data; any other is staged as HEAD's blob, so
        ``git status`` shows the difference instead of hiding it."""
        head = self.head()
        base_file = Path(self.wt.path) / INDEX_BASE_FILE
        base = base_file.read_text().strip() if base_file.is_file() else ""
        if base == str(head.id):
            return
        index = self.wt.index
        index.read(force=False)
        base_commit = self.repo.get(base) if base else None
        paths: set[str] = set()
        if isinstance(base_commit, pygit2.Commit):
            paths = trees.changed_paths(base_commit.tree, head.tree)
        else:
            index.read_tree(head.tree)  # no record of the index: rebuild it from HEAD
        for path in sorted(paths):
            obj = trees.entry(head.tree, path)
            if isinstance(obj, pygit2.Blob):
                mode = trees.entry_mode(head.tree, path) or trees.BLOB
                if self.matches(head.tree, path):
                    self._index_add(index, path, obj.id, mode)
                else:
                    index.add(pygit2.IndexEntry(path, obj.id, FileMode(mode)))
            elif path in index:
                index.remove(path)
        # Written under the index file's OS lock, as a ref is: an index.lock left by a
        # gitrun killed while writing it is then provably stale, and removed first.
        name = (Path(self.wt.path) / "index").resolve().relative_to(gitstore.common_dir(self.repo))
        with gitstore.os_locks(self.repo, [str(name)]):
            index.write()
        # Its bytes durable before the (fsynced) base file says it holds HEAD: no journal
        # record repairs an index written after the journal last rotated.
        _sync_file(Path(self.wt.path) / "index")
        atomic_write(base_file, str(head.id).encode())

    @staticmethod
    def _index_add(index: pygit2.Index, path: str, oid: pygit2.Oid, mode: int) -> None:
        """Stage ``path`` with its stat data (so later status calls need not re-hash it)."""
        index.add(path)
        entry = index[path]
        if entry.id != oid or int(entry.mode) != mode:
            # A filter changed the bytes on the way in: stage the blob itself.
            index.add(pygit2.IndexEntry(path, oid, FileMode(mode)))

    def repair_sync(
        self, fence: Fence | None = None, *, check_only: bool = False, skip: Collection[str] = ()
    ) -> bool:
        """Finish a file sync a crash interrupted (window 3). True when something was fixed.

        Only the paths of the HEAD write commit may differ, and each must hold either its
        old or its new entry (type, mode and bytes); anything else is drift and refused.
        With ``check_only`` it refuses the same way but touches nothing; otherwise it
        writes as the holder of ``fence``.
        """
        head = self.head()
        status = dict(self.status(skip))
        if not status:
            return False
        if self.receipt_of_trailers_only(head) is None or len(head.parents) != 1:
            raise EnvironmentDrift(
                "uncommitted-edits", f"uncommitted changes: {sorted(status)[:5]}"
            )
        parent = head.parents[0]
        changed = trees.changed_paths(parent.tree, head.tree)
        for path in sorted(status):
            allowed = path in changed or any(path.startswith(c + "/") for c in changed)
            on_disk = safefs.inspect(self.worktree, path)  # a link in the way: drift
            ok = (trees.entry_state(parent.tree, path), trees.entry_state(head.tree, path))
            if not allowed or not any(self.same(on_disk, entry) for entry in ok):
                raise EnvironmentDrift(
                    "uncommitted-edits", f"{path} differs from both HEAD and its parent"
                )
        if check_only:
            return True
        if fence is None:
            raise EnvironmentDrift("no-lease", "a file sync needs the run's lease")
        changes: dict[str, trees.Change] = {}
        for path in changed:
            obj = trees.entry(head.tree, path)
            changes[path] = (
                None if obj is None else (obj.id, trees.entry_mode(head.tree, path) or 0)
            )
        self.sync_files(parent.tree, head.tree, changes, fence)
        # The branch moved in an earlier process: its journal record may be gone (rotated).
        gitstore.sync_all(self.repo)
        return True

    # -- after a power cut -----------------------------------------------------------

    def power_loss_paths(self) -> set[str]:
        """The paths whose worktree files a power cut may have taken: those the run's
        branch changed since the value it had before the writes the journal put back
        (:func:`gitrun.store.gitstore.power_cut_branches`). Empty without a recovery."""
        since = gitstore.power_cut_branches(self.repo)
        if self.branch not in since:
            return set()
        before = since[self.branch]
        commit = self.repo.get(before) if before else None
        base = commit.tree if isinstance(commit, pygit2.Commit) else self._empty_tree()
        return trees.changed_paths(base, self.head().tree)

    def _empty_tree(self) -> pygit2.Tree:
        tree = self.repo[self.repo.TreeBuilder().write()]
        if not isinstance(tree, pygit2.Tree):
            raise EnvironmentDrift("not-a-tree", "the empty tree is not a tree")
        return tree

    def repair_power_loss(self, paths: set[str], fence: Fence) -> None:
        """Put gitrun's own writes back on disk after a power cut: each of ``paths`` to
        HEAD's entry, and the index rebuilt from HEAD (its unsynced writes may be torn),
        as the lease holder; then the recovery's note for this branch is dropped."""
        head = self.head()
        changes: dict[str, trees.Change] = {}
        for path in paths:
            if self.matches(head.tree, path):
                continue
            obj = trees.entry(head.tree, path)
            changes[path] = (
                None if obj is None else (obj.id, trees.entry_mode(head.tree, path) or 0)
            )
        if changes:
            self.sync_files(head.tree, head.tree, changes, fence)
        (Path(self.wt.path) / INDEX_BASE_FILE).unlink(missing_ok=True)
        (Path(self.wt.path) / "index").unlink(missing_ok=True)
        self.wt.index.read(force=True)  # forget what libgit2 had read of it
        self.sync_index()
        # Durable before the note goes: a second cut must not keep its removal and lose
        # these writes (made after the recovery's sync, covered by no journal record).
        gitstore.sync_all(self.repo)
        gitstore.power_cut_repaired(self.repo, self.branch)


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise StorageFailed(
            f"the disk holding {path} reported a write error ({exc.strerror}): check the "
            "disk, then resume the run"
        ) from exc
    finally:
        os.close(fd)
