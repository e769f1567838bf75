"""Approvals travel through the remote: ``gitrun approve`` on one machine pushes the
evidence to a ``--remote`` run's inbox, and the machine that resumes the run (any one)
fetches it and consumes it once, under the same checks as the local inbox. Real CLI,
real ``git daemon``, three machines (workspaces and repositories)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import remote_helpers
from conftest import SANDBOXES, Gitrun
from helpers import Keys, Result
from remote_helpers import Daemon, hermetic_git

from gitrun.app import service
from gitrun.app.opening import lease_store
from gitrun.app.workspace import Workspace
from gitrun.core.errors import Exit
from gitrun.core.records import Action
from gitrun.engine.approvals import approval_claims, submit
from gitrun.store import gitstore
from gitrun.store.evidence import APPROVAL_DOMAIN, sign

pytestmark = pytest.mark.timeout(120)

RETIRE = SANDBOXES / "retire-legacy"
RUN = "ri"
INBOX = f"refs/gitrun/runs/{RUN}/inbox/approval"
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
FINGERPRINT = re.compile(r"evidence (sha256:[0-9a-f]{64})")


class Machines(remote_helpers.Machines):
    """Machines a, b and c: each its own workspace; one keyring file shared out of band."""

    def __init__(self, tmp: Path, daemon: Daemon, keys: Keys) -> None:
        super().__init__(tmp, daemon, "abc")
        self.keys = keys

    def cli(self, machine: str, *args: str, **extra: str) -> Result:
        return Gitrun(self.tmp / machine).run([*args, *self.args(machine)], {**FAST, **extra})

    def resume(self, machine: str, *more: str, **extra: str) -> Result:
        roots = ["--trust-roots", str(self.keys.roots)]
        adopt = ["--remote", self.url, "--task", str(RETIRE)] if machine != "a" else []
        return self.cli(machine, "resume", RUN, *adopt, *roots, *more, **extra)

    def on_remote(self, ref: str) -> str | None:
        out = hermetic_git(f"--git-dir={self.bare}", "for-each-ref", "--format=%(objectname)", ref)
        return out.strip() or None

    def delete_commits(self) -> list[str]:
        """The remote branch's write commits of the delete, as their Gitrun-Approval."""
        fmt = (
            "%(trailers:key=Gitrun-Action,valueonly,separator=%x2C)"
            " %(trailers:key=Gitrun-Approval,valueonly,separator=%x2C)"
        )
        out = hermetic_git(f"--git-dir={self.bare}", "log", f"--format={fmt}", f"gitrun/{RUN}")
        return [line.split()[-1] for line in out.splitlines() if line.startswith("delete_file ")]

    def status(self, machine: str) -> dict[str, object]:
        res = self.cli(machine, "status", RUN, "--json")
        assert res.code == 0, res.err
        doc = json.loads(res.out)
        assert isinstance(doc, dict)
        return doc


@pytest.fixture
def machines(tmp_path: Path, git_daemon: Daemon, keys: Keys) -> Machines:
    m = Machines(tmp_path, git_daemon, keys)
    started = m.cli("a", "run", str(RETIRE), "--run-id", RUN, "--remote", m.url)
    assert started.code == Exit.FROZEN, started.err
    assert "waits for approval of delete_file units/legacy.py" in started.err
    # Machine b takes the run in (it waits for a human there too), then approves it.
    adopted = m.resume("b")
    assert adopted.code == Exit.FROZEN, adopted.err
    return m


def _approve(m: Machines, ttl: str = "1h") -> str:
    """alice approves on machine b (no --remote: the run's record names it)."""
    approved = m.cli("b", "approve", RUN, "--key", str(m.keys["alice"]), "--ttl", ttl)
    assert approved.code == 0, approved.err
    found = FINGERPRINT.search(approved.out)
    assert found is not None, approved.out
    return found.group(1)


def test_an_approval_made_on_another_machine_is_consumed_once_by_the_resuming_one(
    machines: Machines,
) -> None:
    m = machines
    fingerprint = _approve(m)
    evidence = m.on_remote(INBOX)
    assert evidence is not None  # the evidence is on the remote, not only on machine b

    done = m.resume("c")
    assert done.code == Exit.DONE, done.err
    assert "fresh approval taken in" in done.err + done.out
    assert m.delete_commits() == [fingerprint]  # executed once, under this approval
    assert m.on_remote(INBOX) is None  # consumed: gone from the remote inbox

    # The consumed evidence put back on the remote changes nothing: the run is done.
    hermetic_git(f"--git-dir={m.bare}", "update-ref", INBOX, evidence)
    tip = m.on_remote(f"refs/heads/gitrun/{RUN}")
    again = m.resume("a")
    assert again.code == Exit.DONE, again.err
    assert m.on_remote(f"refs/heads/gitrun/{RUN}") == tip
    assert m.delete_commits() == [fingerprint]


