"""Use cases behind the CLI: start a run, resume it, report on it.

Each function wires the pieces (workspace, repository, environment, checkpoint store,
lease, agent) and returns plain results; the CLI only parses and prints.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pygit2

from gitrun import faults, gitstore, starting, trees
from gitrun.checkpoint import CheckpointStore, Stored, checkpoint_ref, find_checkpoint_refs
from gitrun.codec import encode
from gitrun.environment import Environment, branch_ref
from gitrun.errors import (
    BadInput,
    CheckpointRejected,
    Frozen,
    GitrunError,
    LeaseLost,
    LeaseUnreadable,
)
from gitrun.keys import Keyring, load_keyring
from gitrun.lease import DEFAULT_DURATION, LeaseManager, default_worker_id, fenced, read_lease
from gitrun.records import AWAITING_APPROVAL, NEEDS_REVIEW, TERMINAL, RunState
from gitrun.task import Task, load_task
from gitrun.witness import Witness
from gitrun.workspace import RunRecord, Workspace, check_run_id, new_run_id, user_repo

if TYPE_CHECKING:
    # Loaded by the use cases that drive, approve or review a run, not by `gitrun status`
    # (hooks call it once per agent tool call; issue #15).
    from gitrun.agents import ScriptAgent
    from gitrun.approvals import Approvals
    from gitrun.evidence import Signed
    from gitrun.runtime import Runtime
    from gitrun.verifier import Secrets


def _quiet(_: str) -> None:
    return None


@dataclass
class Options:
    workspace: Workspace
    worker: str = field(default_factory=default_worker_id)
    lease_seconds: float = DEFAULT_DURATION
    takeover_after: float | None = None
    say: Callable[[str], None] = _quiet
    trust_roots: Path | None = None
    isolation: str | None = None  # --isolation: overrides the task's [verifier] isolation

    @property
    def approvals(self) -> Approvals:
        from gitrun.approvals import Approvals
        from gitrun.evidence import load_trust_roots

        return Approvals(load_trust_roots(self.trust_roots) if self.trust_roots else None)

    @property
    def secrets(self) -> Secrets:
        """What the code under test must never see: this workspace and its keyring."""
        from gitrun.verifier import Secrets

        return Secrets((self.workspace.root,), (self.workspace.key_file,))


@dataclass
class Opened:
    record: RunRecord
    task: Task
    repo: pygit2.Repository
    env: Environment
    store: CheckpointStore


def _base_parts(task: Task, repo: pygit2.Repository, record_base: str | None) -> dict[str, str]:
    """Scenario parts from the task file as handed in now (initial state recomputed)."""
    if task.initial.repo_dir is not None:
        commit, tree = trees.hash_base(Path(task.initial.repo_dir), task.initial.message)
    elif task.initial.commit is not None:
        commit = task.initial.commit
        obj = repo.get(commit)
        tree = str(obj.tree_id) if isinstance(obj, pygit2.Commit) else "missing"
    else:
        commit = record_base or ""
        obj = repo.get(commit) if commit else None
        tree = str(obj.tree_id) if isinstance(obj, pygit2.Commit) else "missing"
    return task.scenario_parts(commit, tree)


def start(
    task_dir: Path, opts: Options, *, repo_path: Path | None, agent_spec: str, run_id: str | None
) -> RunState:
    """Create a run (worktree, first checkpoint) and drive it to an end or a freeze.

    A run id that exists already is continued like ``resume`` when every input is the
    same (a finished run reports its result again); other inputs are refused by name.
    """
    from gitrun.agents import load_agent

    task = load_task(task_dir)
    agent, recorded_spec = load_agent(agent_spec, task)
    ws = opts.workspace
    rid = check_run_id(run_id) if run_id else new_run_id(task.id)
    if ws.exists(rid):
        return _start_again(ws.load(rid), task, agent, recorded_spec, repo_path, opts)
    if repo_path is not None:
        repo, base = user_repo(repo_path, task.initial.commit)
    elif task.initial.path is not None:
        repo, base = user_repo(Path(task.initial.path), task.initial.commit)
    else:
        repo, base = ws.sandbox_repo(task)
    if gitstore.read_ref(repo, branch_ref(rid)) is not None:
        raise BadInput(
            f"branch gitrun/{rid} already exists in {repo.workdir}; pick another --run-id"
        )
    keyring = starting.keyring_for_new_run(ws)  # a bad key file fails before the run exists
    record = RunRecord(
        rid,
        starting.repo_dir(repo),
        task.task_dir,
        str(ws.worktree_path(rid)),
        branch_ref(rid),
        recorded_spec,
        str(base),
        time.time(),
        created_by=opts.worker,
        agent_identity=agent.identity,
        scenario_parts=_base_parts(task, repo, str(base)),
        setup_done=False,
        key_file=str(ws.key_file.resolve()),
    )
    faults.point("setup_before_register")
    ws.register(record)  # the first durable act of the run, and exclusive
    return _setup_and_run(record, task, repo, agent, checkpoint_store(repo, ws, keyring), opts)


def _start_again(
    record: RunRecord,
    task: Task,
    agent: ScriptAgent,
    spec: str,
    repo_path: Path | None,
    opts: Options,
) -> RunState:
    """``gitrun run`` of an existing run id: the same inputs continue it like resume."""
    differs = starting.differences(
        record, task, agent, spec, repo_path, opts.workspace,
        lambda repo, base: _base_parts(task, repo, base),
    )  # fmt: skip
    if differs:
        raise BadInput(
            f"run {record.run_id} already exists with other inputs: {'; '.join(differs)}; "
            f"continue it with `gitrun resume {record.run_id}` or pick another --run-id"
        )
    return resume(record.run_id, opts, Path(task.task_dir))


def keyring_store(repo: pygit2.Repository, ws: Workspace) -> CheckpointStore:
    """The checkpoint store of an existing run: its keyring must exist (never made here)."""
    return checkpoint_store(repo, ws, load_keyring(ws.key_file, create=False))


def checkpoint_store(repo: pygit2.Repository, ws: Workspace, keyring: Keyring) -> CheckpointStore:
    """The one way the product builds a checkpoint store: always with the workspace's
    freshness witness, since a signature alone proves no freshness."""
    return CheckpointStore(repo, keyring, Witness(ws.witness_dir, keyring))


def _setup_and_run(
    record: RunRecord,
    task: Task,
    repo: pygit2.Repository,
    agent: ScriptAgent,
    store: CheckpointStore,
    opts: Options,
    *,
    lease: LeaseManager | None = None,
) -> RunState:
    from gitrun.runtime import begin

    if lease is None:
        lease = LeaseManager(repo, record.run_id, opts.worker, opts.lease_seconds)
        lease.acquire(0, opts.takeover_after)
    try:
        faults.point("setup_lease_taken")
        env = Environment.create(
            repo,
            record.run_id,
            pygit2.Oid(hex=record.base_commit),
            Path(record.worktree),
            f"{task.id}@{task.version}",
            fence=lease.fence,
        )
        rt = begin(
            task=task,
            env=env,
            store=store,
            lease=lease,
            agent=agent,
            worker=opts.worker,
            base_commit=record.base_commit,
            scenario_parts=_base_parts(task, repo, record.base_commit),
            say=opts.say,
            approvals=opts.approvals,
            isolation=opts.isolation,
            secrets=opts.secrets,
        )
        starting.mark_set_up(opts.workspace, repo, record.run_id, lease.fence)
        opts.say(f"run {record.run_id}: worktree {record.worktree}, branch gitrun/{record.run_id}")
        return _drive(rt)
    finally:
        _release(lease)


def _release(lease: LeaseManager) -> None:
    try:
        lease.release()
    except GitrunError:
        return


def _drive(rt: Runtime) -> RunState:
    try:
        return rt.agent.drive(rt)  # the loop, or a session serving the agent's requests
    except LeaseLost as exc:
        raise LeaseLost(exc.owner, f"{exc.message}; stopped without writing") from exc


def open_run(run_id: str, opts: Options, task_dir: Path | None = None) -> Opened:
    ws = opts.workspace
    record = ws.load(check_run_id(run_id))
    task = load_task(task_dir or record.task_dir)
    repo = gitstore.open_repo(record.repo)
    env = Environment(repo, record.run_id, Path(record.worktree), f"{task.id}@{task.version}")
    return Opened(record, task, repo, env, keyring_store(repo, ws))


def _the_ref(opened: Opened) -> str | None:
    """The run's checkpoint ref: read by name (cheap), else found by a scan."""
    try:
        direct = checkpoint_ref(opened.record.run_id, opened.task.id, opened.env.instance_id())
    except GitrunError:
        direct = None
    if direct is not None and gitstore.read_ref(opened.repo, direct) is not None:
        return direct
    refs = find_checkpoint_refs(opened.repo, opened.record.run_id)
    if len(refs) > 1:
        raise CheckpointRejected(
            "ambiguous", f"run {opened.record.run_id} has {len(refs)} checkpoint refs"
        )
    return refs[0] if refs else None


