"""Transitions on evidence from other parties (pure): approvals and review decisions
from humans, the verdict of the test command.

Signatures, trust roots, the re-read of the authoritative receipt and the test run are
the caller's (they need keys, git and processes); what binds to the run's state is
checked again here, so no nonce is consumed twice, no decision lands on a case that
changed, and no verdict counts for a HEAD or tree other than the last write's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gitrun.core.codec import digest, encode
from gitrun.core.errors import ApprovalRefused, EnvironmentDrift, IllegalTransition, RunFrozen
from gitrun.core.machine_events import (
    ApprovalAccepted,
    ApprovalRefreshed,
    ClearInbox,
    MachineEvent,
    Outcome,
    Persist,
    ReviewAbort,
    ReviewReplan,
    Say,
    VerifierCannotStart,
    VerifierResult,
)
from gitrun.core.records import (
    AWAITING_APPROVAL,
    DONE,
    FAILED,
    NEEDS_REVIEW,
    RUNNING,
    Event,
    RunState,
    VerifierEvent,
)


def proposing(s: RunState, e: MachineEvent) -> None:
    """What ``Runtime.step`` requires: running, and no intent waiting to execute."""
    if s.phase != RUNNING or s.pending is not None:
        raise RunFrozen(s.phase, e, f"run {s.run_id} is {s.phase}; no new proposal is accepted")


def _nonce_fresh(s: RunState, nonce: str) -> None:
    if nonce in s.used_nonces:
        raise ApprovalRefused("nonce-reused", f"nonce {nonce} was already used")


# -- approvals ---------------------------------------------------------------------------


def approval_in(
    state: RunState, evidence: Any, signer: str, nonce: str, expires_at: float, at: float
) -> ApprovalAccepted | ApprovalRefreshed:
    """The approval event for verified evidence: a refresh when evidence is already held."""
    held = state.pending is not None and state.pending.approval is not None
    cls = ApprovalRefreshed if held else ApprovalAccepted
    return cls(evidence, signer, nonce, expires_at, at)


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


def _decided(s: RunState, closed: RunState, e: ReviewReplan | ReviewAbort, key: str) -> RunState:
    """Abort: failed, evidence kept. Replan: quarantine the key, re-observe, step back."""
    if isinstance(e, ReviewAbort):
        return replace(closed, phase=FAILED, stop_reason="aborted_by_reviewer")
    env = replace(
        s.env, head=e.head, tree=e.tree, observation_version=e.head, status_digest=e.status
    )
    return replace(
        closed,
        phase=RUNNING,
        stop_reason=None,
        env=env,
        cursor=max(0, s.cursor - 1),
        quarantined_keys=(*s.quarantined_keys, key),
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
    nxt = _decided(s, closed, e, case.key).with_events(
        Event("review_decision", e.at, {"decision": decision, "signer": e.signer})
    )
    return nxt, (
        Persist(nxt),
        ClearInbox("review"),
        Say(f"review decision {decision} by {e.signer} accepted"),
    )


# -- verification ------------------------------------------------------------------------


def verifier_result(s: RunState, e: VerifierResult) -> Outcome:
    """``Runtime.verify``: done only when passing on the HEAD and tree of the last write."""
    phase, reason = (DONE, "verified") if e.passed else (FAILED, "verifier_failed")
    facts = {"exit_code": e.exit_code, "timed_out": e.timed_out, **e.extra}
    return _verdict(s, e, e.passed, dict(e.outcomes), phase, reason, facts)


def verifier_cannot_start(s: RunState, e: VerifierCannotStart) -> Outcome:
    """The test command did not start: failed, every required test an error."""
    facts = {"exit_code": None, "timed_out": False, **e.extra}
    outcomes = dict.fromkeys(e.required, "error")
    return _verdict(s, e, False, outcomes, FAILED, "verifier_cannot_start", facts)


def _verdict(
    s: RunState,
    e: VerifierResult | VerifierCannotStart,
    passed: bool,
    outcomes: dict[str, str],
    phase: str,
    reason: str,
    facts: dict[str, Any],
) -> Outcome:
    """Checkpoint a verdict bound to the last write's HEAD and tree, and its isolation."""
    proposing(s, e)
    if e.head != s.env.head:
        raise EnvironmentDrift("head-moved", f"HEAD {e.head} is not the last write {s.env.head}")
    if e.tree != s.env.tree:
        raise EnvironmentDrift(
            "tree-changed", f"tree {e.tree} is not the last write's {s.env.tree}"
        )
    ver = VerifierEvent(e.head, e.tree, passed, e.summary, outcomes, e.at, e.isolation)
    env = replace(s.env, status_digest=e.status)
    nxt = replace(s, phase=phase, stop_reason=reason, verifier=ver, env=env).with_events(
        Event("verifier", e.at, {**facts, **encode(ver)})  # extra facts never override
    )
    return nxt, (Persist(nxt), Say(f"verifier: {e.summary}"))
