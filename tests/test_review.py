"""Issue 6 acceptance, review: the same idempotency key committed with another intent
freezes the run in ``needs_review`` with the whole case kept; only a trusted reviewer's
decision, bound to exactly that case and re-checked against the authoritative receipt
and the branch, moves it on (replan: a new key; abort: failed, evidence kept).

The conflict is made as it would happen: a fix-median run is SIGKILLed right after its
intent checkpoint, then another writer takes the lease over from the dead owner and
commits a different write with the pending key through the real adapter. That frozen
run is made once per module; each test works on a relocated copy of it.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pygit2
import pytest
from conftest import SANDBOXES, Gitrun, Result, git, relocate_workspace, snapshot
from helpers import CLI_ENV, Keys, RunCopy, hermetic

from gitrun.adapter.environment import index_ref
from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.codec import decode, digest, encode
from gitrun.core.errors import Exit, Frozen, ReceiptConflict
from gitrun.core.records import (
    ADAPTER_VERSION,
    DONE,
    FAILED,
    NEEDS_REVIEW,
    RUNNING,
    Action,
    new_key,
)
from gitrun.engine.agents import load_agent
from gitrun.engine.approvals import review_claims
from gitrun.engine.runtime import Runtime
from gitrun.store import gitstore
from gitrun.store.evidence import REVIEW_DOMAIN, Signed, sign
from gitrun.store.lease import LeaseManager

pytestmark = pytest.mark.timeout(120)

RUN = "rv"
TASK = "fix-median"
KILLED = -9  # a child killed by GITRUN_CRASH_AT (SIGKILL)
CONFLICT = Action(
    "write_file",
    path="stats/notes.txt",
    content="not the fix\n",
    description="another intent under the same key",
)
SAME_KEY = "needs review (same idempotency key, different intent digest)"


# -- the frozen run every test copies ----------------------------------------------------


def _intrude(home: Path, action: Action) -> str:
    """Another writer takes the lease from the dead owner and commits ``action`` under
    the pending key, through the real adapter. Returns the commit."""
    opened = service.open_run(RUN, service.Options(Workspace(home)))
    _, stored = service.load_verified(opened)
    p = stored.state.pending
    assert p is not None
    lease = LeaseManager(opened.repo, RUN, "intruder", 30)
    lease.acquire(stored.state.generation)  # the owner's OS lock is free: taken at once
    try:
        out = opened.env.execute(action, p.key, action.intent_digest(), p.precondition, lease.fence)
    finally:
        lease.release()
    assert not out.replayed
    return out.receipt.commit


@dataclass(frozen=True)
class Template:
    home: Path
    keys: Keys
    crashed: Result
    resumed: Result
    conflict: str


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Template:
    base = tmp_path_factory.mktemp("review-run")
    home = base / "home"
    home.mkdir()
    cli = Gitrun(home)
    with hermetic(base / "user"):
        crashed = cli(
            "run",
            str(SANDBOXES / TASK),
            "--run-id",
            RUN,
            GITRUN_CRASH_AT="after_intent_checkpoint",
            **CLI_ENV,
        )
        conflict = _intrude(home, CONFLICT)
        resumed = cli("resume", RUN, "--trust-roots", str(keys.roots), **CLI_ENV)
    return Template(home, keys, crashed, resumed, conflict)


class Copy(RunCopy):
    RUN = RUN
    TASK = TASK
    INBOX = "review"

    def decide(self, decision: str, key: str = "bob") -> Result:
        return self.cli("review", "decide", RUN, decision, "--key", str(self.keys[key]))

    def craft(self, decision: str = "replan", **edits: Any) -> Signed:
        """bob's decision on the open case, some claims edited, then signed."""
        claims = review_claims(self.state(), decision)
        claims.update(edits)
        return sign(claims, self.keys["bob"], "reviewer", REVIEW_DOMAIN)


