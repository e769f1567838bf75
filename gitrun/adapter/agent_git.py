"""Undoing what an outside agent's own ``git`` did to a run's worktree git state.

Claude Code runs its tools unconfined in the run's worktree: a ``git commit`` there moves
the run's branch, ``git checkout -b``/``git switch`` moves the worktree's HEAD off it,
``git reset HEAD~2`` moves the branch back over receipts, ``rm .git && git init`` puts a
repository of its own in place of the worktree's ``.git``. Each of these is drift that
gitrun's recovery refuses (extra-commits, head-not-on-branch, head-moved-backwards,
dotgit-replaced), and a refusal at every hook blocks every later call: only a person
editing ``.git`` could free the run. A run driven by such an agent (and no pending step:
every move of the branch since its checkpoint is then the agent's) gets gitrun's ``.git``
file back (what stood there removed unread, as after an exec step), HEAD on the run's
branch and the branch where gitrun last recorded it; the files stay as the command left
them, so what its git did to them (a reset's reverted files, a checkout's other branch)
is the next step's change, gated and recorded like any other. The agent's commits are not
deleted: they stay in the object store and the branch's reflog.
"""

from __future__ import annotations

from pathlib import Path

import pygit2

from gitrun.adapter import dotgit
from gitrun.adapter.environment import Environment
from gitrun.store import gitstore
from gitrun.store.lease import Fence, fence_guard, fenced


def restore_run_refs(env: Environment, recorded: str, fence: Fence) -> list[str]:
    """Put the worktree's ``.git`` back (gitrun's file: a repository planted in its place
    removed unread, as after an exec step), HEAD back on the run's branch and the branch
    back at ``recorded`` (the checkpoint's HEAD), under the lease; say what was put back."""
    done: list[str] = []
    admin = Path(env.wt.path)  # opened by its admin dir, never through the .git entry
    wrong = dotgit.problem(env.worktree, admin)
    if wrong is not None:
        with fenced(env.repo, env.run_id, fence):
            dotgit.put_back(env.worktree, admin)
        done.append(f"the worktree's .git {wrong}")
    short = env.branch.removeprefix("refs/heads/")
    head = env.wt.references.get("HEAD")
    target = head.target if head is not None else None
    if target != env.branch:
        with fenced(env.repo, env.run_id, fence):
            env.wt.references.create("HEAD", env.branch, force=True)
        done.append(f"HEAD was {target if isinstance(target, str) else 'detached'}")
    want = pygit2.Oid(hex=recorded)
    tip = gitstore.read_ref(env.repo, env.branch)
    if tip != want:
        gitstore.transaction(env.repo).guard(fence_guard(env.repo, env.run_id, fence)).move(
            env.branch, tip, want,
            message="gitrun: the agent's own git moved the run's branch; put back",
            what="branch",
        ).commit()  # fmt: skip
        done.append(f"{short} was at {str(tip)[:12] if tip else 'nothing'}")
    return done
