"""The pure state machine: one example per transition, then a stateful property test.

No git and no clock: every test drives ``gitrun.core.machine.transition`` with events and
checks the next state and the effects the runtime would perform. The stateful test
(``RunMachine``) sends arbitrary event sequences, illegal ones included, through a
model adapter and checks the invariants of docs/design.md §4, §6, §7 after every step.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machine_world import (
    BASE,
    BASE_TREE,
    CLEAN,
    INSTANCE,
    Adapter,
    evidence,
    grant_of,
    initial_state,
    oid,
    precondition_at,
    write,
)

from gitrun.core.codec import digest, encode
from gitrun.core.errors import ApprovalRefused, EnvironmentDrift, Exit, Frozen
from gitrun.core.machine import (
    AGENT_WRITE_REFUSED,
    CONFLICT_REASON,
    ApprovalAccepted,
    ApprovalExpired,
    ApprovalRefreshed,
    BudgetExhausted,
    ClearInbox,
    Execute,
    ExecuteDue,
    Finished,
    Freeze,
    Grant,
    Hold,
    IllegalTransition,
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
    RunFrozen,
    RunVerifier,
    Say,
    SyncIndex,
    VerifierCannotStart,
    VerifierResult,
    WriteReceipt,
    approval_in,
    stamp,
    transition,
)
from gitrun.core.records import (
    AWAITING_APPROVAL,
    DONE,
    FAILED,
    NEEDS_REVIEW,
    RUNNING,
    Event,
    Pending,
    Receipt,
    RunState,
)
from gitrun.core.validate import validate_state

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


def settle(outcome: Outcome) -> RunState:
    """What the runtime holds after performing the outcome's Persist (Runtime.commit), or
    its Hold (a receipt riding to the next checkpoint, its event still unwritten)."""
    state, effects = outcome
    persists = [e for e in effects if isinstance(e, Persist)]
    if not persists:
        for held in (e for e in effects if isinstance(e, Hold)):
            assert held.state is state
            validate_state(held.state)
        return state
    validate_state(persists[0].state)
    stamped = stamp(
        persists[0].state,
        generation=state.generation + 1,
        elapsed=0.0,
        worker="w-1",
        lease_version=1,
        now=state.updated_at + 1,
    )
    validate_state(stamped)
    return replace(stamped, events=())


def kinds(effects: tuple[object, ...]) -> list[str]:
    return [type(e).__name__ for e in effects]


def proposed(
    state: RunState,
    adapter: Adapter,
    risk: str | None = None,
    key: str = "k-1",
    at: float = 10.0,
    content: str = "x",
) -> Proposed:
    action = write(content=content)
    return Proposed(action, key, action.intent_digest(), risk, precondition_at(adapter), at)


def with_intent(risk: str | None = None, key: str = "k-1") -> tuple[RunState, Adapter]:
    adapter = Adapter()
    return settle(
        transition(initial_state(), proposed(initial_state(), adapter, risk, key))
    ), adapter


def approved(expires_at: float = 100.0, nonce: str = "n-1") -> tuple[RunState, Adapter, Grant]:
    s, adapter = with_intent(risk="touches-config")
    ev = evidence(nonce, expires_at)
    s = settle(transition(s, approval_in(s, ev, "ed-approver", nonce, expires_at, 20.0)))
    return s, adapter, Grant(digest(ev), expires_at)


def written(s: RunState, adapter: Adapter, grant: Grant | None = None, at: float = 30.0) -> Receipt:
    p = s.pending
    assert p is not None
    return adapter.commit(p.key, p.intent_digest, p.action.kind, grant, at)


def conflicting(s: RunState, adapter: Adapter) -> Receipt:
    p = s.pending
    assert p is not None
    return adapter.commit(p.key, write(content="other").intent_digest(), "write_file", None, 30.0)


# -- proposals -------------------------------------------------------------------------


def test_a_proposal_persists_its_intent_and_key_before_anything_executes() -> None:
    s0, adapter = initial_state(), Adapter()
    nxt, effects = transition(s0, proposed(s0, adapter))
    assert kinds(effects) == ["Persist", "Say"]
    assert effects[0] == Persist(nxt)
    assert nxt.pending is not None
    assert nxt.pending.key == "k-1"
    assert nxt.pending.precondition.head == BASE
    assert nxt.pending.approval is None
    assert (nxt.cursor, nxt.budgets.proposals, nxt.phase) == (1, 1, RUNNING)
    assert [e.kind for e in nxt.events] == ["intent"]
    validate_state(nxt)


def test_a_risky_proposal_is_persisted_frozen_awaiting_approval() -> None:
    s0, adapter = initial_state(), Adapter()
    nxt, effects = transition(s0, proposed(s0, adapter, risk="touches-config"))
    assert kinds(effects) == ["Persist", "Say", "Freeze"]
    assert (nxt.phase, nxt.stop_reason) == (AWAITING_APPROVAL, "awaiting_approval")
    assert isinstance(effects[2], Freeze)
    assert "gitrun approve r-1" in effects[2].message
    assert "[needs approval: touches-config]" in effects[1].line  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"digest": "sha256:other"}, "digest"),
        ({"action": replace(write(), kind="apply_patch", path=None, patch="x")}, "scope"),
        ({"precondition": replace(precondition_at(Adapter()), instance_id="inst-2")}, "instance"),
    ],
)
def test_an_intent_that_would_make_an_invalid_checkpoint_is_illegal(
    change: dict[str, Any], why: str
) -> None:
    s0 = initial_state()
    event = replace(proposed(s0, Adapter()), **change)
    if "action" in change:
        event = replace(event, digest=event.action.intent_digest())
    with pytest.raises(IllegalTransition, match=why):
        transition(s0, event)


def test_a_proposal_may_not_reuse_the_last_receipts_or_a_quarantined_key() -> None:
    s, adapter = with_intent()
    s = settle(transition(s, WriteReceipt(written(s, adapter), False, adapter.branch, 30.0)))
    with pytest.raises(IllegalTransition, match="already a recorded receipt"):
        transition(s, proposed(s, adapter, key="k-1"))
    with pytest.raises(IllegalTransition, match="quarantined"):
        transition(replace(s, quarantined_keys=("k-9",)), proposed(s, adapter, key="k-9"))


def test_a_rejected_proposal_counts_and_advances_the_cursor() -> None:
    s0 = initial_state()
    nxt, effects = transition(
        s0, ProposalRejected("path-dotdot", "../x contains '..'", "write_file ../x", 5.0)
    )
    assert kinds(effects) == ["Say", "Persist"]
    assert (nxt.cursor, nxt.budgets.proposals, nxt.phase, nxt.pending) == (1, 1, RUNNING, None)
    assert nxt.events[0].data == {
        "rule": "path-dotdot",
        "message": "../x contains '..'",
        "action": "write_file ../x",
    }


def test_a_refusal_of_the_agents_last_proposal_fails_the_run_in_the_same_checkpoint() -> None:
    s0 = initial_state()
    event = ProposalRejected("path-dotdot", "refused", "write_file ../x", 5.0, last=True)
    nxt, effects = transition(s0, event)
    assert (nxt.phase, nxt.stop_reason, nxt.pending) == (FAILED, AGENT_WRITE_REFUSED, None)
    assert (nxt.cursor, nxt.budgets.proposals) == (1, 1)
    assert [e.kind for e in nxt.events] == ["gate_rejected"]
    assert effects == (
        Say("gate rejected write_file ../x: refused"),
        Persist(nxt),
        Say("run r-1 failed: the agent's last write was refused (path-dotdot)"),
    )
    validate_state(nxt)
    # A budget rule wins: the run is out of budget, not refused.
    budget = transition(s0, replace(event, rule="budget-steps"))[0]
    assert (budget.stop_reason, budget.cursor) == ("budget_exhausted", 0)


@pytest.mark.parametrize("via", [ProposalRejected, BudgetExhausted])
def test_a_budget_rule_fails_the_run(via: type[ProposalRejected] | type[BudgetExhausted]) -> None:
    nxt, effects = transition(
        initial_state(), via("budget-steps", "3 used of 3", "write_file a", 5.0)
    )
    assert (nxt.phase, nxt.stop_reason, nxt.cursor) == (FAILED, "budget_exhausted", 0)
    assert kinds(effects) == ["Say", "Persist"]
    with pytest.raises(IllegalTransition, match="not a budget rule"):
        transition(initial_state(), BudgetExhausted("path-dotdot", "m", "write_file a", 5.0))


def test_finish_asks_for_the_verifier_on_the_last_head_and_changes_nothing() -> None:
    s0 = initial_state()
    nxt, effects = transition(s0, Finished(5.0))
    assert nxt is s0
    assert effects == (RunVerifier(BASE, BASE_TREE),)


def test_no_proposal_is_accepted_while_an_intent_waits_or_the_run_is_frozen() -> None:
    s, _ = with_intent()
    with pytest.raises(RunFrozen, match="no new proposal") as exc:
        transition(s, Finished(5.0))
    assert exc.value.phase == RUNNING
    assert exc.value.event_name == "Finished"
    assert exc.value.exit_code == Exit.FROZEN
    assert isinstance(exc.value, Frozen)
    frozen, adapter = with_intent(risk="r")
    with pytest.raises(RunFrozen):
        transition(frozen, proposed(frozen, adapter, key="k-2"))


# -- execution -------------------------------------------------------------------------


def test_execute_due_executes_the_persisted_intent_with_its_own_key() -> None:
    s, _ = with_intent()
    nxt, effects = transition(s, ExecuteDue(11.0))
    assert nxt is s
    assert effects == (Execute(s.pending, None),)  # type: ignore[arg-type]
    with pytest.raises(IllegalTransition, match="no approval"):
        transition(s, ExecuteDue(11.0, Grant("sha256:x", 99.0)))


def test_a_risky_intent_without_evidence_freezes_instead_of_executing() -> None:
    s, _ = with_intent(risk="r")
    s = replace(s, phase=RUNNING, stop_reason=None)  # as if unfrozen by a bug elsewhere
    nxt, effects = transition(s, ExecuteDue(11.0))
    assert kinds(effects) == ["Persist", "Freeze"]
    assert (nxt.phase, nxt.stop_reason) == (AWAITING_APPROVAL, "awaiting_approval")
    assert nxt.events[-1].kind == "frozen"


def test_an_approved_intent_executes_with_its_grant_until_the_approval_expires() -> None:
    s, _, grant = approved(expires_at=100.0)
    assert transition(s, ExecuteDue(99.0, grant))[1] == (Execute(s.pending, grant),)  # type: ignore[arg-type]
    nxt, effects = transition(s, ExecuteDue(100.0, grant))
    assert kinds(effects) == ["Persist", "Freeze"]
    assert (nxt.phase, nxt.stop_reason) == (AWAITING_APPROVAL, "approval_expired")
    assert nxt.pending == s.pending  # the evidence still loads and shows the pending action
    with pytest.raises(IllegalTransition, match="not the pending approval"):
        transition(s, ExecuteDue(50.0, Grant("sha256:forged", 1e9)))
    with pytest.raises(IllegalTransition, match="not the pending approval"):
        transition(s, ExecuteDue(50.0, None))


def test_approval_expired_freezes_a_running_approved_intent() -> None:
    s, _, _ = approved()
    nxt, effects = transition(s, ApprovalExpired(60.0))
    assert (nxt.phase, nxt.stop_reason) == (AWAITING_APPROVAL, "approval_expired")
    assert kinds(effects) == ["Persist", "Freeze"]
    plain, _ = with_intent()
    with pytest.raises(IllegalTransition, match="no approval to expire"):
        transition(plain, ApprovalExpired(60.0))


def test_a_pending_rejected_at_execute_is_abandoned_and_the_run_goes_on() -> None:
    s, _, _ = approved()
    nxt, effects = transition(s, PendingRejectedAtExecute("path-symlink", "a.txt is a link", 40.0))
    assert (nxt.pending, nxt.phase, nxt.cursor, nxt.sealed) == (None, RUNNING, s.cursor, ())
    assert nxt.events[-1].kind == "gate_rejected"
    assert nxt.events[-1].data == {
        "rule": "path-symlink",
        "message": "a.txt is a link",
        "action": "write_file a.txt",
        "key": "k-1",
        "at": "execute",
    }
    assert effects == (
        Say("gate rejected pending write_file a.txt: a.txt is a link; abandoned"),
        Persist(nxt),
    )
    validate_state(nxt)
    # The budgets are never gated again at execute time: the intent was counted already.
    with pytest.raises(IllegalTransition, match="budgets"):
        transition(s, PendingRejectedAtExecute("budget-steps", "m", 40.0))


# -- receipts --------------------------------------------------------------------------


def test_a_receipt_records_the_write_and_clears_the_pending() -> None:
    s, adapter = with_intent()
    r = written(s, adapter)
    nxt, effects = transition(s, WriteReceipt(r, False, adapter.branch, 31.0))
    assert nxt.pending is None
    assert nxt.phase == RUNNING
    assert (nxt.env.head, nxt.env.tree, nxt.env.adapter_generation) == (r.commit, r.tree, 1)
    assert (nxt.receipts.count, nxt.receipts.last, nxt.budgets.steps) == (1, r, 1)
    assert nxt.events[-1].data == {
        "receipt": encode(r),
        "replayed": False,
        "fingerprint": r.fingerprint(),
    }
    # No checkpoint of its own: the receipt is held, riding in the run's next checkpoint.
    assert effects == (Hold(nxt), Say(f"committed {r.commit[:12]} for k-1"))
    validate_state(nxt)
    replayed = transition(s, WriteReceipt(r, True, adapter.branch, 31.0))[1]
    assert replayed[1] == Say(f"reconciled {r.commit[:12]} for k-1")


def held_write(risk: str | None = None) -> tuple[RunState, Adapter, Receipt]:
    """A write made and its receipt held (riding, no checkpoint written for it yet)."""
    s, adapter = with_intent(risk)
    r = written(s, adapter)
    return settle(transition(s, WriteReceipt(r, False, adapter.branch, 31.0))), adapter, r


def test_a_held_receipt_rides_in_the_next_intent_checkpoint() -> None:
    held, adapter, r = held_write()
    nxt, effects = transition(held, proposed(held, adapter, key="k-2", at=40.0))
    assert kinds(effects) == ["Persist", "Say"]
    assert effects[0] == Persist(nxt)
    assert [e.kind for e in nxt.events] == ["receipt", "intent"]
    assert nxt.events[0] == held.events[0]
    assert (nxt.receipts.last, nxt.receipts.count, nxt.env.head) == (r, 1, r.commit)
    assert nxt.pending is not None
    assert (nxt.pending.key, nxt.pending.precondition.head) == ("k-2", r.commit)
    assert nxt.trace_count == held.trace_count + 1
    validate_state(nxt)


@pytest.mark.parametrize("via", ["risky-intent", "rejection", "verdict", "cannot-start", "pause"])
def test_every_checkpoint_after_a_write_carries_its_held_receipt(via: str) -> None:
    held, adapter, r = held_write()
    events: dict[str, MachineEvent] = {
        "risky-intent": proposed(held, adapter, risk="r", key="k-2"),
        "rejection": ProposalRejected("path-dotdot", "m", "write_file ../x", 40.0),
        "verdict": verdict(held, True),
        "cannot-start": VerifierCannotStart(
            r.commit, r.tree, CLEAN, "cannot start", ("t::a",), 40.0
        ),
        "pause": Pause(40.0),
    }
    nxt, effects = transition(held, events[via])
    persists = [e for e in effects if isinstance(e, Persist)]
    assert persists == [Persist(nxt)]
    assert nxt.events[0] == held.events[0]
    assert nxt.events[0].kind == "receipt"
    assert nxt.receipts.last == r
    validate_state(nxt)


def test_a_pause_writes_only_a_held_receipt() -> None:
    s, _ = with_intent()
    assert transition(s, Pause(5.0)) == (s, ())
    assert transition(initial_state(), Pause(5.0)) == (initial_state(), ())
    held, _, _ = held_write()
    nxt, effects = transition(held, Pause(40.0))
    assert nxt is held
    assert effects == (Persist(held),)
    assert transition(settle((nxt, effects)), Pause(41.0))[1] == ()


def test_nothing_executes_while_the_state_is_ahead_of_its_checkpoint() -> None:
    s, _ = with_intent()
    unwritten = s.with_events(Event("receipt", 20.0, {}))
    for event in (ExecuteDue(21.0), PendingRejectedAtExecute("path-symlink", "m", 21.0)):
        with pytest.raises(IllegalTransition, match="ahead of its checkpoint"):
            transition(unwritten, event)


def test_a_held_receipt_lost_to_a_crash_is_reconciled_into_the_same_state() -> None:
    # Killed before the next checkpoint: the intent checkpoint is what resume loads, and
    # the write commit (the authority) gives the receipt back, exactly once.
    s, adapter = with_intent()
    r = written(s, adapter)
    held = settle(transition(s, WriteReceipt(r, False, adapter.branch, 31.0)))
    again = settle(transition(s, WriteReceipt(adapter.index["k-1"], True, adapter.branch, 90.0)))
    # (the trace differs only in the event's time and its ``replayed`` flag)
    assert replace(again, events=(), trace_chain="") == replace(held, events=(), trace_chain="")
    assert [e.kind for e in again.events] == ["receipt"]
    assert again.events[0].data["replayed"]
    assert (again.receipts.count, again.receipts.last) == (1, r)


def test_a_receipt_not_made_on_the_intents_precondition_is_drift() -> None:
    s, adapter = with_intent()
    r = replace(written(s, adapter), parent=oid(77))
    with pytest.raises(EnvironmentDrift, match="foreign-commit"):
        transition(s, WriteReceipt(r, True, adapter.branch, 31.0))
    with pytest.raises(IllegalTransition, match="not k-1"):
        transition(s, WriteReceipt(replace(r, key="k-2"), True, adapter.branch, 31.0))


@pytest.mark.parametrize("via", ["write", "conflict"])
def test_a_conflicting_receipt_freezes_with_the_case_kept_whole(via: str) -> None:
    s, adapter = with_intent()
    r = conflicting(s, adapter)
    event = (
        WriteReceipt(r, False, adapter.branch, 31.0)
        if via == "write"
        else ReceiptConflict(r, adapter.branch, 31.0)
    )
    nxt, effects = transition(s, event)
    case = nxt.review
    assert case is not None
    assert nxt.pending == s.pending
    assert (nxt.phase, nxt.stop_reason) == (NEEDS_REVIEW, "receipt_conflict")
    p = s.pending
    assert p is not None
    assert (case.action, case.key, case.pending_digest) == (p.action, "k-1", p.intent_digest)
    assert (case.receipt_digest, case.receipt, case.receipt_fingerprint) == (
        r.intent_digest,
        r,
        r.fingerprint(),
    )
    assert (case.environment_version, case.reason) == (adapter.branch, CONFLICT_REASON)
    assert nxt.events[-1].data == {"case": encode(case)}
    assert kinds(effects) == ["Persist", "Say", "Freeze"]
    validate_state(nxt)
    with pytest.raises(RunFrozen):
        transition(nxt, ExecuteDue(32.0))
    with pytest.raises(IllegalTransition):
        transition(nxt, WriteReceipt(r, True, adapter.branch, 32.0))


def test_a_receipt_conflict_with_the_pending_digest_is_not_a_conflict() -> None:
    s, adapter = with_intent()
    with pytest.raises(IllegalTransition, match="pending intent's digest"):
        transition(s, ReceiptConflict(written(s, adapter), adapter.branch, 31.0))


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no-evidence", "without approval evidence"),
        ("other-approval", "another approval"),
        ("after-expiry", "after its approval expired"),
    ],
)
def test_a_risky_write_that_its_approval_does_not_cover_goes_to_review(
    case: str, reason: str
) -> None:
    s, adapter, grant = approved(expires_at=100.0)
    r = written(s, adapter, grant)
    if case == "no-evidence":
        s = replace(s, pending=replace(s.pending, approval=None))  # type: ignore[type-var]
        grant = None  # type: ignore[assignment]
    elif case == "other-approval":
        r = replace(r, approval="sha256:other")
    else:
        r = replace(r, committed_at=101)
    nxt, _ = transition(s, WriteReceipt(r, True, adapter.branch, 150.0, grant))
    assert nxt.phase == NEEDS_REVIEW
    assert nxt.review is not None
    assert reason in nxt.review.reason
    assert nxt.review.receipt_digest == nxt.review.pending_digest


def test_a_write_committed_before_its_approval_expired_reconciles_after_expiry() -> None:
    s, adapter, grant = approved(expires_at=100.0)
    r = written(s, adapter, grant, at=90.0)
    nxt, _ = transition(s, WriteReceipt(r, True, adapter.branch, 500.0, grant))
    assert nxt.phase == RUNNING
    assert nxt.receipts.last == r


def test_a_reconciled_write_is_refused_while_awaiting_approval_as_recording_would_be_invalid() -> (
    None
):
    # Today's Runtime.record keeps the phase: from awaiting_approval it would write a state
    # validate_state rejects (phase-pending). The machine refuses the event instead.
    s, adapter, grant = approved(expires_at=100.0)
    r = written(s, adapter, grant, at=90.0)
    frozen = settle(transition(s, ApprovalExpired(100.0)))
    with pytest.raises(IllegalTransition, match="without a pending"):
        transition(frozen, WriteReceipt(r, True, adapter.branch, 120.0, grant))


def test_the_index_is_synced_every_32_writes() -> None:
    s, adapter = initial_state(), Adapter()
    synced = []
    for i in range(64):
        s = settle(transition(s, proposed(s, adapter, key=f"k-{i}", at=float(i))))
        out = transition(s, WriteReceipt(written(s, adapter), False, adapter.branch, float(i)))
        synced.append(SyncIndex() in out[1])
        s = settle(out)
    assert [i + 1 for i, x in enumerate(synced) if x] == [32, 64]


# -- approvals -------------------------------------------------------------------------


def test_a_fresh_approval_unfreezes_the_intent_and_consumes_its_nonce() -> None:
    s, _ = with_intent(risk="r")
    ev = evidence("n-1", 100.0)
    event = approval_in(s, ev, "ed-approver", "n-1", 100.0, 20.0)
    assert isinstance(event, ApprovalAccepted)
    nxt, effects = transition(s, event)
    assert (nxt.phase, nxt.stop_reason, nxt.used_nonces) == (RUNNING, None, ("n-1",))
    assert nxt.pending == replace(s.pending, approval=ev)  # type: ignore[type-var]
    assert effects == (
        Persist(nxt),
        ClearInbox("approval"),
        Say(f"approval {digest(ev)[:19]} by ed-approver accepted"),
    )
    assert nxt.events[-1].data == {
        "fingerprint": digest(ev),
        "signer": "ed-approver",
        "expires_at": 100.0,
    }


def test_a_refreshed_approval_replaces_the_expired_one_which_is_sealed() -> None:
    s, _, _ = approved(expires_at=100.0, nonce="n-1")
    frozen = settle(transition(s, ApprovalExpired(100.0)))
    ev = evidence("n-2", 300.0)
    event = approval_in(frozen, ev, "ed-approver", "n-2", 300.0, 150.0)
    assert isinstance(event, ApprovalRefreshed)
    nxt, _ = transition(frozen, event)
    assert nxt.phase == RUNNING
    assert nxt.pending is not None
    assert s.pending is not None
    assert nxt.pending.approval == ev
    assert nxt.sealed[-1] == {
        "kind": "approval_superseded",
        "evidence": s.pending.approval,
        "at": 150.0,
    }
    assert nxt.used_nonces == ("n-1", "n-2")


def test_approvals_that_do_not_bind_are_refused_and_change_nothing() -> None:
    s, _, _ = approved(expires_at=100.0, nonce="n-1")
    frozen = settle(transition(s, ApprovalExpired(100.0)))
    with pytest.raises(ApprovalRefused, match="nonce-reused"):
        transition(frozen, ApprovalRefreshed(evidence("n-1", 300.0), "ed", "n-1", 300.0, 150.0))
    with pytest.raises(ApprovalRefused, match="expired"):
        transition(frozen, ApprovalRefreshed(evidence("n-3", 140.0), "ed", "n-3", 140.0, 150.0))
    with pytest.raises(IllegalTransition, match="drop held evidence"):
        transition(frozen, ApprovalAccepted(evidence("n-4", 300.0), "ed", "n-4", 300.0, 150.0))
    with pytest.raises(IllegalTransition, match="no action waiting"):
        transition(s, ApprovalAccepted(evidence("n-5", 300.0), "ed", "n-5", 300.0, 150.0))


# -- reviews ---------------------------------------------------------------------------


def in_review() -> tuple[RunState, Adapter, Receipt]:
    s, adapter = with_intent()
    r = conflicting(s, adapter)
    return settle(transition(s, ReceiptConflict(r, adapter.branch, 31.0))), adapter, r


def test_a_replan_quarantines_the_key_reobserves_and_steps_the_cursor_back() -> None:
    s, adapter, r = in_review()
    ev = {"claims": {"decision": "replan"}, "signer": "ed-rev", "signature": "s"}
    event = ReviewReplan(ev, "ed-rev", "n-9", r.fingerprint(), adapter.branch, r.tree, CLEAN, 40.0)
    nxt, effects = transition(s, event)
    assert (nxt.phase, nxt.stop_reason, nxt.pending, nxt.review) == (RUNNING, None, None, None)
    assert nxt.quarantined_keys == ("k-1",)
    assert nxt.used_nonces == ("n-9",)
    assert (nxt.env.head, nxt.env.tree, nxt.cursor) == (r.commit, r.tree, 0)
    sealed = nxt.sealed[-1]
    assert sealed["case"] == encode(s.review)
    assert sealed["pending"] == encode(s.pending)
    assert sealed["decision"] == ev
    assert kinds(effects) == ["Persist", "ClearInbox", "Say"]
    with pytest.raises(IllegalTransition, match="quarantined"):
        transition(settle((nxt, effects)), proposed(nxt, adapter, key="k-1"))


def test_an_abort_fails_the_run_keeping_the_evidence() -> None:
    s, adapter, r = in_review()
    nxt, _ = transition(
        s, ReviewAbort({"d": "abort"}, "ed-rev", "n-9", r.fingerprint(), adapter.branch, 40.0)
    )
    assert (nxt.phase, nxt.stop_reason, nxt.pending) == (FAILED, "aborted_by_reviewer", None)
    assert nxt.sealed[-1]["case"]["receipt"] == encode(r)
    validate_state(nxt)


@pytest.mark.parametrize("drift", ["receipt", "branch", "nonce"])
def test_a_decision_on_a_case_that_changed_stays_frozen(drift: str) -> None:
    s, adapter, r = in_review()
    s = replace(s, used_nonces=("n-used",))
    fp = "sha256:changed" if drift == "receipt" else r.fingerprint()
    head = oid(999) if drift == "branch" else adapter.branch
    nonce = "n-used" if drift == "nonce" else "n-9"
    with pytest.raises(ApprovalRefused):
        transition(s, ReviewReplan({}, "ed-rev", nonce, fp, head, r.tree, CLEAN, 40.0))
    with pytest.raises(ApprovalRefused):
        transition(s, ReviewAbort({}, "ed-rev", nonce, fp, head, 40.0))


# -- verification ----------------------------------------------------------------------


def verdict(
    s: RunState, passed: bool, head: str | None = None, tree: str | None = None
) -> VerifierResult:
    return VerifierResult(
        passed,
        head or s.env.head,
        tree or s.env.tree,
        CLEAN,
        "2 passed" if passed else "1 failed",
        {"t::a": "passed"},
        0 if passed else 1,
        False,
        50.0,
        {"network": "none"},
        "bwrap",
    )


def test_a_passing_verifier_on_the_last_writes_head_is_done() -> None:
    s, adapter = with_intent()
    r = written(s, adapter)
    s = settle(transition(s, WriteReceipt(r, False, adapter.branch, 31.0)))
    nxt, effects = transition(s, verdict(s, True))
    assert (nxt.phase, nxt.stop_reason) == (DONE, "verified")
    assert nxt.verifier is not None
    assert (nxt.verifier.head, nxt.verifier.tree) == (r.commit, r.tree)
    assert nxt.events[-1].data["exit_code"] == 0
    assert nxt.verifier.isolation == nxt.events[-1].data["isolation"] == "bwrap"
    assert nxt.events[-1].data["network"] == "none"
    assert effects == (Persist(nxt), Say("verifier: 2 passed"))
    validate_state(nxt)


def test_a_verifier_that_cannot_start_fails_the_run_with_every_required_test_an_error() -> None:
    s0 = initial_state()
    event = VerifierCannotStart(
        BASE, BASE_TREE, CLEAN, "cannot start: no such file", ("t::a", "t::b"), 50.0,
        {"network": "none", "unconfined_because": "no bwrap"}, "none",
    )  # fmt: skip
    nxt, effects = transition(s0, event)
    assert (nxt.phase, nxt.stop_reason) == (FAILED, "verifier_cannot_start")
    assert nxt.verifier is not None
    assert not nxt.verifier.passed
    assert nxt.verifier.outcomes == {"t::a": "error", "t::b": "error"}
    data = nxt.events[-1].data
    assert (data["exit_code"], data["timed_out"], data["isolation"]) == (None, False, "none")
    assert data["unconfined_because"] == "no bwrap"
    assert effects == (Persist(nxt), Say("verifier: cannot start: no such file"))
    validate_state(nxt)
    with pytest.raises(EnvironmentDrift, match="head-moved"):
        transition(s0, replace(event, head=oid(5)))


def test_extra_verifier_facts_never_override_the_verdict() -> None:
    s0 = initial_state()
    forged = replace(verdict(s0, False), extra={"passed": True, "isolation": "bwrap"})
    data = transition(s0, forged)[0].events[-1].data
    assert (data["passed"], data["isolation"]) == (False, "bwrap")


def test_a_failing_verifier_fails_the_run() -> None:
    s0 = initial_state()
    nxt, _ = transition(s0, verdict(s0, False))
    assert (nxt.phase, nxt.stop_reason) == (FAILED, "verifier_failed")


@pytest.mark.parametrize(
    ("head", "tree", "reason"), [(oid(5), None, "head-moved"), (None, oid(6), "tree-changed")]
)
def test_a_verdict_not_bound_to_the_last_head_and_tree_is_refused(
    head: str | None, tree: str | None, reason: str
) -> None:
    s0 = initial_state()
    with pytest.raises(EnvironmentDrift, match=reason):
        transition(s0, verdict(s0, True, head, tree))


def test_terminal_runs_accept_nothing() -> None:
    done = settle(transition(initial_state(), verdict(initial_state(), True)))
    for event in (Finished(1.0), ProposalRejected("r", "m", "s", 1.0), ExecuteDue(1.0)):
        with pytest.raises(IllegalTransition) as exc:
            transition(done, event)
        assert exc.value.phase == DONE


# -- the checkpoint advance and the layering -------------------------------------------


def test_stamp_adds_what_runtime_commit_adds() -> None:
    s0 = replace(initial_state(), budgets=replace(initial_state().budgets, wall_seconds=2.0))
    out = stamp(s0, generation=7, elapsed=1.5, worker="w-2", lease_version=3, now=99.0)
    assert (
        out.generation,
        out.budgets.wall_seconds,
        out.identity,
        out.lease_version,
        out.updated_at,
    ) == (
        7,
        3.5,
        "w-2",
        3,
        99.0,
    )
    assert (
        replace(
            out, generation=1, budgets=s0.budgets, identity="w-1", lease_version=1, updated_at=0.0
        )
        == s0
    )


MACHINE_MODULES = ("machine.py", "machine_events.py", "machine_evidence.py")
PURE = {
    "gitrun.core.codec",
    "gitrun.core.records",
    "gitrun.core.errors",
    "gitrun.core.machine_events",
    "gitrun.core.machine_evidence",
}


@pytest.mark.parametrize("name", MACHINE_MODULES)
def test_the_machine_imports_only_pure_modules_and_reads_no_clock(name: str) -> None:
    tree = ast.parse((ROOT / "gitrun" / "core" / name).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {
                f"{node.module}.{a.name}"
                if node.module in ("gitrun", "gitrun.core")
                else node.module
                for a in node.names
            }
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    ours = {m for m in imported if m.startswith("gitrun")}
    assert ours <= PURE, ours - PURE
    assert not imported & {
        "time",
        "os",
        "pathlib",
        "subprocess",
        "random",
        "uuid",
        "secrets",
        "pygit2",
    }


def test_importing_the_machine_loads_no_pygit2() -> None:
    heavy = "('pygit2', 'cryptography', 'filelock')"
    code = (
        f"import sys, gitrun.core.machine; print([m for m in sys.modules if m.startswith({heavy})])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


# -- the stateful property test --------------------------------------------------------

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=250,
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

FROZEN_PHASES = (AWAITING_APPROVAL, NEEDS_REVIEW)
PROPOSING = (
    Proposed,
    ProposalRejected,
    BudgetExhausted,
    Finished,
    VerifierResult,
    VerifierCannotStart,
)
EXECUTING = (ExecuteDue, ApprovalExpired, PendingRejectedAtExecute)
REFUSALS = (IllegalTransition, ApprovalRefused, EnvironmentDrift)


def phase_allows(s: RunState, event: MachineEvent) -> bool:
    """The phase table, written independently of the machine: which phase takes what."""
    if isinstance(event, Pause):
        return True  # any phase: it writes a held receipt, else nothing
    if isinstance(event, PROPOSING):
        return s.phase == RUNNING and s.pending is None
    if isinstance(event, EXECUTING):
        return s.phase == RUNNING and s.pending is not None
    if isinstance(event, WriteReceipt | ReceiptConflict):
        return s.phase in (RUNNING, AWAITING_APPROVAL) and s.pending is not None
    if isinstance(event, ApprovalAccepted | ApprovalRefreshed):
        return s.phase == AWAITING_APPROVAL and s.pending is not None
    return s.phase == NEEDS_REVIEW


def _rare(one_in: int = 4) -> st.SearchStrategy[bool]:
    """True now and then: the unusual branch (a crash, a forgery, a drifted re-read)."""
    return st.integers(1, one_in).map(lambda n: n == 1)


dts = st.integers(min_value=0, max_value=40)
ARGS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "propose": {
        "dt": dts,
        "content": st.sampled_from(["x", "y"]),
        "risky": st.booleans(),
        "key": st.sampled_from(["fresh", "fresh", "fresh", "last", "old", "quarantined"]),
        "patch": _rare(),
        "foreign": _rare(),
    },
    "reject": {
        "dt": dts,
        "budget": _rare(10),
        "via_budget_event": st.booleans(),
        "last": _rare(8),
    },
    "finish": {
        "dt": dts,
        "passed": st.booleans(),
        "bound": st.sampled_from(["last", "stale", "tree"]),
        "starts": st.sampled_from([True, True, True, False]),
    },
    "execute": {
        "dt": dts,
        "lookup": st.booleans(),
        "grant": st.sampled_from(["true", "true", "none", "forged"]),
        "crash": _rare(),
    },
    "reconcile": {"dt": dts, "stray": _rare(), "via_accept": st.booleans()},
    "plant": {"dt": dts, "same_intent": st.booleans()},
    "regate": {"dt": dts, "budget": _rare()},
    "approve": {"dt": dts, "ttl": st.integers(-5, 120), "swapped": _rare(), "reused": _rare()},
    "expire": {"dt": dts},
    "review": {
        "dt": dts,
        "abort": _rare(),
        "drift": st.sampled_from(["", "", "", "receipt", "branch", "nonce"]),
    },
    "crash": {"dt": dts},
    "pause": {"dt": dts},
}


def _rule(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A rule drawing the arguments of ``RunMachine.do_<name>``."""
    return rule(**ARGS[name])  # type: ignore[call-overload, no-any-return]