@pytest.fixture
def ws(template: Template, tmp_path: Path) -> Copy:
    home = tmp_path / "ws-home"
    relocate_workspace(template.home, home)
    return Copy(home, template.keys)


@contextmanager
def _runtime(ws: Copy) -> Iterator[Runtime]:
    """The runtime exactly as `gitrun resume` builds it, holding the lease."""
    opts = service.Options(Workspace(ws.home), trust_roots=ws.keys.roots)
    opened = service.open_run(RUN, opts)
    ref, stored = service.load_verified(opened)
    agent, _ = load_agent(opened.record.agent, opened.task)
    lease = LeaseManager(opened.repo, RUN, "in-process", 30)
    lease.acquire(stored.state.generation)
    try:
        yield service.build_runtime(opened, ref, stored, lease, agent, opts)
    finally:
        lease.release()


def _stays_frozen(ws: Copy, reason: str) -> None:
    """`gitrun resume` exits 3 naming ``reason``; the checkpoint and branch do not move."""
    before = ws.tips()
    res = ws.resume()
    assert res.code == Exit.FROZEN, (res.out, res.err)
    line = res.err.strip().splitlines()[-1]
    assert line.startswith("gitrun: evidence refused"), line
    assert reason in line, line
    assert ws.tips() == before
    state = ws.state()
    assert state.phase == NEEDS_REVIEW
    assert state.review is not None


# -- needs_review ------------------------------------------------------------------------


def test_the_same_key_committed_with_another_intent_freezes_the_run_in_needs_review(
    template: Template, ws: Copy
) -> None:
    assert template.crashed.code == KILLED
    res = template.resumed
    assert res.code == Exit.FROZEN, res.err
    last = res.err.strip().splitlines()[-1]
    assert last.startswith(f"gitrun: run {RUN} {SAME_KEY} for key k-"), last
    assert f"gitrun review show {RUN}" in last

    state = ws.state()
    assert (state.phase, state.stop_reason) == (NEEDS_REVIEW, "receipt_conflict")
    assert state.pending is not None
    assert state.review is not None
    assert state.review.key == state.pending.key  # the pending action stays
    assert state.receipts.count == 0

    # Resuming again (with the trust roots) stays frozen and writes nothing.
    for _ in range(2):
        before = ws.tips()
        again = ws.resume()
        assert again.code == Exit.FROZEN
        assert SAME_KEY in again.err
        assert ws.tips() == before


def test_no_proposal_and_no_direct_execution_is_accepted_while_a_review_is_open(
    ws: Copy,
) -> None:
    before = ws.tips()
    with _runtime(ws) as rt:
        p = rt.state.pending
        assert p is not None
        with pytest.raises(Frozen):
            rt.step()
        with pytest.raises(Frozen):
            rt.execute_pending()
        with pytest.raises(Frozen):
            rt.run()
        # Nor does the adapter itself run the pending intent under the conflicting key.
        with pytest.raises(ReceiptConflict) as conflict:
            rt.env.execute(p.action, p.key, p.intent_digest, p.precondition, rt.lease.fence)
        assert conflict.value.receipt.intent_digest == CONFLICT.intent_digest()
    assert ws.tips() == before
    assert ws.state().phase == NEEDS_REVIEW


