"""Approvals and reviews against the live run: what evidence must bind, and what the
runtime does with it.

Humans sign evidence with ``gitrun approve`` / ``gitrun review decide``; it waits in an
inbox ref (``refs/gitrun/runs/<run>/inbox/<kind>``) until the lease holder takes it in,
checks it against the trust roots and the checkpointed run, and records it with one
checkpoint advance. Only the runtime writes checkpoints. A ``--remote`` run's inbox is
the remote's (``site``): evidence is pushed there, fetched by whichever machine resumes,
and deleted there once consumed; this machine's own inbox refs are its fallback.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from gitrun.adapter.gittypes import Repository
from gitrun.core.codec import DecodeError, canonical_bytes, decode, digest, encode
from gitrun.core.errors import ApprovalRefused, BadInput, CheckpointRejected, ReceiptDrift
from gitrun.core.machine import approval_in
from gitrun.core.machine_events import Grant, ReviewAbort, ReviewReplan
from gitrun.core.records import AWAITING_APPROVAL, NEEDS_REVIEW, Pending, RunState
from gitrun.store import gitstore
from gitrun.store.evidence import APPROVAL_DOMAIN, REVIEW_DOMAIN, Signed, TrustRoot, verify

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime
    from gitrun.store.remote import RemoteSite

CLOCK_SKEW = 120.0


def inbox_ref(run_id: str, kind: str) -> str:
    return f"refs/gitrun/runs/{run_id}/inbox/{kind}"


def submit(
    repo: Repository,
    run_id: str,
    kind: str,
    evidence: Signed,
    site: RemoteSite | None = None,
) -> None:
    """Leave signed evidence for the runtime (replaces any earlier, unconsumed one)."""
    ref = inbox_ref(run_id, kind)
    oid = gitstore.write_blob(repo, canonical_bytes(encode(evidence)))
    if site is not None:
        site.put_evidence(run_id, kind, oid)
        return
    gitstore.transaction(repo).move(
        ref, gitstore.read_ref(repo, ref), oid, message=f"gitrun {kind} evidence"
    ).commit()


def read_inbox(
    repo: Repository, run_id: str, kind: str, site: RemoteSite | None = None
) -> Signed | None:
    """The evidence waiting: the remote's (fetched now) for a remote run, else this
    machine's own inbox ref."""
    oid = None
    if site is not None:
        from gitrun.store.remote import inbox_mirror

        site.fetch_inbox(run_id)
        oid = gitstore.read_ref(repo, inbox_mirror(run_id, kind))
    if oid is None:
        oid = gitstore.read_ref(repo, inbox_ref(run_id, kind))
    if oid is None:
        return None
    try:
        return decode(Signed, json.loads(gitstore.read_blob(repo, oid)))
    except (ValueError, DecodeError) as exc:
        raise ApprovalRefused(
            "malformed", f"{kind} evidence in the inbox is unreadable: {exc}"
        ) from exc


def clear_inbox(repo: Repository, run_id: str, kind: str, site: RemoteSite | None = None) -> None:
    """Remove the evidence :func:`read_inbox` returned (the remote's, else the local)."""
    if site is not None and site.take_evidence(run_id, kind):
        return
    ref = inbox_ref(run_id, kind)
    current = gitstore.read_ref(repo, ref)
    if current is not None:
        gitstore.transaction(repo).move(
            ref, current, None, message=f"gitrun {kind} evidence consumed"
        ).commit()


def state_fingerprint(pending: Pending) -> str:
    """The environment state an approval is bound to: the precondition of the write."""
    pre = pending.precondition
    return digest([pre.instance_id, pre.head, pre.tree])


def approval_binding(state: RunState, p: Pending) -> dict[str, Any]:
    """Everything an approval binds: the run, the exact action and the state it meets."""
    return {
        "kind": "approval",
        "task_id": state.task_id,
        "task_version": state.task_version,
        "run_id": state.run_id,
        "policy_id": state.policy_id,
        "policy_version": state.policy_version,
        "action": digest(encode(p.action)),
        "key": p.key,
        "intent_digest": p.intent_digest,
        "instance_id": state.env.instance_id,
        "state_fingerprint": state_fingerprint(p),
        "generation": state.generation,
    }


