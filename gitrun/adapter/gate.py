"""The contract gate over git and the worktree: the rules of :mod:`gitrun.core.gate_rules`
read a pygit2 tree (:class:`GitTree`) and the files on disk (:class:`WorktreeDisk`).

The gate reads the repository and writes nothing. A pending action passes it again when
it executes (:meth:`Gate.check_action`), against the tree and the disk as they are then.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pygit2

from gitrun.adapter import safefs
from gitrun.core.errors import GateRejected
from gitrun.core.gate_rules import Changes, Rewind, Rules
from gitrun.core.gate_rules import check_shape as _check_shape
from gitrun.core.gate_rules import forbidden_match as forbidden_match  # noqa: PLC0414 - re-export
from gitrun.core.gate_rules import glob_match as glob_match  # noqa: PLC0414 - re-export
from gitrun.core.gate_rules import link_target as link_target  # noqa: PLC0414 - re-export
from gitrun.core.gate_rules import normalise_path as normalise_path  # noqa: PLC0414 - re-export
from gitrun.core.records import REWIND, Action, Budgets
from gitrun.core.task import Policy, Task
from gitrun.store import trees


class GitTree:
    """A pygit2 tree as the gate's rules read it (:class:`gitrun.core.patch_plan.TreeView`)."""

    __slots__ = ("tree",)

    def __init__(self, tree: pygit2.Tree) -> None:
        self.tree = tree

    @property
    def id(self) -> str:
        return str(self.tree.id)

    def mode(self, path: str) -> int | None:
        return trees.entry_mode(self.tree, path)

    def read(self, path: str) -> bytes | None:
        obj = trees.entry(self.tree, path)
        if obj is None:
            return None
        if not isinstance(obj, pygit2.Blob):
            raise GateRejected(
                "path-is-directory", f"{path} is a directory in the tree, not a file"
            )
        data: bytes = obj.data
        return data


@dataclass(frozen=True)
class WorktreeDisk:
    """The worktree's files as the gate's rules look at them (:class:`DiskView`)."""

    root: Path

    def is_symlink(self, path: str) -> bool:
        return os.path.islink(self._joined(path))  # Path.is_symlink's answer, on a string

    def escapes(self, path: str) -> bool:
        """``path`` resolves outside the root (what ``Path.resolve`` and ``.parents`` say,
        on strings: ``realpath`` makes both absolute and normalised)."""
        root = safefs.realpath(self.root)
        resolved = safefs.realpath(self._joined(path))
        return resolved != root and not resolved.startswith(root.rstrip("/") + "/")

    def _joined(self, path: str) -> str:
        """``str(self.root / path)`` without building Paths (a step asks ~5 times)."""
        parts = [p for p in path.split("/") if p and p != "."]
        base = "/" if path.startswith("/") else str(self.root)
        return os.path.join(base, *parts)


def check_shape(path: str, tree: pygit2.Tree) -> None:
    """Refuse a path below a file of the tree, or one that names a directory of it."""
    _check_shape(path, GitTree(tree))


@dataclass(frozen=True)
class Gate:
    task: Task
    worktree: Path
    repo: pygit2.Repository
    # The last action that passed every rule unchanged, and the tree it passed on: the
    # same action on the same tree passes again (the rules read only the task, the tree,
    # objects named by id, and the disk, which adds refusals only), so a pending action's
    # re-check without the disk is not run twice in one process (issue #15).
    _passed: tuple[Action, pygit2.Oid] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    @property
    def policy(self) -> Policy:
        return self.task.policy

    @property
    def rules(self) -> Rules:
        return Rules(self.task)

    def check(self, action: Action, tree: pygit2.Tree, used: Budgets, started_at: float) -> Action:
        """Return the action with normalised paths, or raise :class:`GateRejected`."""
        self.check_budgets(used, started_at)
        return self.check_action(action, tree)

    def check_action(self, action: Action, tree: pygit2.Tree, *, on_disk: bool = True) -> Action:
        """Every rule but the budgets: the one a pending action passes again when it
        executes (``on_disk=False``: the adapter then checks the disk, as drift)."""
        if not on_disk and self._passed == (action, tree.id):
            return action
        disk = WorktreeDisk(self.worktree) if on_disk else None
        rewind = self._rewind(action, tree) if action.kind == REWIND else None
        checked = self.rules.check_action(action, GitTree(tree), disk, rewind)
        if checked == action:
            object.__setattr__(self, "_passed", (action, tree.id))  # frozen: a cache only
        return checked

    def check_budgets(self, used: Budgets, started_at: float) -> None:
        self.rules.check_budgets(used, started_at, time.time())

    def check_path(
        self, path: str, tree: pygit2.Tree, *, on_disk: bool = True, link_ok: bool = False
    ) -> None:
        """Every path rule (:meth:`gitrun.core.gate_rules.Rules.check_path`)."""
        disk = WorktreeDisk(self.worktree) if on_disk else None
        self.rules.check_path(path, GitTree(tree), disk, link_ok=link_ok)

    def check_rewind(self, action: Action, tree: pygit2.Tree) -> None:
        """A rewind meets the rules a write of every path it changes would meet."""
        self.rules.check_rewind(action, self._rewind(action, tree), GitTree(tree))

    def _rewind(self, action: Action, tree: pygit2.Tree) -> Rewind:
        target = self.repo.get(action.tree) if action.tree else None
        if not isinstance(target, pygit2.Tree):
            return Rewind(None, {})
        changes = trees.rewind_changes(tree, target)
        shaped = {p: None if c is None else (c[1], c[0]) for p, c in changes.items()}
        return Rewind(GitTree(target), shaped)

    def check_exec_names(self, changes: Changes) -> None:
        """Every name an exec step made, under git's own path rules (before a tree is
        written: libgit2 refuses the names git's ``verify_path`` refuses)."""
        self.rules.check_exec_names(changes)

    def check_exec_changes(self, changes: Changes, old: pygit2.Tree, new: pygit2.Tree) -> None:
        """Every path an exec step changed, under the rules a write of it would meet."""
        self.rules.check_exec_changes(changes, GitTree(old), GitTree(new))

    def risk(self, action: Action, tree: pygit2.Tree | None = None) -> str | None:
        """The name of the first risk rule the action matches (it needs approval), or None.
        ``tree`` (HEAD's) gives a rewind's paths: every path it would change."""
        rewound: tuple[str, ...] = ()
        if action.kind == REWIND and not action.path and tree is not None:
            rewound = tuple(self._rewind(action, tree).changes)
        return self.rules.risk(action, rewound)