def test_the_review_case_keeps_action_key_both_digests_the_whole_receipt_and_the_trace(
    template: Template, ws: Copy
) -> None:
    state = ws.state()
    case, p = state.review, state.pending
    assert case is not None
    assert p is not None
    assert case.action == p.action
    assert case.key == p.key
    assert case.pending_digest == p.intent_digest == p.action.intent_digest()
    assert case.receipt_digest == CONFLICT.intent_digest() != case.pending_digest
    assert case.reason == "same idempotency key, different intent digest"

    env = ws.opened().env
    authoritative = env.lookup(case.key)
    assert case.receipt == authoritative  # the full receipt, as git has it
    r = case.receipt
    commit = env.repo[template.conflict]
    assert isinstance(commit, pygit2.Commit)
    assert r.namespace == f"git:refs/heads/gitrun/{RUN}"
    assert r.version == ADAPTER_VERSION
    assert r.commit == template.conflict
    assert r.tree == str(commit.tree_id)
    assert r.parent == p.precondition.head
    assert (r.key, r.action, r.run_id, r.approval) == (p.key, "write_file", RUN, "none")
    assert r.instance_id == p.precondition.instance_id
    assert r.paths == ("stats/notes.txt",)
    assert r.committed_at == commit.commit_time
    assert case.receipt_fingerprint == r.fingerprint() == digest(encode(r))
    assert case.environment_version == template.conflict == str(env.head().id)

    events = [(e.kind, e.data) for s in ws.chain() for e in s.events]
    kinds = [k for k, _ in events]
    assert kinds.index("intent") < kinds.index("receipt_conflict")
    assert ("receipt_conflict", {"case": encode(case)}) in events
    intent = next(d for k, d in events if k == "intent")
    assert (intent["key"], intent["digest"]) == (p.key, p.intent_digest)


def test_review_show_prints_both_digests_and_both_diffs(ws: Copy) -> None:
    case = ws.state().review
    assert case is not None
    res = ws.cli("review", "show", RUN)
    assert res.code == 0, res.err
    out = res.out
    assert f"pending intent   {case.pending_digest}" in out
    assert f"receipt intent   {case.receipt_digest}" in out
    assert f"receipt print    {case.receipt_fingerprint}" in out
    assert f"environment      {case.environment_version}" in out
    assert case.receipt is not None
    assert f"commit {case.receipt.commit} tree {case.receipt.tree}" in out
    # Left: the pending patch to stats/median.py; right: what was committed instead.
    assert "+    return (data[mid - 1] + data[mid]) / 2" in out
    assert "+++ b/stats/notes.txt" in out
    assert "+not the fix" in out
    rows = [line for line in out.splitlines() if " | " in line]
    assert any(
        "stats/median.py" in row.split(" | ")[0] and "stats/notes.txt" in row.split(" | ")[1]
        for row in rows
    ), out
    assert f"gitrun review decide {RUN} --key REVIEWER.key replan|abort" in out


# -- decisions that keep the run frozen --------------------------------------------------


def test_a_decision_by_a_reviewer_outside_the_trust_roots_keeps_the_run_frozen(ws: Copy) -> None:
    assert ws.decide("replan", "eve").code == 0  # eve can sign; the runtime does not trust her
    _stays_frozen(ws, "(unknown-signer)")


def test_an_approver_key_cannot_sign_a_review_decision(ws: Copy) -> None:
    res = ws.decide("replan", "alice")
    assert res.code == Exit.BAD_INPUT
    assert "approver key" in res.err
    assert ws.inbox() is None


@pytest.mark.parametrize("part", ["signature", "claims"])
def test_a_tampered_decision_keeps_the_run_frozen(ws: Copy, part: str) -> None:
    assert ws.decide("replan").code == 0
    signed = ws.inbox()
    assert signed is not None
    if part == "signature":
        raw = bytearray(base64.b64decode(signed.signature))
        raw[0] ^= 1
        tampered = replace(signed, signature=base64.b64encode(bytes(raw)).decode())
    else:
        tampered = replace(signed, claims={**signed.claims, "decision": "abort"})
    ws.submit(tampered)
    _stays_frozen(ws, "(bad-signature)")


