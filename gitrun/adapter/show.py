"""Rendering actions and receipts for humans: diffs, side by side (pure text)."""

from __future__ import annotations

import difflib
import shutil

import pygit2

from gitrun.core.records import Action
from gitrun.store import trees


def action_diff(repo: pygit2.Repository, action: Action, tree: pygit2.Tree) -> str:
    """The unified diff ``action`` would make against ``tree``."""
    if action.kind == "apply_patch":
        return (action.patch_bytes() or b"").decode("utf-8", "replace")
    if action.kind == "exec":  # its change is known only once it has run
        return f"$ {action.summary().removeprefix('exec ')} (cwd {action.cwd or '.'})\n"
    path = action.path or "?"
    old = trees.blob_bytes(repo, tree, path) if action.path else None
    old_lines = (old or b"").decode("utf-8", "replace").splitlines(keepends=True)
    content = (action.content_bytes() or b"").decode("utf-8", "replace")
    new_lines = [] if action.kind == "delete_file" else content.splitlines(keepends=True)
    return "".join(difflib.unified_diff(old_lines, new_lines, f"a/{path}", f"b/{path}"))


def commit_diff(repo: pygit2.Repository, commit_id: str) -> str:
    """The diff a (write) commit made against its parent."""
    commit = repo.get(commit_id)
    if not isinstance(commit, pygit2.Commit) or not commit.parents:
        return f"(commit {commit_id} is not available)\n"
    patch: str = repo.diff(commit.parents[0], commit).patch or ""
    return patch


def side_by_side(left_title: str, left: str, right_title: str, right: str) -> str:
    """Two texts in two columns, as wide as the terminal allows."""
    width = max(60, shutil.get_terminal_size((160, 40)).columns)
    col = (width - 3) // 2
    a = [left_title, "-" * min(col, len(left_title)), *left.splitlines()]
    b = [right_title, "-" * min(col, len(right_title)), *right.splitlines()]
    rows = []
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else ""
        y = b[i] if i < len(b) else ""
        rows.append(f"{x[:col]:<{col}} | {y[:col]}")
    return "\n".join(rows) + "\n"


def diffstat(repo: pygit2.Repository, parent: str, commit: str) -> dict[str, int]:
    """Files changed, insertions and deletions from ``parent`` to ``commit`` (git's stat)."""
    stats = repo.diff(parent, commit).stats
    return {"files": stats.files_changed, "insertions": stats.insertions,
            "deletions": stats.deletions}  # fmt: skip
