"""The contract gate's rules, pure: every proposed action is checked before anything is
persisted, and a pending one again when it executes.

Rules, each with its own name in the rejection: action kind allowed; paths relative,
normalised, without ``..``, outside ``.git``, not through a symlink, outside the
forbidden paths (a forbidden ``dir/**`` covers ``dir`` itself), not below a file of the
tree, not naming a directory of it, inside the write allowlist; a patch that parses and
applies to the precondition tree and makes no symlink unless the policy allows symlinks
(then only one that resolves inside the worktree); budgets left; risk. The tree is read
through :class:`~gitrun.core.patch_plan.TreeView` and the disk, where a rule looks at it,
through :class:`DiskView`; :mod:`gitrun.adapter.gate` gives both their git and OS forms.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

from gitrun.core import exec_policy
from gitrun.core.errors import GateRejected
from gitrun.core.git_names import (
    DOTGIT_PREFIX,
    MODE_LINK,
    hidden_character,
    is_dotgit,
    verify_path_problem,
)
from gitrun.core.patch import changed_line_count, touched_paths
from gitrun.core.patch_plan import BLOB, EXECUTABLE, LINK, TREE, TreeView, parsed, plan_patch
from gitrun.core.records import EXEC, REWIND, TOOL, Action, Budgets, kind_allowed
from gitrun.core.task import Policy, Task

# path -> (mode, object id) of what a command or a rewind left there; None: removed
Changes = Mapping[str, tuple[int, object] | None]
# A path the worktree's file system can hold: checked out under the worktree it must fit
# PATH_MAX (4,096 bytes) with room for the worktree's own path, and each name NAME_MAX.
MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255


class DiskView(Protocol):
    """The worktree's files as the rules look at them (``os`` in the adapter)."""

    def is_symlink(self, path: str) -> bool:
        """Whether ``path`` (repo-relative) is a symlink on disk."""
        ...

    def escapes(self, path: str) -> bool:
        """Whether ``path``, every link on the way resolved, lands outside the worktree."""
        ...


@dataclass(frozen=True)
class Rewind:
    """What a rewind would restore, as the adapter found it: the target tree (None: it is
    not in the repository) and the changes from the current tree to it."""

    target: TreeView | None
    changes: Changes


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
    return re.compile("".join(out) + r"\Z", re.DOTALL)  # "**" matches every character


def glob_match(path: str, pattern: str) -> bool:
    """``*`` and ``?`` stay inside one directory; ``**`` crosses directories."""
    return _glob_regex(pattern).match(path) is not None


def forbidden_match(path: str, pattern: str) -> bool:
    """A forbidden glob covers the paths it matches and a directory it covers whole:
    ``tests/**`` forbids ``tests`` itself, not only what is inside."""
    return glob_match(path, pattern) or glob_match(path + "/", pattern)