def load_verified(opened: Opened, *, check_scenario: bool = True) -> tuple[str, Stored]:
    ref = _the_ref(opened)
    if ref is None:
        raise CheckpointRejected(
            "high-water-mark-missing",
            f"run {opened.record.run_id} has no checkpoint ref under refs/gitrun/runs/"
            f"{opened.record.run_id}/checkpoints/; nothing can be trusted"
            + opened.store.witnessed(opened.record.run_id),
        )
    parts = (
        _base_parts(opened.task, opened.repo, opened.record.base_commit) if check_scenario else None
    )
    return ref, opened.store.load(ref, scenario_parts=parts)


def resume(run_id: str, opts: Options, task_dir: Path | None = None) -> RunState:
    """Verify the checkpoint, take the lease, reconcile the environment, carry on."""
    opened = open_run(run_id, opts, task_dir)
    record, task = opened.record, opened.task
    from gitrun.agents import load_agent
    from gitrun.recovery import reconcile

    agent, _ = load_agent(record.agent, task)
    if _the_ref(opened) is None:
        witness = opened.store.witness
        if record.setup_done or (witness is not None and witness.path(run_id).exists()):
            raise starting.mark_missing(opened.repo, record)
        restarted = _restart_setup(opened, agent, opts)
        if restarted is not None:
            return restarted
    ref, stored = load_verified(opened)
    state = stored.state
    if state.agent != agent.identity:
        raise CheckpointRejected(
            "agent-changed", f"the agent's inputs changed since the checkpoint ({record.agent})"
        )
    approvals = opts.approvals
    approvals.require_roots(state)
    if state.phase in TERMINAL:
        _clear_stale_locks(opened)  # e.g. the lease's, if the finished run died releasing it
        if opened.env.worktree.exists():
            opened.env.sync_index()  # killed after its last checkpoint, before the index sync
        return state
    lease = LeaseManager(opened.repo, record.run_id, opts.worker, opts.lease_seconds)
    try:
        # Ownership, then every refusal, before anything is written: a refused resume
        # changes nothing, not even the lease (reconcile runs again under the lease).
        lease.check_takeable(opts.takeover_after)
        if state.phase != NEEDS_REVIEW:
            reconcile(_runtime(opened, ref, stored, lease, agent, opts), apply=False)
    except GitrunError:
        _release(lease)
        raise
    lease.acquire(state.generation, opts.takeover_after)
    try:
        # The previous owner may have advanced (or finished) the run between our first
        # read and our lease: continue only from the checkpoint read under the lease.
        ref, stored = load_verified(opened)
        approvals.require_roots(stored.state)
        if not record.setup_done:  # killed between its first checkpoint and saying so
            starting.mark_set_up(opts.workspace, opened.repo, record.run_id, lease.fence)
        if stored.state.phase in TERMINAL:
            return stored.state
        return _continue(_runtime(opened, ref, stored, lease, agent, opts), opts)
    finally:
        _release(lease)


