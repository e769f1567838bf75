"""Read-only and evidence use cases behind the CLI: status (:mod:`gitrun.app.status`),
receipts, checkpoints, verify, rewitness, approve and review.

None of them drives a run. ``gitrun status`` (hooks call it once per agent tool call,
issue #15) imports this module on its fast path, so whatever only approving or reviewing
needs (approvals, evidence signing, diffs) is imported inside those functions.
:mod:`gitrun.app.service` re-exports every use case here.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gitrun.adapter.gittypes import commit_at
from gitrun.app.opening import Options, load_verified, open_run, the_ref
from gitrun.app.status import status as status  # noqa: PLC0414 - re-export
from gitrun.core.codec import encode
from gitrun.core.errors import BadInput, CheckpointRejected
from gitrun.core.records import AWAITING_APPROVAL, RunState
from gitrun.store.checkpoint import Stored

if TYPE_CHECKING:
    from gitrun.store.evidence import Signed

__all__ = [
    "approve",
    "checkpoints",
    "receipts",
    "review_case",
    "review_decide",
    "rewitness",
    "status",
    "verify",
]


def receipts(run_id: str, opts: Options) -> list[dict[str, Any]]:
    opened = open_run(run_id, opts)
    return [encode(r) for r in opened.env.receipts()]


def checkpoints(run_id: str, opts: Options) -> list[Stored]:
    opened = open_run(run_id, opts)
    ref = the_ref(opened)
    if ref is None:
        raise CheckpointRejected("high-water-mark-missing", f"run {run_id} has no checkpoint ref")
    return opened.store.chain(ref)


def verify(run_id: str, opts: Options, task_dir: Path | None) -> Stored:
    opened = open_run(run_id, opts, task_dir)
    _, stored = load_verified(opened)
    return stored


def rewitness(run_id: str, opts: Options, generation: int) -> Stored:
    """Accept the checkpoint the ref holds now as the newest (after restoring a backup)."""
    opened = open_run(run_id, opts)
    ref = the_ref(opened)
    if ref is None:
        raise CheckpointRejected("high-water-mark-missing", f"run {run_id} has no checkpoint ref")
    return opened.store.rewitness(ref, generation)


MAX_TTL_SECONDS = 366 * 86400


def ttl_seconds(text: str) -> float:
    """A ``--ttl`` duration in seconds: finite, positive, at most a year (bad input else)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(number) * units[unit]
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise BadInput(f"--ttl {text!r} is not a duration like 90s, 30m, 1h or 2d")
    if value > MAX_TTL_SECONDS:
        raise BadInput(f"--ttl {text!r} is longer than 366d; approvals are meant to expire")
    return value


def approve(
    run_id: str, opts: Options, key_file: Path, ttl_seconds: float, note: str
) -> tuple[RunState, Signed, str]:
    """Sign an approval for the pending action and leave it for the runtime."""
    from gitrun.adapter.show import action_diff
    from gitrun.engine.approvals import approval_claims, submit
    from gitrun.store.evidence import APPROVAL_DOMAIN, load_trust_roots
    from gitrun.store.evidence import sign as sign_evidence
    from gitrun.store.evidence import verify as verify_evidence

    opened = open_run(run_id, opts)
    _, stored = load_verified(opened)
    state = stored.state
    if state.phase != AWAITING_APPROVAL or state.pending is None:
        raise BadInput(f"run {run_id} is {state.phase}; there is nothing to approve")
    claims = approval_claims(state, note, ttl_seconds)
    signed = sign_evidence(claims, key_file, "approver", APPROVAL_DOMAIN)
    if opts.trust_roots is not None:
        verify_evidence(signed, load_trust_roots(opts.trust_roots), "approver", APPROVAL_DOMAIN)
    submit(opened.repo, run_id, "approval", signed, opened.site)
    base = commit_at(opened.repo, state.pending.precondition.head)
    tree = base.tree if base is not None else opened.env.head().tree
    return state, signed, action_diff(opened.repo, state.pending.action, tree)


def review_case(run_id: str, opts: Options) -> tuple[RunState, str]:
    """The open review case and its two diffs side by side."""
    from gitrun.adapter.show import action_diff, commit_diff, side_by_side

    opened = open_run(run_id, opts)
    _, stored = load_verified(opened)
    state = stored.state
    case = state.review
    if case is None or state.pending is None:
        raise BadInput(f"run {run_id} is {state.phase}; it has no open review case")
    base = commit_at(opened.repo, state.pending.precondition.head)
    tree = base.tree if base is not None else opened.env.head().tree
    left = action_diff(opened.repo, case.action, tree)
    if case.receipt is None:  # an interrupted exec: nothing was committed
        title, right = "no receipt", case.reason + "\n"
    else:
        title = f"committed receipt {case.receipt.commit[:12]} {case.receipt_digest[:23]}"
        right = commit_diff(opened.repo, case.receipt.commit)
    text = side_by_side(f"pending intent {case.pending_digest[:23]}", left, title, right)
    return state, text


def review_decide(run_id: str, opts: Options, key_file: Path, decision: str) -> Signed:
    from gitrun.engine.approvals import review_claims, submit
    from gitrun.store.evidence import REVIEW_DOMAIN
    from gitrun.store.evidence import sign as sign_evidence

    opened = open_run(run_id, opts)
    _, stored = load_verified(opened)
    if decision not in ("replan", "abort"):
        raise BadInput(f"decision must be replan or abort, not {decision!r}")
    if stored.state.review is None:
        raise BadInput(f"run {run_id} is {stored.state.phase}; it has no open review case")
    signed = sign_evidence(
        review_claims(stored.state, decision), key_file, "reviewer", REVIEW_DOMAIN
    )
    submit(opened.repo, run_id, "review", signed, opened.site)
    return signed


def review_text(run_id: str, state: RunState, diffs: str) -> str:
    """What ``gitrun review show`` prints: the case's digests, receipt and both diffs."""
    case = state.review
    if case is None:
        raise BadInput(f"run {run_id} is {state.phase}; it has no open review case")
    r = case.receipt
    receipt = (
        "none (the command was interrupted; nothing committed)"
        if r is None
        else f"{r.namespace} {r.version} commit {r.commit} tree {r.tree}"
    )
    return "\n".join(
        [
            f"run {run_id}: needs_review ({case.reason})",
            f"key              {case.key}",
            f"pending intent   {case.pending_digest}  ({case.action.summary()})",
            f"receipt intent   {case.receipt_digest}",
            f"receipt          {receipt}",
            f"receipt print    {case.receipt_fingerprint}",
            f"environment      {case.environment_version}",
            diffs.rstrip("\n"),
            f"decide: gitrun review decide {run_id} --key REVIEWER.key replan|abort",
        ]
    )


def approval_text(run_id: str, state: RunState, signed: Signed, diff: str) -> str:
    """What ``gitrun approve`` prints: the action, its diff, and the evidence made."""
    p = state.pending
    if p is None:
        raise BadInput(f"run {run_id} is {state.phase}; there is nothing to approve")
    expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(signed.claims["expires_at"]))
    return "\n".join(
        [
            f"run {run_id} generation {state.generation}: {p.action.summary()}",
            f"risk: {p.risk}   key: {p.key}   intent: {p.intent_digest}",
            diff.rstrip("\n"),
            f"approved by {signed.signer}: evidence {signed.fingerprint()} valid until {expires}",
            f"next: gitrun resume {run_id} --trust-roots TRUST_ROOTS.json",
        ]
    )
