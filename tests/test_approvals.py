"""Issue 6 acceptance, approvals: a risky write waits for a signed, exactly bound,
one-time approval; it then executes once, through any crash; an expired approval is
shown but never executed; evidence that binds anything else is refused.

The retire-legacy sandbox deletes a module, which its policy marks as risky. One run
frozen at that approval is made once per module, and each test works on its own
relocated copy of that workspace. Humans act through the real CLI (``gitrun approve``);
setup steps sign in process through the same service call, and evidence a human could
not produce with the CLI (other bindings, replayed nonces, wrong roles) is crafted with
the same signing code and left in the same inbox.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pygit2
import pytest
from conftest import SANDBOXES, Gitrun, Result, git, relocate_workspace, snapshot
from helpers import CLI_ENV, Keys, RunCopy, Template, Templates, hermetic

from gitrun.adapter.environment import Approval
from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.codec import decode, digest, encode
from gitrun.core.errors import ApprovalRefused, Exit, GateRejected
from gitrun.core.records import AWAITING_APPROVAL, DONE, NEEDS_REVIEW, RUNNING, Action, new_key
from gitrun.engine.approvals import Approvals, approval_claims
from gitrun.store import gitstore, reflocks, trees
from gitrun.store.evidence import APPROVAL_DOMAIN, Signed, load_trust_roots, sign
from gitrun.store.lease import LeaseManager

pytestmark = pytest.mark.timeout(120)

RUN = "ap"
TASK = "retire-legacy"
KILLED = -9  # a child killed by GITRUN_CRASH_AT (SIGKILL)
FINGERPRINT = re.compile(r"evidence (sha256:[0-9a-f]{64})")
SIGNER = re.compile(r"  key (hk-[0-9a-f]+)  ")
# A short approval life that still outlasts one (loaded) CLI start before the intake.
TTL = 4.0
# Holds an OS lock file (as gitrun's ref locks are taken) for argv[2] seconds.
HOLD_LOCK = (
    "import fcntl, sys, time\n"
    "f = open(sys.argv[1], 'a')\n"
    "fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


# -- the frozen run every test copies ----------------------------------------------------


@pytest.fixture(scope="module")
def frozen(templates: Templates) -> Template:
    """retire-legacy after its patch, frozen before the risky delete."""
    return templates.run(SANDBOXES / TASK, RUN, Exit.FROZEN)


class Copy(RunCopy):
    """A private, relocated copy of a template workspace."""

    RUN = RUN
    TASK = TASK
    INBOX = "approval"

    def approve(self, key: str = "alice", ttl: str = "1h") -> Result:
        return self.cli("approve", RUN, "--key", str(self.keys[key]), "--ttl", ttl)

    def approved(self, ttl: float = 3600.0) -> str:
        """What `gitrun approve RUN --key alice.key` does, in process; the fingerprint."""
        opts = service.Options(Workspace(self.home))
        _, signed, _ = service.approve(RUN, opts, self.keys["alice"], ttl, "")
        return signed.fingerprint()

    def delete_commits(self) -> list[str]:
        """Write commits of the risky delete, as "<commit> delete_file <Gitrun-Approval>"."""
        fmt = (
            "%H %(trailers:key=Gitrun-Action,valueonly,separator=%x2C)"
            " %(trailers:key=Gitrun-Approval,valueonly,separator=%x2C)"
        )
        out = git(self.repo, "log", f"--format={fmt}", f"gitrun/{RUN}")
        return [line for line in out.splitlines() if " delete_file " in line]

    def craft(self, **edits: Any) -> Signed:
        """alice's approval of the checkpoint's pending action, some claims edited."""
        claims = approval_claims(self.state(), "crafted", 3600)
        claims.update(edits)
        return sign(claims, self.keys["alice"], "approver", APPROVAL_DOMAIN)


@pytest.fixture
def ws(frozen: Template, keys: Keys, tmp_path: Path) -> Copy:
    return Copy(frozen.copy(tmp_path / "ws-home"), keys)


def _fingerprint(approve: Result) -> str:
    assert approve.code == 0, approve.err
    found = FINGERPRINT.search(approve.out)
    assert found, approve.out
    return found.group(1)


def _frozen_line(res: Result, reason: str) -> None:
    """Exit 3 with one line naming why, and no traceback."""
    assert res.code == Exit.FROZEN, (res.out, res.err)
    last = res.err.strip().splitlines()[-1]
    assert last.startswith("gitrun: "), res.err
    assert reason in last, res.err
    assert "Traceback" not in res.err


def _assert_done_once(ws: Copy, res: Result, fingerprint: str) -> None:
    """Done, both writes once each, the delete carrying exactly this approval."""
    assert res.code == Exit.DONE, (res.out, res.err)
    assert res.out.strip().splitlines()[-1].startswith(f"run {RUN}: done"), res.out
    keys = ws.keys_in_history()
    assert len(keys) == len(set(keys)) == 2, keys
    (delete,) = ws.delete_commits()
    assert delete.split()[-1] == fingerprint
    state = ws.state()
    assert (state.phase, state.receipts.count, state.pending) == (DONE, 2, None)
    assert state.receipts.last is not None
    assert state.receipts.last.approval == fingerprint
    assert not (ws.worktree / "units" / "legacy.py").exists()


def _wait_past(expires_at: float) -> None:
    time.sleep(max(0.0, expires_at - time.time()) + 0.2)


# -- freeze, approve, execute once ------------------------------------------------------


def test_a_risky_action_freezes_the_run_and_prints_the_exact_approve_command(
    frozen: Template, ws: Copy
) -> None:
    err = frozen.run.err.strip().splitlines()[-1]
    assert err.startswith(f"gitrun: run {RUN} waits for approval of delete_file units/legacy.py")
    assert "risk: deleting a module" in err
    assert f"gitrun approve {RUN} --key " in err
    assert f"gitrun resume {RUN} --trust-roots " in err

    state = ws.state()
    assert (state.phase, state.stop_reason) == (AWAITING_APPROVAL, "awaiting_approval")
    assert state.pending is not None
    assert state.pending.approval is None
    assert state.pending.risk == "deleting a module"
    assert len(ws.keys_in_history()) == 1  # the patch only; the delete waits
    assert (ws.worktree / "units" / "legacy.py").is_file()

    # Resuming without an approval stays frozen and changes nothing.
    before = ws.tips()
    _frozen_line(ws.resume(), "waits for approval")
    assert ws.tips() == before


def test_an_approved_risky_action_executes_once_with_the_approval_fingerprint_in_its_commit(
    ws: Copy,
) -> None:
    approve = ws.approve()
    fingerprint = _fingerprint(approve)
    state = ws.state()
    assert state.pending is not None
    assert "delete_file units/legacy.py" in approve.out
    assert f"risk: deleting a module   key: {state.pending.key}" in approve.out
    assert "-def miles(km: float) -> int:" in approve.out  # the diff being approved
    evidence = ws.inbox()
    assert evidence is not None
    assert evidence.fingerprint() == fingerprint
    assert evidence.claims["key"] == state.pending.key
    assert evidence.claims["generation"] == state.generation

    _assert_done_once(ws, ws.resume(), fingerprint)
    done = ws.state()
    assert done.used_nonces == (evidence.claims["nonce"],)
    assert ws.inbox() is None  # consumed
    events = [(e.kind, e.data) for s in ws.chain() for e in s.events]
    accepted = {
        "fingerprint": fingerprint,
        "signer": evidence.signer,
        "expires_at": evidence.claims["expires_at"],
    }
    assert ("approval", accepted) in events

    tip = ws.branch_tip()
    rerun = ws.resume()
    assert rerun.code == Exit.DONE
    assert ws.branch_tip() == tip


APPROVED_WRITE_CRASH_POINTS = [
    "after_write_commit_object",
    "write_ref_locked",
    "write_ref_moved",
    "after_receipt_index",
    "mid_file_sync",
    "after_file_sync",
    # The resume's first checkpoint takes the approval in; the second records the receipt.
    "checkpoint_ref_locked:2",
    "checkpoint_ref_moved:2",
]


@pytest.mark.parametrize("point", APPROVED_WRITE_CRASH_POINTS)
def test_a_crash_anywhere_in_the_approved_write_still_writes_it_exactly_once(
    ws: Copy, point: str
) -> None:
    fingerprint = ws.approved()
    crashed = ws.resume(GITRUN_CRASH_AT=point)
    assert crashed.code == KILLED, (point, crashed.err)
    assert len(ws.delete_commits()) <= 1

    _assert_done_once(ws, ws.resume(), fingerprint)
    assert len(ws.state().used_nonces) == 1  # no second approval was needed or taken


# -- expiry ------------------------------------------------------------------------------


def test_an_approval_that_expired_before_resume_is_refused_and_nothing_executes(
    ws: Copy,
) -> None:
    assert ws.approve(ttl="1s").code == 0
    evidence = ws.inbox()
    assert evidence is not None
    _wait_past(evidence.claims["expires_at"])
    before = ws.tips()

    _frozen_line(ws.resume(), "evidence refused (expired)")
    assert ws.tips() == before
    assert ws.state().phase == AWAITING_APPROVAL


@dataclass(frozen=True)
class Expired:
    """A workspace whose approval was taken in, then expired before the write."""

    ws: Copy
    evidence: Signed


@pytest.fixture(scope="module")
def expired_template(
    frozen: Template, keys: Keys, tmp_path_factory: pytest.TempPathFactory
) -> Expired:
    """Made once: the expiry wait is the slow part."""
    base = tmp_path_factory.mktemp("expired-run")
    ws = Copy(frozen.copy(base / "home"), keys)
    with hermetic(base / "user"):
        fingerprint = ws.approved(ttl=TTL)
        crashed = ws.resume(GITRUN_CRASH_AT="checkpoint_ref_moved")  # right after the intake
    assert crashed.code == KILLED, crashed.err
    state = ws.state()
    assert state.phase == RUNNING
    assert state.pending is not None
    assert state.pending.approval is not None
    evidence = decode(Signed, state.pending.approval)
    assert evidence.fingerprint() == fingerprint
    _wait_past(evidence.claims["expires_at"])
    return Expired(ws, evidence)


@pytest.fixture
def expired(expired_template: Expired, tmp_path: Path) -> Expired:
    home = tmp_path / "ws-home"
    relocate_workspace(expired_template.ws.home, home)
    return Expired(Copy(home, expired_template.ws.keys), expired_template.evidence)


def test_an_expired_approval_in_the_checkpoint_loads_and_shows_but_never_executes(
    expired: Expired,
) -> None:
    ws = expired.ws
    branch = ws.branch_tip()
    _frozen_line(ws.resume(), "approval_expired")
    assert ws.branch_tip() == branch
    assert ws.delete_commits() == []

    verify = ws.cli("checkpoint", "verify", RUN)
    assert verify.code == 0, verify.err  # expired is not corrupt
    status = json.loads(ws.cli("status", RUN, "--json").out)
    assert (status["phase"], status["stop_reason"]) == (AWAITING_APPROVAL, "approval_expired")
    assert status["pending"]["action"] == "delete_file units/legacy.py"
    assert status["pending"]["approval"] == encode(expired.evidence)

    # Resuming again does not try it again.
    tips = ws.tips()
    assert ws.resume().code == Exit.FROZEN
    assert ws.tips() == tips


def test_a_fresh_exact_approval_unfreezes_an_expired_one_and_seals_the_old_evidence(
    expired: Expired,
) -> None:
    ws = expired.ws
    assert ws.resume().code == Exit.FROZEN  # approval_expired
    fresh = _fingerprint(ws.approve())
    evidence = ws.inbox()
    assert evidence is not None
    assert evidence.claims["generation"] == ws.state().generation

    _assert_done_once(ws, ws.resume(), fresh)
    state = ws.state()
    (sealed,) = state.sealed
    assert sealed["kind"] == "approval_superseded"
    assert sealed["evidence"] == encode(expired.evidence)
    assert len(state.used_nonces) == 2


def test_a_replayed_approval_nonce_is_refused(expired: Expired) -> None:
    ws = expired.ws
    assert ws.resume().code == Exit.FROZEN  # approval_expired; the run waits again
    used = expired.evidence.claims["nonce"]
    assert ws.state().used_nonces == (used,)
    tips = ws.tips()

    # The consumed evidence itself, left again in the inbox ...
    ws.submit(expired.evidence)
    _frozen_line(ws.resume(), "evidence refused (nonce-reused)")
    # ... and a new signature over the current binding that recycles the nonce.
    ws.submit(ws.craft(nonce=used, expires_at=time.time() + 3600))
    _frozen_line(ws.resume(), "evidence refused (nonce-reused)")
    assert ws.tips() == tips


def test_a_write_committed_before_the_crash_reconciles_after_its_approval_expired(
    ws: Copy,
) -> None:
    fingerprint = ws.approved(ttl=TTL)
    crashed = ws.resume(GITRUN_CRASH_AT="write_ref_moved")
    assert crashed.code == KILLED, crashed.err
    assert len(ws.delete_commits()) == 1
    state = ws.state()
    assert state.pending is not None
    assert state.pending.approval is not None
    _wait_past(decode(Signed, state.pending.approval).claims["expires_at"])

    _assert_done_once(ws, ws.resume(), fingerprint)
    done = ws.state()
    assert len(done.used_nonces) == 1  # no second approval
    assert done.sealed == ()
    assert ws.inbox() is None


def test_a_write_whose_commit_time_is_after_the_approval_expired_goes_to_review(
    ws: Copy,
) -> None:
    ws.approved()
    crashed = ws.resume(GITRUN_CRASH_AT="checkpoint_ref_moved")  # approval taken in, no write
    assert crashed.code == KILLED, crashed.err
    state = ws.state()
    p = state.pending
    assert p is not None
    assert p.approval is not None
    evidence = decode(Signed, p.approval)
    late = int(evidence.claims["expires_at"]) + 60

    # The exact write the intent makes, carrying the approval, but committed too late.
    env = ws.opened().env
    head = env.head()
    tree = trees.tree_with_changes(env.repo, head.tree, env.plan_changes(p.action, head.tree))
    message = (
        "\n".join(
            [
                "gitrun: delete_file units/legacy.py",
                "",
                "late",
                "",
                f"Gitrun-Run: {RUN}",
                f"Gitrun-Task: {TASK}@1",
                "Gitrun-Action: delete_file",
                f"Gitrun-Idempotency-Key: {p.key}",
                f"Gitrun-Intent-Digest: {p.intent_digest}",
                f"Gitrun-Instance: {p.precondition.instance_id}",
                f"Gitrun-Lease: {state.lease_version}",
                f"Gitrun-Approval: {evidence.fingerprint()}",
            ]
        )
        + "\n"
    )
    sig = pygit2.Signature("gitrun", "gitrun@localhost", late, 0)
    oid = env.repo.create_commit(None, sig, sig, message, tree, [head.id])
    gitstore.transaction(env.repo).move(env.branch, head.id, oid).commit()

    _frozen_line(ws.resume(), "needs review (the write committed after its approval expired)")
    review = ws.state()
    assert review.phase == NEEDS_REVIEW
    assert review.review is not None
    assert review.review.receipt is not None
    assert review.review.receipt.commit == str(oid)
    assert review.review.receipt.committed_at == late
    assert review.review.key == p.key
    assert review.pending == p


def test_the_adapter_itself_refuses_to_commit_after_the_approval_expired(ws: Copy) -> None:
    state = ws.state()
    p = state.pending
    assert p is not None
    env = ws.opened().env
    branch = ws.branch_tip()
    lease = LeaseManager(env.repo, RUN, "in-process", 30)
    lease.acquire(state.generation)
    try:
        with pytest.raises(GateRejected) as expired:
            env.execute(
                p.action,
                p.key,
                p.intent_digest,
                p.precondition,
                lease.fence,
                Approval("sha256:" + "0" * 64, time.time() - 1),
            )
        assert expired.value.rule == "approval-expired"

        # Valid when the write starts, expired by the time the branch lock is ours: the
        # check inside the ref transaction refuses the commit point itself.
        lock = reflocks.lock_path(gitstore.common_dir(env.repo), env.branch)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(lock), "2.5"], stdout=subprocess.PIPE, text=True
        ) as holder:
            try:
                assert holder.stdout is not None
                assert holder.stdout.readline().strip() == "locked"
                with pytest.raises(GateRejected) as late:
                    env.execute(
                        p.action,
                        p.key,
                        p.intent_digest,
                        p.precondition,
                        lease.fence,
                        Approval("sha256:" + "0" * 64, time.time() + 1.0),
                    )
            finally:
                holder.kill()
        assert late.value.rule == "approval-expired"
        assert "commit point" in late.value.message
    finally:
        lease.release()
    assert ws.branch_tip() == branch
    assert env.lookup(p.key) is None
    assert env.write_count == 0


# -- bindings, signers, roles -----------------------------------------------------------


def _other(ws: Copy, field: str) -> Any:
    another = Action("delete_file", path="units/convert.py")
    return {
        "action": digest(encode(another)),
        "key": new_key(),
        "intent_digest": another.intent_digest(),
        "instance_id": str(uuid.uuid4()),
        "state_fingerprint": digest(["another", "head", "tree"]),
        "generation": ws.state().generation - 1,
    }[field]


@pytest.mark.parametrize(
    "field", ["action", "key", "intent_digest", "instance_id", "state_fingerprint", "generation"]
)
def test_an_approval_bound_to_anything_else_is_refused_and_nothing_executes(
    ws: Copy, field: str
) -> None:
    roots = Approvals(load_trust_roots(ws.keys.roots))
    exact = ws.craft()
    assert roots.check_approval(ws.state(), exact)["key"] == exact.claims["key"]  # the control

    crafted = ws.craft(**{field: _other(ws, field)})
    with pytest.raises(ApprovalRefused) as refused:
        roots.check_approval(ws.state(), crafted)
    assert refused.value.reason == "binding"

    tips = ws.tips()
    ws.submit(crafted)
    refusal = f"evidence refused (binding): the approval is bound to another {field}"
    _frozen_line(ws.resume(), refusal)
    assert ws.tips() == tips
    assert ws.state().phase == AWAITING_APPROVAL
    assert (ws.worktree / "units" / "legacy.py").is_file()


def test_an_approval_signed_by_a_key_outside_the_trust_roots_is_refused(ws: Copy) -> None:
    assert ws.approve("mallory").code == 0  # mallory can sign; the runtime does not trust her
    tips = ws.tips()
    _frozen_line(ws.resume(), "evidence refused (unknown-signer)")
    assert ws.tips() == tips

    checked = ws.cli(
        "approve", RUN, "--key", str(ws.keys["mallory"]), "--trust-roots", str(ws.keys.roots)
    )
    _frozen_line(checked, "evidence refused (unknown-signer)")


def test_a_reviewer_key_cannot_approve(ws: Copy, tmp_path: Path) -> None:
    res = ws.approve("bob")
    assert res.code == Exit.BAD_INPUT
    assert "is a reviewer key" in res.err
    assert ws.inbox() is None

    # bob's key relabelled "approver" in its own file: the trust roots still say reviewer.
    doc = json.loads(ws.keys["bob"].read_text())
    doc["role"] = "approver"
    forged = tmp_path / "bob-as-approver.key"
    fd = os.open(forged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh)
    ws.submit(sign(approval_claims(ws.state(), "", 3600), forged, "approver", APPROVAL_DOMAIN))
    tips = ws.tips()
    _frozen_line(ws.resume(), "evidence refused (wrong-role)")
    assert ws.tips() == tips


def test_resuming_a_checkpoint_holding_an_approval_without_trust_roots_fails_closed(
    ws: Copy,
) -> None:
    ws.approved()
    assert ws.resume(GITRUN_CRASH_AT="checkpoint_ref_moved").code == KILLED  # approval taken in
    assert ws.state().pending is not None
    before = snapshot(ws.repo)

    res = ws.cli("resume", RUN)
    assert res.code == Exit.REFUSED, res.err
    (line,) = res.err.strip().splitlines()
    assert line.startswith("gitrun: checkpoint rejected (trust-roots-missing):")
    assert "--trust-roots" in line
    assert snapshot(ws.repo) == before
    assert ws.delete_commits() == []


# -- key files ---------------------------------------------------------------------------


def test_keys_new_keeps_the_private_key_owner_only_and_puts_only_the_public_half_in_the_roots(
    tmp_path: Path,
) -> None:
    cli = Gitrun(tmp_path)
    roots = tmp_path / "roots.json"
    out_dir = str(tmp_path / "k")
    res = cli(
        "keys",
        "new",
        "carol",
        "--role",
        "approver",
        "--dir",
        out_dir,
        "--trust-roots",
        str(roots),
        **CLI_ENV,
    )
    assert res.code == 0, res.err
    key = tmp_path / "k" / "carol.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    private = json.loads(key.read_text())
    (root,) = load_trust_roots(roots).values()
    assert (root.id, root.name, root.role) == (private["id"], "carol", "approver")
    assert private["private_key"] not in roots.read_text()
    assert base64.b64decode(root.public_key) != base64.b64decode(private["private_key"])
    assert root.id in res.out
    assert "mode 600" in res.out

    again = cli("keys", "new", "carol", "--role", "approver", "--dir", out_dir, **CLI_ENV)
    assert again.code == Exit.BAD_INPUT
    assert "already exists" in again.err
    bad_role = cli("keys", "new", "dave", "--role", "admin", "--dir", out_dir, **CLI_ENV)
    assert bad_role.code == Exit.BAD_INPUT
    assert "--role" in bad_role.err


def test_a_private_key_readable_by_others_is_refused(ws: Copy, tmp_path: Path) -> None:
    loose = tmp_path / "alice.key"
    shutil.copy(ws.keys["alice"], loose)
    loose.chmod(0o644)
    res = ws.cli("approve", RUN, "--key", str(loose))
    assert res.code == Exit.BAD_INPUT, res.err
    (line,) = res.err.strip().splitlines()
    assert "readable by others (mode 644)" in line
    assert f"chmod 600 {loose}" in line
    assert ws.inbox() is None


def test_rotating_the_checkpoint_key_keeps_old_checkpoints_verifiable(ws: Copy) -> None:
    old_keys = set(SIGNER.findall(ws.cli("checkpoints", RUN).out))
    assert len(old_keys) == 1
    rotated = ws.cli("keys", "rotate")
    assert rotated.code == 0, rotated.err
    new_key_id = rotated.out.split("new active key ")[1].split()[0]
    assert new_key_id not in old_keys
    assert stat.S_IMODE((ws.home / "keys" / "checkpoint.keyring").stat().st_mode) == 0o600

    verify = ws.cli("checkpoint", "verify", RUN)
    assert verify.code == 0, verify.err
    assert f"signed with {old_keys.pop()}" in verify.out
    ws.approved()
    # To the end: the delete's receipt rides in the verdict's checkpoint (before the
    # verifier it is on the branch only), so that is the checkpoint that records it.
    assert ws.resume().code == Exit.DONE
    listing = ws.cli("checkpoints", RUN)
    assert listing.code == 0, listing.err
    signers = SIGNER.findall(listing.out)
    assert signers[0] == new_key_id  # newest first
    assert len(set(signers)) == 2  # the old checkpoints below still verify with the old key
    assert f"signed with {new_key_id}" in ws.cli("checkpoint", "verify", RUN).out
    assert ws.state().receipts.count == 2