def _runtime(
    opened: Opened, ref: str, stored: Stored, lease: LeaseManager, agent: ScriptAgent, opts: Options
) -> Runtime:
    """A runtime on the verified checkpoint. Its events are already in the chain: the
    next checkpoint starts a new batch."""
    from gitrun.runtime import Runtime

    return Runtime(
        opened.task,
        opened.env,
        opened.store,
        ref,
        lease,
        agent,
        replace(stored.state, events=()),
        stored.oid,
        opts.say,
        opts.approvals,
        opts.isolation,
        opts.secrets,
    )


def _continue(rt: Runtime, opts: Options) -> RunState:
    """Take in waiting evidence or reconcile, then drive the run on."""
    from gitrun.recovery import reconcile

    approvals = rt.approvals
    generation = rt.state.generation
    if rt.state.phase == NEEDS_REVIEW:
        if not approvals.intake_review(rt):
            raise Frozen(rt.frozen_message())
        what = f"review decision applied ({rt.state.phase})"
    else:
        what = reconcile(rt)
        if rt.state.phase == AWAITING_APPROVAL and approvals.intake_approval(rt):
            what += ", fresh approval taken in"
    opts.say(f"resume {rt.state.run_id} at generation {generation}: {what}")
    return _drive(rt)


def _restart_setup(opened: Opened, agent: ScriptAgent, opts: Options) -> RunState | None:
    """A run that died before its first checkpoint: start its setup again, once we own it.

    The setup may be a live worker's, still under way: own the run before undoing it.
    None when its owner reached the first checkpoint after all (resume that instead).
    """
    record = opened.record
    lease = LeaseManager(opened.repo, record.run_id, opts.worker, opts.lease_seconds)
    lease.acquire(0, opts.takeover_after)
    if _the_ref(opened) is not None:
        _release(lease)
        return None
    try:
        starting.check_unstarted(opened.repo, record)
        with fenced(opened.repo, record.run_id, lease.fence):
            _discard_setup(opened)
        # A first checkpoint killed inside its ref transaction left <ref>.lock on a ref
        # named after the discarded instance, which no later write locks.
        _clear_stale_locks(opened)
    except BaseException:
        _release(lease)
        raise
    return _setup_and_run(record, opened.task, opened.repo, agent, opened.store, opts, lease=lease)


