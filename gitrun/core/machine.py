"""The run's state machine, pure: ``transition(state, event) -> (state, effects)``.

Every phase change of docs/design.md §4, §6, §7 and of the seed's diagram is one event here.
Nothing in this module does I/O, reads a clock or imports pygit2: time arrives on the
events, and what must happen in the world (a checkpoint advance, a write, a verifier
run) leaves as effects, in order, for the runtime to perform. An event the current
phase does not accept raises :class:`IllegalTransition`; it never passes silently.

A step is two commit points, not three: the intent checkpoint, then the write commit.
The receipt is not checkpointed on its own: it is held (:class:`Hold`) and rides in the
next checkpoint the run writes anyway. So at most one receipt is ever unwritten, always
the one of the checkpoint's own pending key, and nothing executes until it is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gitrun.core import machine_evidence
from gitrun.core.codec import digest, encode
from gitrun.core.errors import EnvironmentDrift, IllegalTransition, RunFrozen
from gitrun.core.machine_events import (
    ApprovalAccepted,
    ApprovalExpired,
    ApprovalRefreshed,
    BudgetExhausted,
    ClearInbox,
    Effect,
    Execute,
    ExecuteDue,
    Finished,
    Freeze,
    Grant,
    Hold,
    MachineEvent,
    Outcome,
    Pause,
    PendingRejectedAtExecute,
    Persist,
    ProposalRejected,
    Proposed,
    ReceiptConflict,
    ReviewAbort,
    ReviewReplan,
    RunVerifier,
    Say,
    SyncIndex,
    VerifierCannotStart,
    VerifierResult,
    WriteReceipt,
)
from gitrun.core.machine_evidence import approval_in, proposing
from gitrun.core.records import (
    AWAITING_APPROVAL,
    FAILED,
    NEEDS_REVIEW,
    RUNNING,
    Event,
    Pending,
    Receipt,
    ReviewCase,
    RunState,
    kind_allowed,
)

__all__ = [
    "AGENT_WRITE_REFUSED",
    "CONFLICT_REASON",
    "INDEX_SYNC_EVERY",
    "ApprovalAccepted",
    "ApprovalExpired",
    "ApprovalRefreshed",
    "BudgetExhausted",
    "ClearInbox",
    "Effect",
    "Execute",
    "ExecuteDue",
    "Finished",
    "Freeze",
    "Grant",
    "Hold",
    "IllegalTransition",
    "MachineEvent",
    "Outcome",
    "Pause",
    "PendingRejectedAtExecute",
    "Persist",
    "ProposalRejected",
    "Proposed",
    "ReceiptConflict",
    "ReviewAbort",
    "ReviewReplan",
    "RunFrozen",
    "RunVerifier",
    "Say",
    "SyncIndex",
    "VerifierCannotStart",
    "VerifierResult",
    "WriteReceipt",
    "approval_in",
    "frozen_message",
    "stamp",
    "transition",
]

INDEX_SYNC_EVERY = 32  # writes between two syncs of the worktree's index (O(files) each)
CONFLICT_REASON = "same idempotency key, different intent digest"
AGENT_WRITE_REFUSED = "agent_write_refused"  # stop reason: the agent's last write was refused


def frozen_message(s: RunState) -> str:
    """Why the run stopped, and what a human does next (the CLI prints this line)."""
    if s.phase == AWAITING_APPROVAL and s.pending is not None:
        return (
            f"run {s.run_id} waits for approval of {s.pending.action.summary()} "
            f"(risk: {s.pending.risk}; {s.stop_reason}); approve with: "
            f"gitrun approve {s.run_id} --key APPROVER.key, then: "
            f"gitrun resume {s.run_id} --trust-roots TRUST_ROOTS.json"
        )
    if s.phase == NEEDS_REVIEW and s.review is not None:
        return (
            f"run {s.run_id} needs review ({s.review.reason}) for key {s.review.key}; "
            f"see: gitrun review show {s.run_id}"
        )
    return f"run {s.run_id} is {s.phase} ({s.stop_reason})"


def stamp(
    state: RunState,
    *,
    generation: int,
    elapsed: float,
    worker: str,
    lease_version: int,
    now: float,
) -> RunState:
    """The state a checkpoint advance writes (what ``Runtime.commit`` adds to a Persist)."""
    used = replace(state.budgets, wall_seconds=state.budgets.wall_seconds + elapsed)
    return state.evolve(
        generation=generation,
        budgets=used,
        identity=worker,
        lease_version=lease_version,
        updated_at=now,
    )


def transition(state: RunState, event: MachineEvent) -> Outcome:
    """The next state and the effects to perform, in order; raise if ``event`` is illegal."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise IllegalTransition(state.phase, event, f"unknown event {type(event).__name__}")
    return handler(state, event)


