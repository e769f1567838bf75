"""The contract gate: every proposed action is checked before anything is persisted.

Rules, each with its own name in the rejection: action kind allowed; paths relative,
normalised, without ``..``, outside ``.git``, not through a symlink, outside the
forbidden paths (a forbidden ``dir/**`` covers ``dir`` itself), not below a file of the
tree, not naming a directory of it, inside the write allowlist; a patch that parses and
applies to the precondition tree and makes no symlink unless the policy allows symlinks
(then only one that resolves inside the worktree); budgets left. The gate reads the
repository and writes nothing. A pending action passes it again when it executes
(:meth:`Gate.check_action`).
"""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import pygit2

from gitrun.core import exec_policy
from gitrun.core.errors import GateRejected
from gitrun.core.patch import apply_file_patch, changed_line_count, parse_patch, touched_paths
from gitrun.core.records import EXEC, REWIND, Action, Budgets, kind_allowed
from gitrun.core.task import Policy, Task
from gitrun.store import trees


@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def glob_match(path: str, pattern: str) -> bool:
    """``*`` and ``?`` stay inside one directory; ``**`` crosses directories."""
    return _glob_regex(pattern).match(path) is not None


def forbidden_match(path: str, pattern: str) -> bool:
    """A forbidden glob covers the paths it matches and a directory it covers whole:
    ``tests/**`` forbids ``tests`` itself, not only what is inside."""
    return glob_match(path, pattern) or glob_match(path + "/", pattern)