def _discard_setup(opened: Opened) -> None:
    """Undo a setup a crash interrupted before the first checkpoint (nothing was done)."""
    rec = opened.record
    wt_name = f"gitrun-{rec.run_id}"
    if wt_name in opened.repo.list_worktrees():
        opened.repo.lookup_worktree(wt_name).prune(True)
    # add_worktree killed half-way leaves an admin dir libgit2 neither lists nor prunes,
    # and then refuses to add the worktree again: it holds nothing of value yet.
    shutil.rmtree(gitstore.common_dir(opened.repo) / "worktrees" / wt_name, ignore_errors=True)
    shutil.rmtree(rec.worktree, ignore_errors=True)
    tip = gitstore.read_ref(opened.repo, rec.branch)
    if tip is not None:
        gitstore.update_ref(
            opened.repo, rec.branch, tip, None, message="gitrun: discard unstarted run"
        )


def _clear_stale_locks(opened: Opened) -> None:
    """Remove the ``<ref>.lock`` files a killed gitrun writer left on this run's refs.

    Only refs no later step of the run will lock need this (a discarded instance's
    checkpoint ref; the lease of a finished run): every ref write clears its own.
    """
    cdir = gitstore.common_dir(opened.repo)
    folder = cdir / "refs" / "gitrun" / "runs" / opened.record.run_id
    for lock in sorted(folder.rglob("*.lock")) if folder.is_dir() else []:
        with gitstore.os_locks(opened.repo, [str(lock.relative_to(cdir))[: -len(".lock")]]):
            pass  # holding the ref's OS lock removes its stale lock file


def status(run_id: str, opts: Options) -> dict[str, Any]:
    """Everything a user needs to know about a run, from the verified checkpoint."""
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
        return {
            **out,
            "task_id": opened.task.id,
            "phase": "unknown",
            "stop_reason": None,
            "checkpoint_error": str(exc),
            "head": None,
            "pending": None,
            "receipts": [],
            "verifier": None,
            "isolation": None,
        }
    s = stored.state
    return {
        **out,
        "task_id": s.task_id,
        "phase": s.phase,
        "stop_reason": s.stop_reason,
        "generation": s.generation,
        "checkpoint_ref": ref,
        "checkpoint": str(stored.oid),
        "head": s.env.head,
        "instance_id": s.env.instance_id,
        "pending": None
        if s.pending is None
        else {
            "key": s.pending.key,
            "action": s.pending.action.summary(),
            "intent_digest": s.pending.intent_digest,
            "risk": s.pending.risk,
            "approval": s.pending.approval,
        },
        "receipts": [encode(r) for r in opened.env.receipts()],
        "verifier": None if s.verifier is None else encode(s.verifier),
        "isolation": None if s.verifier is None else s.verifier.isolation,
        "budgets": encode(s.budgets),
        "review": None if s.review is None else encode(s.review),
    }


def _lease_info(opened: Opened) -> dict[str, Any] | None:
    """The lease as status shows it; a ref rewritten to garbage is shown, not fatal."""
    try:
        lease, _ = read_lease(opened.repo, opened.record.run_id)
    except LeaseUnreadable as exc:
        return {"unreadable": str(exc), "oid": exc.oid}
    return None if lease is None else {**encode(lease), "live": lease.expires_at > time.time()}


