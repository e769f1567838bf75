"""The repository a run works in: a sandbox's, made from its base files, or the user's.

The git half of :meth:`gitrun.app.workspace.Workspace.sandbox_repo` and ``--repo``: the
workspace decides where and under which lock, these make or open the repository and
name its base commit. Bad input is a :class:`~gitrun.core.errors.BadInput` naming what
to do; nothing here is written for a refused repository.
"""

from __future__ import annotations

from pathlib import Path

import pygit2

from gitrun.core.errors import BadInput
from gitrun.store import gitstore, trees

__all__ = ["init_sandbox", "sandbox_base", "user_repo"]


def init_sandbox(path: Path, base_files: Path, message: str) -> None:
    """A new repository at ``path`` (a scratch dir the caller renames into place) whose
    ``main`` is the deterministic base commit of ``base_files``, checked out."""
    pygit2.init_repository(str(path), bare=False, initial_head="main")
    sandbox_base(gitstore.open_repo(path), base_files, message)


def sandbox_base(repo: pygit2.Repository, base_files: Path, message: str) -> pygit2.Oid:
    """The deterministic base commit of a sandbox, on ``main`` (checked out if new)."""
    tree = trees.tree_from_dir(repo, base_files)
    base = trees.deterministic_commit(repo, tree, message, [])
    if gitstore.read_ref(repo, "refs/heads/main") is None:
        gitstore.transaction(repo).move(
            "refs/heads/main", None, base, message="gitrun: sandbox base"
        ).commit()
        repo.checkout("refs/heads/main")
    return base


def user_repo(path: Path, commit: str | None) -> tuple[pygit2.Repository, pygit2.Oid]:
    """An existing repository (clean), and its base commit: ``commit`` or HEAD."""
    if not path.exists():
        raise BadInput(f"--repo {path}: no such directory")
    discovered = pygit2.discover_repository(str(path))
    if discovered is None:
        raise BadInput(f"--repo {path}: not a git repository (run `git init` there first)")
    repo = gitstore.open_repo(discovered)
    if repo.is_bare:
        raise BadInput(f"--repo {path}: a bare repository has no working tree to check")
    if repo.head_is_unborn:
        raise BadInput(f"--repo {path}: the repository has no commits yet; commit a base first")
    dirty = {
        p
        for p, f in repo.status(untracked_files="no").items()
        if f != pygit2.enums.FileStatus.CURRENT
    }
    if dirty:
        more = f" and {len(dirty) - 1} more" if len(dirty) > 1 else ""
        raise BadInput(
            f"--repo {path}: uncommitted changes in {sorted(dirty)[0]}{more}; "
            "commit or stash them first"
        )
    if commit is None:
        head = repo.head.peel(pygit2.Commit)
        return repo, head.id
    try:
        obj = repo.revparse_single(commit)
    except (KeyError, ValueError) as exc:
        raise BadInput(f"initial.commit {commit} is not in {path}") from exc
    return repo, obj.peel(pygit2.Commit).id
