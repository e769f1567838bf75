"""The git handles the layers above the adapter hold and hand back, and the few reads
that produce them.

The engine and the app reach git through the stores' contracts and the adapter's
functions; where they keep a repository, a commit or a tree between two such calls, they
name its type from here and get it from the functions below, so pygit2 stays imported
only in ``store/`` and ``adapter/`` (tests/test_seams.py). Each read answers None for an
id that names no object of the kind asked for (or is no object id at all), never a
libgit2 error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

import pygit2

Repository: TypeAlias = pygit2.Repository
Object: TypeAlias = pygit2.Object
Commit: TypeAlias = pygit2.Commit
Tree: TypeAlias = pygit2.Tree
Blob: TypeAlias = pygit2.Blob
Oid: TypeAlias = pygit2.Oid
GitError: TypeAlias = pygit2.GitError


def oid(hex_id: str) -> Oid:
    """The object id ``hex_id`` names (ValueError when it is not one)."""
    return pygit2.Oid(hex=hex_id)


def _get(repo: Repository, key: str | Oid) -> Object | None:
    try:
        return repo.get(key)
    except ValueError:  # not an object id at all
        return None


def commit_at(repo: Repository, key: str | Oid) -> Commit | None:
    """The commit ``key`` names in ``repo``, or None."""
    found = _get(repo, key)
    return found if isinstance(found, pygit2.Commit) else None


def tree_at(repo: Repository, key: str | Oid) -> Tree | None:
    """The tree ``key`` names in ``repo``, or None."""
    found = _get(repo, key)
    return found if isinstance(found, pygit2.Tree) else None


def blob_at(repo: Repository, key: str | Oid) -> Blob | None:
    """The blob ``key`` names in ``repo``, or None."""
    found = _get(repo, key)
    return found if isinstance(found, pygit2.Blob) else None


def as_tree(obj: Object | None) -> Tree | None:
    """``obj`` when it is a tree (a tree entry's object), else None."""
    return obj if isinstance(obj, pygit2.Tree) else None


def as_blob(obj: Object | None) -> Blob | None:
    """``obj`` when it is a blob (a tree entry's object), else None."""
    return obj if isinstance(obj, pygit2.Blob) else None


def first_parent(commit: Commit) -> Commit | None:
    """The commit's first parent, or None for a root commit."""
    parents = commit.parents
    return parents[0] if parents else None


def open_plain(path: Path | str) -> Repository:
    """``path``'s repository opened to read, as libgit2 opens it: none of the durability
    set-up of :func:`gitrun.store.gitstore.open_repo` (use that one to write)."""
    return pygit2.Repository(str(path))


def revparse_commit(repo: Repository, rev: str) -> Oid:
    """The commit ``rev`` names (as ``git rev-parse REV^{commit}``); KeyError or
    ValueError when it names none."""
    return repo.revparse_single(rev).peel(pygit2.Commit).id


def tree_of(repo: Repository, key: str | Oid) -> Oid:
    """The tree of the commit (or the tree) ``key`` names; KeyError or ValueError when none."""
    return repo[key].peel(pygit2.Tree).id


def peel_tree(repo: Repository, key: str | Oid) -> Tree:
    """The tree of the commit (or the tree) ``key`` names; KeyError or ValueError when none."""
    return repo[key].peel(pygit2.Tree)


def blob_data(repo: Repository, key: str | Oid) -> bytes:
    """The bytes of the blob ``key`` names; KeyError or ValueError when none."""
    return bytes(repo[key].peel(pygit2.Blob).data)


def is_bare(git_dir: str) -> bool:
    """Whether the repository at ``git_dir`` has no working tree."""
    return bool(pygit2.Repository(git_dir).is_bare)


def discover(path: Path | str) -> str | None:
    """The git dir of the repository ``path`` is in (as ``git`` finds it), or None."""
    found = pygit2.discover_repository(str(path))
    return None if found is None else str(found)


__all__ = [
    "Blob",
    "Commit",
    "GitError",
    "Object",
    "Oid",
    "Repository",
    "Tree",
    "as_blob",
    "as_tree",
    "blob_at",
    "blob_data",
    "commit_at",
    "discover",
    "first_parent",
    "is_bare",
    "oid",
    "open_plain",
    "peel_tree",
    "revparse_commit",
    "tree_at",
    "tree_of",
]