# -- guards ----------------------------------------------------------------------------


def _executing(s: RunState, e: MachineEvent) -> Pending:
    """What ``Runtime.execute_pending`` requires: running, with a persisted intent."""
    if s.pending is None:
        raise IllegalTransition(s.phase, e, "no pending action to execute")
    if s.phase != RUNNING:
        raise RunFrozen(s.phase, e, frozen_message(s))
    if s.events:
        # Every state that sets a pending is persisted at once; unwritten events here
        # would mean a write whose intent (or whose predecessor's receipt) no checkpoint has.
        raise IllegalTransition(s.phase, e, "the run's state is ahead of its checkpoint")
    return s.pending


def _reconciling(s: RunState, e: WriteReceipt | ReceiptConflict) -> Pending:
    """A receipt is taken in only for the pending intent's own key, outside review."""
    p = s.pending
    if p is None or s.phase not in (RUNNING, AWAITING_APPROVAL):
        raise IllegalTransition(s.phase, e, f"run {s.run_id} is {s.phase}; no receipt expected")
    if e.receipt.key != p.key:
        raise IllegalTransition(
            s.phase, e, f"receipt {e.receipt.commit} is for {e.receipt.key}, not {p.key}"
        )
    if not e.receipt.commit:
        raise IllegalTransition(s.phase, e, "a receipt needs its commit id")
    return p


# -- proposals ---------------------------------------------------------------------------


def _proposed(s: RunState, e: Proposed) -> Outcome:
    proposing(s, e)
    why = _bad_intent(s, e)
    if why is not None:
        raise IllegalTransition(s.phase, e, why)
    pending = Pending(e.action, e.key, e.digest, e.risk, e.precondition, None, e.at)
    data = {"key": e.key, "action": e.action.summary(), "digest": e.digest, "risk": e.risk}
    budgets = replace(s.budgets, proposals=s.budgets.proposals + 1)
    nxt = s.evolve(pending=pending, cursor=s.cursor + 1, budgets=budgets).with_events(
        Event("intent", e.at, data)
    )
    line = f"intent {e.key}: {e.action.summary()}"
    if e.risk is None:
        return nxt, (Persist(nxt), Say(line))
    nxt = replace(nxt, phase=AWAITING_APPROVAL, stop_reason="awaiting_approval")
    return nxt, (
        Persist(nxt),
        Say(f"{line} [needs approval: {e.risk}]"),
        Freeze("awaiting_approval", frozen_message(nxt)),
    )


def _bad_intent(s: RunState, e: Proposed) -> str | None:
    """Why this intent would make an invalid checkpoint (validate_state's pending rules)."""
    if e.digest != e.action.intent_digest():
        return "the intent digest does not match its action"
    if e.key in s.quarantined_keys:
        return f"key {e.key} is quarantined"
    last = s.receipts.last
    if last is not None and last.key == e.key and last.intent_digest == e.digest:
        return f"key {e.key} is already a recorded receipt"  # another digest: a conflict
    if not kind_allowed(e.action.kind, s.scope.allowed_actions):
        return f"{e.action.kind} is outside the allowed scope"
    if e.precondition.instance_id != s.env.instance_id:
        return "the precondition names another environment instance"
    return None


def _gate_event(rule: str, message: str, summary: str, at: float) -> Event:
    return Event("gate_rejected", at, {"rule": rule, "message": message, "action": summary})


def _proposal_rejected(s: RunState, e: ProposalRejected) -> Outcome:
    proposing(s, e)
    if e.rule.startswith("budget-"):
        return _exhausted(s, e.rule, e.message, e.summary, e.at)
    budgets = replace(s.budgets, proposals=s.budgets.proposals + 1)
    nxt = replace(s, cursor=s.cursor + 1, budgets=budgets).with_events(
        _gate_event(e.rule, e.message, e.summary, e.at)
    )
    said = Say(f"gate rejected {e.summary}: {e.message}")
    if not e.last:
        # An earlier refusal may be recovered from by the writes after it (later steps).
        return nxt, (said, Persist(nxt))
    nxt = replace(nxt, phase=FAILED, stop_reason=AGENT_WRITE_REFUSED)
    why = f"run {s.run_id} failed: the agent's last write was refused ({e.rule})"
    return nxt, (said, Persist(nxt), Say(why))