@pytest.mark.parametrize(
    "field",
    [
        "run_id",
        "key",
        "pending_digest",
        "receipt_digest",
        "receipt_fingerprint",
        "environment_version",
        "action",
    ],
)
def test_a_decision_bound_to_another_run_key_or_digest_keeps_the_run_frozen(
    ws: Copy, field: str
) -> None:
    other = {
        "run_id": "another-run",
        "key": new_key(),
        "pending_digest": Action("delete_file", path="stats/median.py").intent_digest(),
        "receipt_digest": Action("delete_file", path="stats/notes.txt").intent_digest(),
        "receipt_fingerprint": digest(["another receipt"]),
        "environment_version": "0" * 40,
        "action": digest(encode(CONFLICT)),
    }[field]
    ws.submit(ws.craft(**{field: other}))
    _stays_frozen(ws, f"(binding): the decision is bound to another {field}")


@pytest.mark.parametrize("change", ["a commit on the branch", "an uncommitted file"])
def test_a_decision_signed_before_the_environment_changed_keeps_the_run_frozen(
    ws: Copy, change: str
) -> None:
    assert ws.decide("replan").code == 0
    if change == "a commit on the branch":
        git(ws.worktree, "commit", "--allow-empty", "-q", "-m", "someone else was here")
    else:
        (ws.worktree / "stats" / "scratch.py").write_text("x = 1\n")
    _stays_frozen(ws, "(environment-changed)")


@pytest.mark.parametrize("index", ["left stale", "moved along"])
def test_a_decision_signed_before_the_receipt_changed_keeps_the_run_frozen(
    ws: Copy, index: str
) -> None:
    assert ws.decide("replan").code == 0
    # Rewrite the conflicting commit (same tree, parent and trailers; another subject).
    env = ws.opened().env
    old = env.head()
    key = old.message_trailers["Gitrun-Idempotency-Key"]
    message = old.message.replace("gitrun: write_file", "gitrun: write_file (reworded)", 1)
    new = env.repo.create_commit(
        None, old.author, old.committer, message, old.tree_id, [old.parents[0].id]
    )
    gitstore.transaction(env.repo).move(env.branch, old.id, new).commit()
    if index == "moved along":
        gitstore.transaction(env.repo).move(index_ref(RUN, key), old.id, new).commit()
        case = ws.state().review
        rewritten = env.lookup(key)
        assert case is not None
        assert rewritten is not None
        assert rewritten.fingerprint() != case.receipt_fingerprint
    _stays_frozen(ws, "(receipt-changed)")


def test_a_reused_review_nonce_is_refused(ws: Copy) -> None:
    # First case: replan, and crash right after the re-proposed intent is persisted.
    assert ws.decide("replan").code == 0
    assert ws.resume(GITRUN_CRASH_AT="after_intent_checkpoint").code == KILLED
    first = ws.state()
    (used,) = first.used_nonces
    consumed = decode(Signed, first.sealed[0]["decision"])
    assert consumed.claims["nonce"] == used
    # Second case: the new key is committed with another intent, too.
    _intrude(ws.home, Action("write_file", path="stats/notes2.txt", content="again\n"))
    second = ws.resume()
    assert second.code == Exit.FROZEN
    assert SAME_KEY in second.err
    assert ws.state().review is not None

    ws.submit(consumed)  # the consumed decision itself
    _stays_frozen(ws, "(nonce-reused)")
    ws.submit(ws.craft(nonce=used))  # a fresh signature over this case that recycles it
    _stays_frozen(ws, "(nonce-reused)")


# -- decisions that move the run on ------------------------------------------------------