def approval_claims(state: RunState, approver_note: str, ttl_seconds: float) -> dict[str, Any]:
    """What ``gitrun approve`` signs for the checkpoint's pending action."""
    p = state.pending
    if p is None or state.phase != AWAITING_APPROVAL:
        raise BadInput(
            f"run {state.run_id} has no action waiting for approval (phase {state.phase})"
        )
    now = time.time()
    return {
        **approval_binding(state, p),
        "issued_at": now,
        "expires_at": now + ttl_seconds,
        "nonce": secrets.token_hex(16),
        "note": approver_note,
    }


def review_claims(state: RunState, decision: str) -> dict[str, Any]:
    """What ``gitrun review decide`` signs for the open review case."""
    case = state.review
    if case is None or state.phase != NEEDS_REVIEW:
        raise BadInput(f"run {state.run_id} has no open review case (phase {state.phase})")
    if decision not in ("replan", "abort"):
        raise BadInput(f"decision must be replan or abort, not {decision!r}")
    return {
        "kind": "review",
        "decision": decision,
        "task_id": state.task_id,
        "task_version": state.task_version,
        "run_id": state.run_id,
        "policy_id": state.policy_id,
        "policy_version": state.policy_version,
        "action": digest(encode(case.action)),
        "key": case.key,
        "pending_digest": case.pending_digest,
        "receipt_digest": case.receipt_digest,
        "receipt_fingerprint": case.receipt_fingerprint,
        "environment_version": case.environment_version,
        "nonce": secrets.token_hex(16),
        "issued_at": time.time(),
    }


def _mismatch(claims: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in expected.items() if claims.get(k) != v)


