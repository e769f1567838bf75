"""``gitrun status``: a run as its verified checkpoint, its branch and its lease show it.

:func:`status` returns a :class:`RunStatus` (frozen records); :meth:`RunStatus.to_json`
is what ``gitrun status --json`` prints, and :meth:`RunStatus.as_dict` its JSON value.
Two shapes: a checkpoint that verifies (:class:`CheckpointStatus`), or one that does not
(phase ``unknown`` and ``checkpoint_error``). Hooks call this once per agent tool call
(issue #15), so it is answered without pygit2 when it can be (:mod:`gitrun.app.status_read`
reads loose refs and objects in pure Python) and through pygit2 otherwise: the same
checks and the same answer either way, and this module loads no pygit2 itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gitrun.app.options import Options
from gitrun.core.codec import digest, encode
from gitrun.core.errors import CheckpointRejected, LeaseUnreadable
from gitrun.core.records import Budgets, Receipt, ReviewCase, RunState, VerifierEvent
from gitrun.store.lease_record import Lease

if TYPE_CHECKING:
    from gitrun.app.opening import Opened
    from gitrun.app.workspace import RunRecord

__all__ = [
    "CheckpointStatus",
    "LeaseStatus",
    "PendingStatus",
    "RunStatus",
    "UnreadableLease",
    "lease_status",
    "status",
    "through_pygit2",
    "unknown",
    "verified_fields",
    "where_fields",
]


@dataclass(frozen=True)
class LeaseStatus:
    """The run's lease, and whether it was live when status read it."""

    lease: Lease
    live: bool

    def as_dict(self) -> dict[str, Any]:
        return {**encode(self.lease), "live": self.live}


@dataclass(frozen=True)
class UnreadableLease:
    """A lease ref that holds no gitrun lease (rewritten by hand?): shown, not fatal."""

    reason: str
    oid: str

    def as_dict(self) -> dict[str, Any]:
        return {"unreadable": self.reason, "oid": self.oid}


@dataclass(frozen=True)
class PendingStatus:
    """The pending action as status shows it: its key, summary, digest, risk, approval."""

    key: str
    action: str
    intent_digest: str
    risk: str | None
    approval: Any | None  # the signed approval evidence (encoded), as the checkpoint holds it

    @classmethod
    def of(cls, s: RunState) -> PendingStatus | None:
        p = s.pending
        if p is None:
            return None
        return cls(p.key, p.action.summary(), p.intent_digest, p.risk, p.approval)

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "action": self.action,
            "intent_digest": self.intent_digest,
            "risk": self.risk,
            "approval": self.approval,
        }


@dataclass(frozen=True)
class CheckpointStatus:
    """What only a verified checkpoint tells: where it is and what it holds."""

    generation: int
    ref: str
    oid: str
    instance_id: str
    budgets: Budgets
    review: ReviewCase | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "checkpoint_ref": self.ref,
            "checkpoint": self.oid,
            "instance_id": self.instance_id,
            "budgets": encode(self.budgets),
            "review": None if self.review is None else encode(self.review),
        }


@dataclass(frozen=True)
class RunStatus:
    """Everything a user needs to know about a run. Exactly one of ``checkpoint`` (it
    verified) and ``checkpoint_error`` (it did not: phase ``unknown``) is set."""

    run_id: str
    repo: str
    worktree: str
    branch: str
    task_dir: str
    workspace: str
    key_file: str
    lease: LeaseStatus | UnreadableLease | None
    task_id: str
    phase: str
    stop_reason: str | None
    head: str | None
    pending: PendingStatus | None
    receipts: tuple[Receipt, ...]
    verifier: VerifierEvent | None
    checkpoint: CheckpointStatus | None
    checkpoint_error: str | None = None
    agent_isolation: dict[str, str] | None = None
    unrecorded_receipt: str | None = None  # the last write's commit, not checkpointed yet

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.checkpoint_error is None):
            raise ValueError("a run status has either a verified checkpoint or its error")

    @property
    def isolation(self) -> str | None:
        """The isolation the last verdict ran under, or None before any verdict."""
        return None if self.verifier is None else self.verifier.isolation

    def as_dict(self) -> dict[str, Any]:
        """The JSON value ``gitrun status --json`` prints (its keys, exactly)."""
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "repo": self.repo,
            "worktree": self.worktree,
            "branch": self.branch,
            "task_dir": self.task_dir,
            "workspace": self.workspace,
            "key_file": self.key_file,
            "lease": None if self.lease is None else self.lease.as_dict(),
            "task_id": self.task_id,
            "phase": self.phase,
            "stop_reason": self.stop_reason,
            "head": self.head,
            "pending": None if self.pending is None else self.pending.as_dict(),
            "unrecorded_receipt": self.unrecorded_receipt,
            "receipts": [encode(r) for r in self.receipts],
            "verifier": None if self.verifier is None else encode(self.verifier),
            "isolation": self.isolation,
            "agent_isolation": self.agent_isolation,
        }
        if self.checkpoint is None:
            return {**out, "checkpoint_error": self.checkpoint_error}
        return {**out, **self.checkpoint.as_dict()}

    def to_json(self) -> str:
        """``gitrun status --json``: indented, keys sorted."""
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)