def receipts(run_id: str, opts: Options) -> list[dict[str, Any]]:
    opened = open_run(run_id, opts)
    return [encode(r) for r in opened.env.receipts()]


def checkpoints(run_id: str, opts: Options) -> list[Stored]:
    opened = open_run(run_id, opts)
    ref = _the_ref(opened)
    if ref is None:
        raise CheckpointRejected("high-water-mark-missing", f"run {run_id} has no checkpoint ref")
    return opened.store.chain(ref)


def verify(run_id: str, opts: Options, task_dir: Path | None) -> Stored:
    opened = open_run(run_id, opts, task_dir)
    _, stored = load_verified(opened)
    return stored


def rewitness(run_id: str, opts: Options, generation: int) -> Stored:
    """Accept the checkpoint the ref holds now as the newest (after restoring a backup)."""
    opened = open_run(run_id, opts)
    ref = _the_ref(opened)
    if ref is None:
        raise CheckpointRejected("high-water-mark-missing", f"run {run_id} has no checkpoint ref")
    return opened.store.rewitness(ref, generation)


def approve(
    run_id: str, opts: Options, key_file: Path, ttl_seconds: float, note: str
) -> tuple[RunState, Signed, str]:
    """Sign an approval for the pending action and leave it for the runtime."""
    from gitrun.approvals import approval_claims, submit
    from gitrun.evidence import APPROVAL_DOMAIN, load_trust_roots
    from gitrun.evidence import sign as sign_evidence
    from gitrun.evidence import verify as verify_evidence
    from gitrun.show import action_diff

    opened = open_run(run_id, opts)
    _, stored = load_verified(opened)
    state = stored.state
    if state.phase != AWAITING_APPROVAL or state.pending is None:
        raise BadInput(f"run {run_id} is {state.phase}; there is nothing to approve")
    claims = approval_claims(state, note, ttl_seconds)
    signed = sign_evidence(claims, key_file, "approver", APPROVAL_DOMAIN)
    if opts.trust_roots is not None:
        verify_evidence(signed, load_trust_roots(opts.trust_roots), "approver", APPROVAL_DOMAIN)
    submit(opened.repo, run_id, "approval", signed)
    base = opened.repo.get(state.pending.precondition.head)
    tree = base.tree if isinstance(base, pygit2.Commit) else opened.env.head().tree
    return state, signed, action_diff(opened.repo, state.pending.action, tree)


def review_case(run_id: str, opts: Options) -> tuple[RunState, str]:
    """The open review case and its two diffs side by side."""
    from gitrun.show import action_diff, commit_diff, side_by_side

    opened = open_run(run_id, opts)
    _, stored = load_verified(opened)
    state = stored.state
    case = state.review
    if case is None or state.pending is None:
        raise BadInput(f"run {run_id} is {state.phase}; it has no open review case")
    base = opened.repo.get(state.pending.precondition.head)
    tree = base.tree if isinstance(base, pygit2.Commit) else opened.env.head().tree
    left = action_diff(opened.repo, case.action, tree)
    if case.receipt is None:  # an interrupted exec: nothing was committed
        title, right = "no receipt", case.reason + "\n"
    else:
        title = f"committed receipt {case.receipt.commit[:12]} {case.receipt_digest[:23]}"
        right = commit_diff(opened.repo, case.receipt.commit)
    text = side_by_side(f"pending intent {case.pending_digest[:23]}", left, title, right)
    return state, text


def review_decide(run_id: str, opts: Options, key_file: Path, decision: str) -> Signed:
    from gitrun.approvals import review_claims, submit
    from gitrun.evidence import REVIEW_DOMAIN
    from gitrun.evidence import sign as sign_evidence

    opened = open_run(run_id, opts)
    _, stored = load_verified(opened)
    if decision not in ("replan", "abort"):
        raise BadInput(f"decision must be replan or abort, not {decision!r}")
    if stored.state.review is None:
        raise BadInput(f"run {run_id} is {stored.state.phase}; it has no open review case")
    signed = sign_evidence(
        review_claims(stored.state, decision), key_file, "reviewer", REVIEW_DOMAIN
    )
    submit(opened.repo, run_id, "review", signed)
    return signed