def check_shape(path: str, tree: pygit2.Tree) -> None:
    """Refuse a path below a file of the tree, or one that names a directory of it."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        if trees.entry_mode(tree, prefix) in (trees.BLOB, trees.EXEC):
            raise GateRejected(
                "path-under-file", f"{path} would go below {prefix}, which is a file"
            )
    if trees.entry_mode(tree, path) == trees.TREE:
        raise GateRejected(
            "path-is-directory", f"{path} is a directory; actions write and delete files only"
        )


def _check_nested(paths: Sequence[str]) -> None:
    """A patch may not make a file and a path below it at once."""
    made = set(paths)
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in made:
                raise GateRejected(
                    "path-under-file",
                    f"the patch makes {path} and {'/'.join(parts[:i])}, a file above it",
                )


def link_target(path: str, target: bytes) -> str:
    """Where a symlink at ``path`` with ``target`` points, repo-relative; refused with
    ``symlink-escape`` unless the target is relative, normalised and stays inside."""
    text = target.decode("utf-8", "replace")
    if not text or "\x00" in text or "\\" in text or "\ufffd" in text:
        raise GateRejected("symlink-escape", f"{path} has an unreadable symlink target")
    if text.startswith("/"):
        raise GateRejected("symlink-escape", f"{path} points at the absolute path {text}")
    if posixpath.normpath(text) != text.rstrip("/"):  # so ".." can only lead: no link climbs
        raise GateRejected("symlink-escape", f"{path} -> {text}: the target is not normalised")
    where = posixpath.normpath(posixpath.join(posixpath.dirname(path), text))
    if where == ".." or where.startswith("../"):
        raise GateRejected("symlink-escape", f"{path} -> {text} points outside the worktree")
    if any(part.lower() == ".git" for part in where.split("/")):
        raise GateRejected("symlink-escape", f"{path} -> {text} points into .git")
    return where


def normalise_path(raw: str | None) -> str:
    """A clean repo-relative POSIX path, or a rejection naming the rule broken."""
    if not isinstance(raw, str) or not raw.strip():
        raise GateRejected("path-empty", "the action names no path")
    if "\x00" in raw or "\\" in raw:
        raise GateRejected("path-characters", f"{raw!r} contains a NUL or a backslash")
    if raw.startswith("/") or re.match(r"^[A-Za-z]:", raw):
        raise GateRejected(
            "path-absolute", f"{raw} is absolute; paths are relative to the repo root"
        )
    parts = raw.split("/")
    if ".." in parts:
        raise GateRejected("path-dotdot", f"{raw} contains '..'")
    path = posixpath.normpath(raw)
    if path in (".", ""):
        raise GateRejected("path-empty", f"{raw} names the repository root, not a file")
    if any(part.lower() == ".git" for part in path.split("/")):
        raise GateRejected("path-git-dir", f"{raw} is inside .git")
    return path


@dataclass(frozen=True)
class Gate:
    task: Task
    worktree: Path
    repo: pygit2.Repository

    @property
    def policy(self) -> Policy:
        return self.task.policy

    def check(self, action: Action, tree: pygit2.Tree, used: Budgets, started_at: float) -> Action:
        """Return the action with normalised paths, or raise :class:`GateRejected`."""
        self.check_budgets(used, started_at)
        return self.check_action(action, tree)

    def check_action(self, action: Action, tree: pygit2.Tree, *, on_disk: bool = True) -> Action:
        """Every rule but the budgets: the one a pending action passes again when it
        executes (``on_disk=False``: the adapter then checks the disk, as drift)."""
        if not kind_allowed(action.kind, self.policy.allowed_actions):
            raise GateRejected(
                "action-not-allowed",
                f"{action.kind} is not allowed by policy {self.policy.id}@{self.policy.version} "
                f"(allowed: {', '.join(self.policy.allowed_actions)})",
            )
        if action.kind == "apply_patch":
            self._check_patch(action, tree, on_disk)
            return action
        if action.kind == EXEC:
            return self._check_exec(action, tree, on_disk)
        if action.kind == REWIND:
            self.check_rewind(action, tree)
            return action
        path = normalise_path(action.path)
        self.check_path(path, tree, on_disk=on_disk)
        if action.kind == "write_file" and action.content_bytes() is None:
            raise GateRejected("malformed-action", "write_file needs content")
        if action.kind == "delete_file" and trees.entry(tree, path) is None:
            raise GateRejected("missing-path", f"{path} does not exist; nothing to delete")
        return replace(action, path=path)

    def check_budgets(self, used: Budgets, started_at: float) -> None:
        limits = self.task.budgets
        if used.proposals >= limits.max_proposals:
            raise GateRejected(
                "budget-proposals", f"{used.proposals} proposals used of {limits.max_proposals}"
            )
        if used.steps >= limits.max_steps:
            raise GateRejected(
                "budget-steps", f"{used.steps} write steps used of {limits.max_steps}"
            )
        elapsed = used.wall_seconds + (time.time() - started_at)
        if elapsed >= limits.max_wall_seconds:
            raise GateRejected(
                "budget-wall-time", f"{elapsed:.0f}s used of {limits.max_wall_seconds:.0f}s"
            )

    def check_path(
        self, path: str, tree: pygit2.Tree, *, on_disk: bool = True, link_ok: bool = False
    ) -> None:
        """Every path rule; ``link_ok``: ``path`` itself may be a symlink (only its parents
        may not), as a symlink an exec step made is checked by its own rules."""
        parts = path.split("/")
        for i in range(1, len(parts) + (0 if link_ok else 1)):
            prefix = "/".join(parts[:i])
            if trees.entry_mode(tree, prefix) == trees.LINK:
                raise GateRejected("path-symlink", f"{path} goes through the symlink {prefix}")
            if on_disk and (self.worktree / prefix).is_symlink():
                raise GateRejected(
                    "path-symlink", f"{path} goes through the symlink {prefix} on disk"
                )
        if on_disk:
            root = self.worktree.resolve()
            resolved = (self.worktree / path).resolve()
            if resolved != root and root not in resolved.parents:
                raise GateRejected("path-escape", f"{path} resolves outside the worktree")
        for pattern in self.policy.forbidden_paths:
            if forbidden_match(path, pattern):
                raise GateRejected("path-forbidden", f"{path} matches forbidden path {pattern!r}")
        check_shape(path, tree)
        if not any(glob_match(path, p) for p in self.policy.write_allowlist):
            raise GateRejected(
                "path-not-allowlisted",
                f"{path} is outside the write allowlist {list(self.policy.write_allowlist)}",
            )

    def _check_patch(self, action: Action, tree: pygit2.Tree, on_disk: bool) -> None:
        patch = action.patch_bytes()
        if not patch:
            raise GateRejected("malformed-action", "apply_patch needs a patch")
        patches = parse_patch(patch)
        touched = touched_paths(patches)
        for raw in touched:
            path = normalise_path(raw)
            if path != raw:
                raise GateRejected("path-not-normal", f"patch path {raw} is not normalised")
            self.check_path(path, tree, on_disk=on_disk)
        _check_nested(touched)
        for fp in patches:
            old = trees.blob_bytes(self.repo, tree, fp.old_path) if fp.old_path else None
            if fp.old_path is None and fp.new_path and trees.entry(tree, fp.new_path) is not None:
                raise GateRejected("patch-does-not-apply", f"{fp.new_path} already exists")
            new = apply_file_patch(old, fp)
            if fp.new_path is not None and fp.new_mode == trees.LINK:
                self._check_link(fp.new_path, new or b"", tree, on_disk)

    def _check_link(self, path: str, target: bytes, tree: pygit2.Tree, on_disk: bool) -> None:
        """A new symlink: only if the policy allows them, and only to a path inside."""
        if not self.policy.allow_symlinks:
            raise GateRejected(
                "symlink-not-allowed",
                f"the patch makes {path} a symlink; policy {self.policy.id} does not allow "
                "symlinks (allow_symlinks = true in [policy])",
            )
        where = link_target(path, target)
        parts = where.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if trees.entry_mode(tree, prefix) == trees.LINK or (
                on_disk and (self.worktree / prefix).is_symlink()
            ):
                raise GateRejected("symlink-escape", f"{path} points through the symlink {prefix}")

    def _check_exec(self, action: Action, tree: pygit2.Tree, on_disk: bool) -> Action:
        """An exec step: one command form, allowed by ``[policy.exec]``, a cwd that is a
        directory of the tree, a timeout within the policy's; defaults filled in."""
        shell = self.policy.exec
        if shell is None:
            raise GateRejected("action-not-allowed", "the policy has no [policy.exec] table")
        if action.path or action.content_bytes() is not None or action.patch_bytes() is not None:
            raise GateRejected("malformed-action", "exec takes a command, not a path or content")
        if (action.command is None) == (action.argv is None):
            raise GateRejected("malformed-action", "exec needs exactly one of command and argv")
        parts = (action.command,) if action.command is not None else (action.argv or ())
        if not parts or not all(isinstance(p, str) and p and "\x00" not in p for p in parts):
            raise GateRejected("malformed-action", "the exec command is empty or holds a NUL")
        text = exec_policy.command_text(action.command, action.argv)
        denied = shell.denied_by(text)
        if denied is not None:
            raise GateRejected("exec-denied", f"{text!r} matches the denied pattern {denied!r}")
        if not shell.allowed(text):
            raise GateRejected(
                "exec-not-allowed", f"{text!r} matches no allowed pattern {list(shell.allow)}"
            )
        timeout = (
            shell.max_timeout_seconds if action.timeout_seconds is None else action.timeout_seconds
        )
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= shell.max_timeout_seconds
        ):
            raise GateRejected(
                "exec-timeout",
                f"timeout {timeout!r} is not within (0, {shell.max_timeout_seconds:g}] seconds",
            )
        env = tuple(shell.env) if action.env is None else tuple(action.env)
        extra = sorted(set(env) - set(shell.env))
        if extra:
            raise GateRejected(
                "exec-env", f"{extra[0]} is not in policy.exec.env {list(shell.env)}"
            )
        cwd = None if action.cwd in (None, "", ".") else self._check_cwd(action.cwd, tree, on_disk)
        return replace(action, cwd=cwd, timeout_seconds=float(timeout), env=env)

    def _check_cwd(self, raw: str | None, tree: pygit2.Tree, on_disk: bool) -> str:
        path = normalise_path(raw)
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if trees.entry_mode(tree, prefix) == trees.LINK or (
                on_disk and (self.worktree / prefix).is_symlink()
            ):
                raise GateRejected("path-symlink", f"cwd {path} goes through the symlink {prefix}")
        if trees.entry_mode(tree, path) != trees.TREE:
            raise GateRejected("exec-cwd", f"cwd {path} is not a directory of the tree")
        return path

    def check_rewind(self, action: Action, tree: pygit2.Tree) -> None:
        """A rewind meets the rules a write of every path it changes would meet."""
        target = self.repo.get(action.tree) if action.tree else None
        if not isinstance(target, pygit2.Tree):
            raise GateRejected("rewind-target-missing", f"tree {action.tree} is not in the repo")
        changes = trees.rewind_changes(tree, target)
        if not changes:
            raise GateRejected("rewind-no-change", "HEAD already has that tree; nothing to do")
        shaped: dict[str, tuple[int, pygit2.Oid | None] | None] = {
            p: None if c is None else (c[1], c[0]) for p, c in changes.items()
        }
        self.check_exec_changes(shaped, tree, target)

    def _rewound_paths(self, action: Action, tree: pygit2.Tree | None) -> tuple[str, ...]:
        target = self.repo.get(action.tree) if action.kind == REWIND and action.tree else None
        if tree is None or not isinstance(target, pygit2.Tree):
            return ()
        return tuple(trees.rewind_changes(tree, target))

    def check_exec_changes(
        self, changes: dict[str, tuple[int, pygit2.Oid | None] | None],
        old: pygit2.Tree, new: pygit2.Tree,
    ) -> None:  # fmt: skip
        """Every path an exec step changed, under the rules a write of it would meet: the
        old path in the old tree, the new one in the new tree; links and special files."""
        for path, found in sorted(changes.items()):
            if normalise_path(path) != path:
                raise GateRejected("path-not-normal", f"the command made {path!r}")
            if trees.entry_mode(old, path) is not None:
                self.check_path(path, old, on_disk=False)
            if found is None:
                continue
            if found[0] not in (trees.BLOB, trees.EXEC, trees.LINK):
                raise GateRejected(
                    "exec-special-file", f"the command made {path}, neither file nor symlink"
                )
            self.check_path(path, new, on_disk=False, link_ok=found[0] == trees.LINK)
            if found[0] == trees.LINK:
                obj = trees.entry(new, path)
                self._check_link(
                    path, obj.data if isinstance(obj, pygit2.Blob) else b"", new, False
                )

    def risk(self, action: Action, tree: pygit2.Tree | None = None) -> str | None:
        """The name of the first risk rule the action matches (it needs approval), or None.
        ``tree`` (HEAD's) gives a rewind's paths: every path it would change."""
        patch = action.patch_bytes()
        paths = (
            touched_paths(parse_patch(patch))
            if action.kind == "apply_patch" and patch
            else (action.path,)
            if action.path
            else self._rewound_paths(action, tree)
        )
        lines = changed_line_count(parse_patch(patch)) if patch else 0
        for rule in self.policy.risk:
            if rule.actions and action.kind not in rule.actions:
                continue
            if rule.paths and not any(glob_match(p, g) for p in paths for g in rule.paths):
                continue
            if rule.patch_lines_over is not None and lines <= rule.patch_lines_over:
                continue
            return rule.name
        return None