def status(run_id: str, opts: Options) -> RunStatus:
    """Everything a user needs to know about a run, from the verified checkpoint."""
    from gitrun.app.status_read import quick

    found = quick(run_id, opts)
    return found if found is not None else through_pygit2(run_id, opts)


def through_pygit2(run_id: str, opts: Options) -> RunStatus:
    """:func:`status` through pygit2: any repository, any object store, a remote."""
    from gitrun.app.opening import load_verified, open_run

    opened = open_run(run_id, opts)
    where = where_fields(opened.record, opts, _lease(opened))
    try:
        ref, stored = load_verified(opened, check_scenario=False)
    except CheckpointRejected as exc:
        return unknown(where, opened.task.id, exc)
    state, oid = stored.state, str(stored.oid)
    return RunStatus(**where, **verified_fields(state, ref, oid, opened.env.receipts()))


def where_fields(
    rec: RunRecord, opts: Options, lease: LeaseStatus | UnreadableLease | None
) -> dict[str, Any]:
    """Where the run lives, and its lease: what status shows whether or not it verifies."""
    return {
        "run_id": rec.run_id,
        "repo": rec.repo,
        "worktree": rec.worktree,
        "branch": rec.branch.removeprefix("refs/heads/"),
        "task_dir": rec.task_dir,
        "workspace": str(opts.workspace.root),
        "key_file": str(opts.workspace.key_file),
        "lease": lease,
    }


def unknown(where: dict[str, Any], task_id: str, exc: CheckpointRejected) -> RunStatus:
    """The status of a run whose checkpoint does not verify: phase ``unknown``, and why."""
    return RunStatus(
        **where, task_id=task_id, phase="unknown", stop_reason=None, head=None,
        pending=None, receipts=(), verifier=None, checkpoint=None, checkpoint_error=str(exc),
    )  # fmt: skip


def verified_fields(s: RunState, ref: str, oid: str, receipts: list[Receipt]) -> dict[str, Any]:
    """The fields of a verified checkpoint (and the receipts on the run's branch)."""
    checkpoint = CheckpointStatus(s.generation, ref, oid, s.env.instance_id, s.budgets, s.review)
    landed = _landed(s, receipts)
    return {
        "task_id": s.task_id,
        "phase": s.phase,
        "stop_reason": s.stop_reason,
        "head": s.env.head if landed is None else landed.commit,
        "pending": PendingStatus.of(s) if landed is None else None,
        "unrecorded_receipt": None if landed is None else landed.commit,
        "receipts": tuple(receipts),
        "verifier": s.verifier,
        "checkpoint": checkpoint,
        "agent_isolation": s.agent_isolation,
    }


def _landed(s: RunState, receipts: list[Receipt]) -> Receipt | None:
    """The pending write when its commit is already the branch tip: a step's receipt rides
    in the run's next checkpoint, so a run stopped in between shows the write done."""
    p, last = s.pending, (receipts[-1] if receipts else None)
    if p is None or last is None or last.key != p.key or last.parent != s.env.head:
        return None
    if last.intent_digest != p.intent_digest:
        return None  # another intent under the key: resume opens a review case
    if p.risk is not None and (p.approval is None or last.approval != digest(p.approval)):
        return None  # not covered by the checkpoint's approval: resume opens a review case
    return last


def _lease(opened: Opened) -> LeaseStatus | UnreadableLease | None:
    """The lease as status shows it; a ref rewritten to garbage is shown, not fatal."""
    from gitrun.store.lease import read_lease

    try:
        lease, _ = read_lease(opened.repo, opened.record.run_id)
    except LeaseUnreadable as exc:
        return UnreadableLease(str(exc), exc.oid)
    return lease_status(lease)


def lease_status(lease: Lease | None) -> LeaseStatus | None:
    """A lease as status shows it: live when it expires after now."""
    return None if lease is None else LeaseStatus(lease, lease.expires_at > time.time())