def _budget_exhausted(s: RunState, e: BudgetExhausted) -> Outcome:
    proposing(s, e)
    if not e.rule.startswith("budget-"):
        raise IllegalTransition(s.phase, e, f"{e.rule} is not a budget rule")
    return _exhausted(s, e.rule, e.message, e.summary, e.at)


def _exhausted(s: RunState, rule: str, message: str, summary: str, at: float) -> Outcome:
    nxt = replace(s, phase=FAILED, stop_reason="budget_exhausted").with_events(
        _gate_event(rule, message, summary, at)
    )
    return nxt, (Say(f"gate rejected {summary}: {message}"), Persist(nxt))


def _finished(s: RunState, e: Finished) -> Outcome:
    proposing(s, e)
    return s, (RunVerifier(s.env.head, s.env.tree),)


# -- execution ---------------------------------------------------------------------------


def _execute_due(s: RunState, e: ExecuteDue) -> Outcome:
    p = _executing(s, e)
    if p.risk is None:
        if e.grant is not None:
            raise IllegalTransition(s.phase, e, "a write without risk carries no approval")
        return s, (Execute(p, None),)
    if p.approval is None:
        return _freeze(s, "awaiting_approval", e.at)
    grant = _grant_of(s, p, e, e.grant)
    if grant.expires_at <= e.at:
        return _freeze(s, "approval_expired", e.at)
    return s, (Execute(p, grant),)


def _grant_of(s: RunState, p: Pending, e: MachineEvent, grant: Grant | None) -> Grant:
    """The verified grant of the pending's own evidence (the runtime checked the signature)."""
    if grant is None or p.approval is None or grant.fingerprint != digest(p.approval):
        raise IllegalTransition(s.phase, e, "the grant is not the pending approval's evidence")
    return grant


def _freeze(s: RunState, reason: str, at: float) -> Outcome:
    nxt = replace(s, phase=AWAITING_APPROVAL, stop_reason=reason).with_events(
        Event("frozen", at, {"reason": reason})
    )
    return nxt, (Persist(nxt), Freeze(reason, frozen_message(nxt)))


def _approval_expired(s: RunState, e: ApprovalExpired) -> Outcome:
    p = _executing(s, e)
    if p.risk is None or p.approval is None:
        raise IllegalTransition(s.phase, e, "the pending action holds no approval to expire")
    return _freeze(s, "approval_expired", e.at)


def _rejected_at_execute(s: RunState, e: PendingRejectedAtExecute) -> Outcome:
    p = _executing(s, e)
    if e.rule.startswith("budget-"):
        raise IllegalTransition(s.phase, e, "a persisted intent is not re-gated on budgets")
    summary = p.action.summary()
    data = {"rule": e.rule, "message": e.message, "action": summary, "key": p.key}
    nxt = replace(s, pending=None).with_events(
        Event("gate_rejected", e.at, {**data, "at": "execute"})
    )
    return nxt, (Say(f"gate rejected pending {summary}: {e.message}; abandoned"), Persist(nxt))


# -- receipts ----------------------------------------------------------------------------


def _write_receipt(s: RunState, e: WriteReceipt) -> Outcome:
    """``Runtime.accept``: record the receipt unless only a human can reconcile it."""
    p = _reconciling(s, e)
    r = e.receipt
    if r.intent_digest != p.intent_digest:
        return _open_review(s, p, r, CONFLICT_REASON, e.environment_version, e.at)
    if p.risk is not None:
        problem = _receipt_problem(s, p, e)
        if problem is not None:
            return _open_review(s, p, r, problem, e.environment_version, e.at)
    if s.phase != RUNNING:
        # A covered write found while awaiting approval. docs/design.md §4 would reconcile it
        # (record, go running); the runtime before the machine tried to record it keeping
        # the phase, an invalid checkpoint validate_state refused (exit 5). No real run
        # reaches it: the key is looked up before any freeze, and a crash after the write
        # resumes running (only a hand-made commit of the exact write lands here). Kept a
        # refusal that changes nothing, until a test shows the path.
        raise IllegalTransition(
            s.phase, e, f"run {s.run_id} is {s.phase}: recording would leave it without a pending"
        )
    return _record(s, p, r, e.replayed, e.at)


