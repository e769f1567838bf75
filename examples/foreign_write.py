"""Simulate a foreign writer that reuses a run's pending idempotency key for another change.

Used by the README's review walkthrough: after a run crashed with an intent persisted,
this commits a *different* write under the same key, as a buggy or stale caller would.
The next ``gitrun resume`` must not call that a replay: it freezes the run for review.

    python examples/foreign_write.py RUN_ID PATH CONTENT
"""

from __future__ import annotations

import sys

from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.records import Action
from gitrun.store.lease import LeaseManager


def main(run_id: str, path: str, content: str) -> None:
    opened = service.open_run(run_id, service.Options(Workspace()))
    _, stored = service.load_verified(opened)
    pending = stored.state.pending
    if pending is None:
        raise SystemExit(f"run {run_id} has no pending intent to collide with")
    lease = LeaseManager(opened.repo, run_id, "foreign-writer")
    lease.acquire(stored.state.generation)
    try:
        action = Action("write_file", path=path, content=content, description="foreign write")
        outcome = opened.env.execute(
            action, pending.key, action.intent_digest(), pending.precondition, lease.fence
        )
    finally:
        lease.release()
    print(f"foreign commit {outcome.receipt.commit[:12]} under key {pending.key}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