def proposing(m: RunMachine) -> bool:
    return m.state.phase == RUNNING and m.state.pending is None


def executing(m: RunMachine) -> bool:
    return m.state.phase == RUNNING and m.state.pending is not None


class RunMachine(RuleBasedStateMachine):
    """Event sequences against a model adapter and model humans. Each rule fires in the
    phase it belongs to; ``anything`` fires any of them in any phase (illegal included)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = initial_state()
        self.adapter = Adapter()
        self.clock = 0.0
        self.counter = 0
        self.expiry: dict[str, float] = {}  # approval fingerprint -> expires_at (the truth)
        self.persisted: set[str] = {digest(encode(None))}  # pendings some checkpoint held
        self.recorded: list[str] = []  # keys of receipt events in persisted checkpoints
        self.checkpointed = self.state  # the last checkpoint: what a crash leaves to resume
        self.held: list[str] = []  # the key of a receipt held in memory, riding (at most one)
        self.executed: list[str] = []  # keys the adapter wrote for this run's own Execute
        self.trace: list[Event] = []
        self.last_head = BASE  # the HEAD after the last write (or the re-observed HEAD)
        self.replanned: list[str] = []  # keys a reviewer's replan retired

    # -- driving -----------------------------------------------------------------------

    def tick(self, dt: int) -> float:
        self.clock += dt
        return self.clock

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter}"

    def feed(self, event: MachineEvent) -> tuple[object, ...] | None:
        """Send one event; check the refusal or the outcome; perform the Persist."""
        pre, before = self.state, encode(self.state)
        allowed = phase_allows(pre, event)
        try:
            nxt, effects = transition(pre, event)
        except REFUSALS as exc:
            self.check_refusal(pre, before, event, exc, allowed)
            return None
        assert allowed, f"{pre.phase} accepted {type(event).__name__}"
        self.check_outcome(pre, event, nxt, effects)
        return effects

    def check_refusal(
        self, pre: RunState, before: object, event: MachineEvent, exc: Exception, allowed: bool
    ) -> None:
        """A refused event changes nothing; one its phase forbids is an IllegalTransition."""
        assert encode(self.state) == before, "a refused event changed the state"
        if allowed:
            return
        assert isinstance(exc, IllegalTransition), f"{type(event).__name__}: {exc!r}"
        assert (exc.phase, exc.event) == (pre.phase, event)
        if pre.phase in FROZEN_PHASES and isinstance(event, PROPOSING + EXECUTING):
            assert isinstance(exc, RunFrozen)
            assert exc.exit_code == Exit.FROZEN

    def check_outcome(
        self, pre: RunState, event: MachineEvent, nxt: RunState, effects: tuple[object, ...]
    ) -> None:
        persists = [e for e in effects if isinstance(e, Persist)]
        holds = [e for e in effects if isinstance(e, Hold)]
        assert len(persists) + len(holds) <= 1, "one checkpoint advance (or hold) per transition"
        if not persists and not holds:
            assert nxt is pre, "the state changes only through a Persist or a held receipt"
        assert nxt.events[: len(pre.events)] == pre.events, "a held receipt is never dropped"
        for effect in effects:
            if isinstance(effect, Persist):
                assert effect.state is nxt
                self.persist(effect.state)
            elif isinstance(effect, Hold):
                assert effect.state is nxt
                self.hold(pre, nxt)
            elif isinstance(effect, Execute):
                self.check_execute(pre, event, effect)
        freezes = any(isinstance(e, Freeze) for e in effects)
        assert freezes == (nxt.phase in FROZEN_PHASES and nxt.phase != pre.phase)
        assert not (freezes and any(isinstance(e, Execute) for e in effects))
        receipt = getattr(event, "receipt", None)
        p = pre.pending
        if (
            isinstance(receipt, Receipt)
            and p is not None
            and receipt.intent_digest != p.intent_digest
        ):
            self.check_case_whole(pre, event, nxt, receipt)
        assert pre.used_nonces == nxt.used_nonces[: len(pre.used_nonces)]
        assert pre.quarantined_keys == nxt.quarantined_keys[: len(pre.quarantined_keys)]
        assert pre.sealed == nxt.sealed[: len(pre.sealed)]
        assert nxt.trace_count == pre.trace_count + len(nxt.events) - len(pre.events)
        self.check_ending(pre, event, nxt)

    @staticmethod
    def check_ending(pre: RunState, event: MachineEvent, nxt: RunState) -> None:
        """The agent's last write refused ends the run failed at once (never verified);
        a gate rejection at execute abandons the pending and never ends the run; a
        verifier that cannot start fails it with every required test an error."""
        if isinstance(event, ProposalRejected) and event.last:
            budget = event.rule.startswith("budget-")
            assert nxt.phase == FAILED
            assert nxt.stop_reason == ("budget_exhausted" if budget else AGENT_WRITE_REFUSED)
            assert nxt.verifier is None
        if nxt.stop_reason == AGENT_WRITE_REFUSED:
            assert nxt.verifier is None
            assert isinstance(event, ProposalRejected) or nxt is pre
        if isinstance(event, PendingRejectedAtExecute):
            assert not event.rule.startswith("budget-")
            assert (nxt.phase, nxt.pending, nxt.receipts) == (RUNNING, None, pre.receipts)
            assert nxt.events[-1].data["at"] == "execute"
        if isinstance(event, VerifierCannotStart):
            assert (nxt.phase, nxt.stop_reason) == (FAILED, "verifier_cannot_start")
            assert nxt.verifier is not None
            assert set(nxt.verifier.outcomes.values()) <= {"error"}
        if nxt.verifier is not None and nxt.verifier is not pre.verifier:
            assert nxt.verifier.isolation == getattr(event, "isolation", None)

    def check_execute(self, pre: RunState, event: MachineEvent, effect: Execute) -> None:
        """No write without a persisted intent; frozen never executes, nor does an
        expired or foreign approval."""
        p = effect.pending
        assert digest(encode(p)) in self.persisted, "Execute of an intent never persisted"
        # ... and the last checkpoint is the whole state: no receipt still rides.
        assert encode(pre) == encode(self.checkpointed), "a write while the checkpoint lags"
        assert pre.phase == RUNNING
        assert pre.pending == p
        if p.risk is not None:
            assert p.approval is not None
            assert effect.grant is not None
            assert effect.grant.fingerprint == digest(p.approval)
            assert self.expiry[effect.grant.fingerprint] > getattr(event, "at", 0.0)

    @staticmethod
    def check_case_whole(pre: RunState, event: MachineEvent, nxt: RunState, r: Receipt) -> None:
        """A conflicting receipt freezes the run with pending, both digests, the receipt."""
        p, case = pre.pending, nxt.review
        assert p is not None
        assert case is not None
        assert (nxt.phase, nxt.pending) == (NEEDS_REVIEW, p)
        assert (case.action, case.key) == (p.action, p.key)
        assert (case.pending_digest, case.receipt_digest) == (p.intent_digest, r.intent_digest)
        assert (case.receipt, case.receipt_fingerprint) == (r, r.fingerprint())
        assert case.environment_version == getattr(event, "environment_version", None)
        assert nxt.events[-1].data == {"case": encode(case)}

    def hold(self, pre: RunState, state: RunState) -> None:
        """A receipt recorded, not written: only ever one, the last checkpoint's own
        pending key, made on its precondition, never a key a checkpoint recorded."""
        validate_state(state)
        validate_state(
            stamp(state, generation=state.generation + 1, elapsed=0.0, worker="w-1",
                  lease_version=1, now=self.clock)
        )  # fmt: skip
        assert not pre.events, "a second receipt held before the first was written"
        assert [e.kind for e in state.events] == ["receipt"]
        r, cp = state.receipts.last, self.checkpointed.pending
        assert r is not None
        assert cp is not None
        assert (r.key, r.parent) == (cp.key, cp.precondition.head)
        assert r.key not in self.recorded, f"two receipts for {r.key}"
        self.held = [r.key]
        self.state = state

    def persist(self, state: RunState) -> None:
        """Runtime.commit: stamp, validate with the real validator, hold without events."""
        stamped = stamp(
            state,
            generation=self.state.generation + 1,
            elapsed=0.0,
            worker="w-1",
            lease_version=1,
            now=self.clock,
        )
        validate_state(state)
        validate_state(stamped)
        self.persisted.add(digest(encode(stamped.pending)))
        for ev in stamped.events:
            self.trace.append(ev)
            if ev.kind == "receipt":
                key = ev.data["receipt"]["key"]
                assert key not in self.recorded, f"two receipts for {key}"
                self.recorded.append(key)
                self.last_head = ev.data["receipt"]["commit"]
            if ev.kind == "review_decision" and ev.data["decision"] == "replan":
                self.last_head = stamped.env.head
                self.replanned.append(state.sealed[-1]["case"]["key"])
        assert set(self.replanned) <= set(stamped.quarantined_keys)
        if stamped.pending is not None:
            assert stamped.pending.key not in self.replanned
        assert stamped.receipts.count == len(self.recorded) == len(set(self.recorded))
        if stamped.phase == DONE:
            self.check_done(stamped)
        self.state = self.checkpointed = replace(stamped, events=())
        self.held = []

    def check_done(self, s: RunState) -> None:
        """Done only with a passing verifier event in the trace, bound to the last HEAD."""
        ver = s.verifier
        assert ver is not None
        assert ver.passed
        assert ver.head == s.env.head == self.last_head
        assert any(
            e.kind == "verifier" and e.data["passed"] and e.data["head"] == ver.head
            for e in self.trace
        )

    # -- the agent and the gate --------------------------------------------------------

    def do_propose(
        self, dt: int, content: str, risky: bool, key: str, patch: bool, foreign: bool
    ) -> None:
        at = self.tick(dt)
        reuse = {
            "last": (self.recorded + self.held)[-1:],
            "old": self.recorded[:1],
            "quarantined": self.replanned[:1],
        }
        k = (reuse.get(key) or [self.fresh("k")])[0]
        action = replace(write(content=content), kind="apply_patch" if patch else "write_file")
        pre = precondition_at(self.adapter, "inst-2" if foreign else INSTANCE)
        self.feed(Proposed(action, k, action.intent_digest(), "risk" if risky else None, pre, at))

    def do_reject(self, dt: int, budget: bool, via_budget_event: bool, last: bool) -> None:
        rule_name = "budget-steps" if budget else "path-dotdot"
        at = self.tick(dt)
        if via_budget_event:
            self.feed(BudgetExhausted(rule_name, "refused", "write_file a.txt", at))
        else:
            self.feed(ProposalRejected(rule_name, "refused", "write_file a.txt", at, last))

    def do_finish(self, dt: int, passed: bool, bound: str, starts: bool = True) -> None:
        at = self.tick(dt)
        asked = self.feed(Finished(at))
        if asked is not None:
            assert asked == (RunVerifier(self.state.env.head, self.state.env.tree),)
        head, tree = self.state.env.head, self.state.env.tree
        if bound == "stale":
            head = BASE if head != BASE else oid(9)
        elif bound == "tree":
            tree = oid(8)
        if not starts:
            self.feed(VerifierCannotStart(head, tree, CLEAN, "no such file", ("t::a",), at))
            return
        isolation = "bwrap" if passed else "none"
        self.feed(VerifierResult(passed, head, tree, CLEAN, "s", {}, 0, False, at, {}, isolation))

    # -- execution and recovery --------------------------------------------------------

    def grant(self) -> Grant | None:
        return grant_of(self.state.pending, self.expiry)

    def do_execute(self, dt: int, grant: str, crash: bool, lookup: bool = True) -> None:
        """``execute_pending``: the intent's key is looked up first (a write found is
        reconciled, not executed again), then the machine decides, then the adapter."""
        at = self.tick(dt)
        p = self.state.pending
        found = self.adapter.index.get(p.key) if p is not None else None
        if found is not None and lookup:
            self.feed(WriteReceipt(found, True, self.adapter.branch, at, self.grant()))
            return
        given = {"true": self.grant(), "none": None, "forged": Grant("sha256:forged", 1e12)}[grant]
        for effect in self.feed(ExecuteDue(at, given)) or ():
            if not isinstance(effect, Execute):
                continue
            outcome = self.adapter.execute(effect.pending, effect.grant, at)
            if outcome is None or crash:
                return  # the branch CAS lost, or killed after the write (window 3)
            r, replayed = outcome
            if not replayed:
                self.executed.append(r.key)
            if r.intent_digest != effect.pending.intent_digest:
                self.feed(ReceiptConflict(r, self.adapter.branch, at))
            else:
                self.feed(WriteReceipt(r, replayed, self.adapter.branch, at, effect.grant))

    def do_reconcile(self, dt: int, stray: bool, via_accept: bool) -> None:
        """Resume, or the lookup before a risky write: take in what the pending key names
        (a conflict through ``reconcile`` or through ``accept``), or a stray old receipt."""
        at = self.tick(dt)
        p = self.state.pending
        found = self.adapter.index.get(p.key) if p is not None else None
        if found is None or stray:
            old = self.adapter.index.get(self.recorded[0]) if self.recorded else None
            if old is not None:
                self.feed(WriteReceipt(old, True, self.adapter.branch, at, self.grant()))
        elif p is not None and found.intent_digest != p.intent_digest and not via_accept:
            self.feed(ReceiptConflict(found, self.adapter.branch, at))
        else:
            self.feed(WriteReceipt(found, True, self.adapter.branch, at, self.grant()))

    def do_plant(self, dt: int, same_intent: bool) -> None:
        """Someone else commits the pending key: with another intent, or with the same
        intent but no approval of its own (a forged write); or any foreign write."""
        at = self.tick(dt)
        p = self.state.pending
        key = p.key if p is not None else self.fresh("k-foreign")
        digest_ = write(content="hostile").intent_digest()
        if p is not None and same_intent:
            digest_ = p.intent_digest
        if key not in self.adapter.index:
            self.adapter.commit(key, digest_, "write_file", None, at)

    def do_regate(self, dt: int, budget: bool) -> None:
        """``execute_pending`` re-gates only a write not yet made (its key looked up first):
        an abandoned pending never leaves a write behind unrecorded."""
        at = self.tick(dt)
        p = self.state.pending
        if p is not None and p.key in self.adapter.index:
            self.do_execute(0, "true", crash=False)
            return
        rule_name = "budget-steps" if budget else "path-symlink"
        if self.feed(PendingRejectedAtExecute(rule_name, "refused at execute", at)) is not None:
            assert p is not None
            assert p.key not in self.adapter.index
            assert self.state.pending is None

    def do_crash(self, dt: int) -> None:
        """SIGKILL, then resume: what was only held in memory is gone; the last
        checkpoint and the adapter (the branch, its receipts) are what is left."""
        self.tick(dt)
        self.state = self.checkpointed
        self.held = []

    def do_pause(self, dt: int) -> None:
        """The driver stops (a session's agent left): a held receipt is written."""
        held = bool(self.held)
        effects = self.feed(Pause(self.tick(dt)))
        assert effects is not None
        assert [type(e) for e in effects] == ([Persist] if held else [])
        assert not self.held
        assert encode(self.state) == encode(self.checkpointed)

    # -- humans ------------------------------------------------------------------------

    def do_approve(self, dt: int, ttl: int, swapped: bool, reused: bool) -> None:
        at = self.tick(dt)
        nonce = self.state.used_nonces[0] if reused and self.state.used_nonces else self.fresh("n")
        ev = evidence(nonce, at + ttl, self.fresh("salt"))
        self.expiry[digest(ev)] = at + ttl
        event = approval_in(self.state, ev, "ed-approver", nonce, at + ttl, at)
        if swapped:
            other = ApprovalAccepted if isinstance(event, ApprovalRefreshed) else ApprovalRefreshed
            event = other(ev, "ed-approver", nonce, at + ttl, at)
        self.feed(event)

    def do_expire(self, dt: int) -> None:
        self.feed(ApprovalExpired(self.tick(dt)))

    def do_review(self, dt: int, abort: bool, drift: str) -> None:
        at = self.tick(dt)
        case = self.state.review
        fp = case.receipt_fingerprint if case and drift != "receipt" else "sha256:changed"
        head = case.environment_version if case and drift != "branch" else oid(999)
        used = self.state.used_nonces
        nonce = used[0] if drift == "nonce" and used else self.fresh("n")
        ev = {"claims": {"nonce": nonce}, "signer": "ed-reviewer", "signature": nonce}
        if abort:
            self.feed(ReviewAbort(ev, "ed-reviewer", nonce, fp, head, at))
        else:
            tree = self.adapter.trees.get(head, oid(998))
            self.feed(ReviewReplan(ev, "ed-reviewer", nonce, fp, head, tree, CLEAN, at))

    # -- rules: each in its own phase, and anything anywhere ---------------------------

    @initialize(loaded=_rare())
    def start(self, loaded: bool) -> None:
        """A fresh run, or one loaded from a valid checkpoint whose risky intent is
        running without evidence (validate_state allows it; nothing else makes it)."""
        if loaded:
            action = write(content="loaded")
            pending = Pending(
                action, "k-loaded", action.intent_digest(), "risk", precondition_at(self.adapter),
                None, 0.0,
            )  # fmt: skip
            self.state = self.checkpointed = replace(self.state, pending=pending)
            validate_state(self.state)
            self.persisted.add(digest(encode(pending)))

    @precondition(proposing)
    @_rule("propose")
    def propose(self, **kw: Any) -> None:
        self.do_propose(**kw)

    @precondition(proposing)
    @_rule("reject")
    def reject(self, **kw: Any) -> None:
        self.do_reject(**kw)

    @precondition(lambda m: proposing(m) and m.state.receipts.count > 0)
    @_rule("finish")
    def finish(self, **kw: Any) -> None:
        self.do_finish(**kw)

    @precondition(executing)
    @_rule("execute")
    def execute(self, **kw: Any) -> None:
        self.do_execute(**kw)

    @precondition(lambda m: m.state.pending is not None and m.state.phase != NEEDS_REVIEW)
    @_rule("reconcile")
    def reconcile(self, **kw: Any) -> None:
        self.do_reconcile(**kw)

    @precondition(lambda m: m.state.pending is not None)
    @_rule("plant")
    def plant(self, **kw: Any) -> None:
        self.do_plant(**kw)

    @precondition(lambda m: m.state.phase == AWAITING_APPROVAL)
    @_rule("approve")
    def approve(self, **kw: Any) -> None:
        self.do_approve(**kw)

    @precondition(lambda m: executing(m) and m.state.pending.approval is not None)
    @_rule("expire")
    def expire(self, **kw: Any) -> None:
        self.do_expire(**kw)

    @precondition(lambda m: m.state.phase == NEEDS_REVIEW)
    @_rule("review")
    def review(self, **kw: Any) -> None:
        self.do_review(**kw)

    @_rule("crash")
    def crash(self, **kw: Any) -> None:
        self.do_crash(**kw)

    @_rule("pause")
    def pause(self, **kw: Any) -> None:
        self.do_pause(**kw)

    @rule(data=st.data(), which=st.sampled_from(sorted(ARGS)))
    def anything(self, data: st.DataObject, which: str) -> None:
        """Any event in any phase: illegal ones must raise and change nothing."""
        getattr(self, f"do_{which}")(**data.draw(st.fixed_dictionaries(ARGS[which])))

    @invariant()
    def the_branch_is_at_most_the_pending_write_ahead_of_the_checkpoint(self) -> None:
        """The crash-window proof: every write the run made is recorded in the last
        checkpoint, or is that checkpoint's pending intent's (resume takes its receipt in
        from the branch), or a reviewer's case holds it."""
        cp = self.checkpointed
        named = {*self.recorded, *cp.quarantined_keys}
        named |= {x["case"]["key"] for x in cp.sealed if x.get("kind") == "review"}
        if cp.pending is not None:
            named.add(cp.pending.key)
        assert set(self.executed) <= named, set(self.executed) - named

    @invariant()
    def frozen_holds_its_pending_and_terminal_holds_none(self) -> None:
        s = self.state
        if s.phase in FROZEN_PHASES:
            assert s.pending is not None
        if s.phase in (DONE, FAILED):
            assert s.pending is None
            assert s.review is None


TestRunMachine = RunMachine.TestCase
TestRunMachine.settings = settings.get_profile("ci")


# -- pinned regressions: explicit runs of the stateful machine -------------------------


def drive(*steps: tuple[str, dict[str, Any]], loaded: bool = False) -> RunMachine:
    """Run ``RunMachine`` through these steps, checking every invariant after each."""
    m = RunMachine()
    m.start(loaded=loaded)
    for name, kw in steps:
        getattr(m, f"do_{name}")(**kw)
        m.frozen_holds_its_pending_and_terminal_holds_none()
        m.the_branch_is_at_most_the_pending_write_ahead_of_the_checkpoint()
    m.teardown()
    return m


PROPOSE = {
    "dt": 1,
    "content": "x",
    "risky": False,
    "key": "fresh",
    "patch": False,
    "foreign": False,
}
RISKY = {**PROPOSE, "risky": True}
EXECUTE = {"dt": 1, "grant": "true", "crash": False}
APPROVE = {"dt": 1, "ttl": 50, "swapped": False, "reused": False}
RECONCILE = {"dt": 1, "stray": False, "via_accept": False}
FINISH = {"dt": 1, "passed": True, "bound": "last"}
REPLAN = {"dt": 1, "abort": False, "drift": ""}


def test_regression_an_approved_write_killed_before_its_receipt_reconciles_after_expiry() -> None:
    m = drive(
        ("propose", RISKY),
        ("approve", APPROVE),
        ("execute", {**EXECUTE, "crash": True}),
        ("reconcile", {**RECONCILE, "dt": 500}),  # long after the approval expired
        ("finish", FINISH),
    )
    assert m.state.phase == DONE
    assert m.recorded == ["k-1"]
    assert m.state.receipts.last is not None
    assert m.state.receipts.last.committed_at < 500


def test_regression_a_conflict_replanned_plans_again_with_a_new_key_and_finishes() -> None:
    m = drive(
        ("propose", PROPOSE),
        ("plant", {"dt": 1, "same_intent": False}),
        ("execute", EXECUTE),
        ("review", {**REPLAN, "drift": "receipt"}),  # refused: stays frozen
        ("review", REPLAN),
        ("propose", {**PROPOSE, "key": "quarantined"}),  # refused: the key is retired
        ("propose", PROPOSE),
        ("execute", EXECUTE),
        ("finish", FINISH),
    )
    assert m.state.phase == DONE
    assert m.replanned == ["k-1"]
    assert m.state.quarantined_keys == ("k-1",)
    assert len(m.recorded) == 1
    assert m.recorded[0] != "k-1"


def test_regression_an_expired_approval_freezes_and_a_refreshed_one_writes_once() -> None:
    m = drive(
        ("propose", RISKY),
        ("approve", {**APPROVE, "ttl": 10}),
        ("execute", {**EXECUTE, "dt": 20}),  # expired: frozen, nothing executes
        ("execute", EXECUTE),  # still frozen
        ("approve", {**APPROVE, "reused": True}),  # the old nonce: refused
        ("approve", APPROVE),
        ("execute", EXECUTE),
        ("pause", {"dt": 1}),  # the receipt rode in memory: the driver's pause writes it
    )
    assert m.state.phase == RUNNING
    assert len(m.recorded) == 1
    assert [s["kind"] for s in m.state.sealed] == ["approval_superseded"]
    assert len(m.state.used_nonces) == 2


def test_regression_a_verdict_on_a_stale_head_or_tree_never_finishes() -> None:
    m = drive(
        ("propose", PROPOSE),
        ("execute", EXECUTE),
        ("finish", {**FINISH, "bound": "stale"}),
        ("finish", {**FINISH, "bound": "tree"}),
    )
    assert m.state.phase == RUNNING
    assert m.state.verifier is None


def test_regression_a_loaded_risky_intent_without_evidence_freezes_not_executes() -> None:
    m = drive(("execute", {**EXECUTE, "grant": "none"}), ("execute", EXECUTE), loaded=True)
    assert (m.state.phase, m.state.stop_reason) == (AWAITING_APPROVAL, "awaiting_approval")
    assert m.adapter.index == {}


def test_regression_a_forged_write_of_a_risky_key_goes_to_review() -> None:
    m = drive(
        ("propose", RISKY),
        ("plant", {"dt": 1, "same_intent": True}),  # same intent, no approval in its trailers
        ("reconcile", RECONCILE),
    )
    assert m.state.phase == NEEDS_REVIEW
    assert m.state.review is not None
    assert "without approval evidence" in m.state.review.reason


def test_regression_a_write_found_after_an_expiry_freeze_is_refused_not_recorded_invalid() -> None:
    # The write landed (killed before its receipt), then the run froze on the expired
    # approval. Recording now would keep awaiting_approval without a pending (an invalid
    # checkpoint, as today's Runtime.record would try): the machine refuses instead.
    m = drive(
        ("propose", RISKY),
        ("approve", APPROVE),
        ("execute", {**EXECUTE, "crash": True}),
        ("expire", {"dt": 100}),
        ("reconcile", RECONCILE),
    )
    assert (m.state.phase, m.state.stop_reason) == (AWAITING_APPROVAL, "approval_expired")
    assert m.recorded == []
    assert "k-1" in m.adapter.index


def test_regression_a_refused_last_proposal_ends_the_run_before_any_verifier() -> None:
    m = drive(
        ("propose", PROPOSE),
        ("execute", EXECUTE),
        ("reject", {"dt": 1, "budget": False, "via_budget_event": False, "last": False}),
        ("reject", {"dt": 1, "budget": False, "via_budget_event": False, "last": True}),
        ("finish", FINISH),  # refused: the run has ended
    )
    assert (m.state.phase, m.state.stop_reason) == (FAILED, AGENT_WRITE_REFUSED)
    assert m.state.verifier is None
    assert m.state.cursor == 3
    assert [e.kind for e in m.trace][-2:] == ["gate_rejected", "gate_rejected"]


def test_regression_a_verifier_that_cannot_start_fails_and_a_stale_one_changes_nothing() -> None:
    m = drive(
        ("propose", PROPOSE),
        ("execute", EXECUTE),
        ("finish", {**FINISH, "bound": "stale", "starts": False}),  # refused: not the last HEAD
        ("finish", {**FINISH, "starts": False}),
    )
    assert (m.state.phase, m.state.stop_reason) == (FAILED, "verifier_cannot_start")
    assert m.state.verifier is not None
    assert m.state.verifier.outcomes == {"t::a": "error"}


def test_regression_a_pending_regated_at_execute_is_abandoned_and_never_written() -> None:
    m = drive(
        ("propose", RISKY),
        ("approve", APPROVE),
        ("regate", {"dt": 1, "budget": True}),  # refused: budgets are not gated again
        ("regate", {"dt": 1, "budget": False}),
        ("propose", PROPOSE),
        ("execute", EXECUTE),
        ("finish", FINISH),
    )
    assert m.state.phase == DONE
    assert len(m.recorded) == 1
    assert m.recorded[0] != "k-1"
    assert "k-1" not in m.adapter.index


def test_regression_a_receipt_lost_to_a_crash_before_its_checkpoint_is_recorded_once() -> None:
    m = drive(
        ("propose", PROPOSE),
        ("execute", EXECUTE),  # written; the receipt rides in memory
        ("crash", {"dt": 1}),  # lost with the process: the intent checkpoint is left
        ("finish", FINISH),  # refused: the intent is still pending there
        ("execute", EXECUTE),  # the key is looked up first: reconciled, not written again
        ("crash", {"dt": 1}),
        ("reconcile", RECONCILE),
        ("propose", PROPOSE),  # its checkpoint carries the receipt of k-1
        ("execute", EXECUTE),
        ("finish", FINISH),  # and the verdict carries the receipt of the last write
    )
    assert m.state.phase == DONE
    assert m.recorded == m.executed
    assert len(m.recorded) == 2
    assert [e.kind for e in m.trace] == ["intent", "receipt", "intent", "receipt", "verifier"]


def test_run_state_evolve_is_dataclasses_replace() -> None:
    """``RunState.evolve`` (the machine's cheap replace) copies the fields only: it gives
    exactly what ``dataclasses.replace`` gives, and a RunState holds nothing but fields."""
    s, _ = with_intent()
    changes: dict[str, Any] = {"cursor": 7, "pending": None, "events": (), "trace_chain": "c"}
    evolved = s.evolve(**changes)
    assert evolved == replace(s, **changes)
    assert type(evolved) is RunState
    assert evolved is not s
    assert s.cursor != 7
    assert set(vars(s)) == set(vars(evolved)) == {f.name for f in fields(RunState)}
    assert encode(evolved) == encode(replace(s, **changes))
    with pytest.raises(TypeError):
        s.evolve(no_such_field=1)
