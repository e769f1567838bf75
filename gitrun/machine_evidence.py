"""Transitions on evidence from other parties: approvals in, review decisions in (pure).

Signatures, trust roots and the re-read of the authoritative receipt are checked by the
caller (they need keys and git); what binds to the run's state is checked again here,
so no nonce is consumed twice and no decision lands on a case that changed.
"""

from __future__ import annotations

from dataclasses import replace

from gitrun.codec import digest, encode
from gitrun.errors import ApprovalRefused, IllegalTransition
from gitrun.machine_events import (
    ApprovalAccepted,
    ApprovalRefreshed,
    ClearInbox,
    Outcome,
    Persist,
    ReviewAbort,
    ReviewReplan,
    Say,
)
from gitrun.records import AWAITING_APPROVAL, FAILED, NEEDS_REVIEW, RUNNING, Event, RunState


def _nonce_fresh(s: RunState, nonce: str) -> None:
    if nonce in s.used_nonces:
        raise ApprovalRefused("nonce-reused", f"nonce {nonce} was already used")


# -- approvals ---------------------------------------------------------------------------


def approval(s: RunState, e: ApprovalAccepted | ApprovalRefreshed) -> Outcome:
    """``Approvals.intake_approval``: fresh evidence replaces any held one (sealed)."""
    p = s.pending
    if s.phase != AWAITING_APPROVAL or p is None:
        raise IllegalTransition(s.phase, e, f"run {s.run_id} has no action waiting for approval")
    if isinstance(e, ApprovalRefreshed) != (p.approval is not None):
        what = "replaces no held evidence" if p.approval is None else "would drop held evidence"
        raise IllegalTransition(s.phase, e, f"{type(e).__name__} {what}")
    _nonce_fresh(s, e.nonce)
    if e.expires_at <= e.at:
        raise ApprovalRefused("expired", "the approval has already expired; approve again")
    sealed = s.sealed
    if p.approval is not None:
        sealed = (*sealed, {"kind": "approval_superseded", "evidence": p.approval, "at": e.at})
    fingerprint = digest(e.evidence)
    data = {"fingerprint": fingerprint, "signer": e.signer, "expires_at": e.expires_at}
    nxt = replace(
        s,
        pending=replace(p, approval=e.evidence),
        phase=RUNNING,
        stop_reason=None,
        sealed=sealed,
        used_nonces=(*s.used_nonces, e.nonce),
    ).with_events(Event("approval", e.at, data))
    return nxt, (
        Persist(nxt),
        ClearInbox("approval"),
        Say(f"approval {fingerprint[:19]} by {e.signer} accepted"),
    )


# -- reviews -----------------------------------------------------------------------------


def review(s: RunState, e: ReviewReplan | ReviewAbort) -> Outcome:
    """``Approvals.intake_review``: a trusted decision on a case the re-read still shows."""
    case, p = s.review, s.pending
    if s.phase != NEEDS_REVIEW or case is None or p is None:
        raise IllegalTransition(s.phase, e, f"run {s.run_id} has no open review case")
    _nonce_fresh(s, e.nonce)
    if e.reread_fingerprint != case.receipt_fingerprint:
        raise ApprovalRefused(
            "receipt-changed", f"the receipt for {case.key} changed after the decision was signed"
        )
    if e.head != case.environment_version:
        raise ApprovalRefused(
            "environment-changed", f"the branch moved to {e.head} after the decision was signed"
        )
    decision = "abort" if isinstance(e, ReviewAbort) else "replan"
    sealed_case = {
        "kind": "review",
        "case": encode(case),
        "decision": e.evidence,
        "pending": encode(p),
        "at": e.at,
    }
    closed = replace(
        s,
        pending=None,
        review=None,
        sealed=(*s.sealed, sealed_case),
        used_nonces=(*s.used_nonces, e.nonce),
    )
    if isinstance(e, ReviewAbort):
        nxt = replace(closed, phase=FAILED, stop_reason="aborted_by_reviewer")
    else:
        env = replace(
            s.env, head=e.head, tree=e.tree, observation_version=e.head, status_digest=e.status
        )
        nxt = replace(
            closed,
            phase=RUNNING,
            stop_reason=None,
            env=env,
            cursor=max(0, s.cursor - 1),
            quarantined_keys=(*s.quarantined_keys, case.key),
        )
    nxt = nxt.with_events(
        Event("review_decision", e.at, {"decision": decision, "signer": e.signer})
    )
    return nxt, (
        Persist(nxt),
        ClearInbox("review"),
        Say(f"review decision {decision} by {e.signer} accepted"),
    )