def check_shape(path: str, tree: TreeView) -> None:
    """Refuse a path below a file of the tree, or one that names a directory of it."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        if tree.mode(prefix) in (BLOB, EXECUTABLE):
            raise GateRejected(
                "path-under-file", f"{path} would go below {prefix}, which is a file"
            )
    if tree.mode(path) == TREE:
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
    check_git_path(path)
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > MAX_PATH_BYTES:
        raise GateRejected(
            "path-too-long", f"{path[:60]}... is {size} bytes; a path may be {MAX_PATH_BYTES}"
        )
    if any(
        len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES for part in path.split("/")
    ):
        raise GateRejected(
            "path-too-long", f"{path[:60]}... has a name over {MAX_NAME_BYTES} bytes"
        )
    return path


def check_git_path(path: str, mode: int = 0o100644) -> None:
    """Refuse what git's ``verify_path`` refuses (``core.protectNTFS``/``protectHFS`` on):
    a name some file system reads as ``.git`` would make git and libgit2 refuse the
    commit after the intent is checkpointed."""
    why = verify_path_problem(path, mode)
    if why is None:
        return
    rule = "path-git-dir" if is_dotgit(why) else "path-not-normal"
    raise GateRejected(rule, f"git refuses {path!r}: {why.removeprefix(DOTGIT_PREFIX)}")


def _through_link(prefix: str, tree: TreeView, disk: DiskView | None) -> bool:
    return tree.mode(prefix) == LINK or (disk is not None and disk.is_symlink(prefix))


@dataclass(frozen=True)
class Rules:
    """The gate's rules for one task's policy and budgets. ``disk`` None: the disk is not
    looked at (a pending action executing: the adapter then checks the disk, as drift)."""

    task: Task

    @property
    def policy(self) -> Policy:
        return self.task.policy

    def check(
        self, action: Action, tree: TreeView, disk: DiskView | None,
        used: Budgets, started_at: float, now: float,
    ) -> Action:  # fmt: skip
        """Return the action with normalised paths, or raise :class:`GateRejected`."""
        self.check_budgets(used, started_at, now)
        return self.check_action(action, tree, disk)

    def check_action(
        self, action: Action, tree: TreeView, disk: DiskView | None, rewind: Rewind | None = None
    ) -> Action:
        """Every rule but the budgets: the one a pending action passes again when it
        executes. A rewind's target and changes come in ``rewind``."""
        if not kind_allowed(action.kind, self.policy.allowed_actions):
            raise GateRejected(
                "action-not-allowed",
                f"{action.kind} is not allowed by policy {self.policy.id}@{self.policy.version} "
                f"(allowed: {', '.join(self.policy.allowed_actions)})",
            )
        if action.kind == "apply_patch":
            self.check_patch(action, tree, disk)
            return action
        if action.kind == EXEC:
            return self.check_exec(action, tree, disk)
        if action.kind == REWIND:
            self.check_rewind(action, rewind, tree)
            return action
        if action.kind == TOOL:  # its change is known after the call: check_exec_changes
            if not action.tool:
                raise GateRejected("malformed-action", "a tool step names its tool")
            return action
        path = normalise_path(action.path)
        self.check_path(path, tree, disk)
        if action.kind == "write_file" and action.content_bytes() is None:
            raise GateRejected("malformed-action", "write_file needs content")
        if action.kind == "delete_file" and tree.mode(path) is None:
            raise GateRejected("missing-path", f"{path} does not exist; nothing to delete")
        return action if path == action.path else replace(action, path=path)

    def check_budgets(self, used: Budgets, started_at: float, now: float) -> None:
        """Proposals, write steps and wall time left (this segment's time counts too)."""
        limits = self.task.budgets
        if used.proposals >= limits.max_proposals:
            raise GateRejected(
                "budget-proposals", f"{used.proposals} proposals used of {limits.max_proposals}"
            )
        if used.steps >= limits.max_steps:
            raise GateRejected(
                "budget-steps", f"{used.steps} write steps used of {limits.max_steps}"
            )
        elapsed = used.wall_seconds + (now - started_at)
        if elapsed >= limits.max_wall_seconds:
            raise GateRejected(
                "budget-wall-time", f"{elapsed:.0f}s used of {limits.max_wall_seconds:.0f}s"
            )

    def check_path(
        self, path: str, tree: TreeView, disk: DiskView | None, *, link_ok: bool = False
    ) -> None:
        """Every path rule; ``link_ok``: ``path`` itself may be a symlink (only its parents
        may not), as a symlink an exec step made is checked by its own rules."""
        if not self.policy.allow_hidden_characters:
            hidden = hidden_character(path)
            if hidden is not None:
                raise GateRejected(
                    "path-hidden-character",
                    f"{path!r} holds {hidden}, which a reader cannot see or which reorders "
                    f"what is shown; rename it (policy {self.policy.id} would need "
                    "allow_hidden_characters = true in [policy])",
                )
        parts = path.split("/")
        for i in range(1, len(parts) + (0 if link_ok else 1)):
            prefix = "/".join(parts[:i])
            if tree.mode(prefix) == LINK:
                raise GateRejected("path-symlink", f"{path} goes through the symlink {prefix}")
            if disk is not None and disk.is_symlink(prefix):
                raise GateRejected(
                    "path-symlink", f"{path} goes through the symlink {prefix} on disk"
                )
        if disk is not None and disk.escapes(path):
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

    def check_patch(self, action: Action, tree: TreeView, disk: DiskView | None) -> None:
        """Every path the patch touches passes the path rules; it applies to ``tree``; a
        symlink it makes passes the link rules."""
        patch = action.patch_bytes()
        if not patch:
            raise GateRejected("malformed-action", "apply_patch needs a patch")
        touched = touched_paths(parsed(patch))
        for raw in touched:
            path = normalise_path(raw)
            if path != raw:
                raise GateRejected("path-not-normal", f"patch path {raw} is not normalised")
            self.check_path(path, tree, disk)
        _check_nested(touched)
        plan = plan_patch(patch, tree)
        for fp in plan.files:
            made = plan.changes.get(fp.new_path) if fp.new_path is not None else None
            if made is not None and fp.new_mode == LINK:
                self.check_link(fp.new_path or "", made[0], tree, disk)

    def check_link(self, path: str, target: bytes, tree: TreeView, disk: DiskView | None) -> None:
        """A new symlink: only if the policy allows them, and only to a path inside."""
        if not self.policy.allow_symlinks:
            raise GateRejected(
                "symlink-not-allowed",
                f"the patch makes {path} a symlink; policy {self.policy.id} does not allow "
                "symlinks (allow_symlinks = true in [policy])",
            )
        check_git_path(path, MODE_LINK)
        parts = link_target(path, target).split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if _through_link(prefix, tree, disk):
                raise GateRejected("symlink-escape", f"{path} points through the symlink {prefix}")

    def check_exec(self, action: Action, tree: TreeView, disk: DiskView | None) -> Action:
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
        exec_policy.check_set_env(action.set_env)
        cwd = None if action.cwd in (None, "", ".") else self._check_cwd(action.cwd, tree, disk)
        return replace(action, cwd=cwd, timeout_seconds=float(timeout), env=env)

    def _check_cwd(self, raw: str | None, tree: TreeView, disk: DiskView | None) -> str:
        path = normalise_path(raw)
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if _through_link(prefix, tree, disk):
                raise GateRejected("path-symlink", f"cwd {path} goes through the symlink {prefix}")
        if tree.mode(path) != TREE:
            raise GateRejected("exec-cwd", f"cwd {path} is not a directory of the tree")
        return path

    def check_rewind(self, action: Action, rewind: Rewind | None, tree: TreeView) -> None:
        """A rewind meets the rules a write of every path it changes would meet."""
        if rewind is None or rewind.target is None:
            raise GateRejected("rewind-target-missing", f"tree {action.tree} is not in the repo")
        if not rewind.changes:
            raise GateRejected("rewind-no-change", "HEAD already has that tree; nothing to do")
        self.check_exec_changes(rewind.changes, tree, rewind.target)

    def check_exec_names(self, changes: Changes) -> None:
        """Every path an exec step made, under git's name rules alone (``normalise_path``
        with ``verify_path``, a symlink's own): the ones a tree write would fail on."""
        for path, found in sorted(changes.items()):
            if found is None:
                continue
            if normalise_path(path) != path:
                raise GateRejected("path-not-normal", f"the command made {path!r}")
            check_git_path(path, found[0])

    def check_exec_changes(self, changes: Changes, old: TreeView, new: TreeView) -> None:
        """Every path an exec step changed, under the rules a write of it would meet: the
        old path in the old tree, the new one in the new tree; links and special files."""
        for path, found in sorted(changes.items()):
            if normalise_path(path) != path:
                raise GateRejected("path-not-normal", f"the command made {path!r}")
            if old.mode(path) is not None:
                self.check_path(path, old, None)
            if found is None:
                continue
            if found[0] not in (BLOB, EXECUTABLE, LINK):
                raise GateRejected(
                    "exec-special-file", f"the command made {path}, neither file nor symlink"
                )
            self.check_path(path, new, None, link_ok=found[0] == LINK)
            if found[0] == LINK:
                self.check_link(path, new.read(path) or b"", new, None)

    def risk(self, action: Action, rewound: Sequence[str] = ()) -> str | None:
        """The name of the first risk rule the action matches (it needs approval), or None.
        ``rewound``: the paths a rewind would change (every one of them counts)."""
        patch = action.patch_bytes()
        files = parsed(patch) if patch else ()
        paths = (
            touched_paths(files)
            if action.kind == "apply_patch" and patch
            else (action.path,)
            if action.path
            else tuple(rewound)
        )
        lines = changed_line_count(files)
        for rule in self.policy.risk:
            if rule.actions and action.kind not in rule.actions:
                continue
            if rule.paths and not any(glob_match(p, g) for p in paths for g in rule.paths):
                continue
            if rule.patch_lines_over is not None and lines <= rule.patch_lines_over:
                continue
            return rule.name
        return None
