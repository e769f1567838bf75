"""Write one git tree into a fresh directory, straight from the object database.

The verifier runs the tests here, not in the worktree: nothing the agent left in the
worktree (untracked or ignored files, ``.pyc``, ``conftest.py``, ``.pth``) and nothing
in the repository's config or attributes (filters, ``eol``, ``export-subst``) can reach
the verdict. Each blob is written with its mode; a symlink is written as a symlink; a
submodule is an empty directory, as a checkout without ``--recurse-submodules`` leaves
it. Every file is created relative to its directory's descriptor with ``O_EXCL`` and
``O_NOFOLLOW``, so even a hostile tree cannot make a write land outside ``dest``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pygit2

from gitrun.adapter.scratch import make as make_scratch
from gitrun.core.errors import BadInput, GitrunError

_T = TypeVar("_T", pygit2.Tree, pygit2.Blob)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeTree(GitrunError):
    """The tree holds an entry git itself would refuse to check out."""


def materialise(repo: pygit2.Repository, tree_id: pygit2.Oid | str, dest: Path) -> str:
    """Write the tree ``tree_id`` into the new directory ``dest``; return its oid."""
    tree = repo.get(tree_id)
    if not isinstance(tree, pygit2.Tree):
        raise GitrunError(f"{tree_id} is not a tree")
    os.mkdir(dest, 0o700)
    fd = os.open(dest, _DIR_FLAGS)
    try:
        _write_tree(repo, tree, fd, "")
    finally:
        os.close(fd)
    return str(tree.id)


def _check_name(name: str, where: str) -> None:
    if name in ("", ".", "..") or "/" in name or "\0" in name or name.lower() == ".git":
        raise UnsafeTree(f"the tree holds an entry git would not check out: {where}{name!r}")


def _write_tree(repo: pygit2.Repository, tree: pygit2.Tree, dir_fd: int, where: str) -> None:
    for entry in tree:
        name = entry.name or ""
        _check_name(name, where)
        mode = entry.filemode
        if mode == pygit2.GIT_FILEMODE_TREE:
            os.mkdir(name, 0o755, dir_fd=dir_fd)
            sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                _write_tree(repo, _get(repo, entry.id, pygit2.Tree), sub, f"{where}{name}/")
            finally:
                os.close(sub)
        elif mode in (pygit2.GIT_FILEMODE_BLOB, pygit2.GIT_FILEMODE_BLOB_EXECUTABLE):
            perm = 0o755 if mode == pygit2.GIT_FILEMODE_BLOB_EXECUTABLE else 0o644
            fd = os.open(name, _FILE_FLAGS, perm, dir_fd=dir_fd)
            with os.fdopen(fd, "wb") as handle:
                handle.write(_get(repo, entry.id, pygit2.Blob).data)
        elif mode == pygit2.GIT_FILEMODE_LINK:
            target = os.fsdecode(_get(repo, entry.id, pygit2.Blob).data)
            os.symlink(target, name, dir_fd=dir_fd)
        elif mode == pygit2.GIT_FILEMODE_COMMIT:
            os.mkdir(name, 0o755, dir_fd=dir_fd)  # a submodule: not checked out
        else:
            raise UnsafeTree(f"the tree holds {where}{name!r} with unknown mode {mode:o}")


def _get(repo: pygit2.Repository, oid: pygit2.Oid, kind: type[_T]) -> _T:
    obj = repo.get(oid)
    if not isinstance(obj, kind):
        raise UnsafeTree(f"object {oid} is not a {kind.__name__.lower()}")
    return obj


@contextlib.contextmanager
def scratch(avoid: Sequence[Path]) -> Iterator[Path]:
    """A fresh private directory outside every path in ``avoid``; removed afterwards."""
    path = make_scratch("gitrun-verify-")  # under the root no other run's sandbox shows
    try:
        for other in avoid:
            resolved = other.resolve()
            if path == resolved or path.is_relative_to(resolved):
                raise BadInput(
                    f"the temporary directory {path} lies inside {resolved}; "
                    "set TMPDIR to a directory outside the workspace and the repository"
                )
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
