"""``gitrun status`` is a typed result (:class:`gitrun.app.status.RunStatus`) whose JSON is
byte for byte what the untyped status of before printed, for real runs in every state a
user meets: running (killed mid-step, lease live), awaiting approval, needs review, done,
failed, and a checkpoint that no longer verifies beside a lease ref rewritten by hand.

``legacy_status`` / ``legacy_text`` below are the status code as it was (a dict of two
shapes), kept verbatim as the reference the typed result must reproduce."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import SANDBOXES, Gitrun, git, relocate_workspace
from helpers import CLI_ENV, Keys, hermetic

from gitrun.app import service
from gitrun.app.opening import Opened, Options, load_verified, open_run
from gitrun.app.status import LeaseStatus, RunStatus, UnreadableLease
from gitrun.app.status_read import quick
from gitrun.app.workspace import Workspace
from gitrun.core.codec import digest, encode
from gitrun.core.errors import CheckpointRejected, Exit, LeaseUnreadable
from gitrun.core.records import Action, Receipt, RunState
from gitrun.entry import status_text
from gitrun.store.checkpoint import Stored
from gitrun.store.lease import LeaseManager, read_lease

pytestmark = pytest.mark.timeout(180)

# -- the status of before, verbatim (gitrun/app/reports.py and gitrun/entry.py) ----------


def legacy_status(run_id: str, opts: Options) -> dict[str, Any]:
    opened = open_run(run_id, opts)
    rec = opened.record
    out: dict[str, Any] = {
        "run_id": rec.run_id,
        "repo": rec.repo,
        "worktree": rec.worktree,
        "branch": rec.branch.removeprefix("refs/heads/"),
        "task_dir": rec.task_dir,
        "workspace": str(opts.workspace.root),
        "key_file": str(opts.workspace.key_file),
        "lease": _lease_info(opened),
    }
    try:
        ref, stored = load_verified(opened, check_scenario=False)
    except CheckpointRejected as exc:
        return {**out, **_unverified_info(opened, exc)}
    return {**out, **_checkpoint_info(opened, ref, stored)}


def _unverified_info(opened: Opened, exc: CheckpointRejected) -> dict[str, Any]:
    return {
        "task_id": opened.task.id,
        "phase": "unknown",
        "stop_reason": None,
        "checkpoint_error": str(exc),
        "head": None,
        "pending": None,
        "unrecorded_receipt": None,
        "receipts": [],
        "verifier": None,
        "isolation": None,
        "agent_isolation": None,
    }


def _checkpoint_info(opened: Opened, ref: str, stored: Stored) -> dict[str, Any]:
    s = stored.state
    receipts = opened.env.receipts()
    landed = _landed(s, receipts)
    return {
        "task_id": s.task_id,
        "phase": s.phase,
        "stop_reason": s.stop_reason,
        "generation": s.generation,
        "checkpoint_ref": ref,
        "checkpoint": str(stored.oid),
        "head": s.env.head if landed is None else landed.commit,
        "instance_id": s.env.instance_id,
        "pending": _pending_info(s) if landed is None else None,
        "unrecorded_receipt": None if landed is None else landed.commit,
        "receipts": [encode(r) for r in receipts],
        "verifier": None if s.verifier is None else encode(s.verifier),
        "isolation": None if s.verifier is None else s.verifier.isolation,
        "agent_isolation": s.agent_isolation,
        "budgets": encode(s.budgets),
        "review": None if s.review is None else encode(s.review),
    }


def _landed(s: RunState, receipts: list[Receipt]) -> Receipt | None:
    p, last = s.pending, (receipts[-1] if receipts else None)
    if p is None or last is None or last.key != p.key or last.parent != s.env.head:
        return None
    if last.intent_digest != p.intent_digest:
        return None
    if p.risk is not None and (p.approval is None or last.approval != digest(p.approval)):
        return None
    return last


def _pending_info(s: RunState) -> dict[str, Any] | None:
    if s.pending is None:
        return None
    return {
        "key": s.pending.key,
        "action": s.pending.action.summary(),
        "intent_digest": s.pending.intent_digest,
        "risk": s.pending.risk,
        "approval": s.pending.approval,
    }


def _lease_info(opened: Opened) -> dict[str, Any] | None:
    try:
        lease, _ = read_lease(opened.repo, opened.record.run_id)
    except LeaseUnreadable as exc:
        return {"unreadable": str(exc), "oid": exc.oid}
    return None if lease is None else {**encode(lease), "live": lease.expires_at > time.time()}


def legacy_text(info: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(info, indent=2, sort_keys=True)
    lease = info.get("lease")
    pending = info["pending"]
    lines = [
        f"run        {info['run_id']}  (task {info['task_id']})",
        f"phase      {info['phase']}"
        + (f"  ({info['stop_reason']})" if info.get("stop_reason") else ""),
        f"repo       {info['repo']}",
        f"worktree   {info['worktree']}  branch {info['branch']}",
        f"head       {info['head']}"
        + ("  (last write, not checkpointed yet)" if info.get("unrecorded_receipt") else ""),
        f"pending    {pending['action'] + ' key ' + pending['key'] if pending else '-'}",
        f"receipts   {len(info['receipts'])}",
        f"verifier   {info['verifier']['summary'] if info['verifier'] else '-'}",
        f"isolation  {info.get('isolation') or '-'}",
        f"agent      {_agent_line(info.get('agent_isolation'))}",
        f"lease      {_lease_line(lease)}",
    ]
    if info.get("checkpoint_error"):
        lines.append(f"checkpoint {info['checkpoint_error']}")
    return "\n".join(lines)


def _agent_line(box: dict[str, str] | None) -> str:
    if not box:
        return "-"
    if box["kind"] == "none":
        return f"unconfined ({box.get('unconfined_because', '?')})"
    return f"{box['kind']}, network {box['network']}"


def _lease_line(lease: dict[str, Any] | None) -> str:
    if not lease:
        return "-"
    if "unreadable" in lease:
        return f"unreadable: {lease['unreadable']}"
    state = "live" if lease["live"] else "expired"
    until = time.strftime("%H:%M:%S", time.localtime(lease["expires_at"]))
    return f"{lease['owner_worker']} v{lease['lease_version']} {state} until {until}"


# -- one workspace, a real run in each state ---------------------------------------------


@dataclass(frozen=True)
class Runs:
    home: Path


def _intrude(home: Path, run_id: str) -> None:
    """Another writer takes the dead owner's lease and commits another intent under the
    pending key, through the real adapter (as tests/test_review.py does)."""
    opened = service.open_run(run_id, service.Options(Workspace(home)))
    _, stored = service.load_verified(opened)
    p = stored.state.pending
    if p is None:
        raise RuntimeError("the killed run has no pending action")
    lease = LeaseManager(opened.repo, run_id, "intruder", 30)
    lease.acquire(stored.state.generation)
    other = Action("write_file", path="stats/notes.txt", content="not the fix\n")
    try:
        opened.env.execute(other, p.key, other.intent_digest(), p.precondition, lease.fence)
    finally:
        lease.release()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Runs:
    base = tmp_path_factory.mktemp("status-runs")
    home = base / "home"
    home.mkdir()
    cli = Gitrun(home)
    median = str(SANDBOXES / "fix-median")
    spent = base / "spent"
    spent.mkdir()
    for name in ("task.toml", "plan.toml"):
        (spent / name).write_text((SANDBOXES / "fix-median" / name).read_text())
    (spent / "repo").symlink_to(SANDBOXES / "fix-median" / "repo")
    toml = (spent / "task.toml").read_text().replace("max_proposals = 20", "max_proposals = 1")
    (spent / "task.toml").write_text(toml)
    (spent / "plan.toml").write_text(
        'schema = 1\n\n[[step]]\nkind = "write_file"\npath = "setup.py"\ncontent = "x"\n'
    )
    crash = {"GITRUN_CRASH_AT": "after_intent_checkpoint", **CLI_ENV}
    with hermetic(base / "user"):
        expect = [
            (("run", median, "--run-id", "done"), {}, Exit.DONE),
            (("run", median, "--run-id", "running", "--lease-seconds", "600"), crash, -9),
            (("run", median, "--run-id", "review"), crash, -9),
            (("run", str(SANDBOXES / "retire-legacy"), "--run-id", "approval"), {}, Exit.FROZEN),
            (("run", str(spent), "--run-id", "failed"), {}, Exit.FAILED),
        ]
        for args, env, code in expect:
            res = cli(*args, **CLI_ENV, **env)
            assert res.code == code, (args, res.err)
        _intrude(home, "review")
        res = cli("resume", "review", "--trust-roots", str(keys.roots), **CLI_ENV)
        assert res.code == Exit.FROZEN, res.err
    return Runs(home)


STATES = [
    ("done", "done"),
    ("running", "running"),
    ("review", "needs_review"),
    ("approval", "awaiting_approval"),
    ("failed", "failed"),
]


def _same_as_before(home: Path, run_id: str) -> RunStatus:
    """The typed status prints what the status of before printed, JSON and text."""
    opts = service.Options(Workspace(home))
    typed = service.status(run_id, opts)
    old = legacy_status(run_id, opts)
    # ... read without pygit2 (tests/test_status_fast.py): a loose repository is never
    # handed over to the pygit2 path, whatever state its run is in.
    fast = quick(run_id, opts)
    assert fast is not None
    assert fast.to_json() == typed.to_json()
    assert typed.to_json() == legacy_text(old, True)
    assert status_text(typed, False) == legacy_text(old, False)
    assert typed.as_dict() == old
    res = Gitrun(home)("status", run_id, "--json", **CLI_ENV)  # the fast path, fresh process
    assert (res.code, res.err) == (0, "")
    if not isinstance(typed.lease, LeaseStatus) or typed.lease.lease.expires_at > time.time() + 5:
        assert res.out == typed.to_json() + "\n"
    return typed


@pytest.mark.parametrize(("run_id", "phase"), STATES, ids=[p for _, p in STATES])
def test_status_json_is_byte_for_byte_the_untyped_status_of_before(
    runs: Runs, run_id: str, phase: str
) -> None:
    typed = _same_as_before(runs.home, run_id)
    assert typed.phase == phase
    assert typed.checkpoint is not None
    assert typed.checkpoint_error is None
    assert (typed.pending is not None) == (
        phase in ("running", "needs_review", "awaiting_approval")
    )
    if phase == "running":  # killed while holding the lease: still live
        assert isinstance(typed.lease, LeaseStatus)
        assert typed.lease.live
    if phase == "needs_review":
        assert typed.checkpoint.review is not None
    if phase == "done":
        assert typed.verifier is not None
        assert typed.verifier.passed
        assert [r.paths for r in typed.receipts] == [("stats/median.py",)]


def test_a_checkpoint_that_does_not_verify_and_an_unreadable_lease_keep_their_shape(
    runs: Runs, tmp_path: Path
) -> None:
    """The second shape: phase unknown, the reason, no checkpoint fields; and a lease ref
    pointing at a blob is shown as unreadable."""
    home = tmp_path / "ws"
    relocate_workspace(runs.home, home)
    repo = home / "repos" / "fix-median"
    refs = git(repo, "for-each-ref", "--format=%(refname)", "refs/gitrun/runs/done/").split()
    checkpoint = next(r for r in refs if r.startswith("refs/gitrun/runs/done/checkpoints/"))
    git(repo, "update-ref", checkpoint, f"{checkpoint}~1")  # rolled back one generation
    (tmp_path / "garbage").write_text("not a lease\n")
    blob = git(repo, "hash-object", "-w", str(tmp_path / "garbage")).strip()
    git(repo, "update-ref", "refs/gitrun/runs/done/lease", blob)
    typed = _same_as_before(home, "done")
    assert (typed.phase, typed.checkpoint) == ("unknown", None)
    assert typed.checkpoint_error
    assert "checkpoint_ref" not in typed.as_dict()
    assert isinstance(typed.lease, UnreadableLease)
    assert "generation" not in typed.as_dict()
