"""Tool calls that changed nothing: one record each on the run's call log, never a commit
on the run's branch.

The log is the ref ``refs/gitrun/runs/<run>/calls``: a chain of commits beside the
branch, one per call, newest first (``git log refs/gitrun/runs/RUN/calls``). Each commit's
tree is the call's output (``stdout``, ``stderr``: ``git show COMMIT:stdout``) and its
trailers say what the call was — its key (Claude Code's ``tool_use_id``), the intent
digest of its input, the tool, the session, Bash's exit status — and where the branch
stood (``Gitrun-Head``). A key is recorded at most once: :func:`find` looks it up in the
log before :func:`append` writes, under the run's lease, and the ref moves by
compare-and-swap (the one durable ref-update path). ``gitrun rm`` removes the ref with
the run's other refs, and ``git gc`` then frees the records.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pygit2

from gitrun.adapter.environment import AUTHOR, Environment
from gitrun.adapter.exec_step import output_digest, output_tree
from gitrun.core import trailer
from gitrun.store import gitstore

HEAD_TRAILER = "Gitrun-Head"


def ref_name(run_id: str) -> str:
    return f"refs/gitrun/runs/{run_id}/calls"


def find(env: Environment, key: str) -> str | None:
    """The record of ``key`` on the run's call log (its commit id), or None."""
    tip = gitstore.read_ref(env.repo, ref_name(env.run_id))
    if tip is None:
        return None
    for commit in env.repo.walk(tip, pygit2.enums.SortMode.TOPOLOGICAL):
        if commit.message_trailers.get(trailer.IDEMPOTENCY_KEY) == key:
            return str(commit.id)
    return None


def append(
    env: Environment,
    subject: str,
    pairs: Sequence[tuple[str, str]],
    stdout: bytes,
    stderr: bytes,
) -> str:
    """One record on the call log: ``subject``, the ``pairs`` as trailers (after the run's
    and the branch head's), the output as its tree. Durable when this returns."""
    repo = env.repo
    name = ref_name(env.run_id)
    tip = gitstore.read_ref(repo, name)
    head = gitstore.read_ref(repo, env.branch)
    tree = output_tree(repo, stdout, stderr)
    message = trailer.write_message(
        subject,
        "A tool call that changed no file: recorded here, not on the run's branch.",
        [
            (trailer.RUN, env.run_id),
            *pairs,
            (HEAD_TRAILER, str(head) if head is not None else "none"),
            ("Gitrun-Output-Digest", output_digest(stdout, stderr)),
        ],
    )
    sig = pygit2.Signature(*AUTHOR, int(time.time()), 0)
    oid = repo.create_commit(None, sig, sig, message, tree, [tip] if tip is not None else [])
    gitstore.transaction(repo).move(
        name, tip, oid, message="gitrun: a call that changed nothing"
    ).commit()
    return str(oid)