def _receipt_problem(s: RunState, p: Pending, e: WriteReceipt) -> str | None:
    """Why a receipt of a risky write cannot be reconciled automatically, if it can't."""
    if p.approval is None:
        return "the write committed without approval evidence in the checkpoint"
    grant = _grant_of(s, p, e, e.grant)
    if e.receipt.approval != grant.fingerprint:
        return "the write carries another approval than the checkpoint's"
    if e.receipt.committed_at > grant.expires_at:
        return "the write committed after its approval expired"
    return None


def _record(s: RunState, p: Pending, r: Receipt, replayed: bool, at: float) -> Outcome:
    """``Runtime.record``: the deterministic transition a receipt proves."""
    if r.parent != p.precondition.head or r.instance_id != p.precondition.instance_id:
        raise EnvironmentDrift(
            "foreign-commit", f"receipt {r.commit} was not made on the intent's precondition"
        )
    env = replace(
        s.env,
        head=r.commit,
        tree=r.tree,
        observation_version=r.commit,
        adapter_generation=s.env.adapter_generation + 1,
    )
    budgets = replace(s.budgets, steps=s.budgets.steps + 1)
    data = {"receipt": encode(r), "replayed": replayed, "fingerprint": r.fingerprint()}
    nxt = s.evolve(pending=None, env=env, budgets=budgets, receipts=s.receipts.add(r)).with_events(
        Event("receipt", at, data)
    )
    how = "reconciled" if replayed else "committed"
    # No checkpoint of its own: the receipt rides in the run's next one (see the module
    # docstring); until then the write commit is the authority and resume reconciles.
    effects: tuple[Effect, ...] = (Hold(nxt), Say(f"{how} {r.commit[:12]} for {r.key}"))
    if env.adapter_generation % INDEX_SYNC_EVERY == 0:
        effects = (*effects, SyncIndex())
    return nxt, effects


def _receipt_conflict(s: RunState, e: ReceiptConflict) -> Outcome:
    p = _reconciling(s, e)
    if e.receipt.intent_digest == p.intent_digest:
        raise IllegalTransition(s.phase, e, "the receipt has the pending intent's digest")
    return _open_review(s, p, e.receipt, CONFLICT_REASON, e.environment_version, e.at)


def _open_review(
    s: RunState, p: Pending, r: Receipt, reason: str, environment_version: str, at: float
) -> Outcome:
    """``Runtime.open_review``: freeze with the case kept whole; the pending stays."""
    case = ReviewCase(
        action=p.action,
        key=p.key,
        pending_digest=p.intent_digest,
        receipt_digest=r.intent_digest,
        receipt=r,
        receipt_fingerprint=r.fingerprint(),
        environment_version=environment_version,
        reason=reason,
        opened_at=at,
    )
    nxt = replace(s, phase=NEEDS_REVIEW, stop_reason="receipt_conflict", review=case).with_events(
        Event("receipt_conflict", at, {"case": encode(case)})
    )
    return nxt, (
        Persist(nxt),
        Say(f"review needed for {p.key}: {reason}; run frozen"),
        Freeze("receipt_conflict", frozen_message(nxt)),
    )


def _pause(s: RunState, e: Pause) -> Outcome:
    """The driver stops: write what is still held (a riding receipt), else nothing."""
    del e
    return s, ((Persist(s),) if s.events else ())


_HANDLERS: dict[type, Callable[[RunState, Any], Outcome]] = {
    Proposed: _proposed,
    ProposalRejected: _proposal_rejected,
    BudgetExhausted: _budget_exhausted,
    Finished: _finished,
    ExecuteDue: _execute_due,
    ApprovalExpired: _approval_expired,
    PendingRejectedAtExecute: _rejected_at_execute,
    WriteReceipt: _write_receipt,
    ReceiptConflict: _receipt_conflict,
    ApprovalAccepted: machine_evidence.approval,
    ApprovalRefreshed: machine_evidence.approval,
    ReviewReplan: machine_evidence.review,
    ReviewAbort: machine_evidence.review,
    VerifierResult: machine_evidence.verifier_result,
    VerifierCannotStart: machine_evidence.verifier_cannot_start,
    Pause: _pause,
}