def test_a_consumed_approval_left_on_the_remote_is_refused_as_a_replayed_nonce(
    machines: Machines,
) -> None:
    m = machines
    # Long enough for machine a to take it in on a loaded machine (4 s was not, in CI
    # load), and waited out below from when it was made, not for a fixed time.
    ttl = 10.0
    _approve(m, ttl=f"{ttl:.0f}s")
    expires_by = time.time() + ttl  # made before `approve` returned: it expires by then
    evidence = m.on_remote(INBOX)
    # Machine a takes the approval in and dies right after its checkpoint landed: the
    # evidence was never deleted from the remote inbox.
    killed = m.resume("a", GITRUN_CRASH_AT="checkpoint_witness_written")
    assert killed.code == -9, killed.err
    assert m.on_remote(INBOX) == evidence
    held = m.status("a")
    pending = held["pending"]
    assert isinstance(pending, dict)
    assert pending["approval"] is not None  # taken in and checkpointed before the kill
    time.sleep(max(0.0, expires_by + 0.5 - time.time()))  # past the approval's expiry
    expired = m.resume("c", "--takeover-after", "0")  # a's lease died with it
    assert expired.code == Exit.FROZEN, expired.err
    assert "approval_expired" in expired.err
    tip = m.on_remote(f"refs/heads/gitrun/{RUN}")

    replayed = m.resume("c")
    assert replayed.code == Exit.FROZEN, replayed.err
    assert "evidence refused (nonce-reused)" in replayed.err.strip().splitlines()[-1]
    assert m.on_remote(f"refs/heads/gitrun/{RUN}") == tip
    assert m.delete_commits() == []


def test_evidence_only_in_this_machines_own_inbox_survives_syncs_and_is_taken_in(
    machines: Machines,
) -> None:
    m = machines
    opened = service.open_run(RUN, service.Options(Workspace(m.tmp / "a", m.key)))
    _, stored = service.load_verified(opened)
    claims = approval_claims(stored.state, "left here", 3600)
    signed = sign(claims, m.keys["alice"], "approver", APPROVAL_DOMAIN)
    submit(opened.repo, RUN, "approval", signed)  # this machine's inbox only, never pushed
    local = gitstore.read_ref(opened.repo, INBOX)
    assert local is not None
    assert m.on_remote(INBOX) is None

    m.status("a")  # a sync of the run's refs neither fetches over nor prunes it
    assert gitstore.read_ref(opened.repo, INBOX) == local
    done = m.resume("a")
    assert done.code == Exit.DONE, done.err
    assert m.delete_commits() == [signed.fingerprint()]
    assert gitstore.read_ref(gitstore.open_repo(opened.record.repo), INBOX) is None


CONFLICT = Action(
    "write_file",
    path="stats/notes.txt",
    content="not the fix\n",
    description="another intent under the same key",
)


def test_a_review_decision_made_on_another_machine_is_applied_by_the_resuming_one(
    tmp_path: Path, git_daemon: Daemon, keys: Keys
) -> None:
    m = Machines(tmp_path, git_daemon, keys)
    fix = SANDBOXES / "fix-median"
    run = ["run", str(fix), "--run-id", RUN, "--remote", m.url]
    killed = m.cli("a", *run, GITRUN_CRASH_AT="after_intent_checkpoint")
    assert killed.code == -9, killed.err
    # Another writer on machine a commits a different intent under the pending key.
    opts = service.Options(Workspace(m.tmp / "a", m.key), worker="intruder")
    opened = service.open_run(RUN, opts)
    _, stored = service.load_verified(opened)
    p = stored.state.pending
    assert p is not None
    lease = lease_store(opened.repo, RUN, opts, opened.site)
    lease.acquire(stored.state.generation)  # the owner died on this clone: taken at once
    try:
        env = opened.env
        env.execute(CONFLICT, p.key, CONFLICT.intent_digest(), p.precondition, lease.fence)
    finally:
        lease.release()
    frozen = m.cli("a", "resume", RUN, "--trust-roots", str(keys.roots))
    assert frozen.code == Exit.FROZEN, frozen.err
    adopt = ["--remote", m.url, "--task", str(fix), "--trust-roots", str(keys.roots)]
    assert m.cli("b", "resume", RUN, *adopt).code == Exit.FROZEN
    decided = m.cli("b", "review", "decide", RUN, "abort", "--key", str(keys["bob"]))
    assert decided.code == 0, decided.err
    review = f"refs/gitrun/runs/{RUN}/inbox/review"
    assert m.on_remote(review) is not None

    aborted = m.cli("c", "resume", RUN, *adopt)
    assert aborted.code == Exit.FAILED, aborted.err
    assert aborted.out.strip().splitlines()[-1] == f"run {RUN}: failed (aborted_by_reviewer)"
    assert m.on_remote(review) is None
