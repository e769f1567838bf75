"""Cross-object invariants of a run state, checked before any checkpoint is written.

Every check is an explicit ``if … raise`` so it survives ``python -O``.
"""

from __future__ import annotations

from gitrun.core.codec import canonical_bytes, encode
from gitrun.core.errors import InvalidState
from gitrun.core.records import (
    AWAITING_APPROVAL,
    DONE,
    FAILED,
    NEEDS_REVIEW,
    PHASES,
    RUNNING,
    SCHEMA_VERSION,
    Pending,
    RunState,
    kind_allowed,
)


def _bad(rule: str, message: str) -> InvalidState:
    return InvalidState(rule, message)


def validate_state(state: RunState) -> bytes:
    """Raise :class:`InvalidState` naming the first invariant ``state`` breaks; return the
    canonical bytes of a valid state (the payload a checkpoint stores)."""
    if state.schema != SCHEMA_VERSION:
        raise _bad("schema", f"schema {state.schema} is not {SCHEMA_VERSION}")
    if state.generation < 1:
        raise _bad("generation", "generations start at 1")
    if state.phase not in PHASES:
        raise _bad("phase", f"unknown phase {state.phase!r}")
    _check_phase(state)
    if state.pending is not None:
        _check_pending(state, state.pending)
    _check_counts(state)
    if state.phase == DONE:
        ver = state.verifier
        if ver is None or not ver.passed or ver.head != state.env.head:
            raise _bad("done-verified", "done needs a passing verifier event at the last HEAD")
    if state.env.observation_version != state.env.head:
        raise _bad("observation", "observation version must be the HEAD commit")
    try:
        return canonical_bytes(encode(state))
    except (TypeError, ValueError) as exc:
        raise _bad("serialisable", str(exc)) from exc


def _check_phase(state: RunState) -> None:
    """The phase agrees with the pending action, the review case and the stop reason."""
    pending = state.pending
    if state.phase in (AWAITING_APPROVAL, NEEDS_REVIEW) and pending is None:
        raise _bad("phase-pending", f"phase {state.phase} needs a pending action")
    if state.phase in (DONE, FAILED) and pending is not None:
        raise _bad("phase-pending", f"a {state.phase} run cannot hold a pending action")
    if (state.phase == NEEDS_REVIEW) != (state.review is not None):
        raise _bad("phase-review", "a review case exists exactly when the phase is needs_review")
    if state.phase == AWAITING_APPROVAL and (pending is None or pending.risk is None):
        raise _bad("phase-risk", "awaiting approval, but the pending action carries no risk")
    if (state.phase == RUNNING) != (state.stop_reason is None):
        raise _bad("stop-reason", "a stop reason is set exactly when the run is not running")


def _check_pending(state: RunState, pending: Pending) -> None:
    """The pending intent is its action's, under a fresh key, in scope, on this instance."""
    if pending.intent_digest != pending.action.intent_digest():
        raise _bad("pending-digest", "the pending intent digest does not match its action")
    if pending.key in state.quarantined_keys:
        raise _bad("pending-key", f"pending key {pending.key} is quarantined")
    last = state.receipts.last
    # The same key with another intent may be pending: it is the seed's conflict (a
    # session client reusing its key), which execution turns into a review case.
    if last is not None and last.key == pending.key and last.intent_digest == pending.intent_digest:
        raise _bad("pending-key", f"pending key {pending.key} is already a recorded receipt")
    if not kind_allowed(pending.action.kind, state.scope.allowed_actions):
        raise _bad("pending-scope", f"{pending.action.kind} is outside the allowed scope")
    if pending.precondition.instance_id != state.env.instance_id:
        raise _bad("pending-instance", "the pending precondition names another instance")


def _check_counts(state: RunState) -> None:
    """Receipts, the adapter generation, the budgets used and the nonces agree."""
    if state.receipts.count != state.env.adapter_generation:
        raise _bad("receipts", "receipt count and adapter generation disagree")
    if state.budgets.steps != state.receipts.count:
        raise _bad("budgets", "step budget used does not equal the number of receipts")
    if min(state.budgets.proposals, state.budgets.steps) < 0 or state.budgets.wall_seconds < 0:
        raise _bad("budgets", "budgets used cannot be negative")
    if state.receipts.last is not None and state.receipts.last.commit == "":
        raise _bad("receipts", "a receipt needs its commit id")
    if len(set(state.used_nonces)) != len(state.used_nonces):
        raise _bad("nonces", "a nonce is recorded twice")
