"""A patch parsed once and applied once per step: what it makes of one tree, memoised.

A step reads a pending patch in four places (the gate at intake, the risk rules, the gate
again when it executes, the adapter's write). Parsing is a function of the patch bytes and
applying a function of (tree, patch); the tree is content-addressed, so both are memoised
here and each place still runs every rule on the result. Pure: the tree is read through
:class:`TreeView`; a view without an id (a test's dict) is never memoised.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Protocol

from gitrun.core.errors import GateRejected
from gitrun.core.patch import FilePatch, apply_file_patch, parse_patch

__all__ = [
    "BLOB",
    "EXECUTABLE",
    "LINK",
    "TREE",
    "PatchPlan",
    "TreeView",
    "forget",
    "parsed",
    "plan_patch",
]

BLOB = 0o100644
EXECUTABLE = 0o100755
TREE = 0o040000
LINK = 0o120000

FileChange = tuple[bytes, int] | None  # the new (bytes, mode), or None: the path is deleted


class TreeView(Protocol):
    """A read-only git tree as the gate's rules see it (a pygit2 tree in the adapter)."""

    @property
    def id(self) -> str | None:
        """The tree's content address; None: results over it are never memoised."""
        ...

    def mode(self, path: str) -> int | None:
        """The mode of the entry at ``path`` (:data:`TREE` for a directory), or None."""
        ...

    def read(self, path: str) -> bytes | None:
        """The bytes of the file or link at ``path``, None when absent; a directory is
        refused with ``path-is-directory``."""
        ...


@dataclass(frozen=True)
class PatchPlan:
    """A patch applied to one tree: its file patches and each path's new content."""

    files: tuple[FilePatch, ...]
    changes: Mapping[str, FileChange]


@lru_cache(maxsize=16)
def parsed(patch: bytes) -> tuple[FilePatch, ...]:
    """:func:`gitrun.core.patch.parse_patch`, once per patch (file patches are frozen)."""
    return parse_patch(patch)


_PLANS: dict[tuple[str, bytes], PatchPlan] = {}
_PLANS_MAX = 16
_LOCK = threading.Lock()


def plan_patch(patch: bytes, tree: TreeView) -> PatchPlan:
    """What ``patch`` makes of ``tree``: every path it deletes or writes (bytes and mode),
    or the rejection; computed once per (tree, patch)."""
    key = None if tree.id is None else (tree.id, patch)
    if key is not None:
        with _LOCK:
            found = _PLANS.get(key)
        if found is not None:
            return found
    files = parsed(patch)
    plan = PatchPlan(files, MappingProxyType(_apply(files, tree)))
    if key is not None:
        with _LOCK:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
    return plan


def forget() -> None:
    """Drop every memoised parse and plan (a test that counts them starts from none)."""
    parsed.cache_clear()
    with _LOCK:
        _PLANS.clear()


def _apply(files: tuple[FilePatch, ...], tree: TreeView) -> dict[str, FileChange]:
    changes: dict[str, FileChange] = {}
    for fp in files:
        old_mode = tree.mode(fp.old_path) if fp.old_path else None
        if old_mode == TREE:
            raise GateRejected("path-is-directory", f"{fp.old_path} is a directory")
        old = tree.read(fp.old_path) if fp.old_path else None
        if fp.old_path is None and fp.new_path and tree.mode(fp.new_path) is not None:
            raise GateRejected("patch-does-not-apply", f"{fp.new_path} already exists")
        new = apply_file_patch(old, fp)
        if fp.old_path and fp.old_path != fp.new_path:
            changes[fp.old_path] = None
        if fp.new_path is not None and new is not None:
            changes[fp.new_path] = (new, fp.new_mode or old_mode or BLOB)
    return changes