def test_a_trusted_replan_quarantines_the_key_and_finishes_with_a_new_one(
    template: Template, ws: Copy
) -> None:
    before = ws.state()
    case, pending = before.review, before.pending
    assert case is not None
    assert pending is not None
    decided = ws.decide("replan")
    assert decided.code == 0, decided.err
    decision = ws.inbox()
    assert decision is not None
    assert decision.fingerprint() in decided.out

    res = ws.resume()
    assert res.code == Exit.DONE, (res.out, res.err)
    assert res.out.strip().splitlines()[-1].startswith(f"run {RUN}: done")
    state = ws.state()
    assert state.phase == DONE
    assert state.quarantined_keys == (case.key,)
    assert state.receipts.count == 1
    assert state.receipts.last is not None
    assert state.receipts.last.key != case.key
    assert ws.keys_in_history() == [state.receipts.last.key, case.key]  # each key once
    assert state.used_nonces == (decision.claims["nonce"],)
    (sealed,) = state.sealed
    assert sealed["kind"] == "review"
    assert sealed["case"] == encode(case)
    assert sealed["decision"] == encode(decision)
    assert sealed["pending"] == encode(pending)
    assert ws.inbox() is None

    # The decision's checkpoint: running again, from a re-observation, one step back.
    after = next(s for s in ws.chain() if any(e.kind == "review_decision" for e in s.events))
    assert (after.phase, after.pending, after.review) == (RUNNING, None, None)
    assert after.env.head == template.conflict
    assert after.cursor == before.cursor - 1


def test_a_trusted_abort_fails_the_run_and_keeps_all_evidence_in_the_checkpoint(
    ws: Copy,
) -> None:
    before = ws.state()
    assert ws.decide("abort").code == 0
    decision = ws.inbox()
    assert decision is not None
    branch = ws.tips()[1]

    res = ws.resume()
    assert res.code == Exit.FAILED, (res.out, res.err)
    assert res.out.strip().splitlines()[-1] == f"run {RUN}: failed (aborted_by_reviewer)"
    assert ws.tips()[1] == branch  # nothing written
    state = ws.state()
    assert (state.phase, state.stop_reason) == (FAILED, "aborted_by_reviewer")
    (sealed,) = state.sealed
    assert sealed["case"] == encode(before.review)
    assert sealed["decision"] == encode(decision)
    assert sealed["pending"] == encode(before.pending)
    assert state.used_nonces == (decision.claims["nonce"],)
    verify = ws.cli("checkpoint", "verify", RUN)
    assert verify.code == 0, verify.err

    again = ws.resume()
    assert again.code == Exit.FAILED
    assert ws.tips()[1] == branch


def test_resuming_an_open_review_without_trust_roots_fails_closed(ws: Copy) -> None:
    assert ws.decide("replan").code == 0  # even with a valid decision waiting
    before = snapshot(ws.repo)
    res = ws.cli("resume", RUN)
    assert res.code == Exit.REFUSED, res.err
    (line,) = res.err.strip().splitlines()
    assert line.startswith("gitrun: checkpoint rejected (trust-roots-missing):")
    assert "--trust-roots" in line
    assert snapshot(ws.repo) == before
    assert ws.state().phase == NEEDS_REVIEW


def test_the_html_report_shows_the_conflict_the_takeover_and_the_signed_decision(
    template: Template, ws: Copy, tmp_path: Path
) -> None:
    from browser import parse

    from gitrun.store.evidence import load_trust_roots

    assert ws.decide("replan").code == 0
    assert ws.resume().code == Exit.DONE
    page = tmp_path / "rv.html"
    res = ws.cli("report", RUN, "--html", str(page))
    assert res.code == 0, res.err
    doc = parse(page.read_text())
    kinds = [n.attrs["data-kind"] for n in doc.walk() if "data-kind" in n.attrs]
    assert kinds.index("receipt_conflict") < kinds.index("review_decision")
    decision = doc.find(**{"data-kind": "review_decision"})[0].all_text()
    bob = next(r.id for r in load_trust_roots(ws.keys.roots).values() if r.name == "bob")
    assert "decisionreplan" in decision
    assert f"signer{bob}" in decision
    resumed = doc.find(**{"data-kind": "resume"})
    assert any("interrupted" in n.attrs["class"].split() for n in resumed)  # the SIGKILL
    conflict = next(
        n for n in doc.find(**{"data-kind": "receipt"}) if "stats/notes.txt" in n.all_text()
    )
    assert "+not the fix" in conflict.all_text()
    assert "SSH signatures good on" in doc.find(id="chain")[0].all_text()