class Approvals:
    """The runtime's view of approval and review evidence, given the trust roots."""

    def __init__(self, roots: dict[str, TrustRoot] | None) -> None:
        self.roots = roots

    # -- on load -----------------------------------------------------------------------

    def require_roots(self, state: RunState) -> None:
        """Evidence in a checkpoint is trusted only against trust roots handed in now."""
        holds = bool(
            state.used_nonces
            or state.review
            or state.sealed
            or (state.pending is not None and state.pending.approval is not None)
        )
        if holds and self.roots is None:
            raise CheckpointRejected(
                "trust-roots-missing",
                "this checkpoint holds approval or review evidence; pass --trust-roots FILE "
                "(or set GITRUN_TRUST_ROOTS) to resume it",
            )
        p = state.pending
        if p is not None and p.approval is not None and self.roots is not None:
            try:
                verify(self._signed(p.approval), self.roots, "approver", APPROVAL_DOMAIN)
            except ApprovalRefused as exc:
                raise CheckpointRejected("untrusted-evidence", str(exc)) from exc

    @staticmethod
    def _signed(raw: Any) -> Signed:
        try:
            return decode(Signed, raw)
        except DecodeError as exc:
            raise ApprovalRefused("malformed", f"evidence is malformed: {exc}") from exc

    def _roots(self) -> dict[str, TrustRoot]:
        if self.roots is None:
            raise ApprovalRefused("no-trust-roots", "no trust roots given (--trust-roots FILE)")
        return self.roots

    # -- approvals ---------------------------------------------------------------------

    def check_approval(self, state: RunState, evidence: Signed) -> dict[str, Any]:
        """Verify a fresh approval for the checkpoint's pending action, or refuse it."""
        claims = verify(evidence, self._roots(), "approver", APPROVAL_DOMAIN)
        p = state.pending
        if p is None:
            raise ApprovalRefused("nothing-pending", "no pending action to approve")
        if claims.get("nonce") in state.used_nonces:
            raise ApprovalRefused("nonce-reused", f"nonce {claims.get('nonce')} was already used")
        wrong = _mismatch(claims, approval_binding(state, p))
        if wrong:
            raise ApprovalRefused("binding", f"the approval is bound to another {', '.join(wrong)}")
        expires = claims.get("expires_at")
        if not isinstance(expires, int | float) or expires <= time.time():
            raise ApprovalRefused("expired", "the approval has already expired; approve again")
        return claims

    def intake_approval(self, rt: Runtime) -> bool:
        """refresh_pending_approval: take a fresh approval from the inbox into the checkpoint."""
        s = rt.state
        evidence = read_inbox(rt.env.repo, s.run_id, "approval", rt.env.site)
        if evidence is None or s.phase != AWAITING_APPROVAL or s.pending is None:
            return False
        claims = self.check_approval(s, evidence)
        nonce, expires = str(claims["nonce"]), claims["expires_at"]
        rt.apply(approval_in(s, encode(evidence), evidence.signer, nonce, expires, time.time()))
        return True

    def grant(self, pending: Pending) -> Grant | None:
        """The verified approval the adapter must enforce (None: the pending holds none)."""
        if pending.approval is None:
            return None
        evidence = self._signed(pending.approval)
        claims = verify(evidence, self._roots(), "approver", APPROVAL_DOMAIN)
        return Grant(evidence.fingerprint(), float(claims["expires_at"]))

    # -- reviews -----------------------------------------------------------------------

    def intake_review(self, rt: Runtime) -> bool:
        """Consume a signed review decision: replan or abort; anything off stays frozen."""
        s = rt.state
        case = s.review
        evidence = read_inbox(rt.env.repo, s.run_id, "review", rt.env.site)
        if case is None or evidence is None or s.pending is None:
            return False
        claims = verify(evidence, self._roots(), "reviewer", REVIEW_DOMAIN)
        if claims.get("nonce") in s.used_nonces:
            raise ApprovalRefused("nonce-reused", f"nonce {claims.get('nonce')} was already used")
        expected = review_claims(s, str(claims.get("decision")))
        wrong = _mismatch(
            claims, {k: v for k, v in expected.items() if k not in ("nonce", "issued_at")}
        )
        if wrong:
            raise ApprovalRefused("binding", f"the decision is bound to another {', '.join(wrong)}")
        fp, head = self._reread(rt, case.key, case.receipt_fingerprint, case.environment_version)
        ev, signer, nonce = encode(evidence), evidence.signer, str(claims["nonce"])
        now = time.time()
        if claims["decision"] == "abort":
            rt.apply(ReviewAbort(ev, signer, nonce, fp, head, now))
        else:
            obs = rt.env.observe(full=True)
            status = obs.status_digest
            rt.apply(ReviewReplan(ev, signer, nonce, fp, obs.head, obs.tree, status, now))
        return True

    @staticmethod
    def _reread(
        rt: Runtime, key: str, fingerprint: str, environment_version: str
    ) -> tuple[str, str]:
        """The authoritative receipt and environment must be exactly what was reviewed:
        the receipt's fingerprint and the branch tip, as re-read now."""
        try:
            receipt = rt.env.lookup(key)
        except ReceiptDrift as exc:
            raise ApprovalRefused("receipt-changed", f"the receipt of {key} moved: {exc}") from exc
        # An interrupted exec's case has no receipt: there must still be none.
        reread = receipt.fingerprint() if receipt is not None else ""
        if reread != fingerprint:
            raise ApprovalRefused(
                "receipt-changed", f"the receipt for {key} changed after the decision was signed"
            )
        head = str(rt.env.head().id)
        if head != environment_version:
            raise ApprovalRefused(
                "environment-changed", f"the branch moved to {head} after the decision was signed"
            )
        obs = rt.env.observe(full=True)
        if obs.dirty:
            raise ApprovalRefused(
                "environment-changed", f"uncommitted changes: {list(obs.dirty[:5])}"
            )
        return reread, head
