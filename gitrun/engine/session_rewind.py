"""The ``rewind`` step's target: a receipt commit of the run (or its base) or a checkpoint
generation, resolved to the tree the new step restores.

History is never rewritten: a rewind is one more gated write whose receipt commit has
the target's tree (docs/design.md §6), so the audit trail keeps the steps it undoes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from gitrun.adapter.gittypes import Commit, commit_at, first_parent
from gitrun.core.errors import BadInput
from gitrun.core.records import REWIND, Action

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime

MIN_PREFIX = 7
_HEX = re.compile(r"[0-9a-f]{7,40}\Z")


def run_commits(rt: Runtime) -> list[Commit]:
    """HEAD back along first parents to the base commit (inclusive), newest first."""
    out: list[Commit] = []
    commit = commit_at(rt.env.repo, rt.state.env.head)
    base = rt.state.env.base_commit
    while commit is not None:
        out.append(commit)
        if str(commit.id) == base:
            break
        commit = first_parent(commit)
    return out


def target_commit(rt: Runtime, to: str | int) -> Commit:
    """The commit ``to`` names: a generation number, or a receipt commit (unique prefix)."""
    if isinstance(to, int):
        return _at_generation(rt, to)
    text = to.strip().lower()
    if not _HEX.match(text):
        raise BadInput(
            f"rewind: {to!r} is neither a commit (at least {MIN_PREFIX} hex digits) "
            "nor a generation number; see gitrun log RUN"
        )
    found = [c for c in run_commits(rt) if str(c.id).startswith(text)]
    if not found:
        raise BadInput(f"rewind: no receipt commit {to} on the run's branch or its base")
    if len(found) > 1:
        raise BadInput(f"rewind: {to} is ambiguous ({len(found)} commits); give more digits")
    return found[0]


def _at_generation(rt: Runtime, generation: int) -> Commit:
    if generation < 1 or generation > rt.state.generation:
        raise BadInput(f"rewind: generation {generation} is not in 1..{rt.state.generation}")
    for stored in rt.store.chain(rt.ref):
        if stored.state.generation == generation:
            commit = commit_at(rt.env.repo, stored.state.env.head)
            if commit is not None:
                return commit
    raise BadInput(f"rewind: the checkpoint chain has no generation {generation}")


def rewind_action(rt: Runtime, to: str | int) -> Action:
    """The rewind action restoring the tree ``to`` names (its intent: that tree)."""
    commit = target_commit(rt, to)
    return Action(REWIND, description=f"rewind to {commit.id}", tree=str(commit.tree_id))
