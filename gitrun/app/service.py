"""Use cases behind the CLI that drive a run: start it, resume it, restart its setup.

Each function wires the pieces (workspace, repository, environment, checkpoint store,
lease, agent) and returns plain results; the CLI only parses and prints. Opening a run is
:mod:`gitrun.app.opening`'s; the read-only and evidence use cases (status, receipts,
checkpoints, verify, rewitness, approve, review) are :mod:`gitrun.app.reports`', re-exported
here so ``service.status`` and the rest keep working.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gitrun.adapter.environment import Environment, branch_ref
from gitrun.adapter.gittypes import Oid, Repository, oid
from gitrun.adapter.repos import user_repo
from gitrun.app import remote_run, starting
from gitrun.app.opening import (
    Opened,
    Options,
    base_parts,
    checkpoint_store,
    keyring_store,
    lease_floor,
    lease_store,
    load_verified,
    open_run,
    remote_site,
    report_finished,
    the_ref,
)
from gitrun.app.reports import (
    approve,
    checkpoints,
    receipts,
    review_case,
    review_decide,
    rewitness,
    status,
    verify,
)
from gitrun.app.workspace import RunRecord, check_run_id, new_run_id
from gitrun.core import faults
from gitrun.core.errors import BadInput, CheckpointRejected, Frozen, GitrunError, LeaseLost
from gitrun.core.records import AWAITING_APPROVAL, NEEDS_REVIEW, TERMINAL, RunState
from gitrun.core.task import Task, load_task
from gitrun.store import gitstore
from gitrun.store.checkpoint import CheckpointStore, Stored
from gitrun.store.lease import LeaseManager, fenced
from gitrun.store.remote import RemoteSite

if TYPE_CHECKING:
    # Loaded by the use cases that drive a run, not by `gitrun status` (hooks call it
    # once per agent tool call; issue #15).
    from gitrun.engine.agents import ScriptAgent
    from gitrun.engine.approvals import Approvals
    from gitrun.engine.runtime import Runtime

__all__ = [
    "Opened",
    "Options",
    "approve",
    "checkpoint_store",
    "checkpoints",
    "keyring_store",
    "load_verified",
    "open_run",
    "receipts",
    "resume",
    "review_case",
    "review_decide",
    "rewitness",
    "start",
    "status",
    "verify",
]


def start(
    task_dir: Path, opts: Options, *, repo_path: Path | None, agent_spec: str, run_id: str | None
) -> RunState:
    """Create a run (worktree, first checkpoint) and drive it to an end or a freeze.

    A run id that exists already is continued like ``resume`` when every input is the
    same (a finished run reports its result again); other inputs are refused by name.
    """
    from gitrun.engine.agents import load_agent

    task = load_task(task_dir)
    agent, recorded_spec = load_agent(agent_spec, task)
    ws = opts.workspace
    rid = check_run_id(run_id) if run_id else new_run_id(task.id)
    if ws.exists(rid):
        return _start_again(ws.load(rid), task, agent, recorded_spec, repo_path, opts)
    faults.point("setup_unregistered")
    repo, base = _repo_and_base(task, opts, repo_path)
    site = remote_site(repo, opts.remote_for())
    if site is not None and remote_run.on_remote(site, rid):  # started on another machine
        record = remote_run.adopt(site, rid, task, opts)
        return _start_again(record, task, agent, recorded_spec, repo_path, opts)
    if gitstore.read_ref(repo, branch_ref(rid)) is not None:
        if ws.exists(rid):  # another start of this run id registered it (and made its
            # branch) since we looked: continue or report it, as if we had looked now
            return _start_again(ws.load(rid), task, agent, recorded_spec, repo_path, opts)
        raise BadInput(
            f"branch gitrun/{rid} already exists in {repo.workdir}; pick another --run-id"
        )
    keyring = starting.keyring_for_new_run(ws)  # a bad key file fails before the run exists
    record = _new_record(rid, task, repo, base, agent, recorded_spec, opts)
    record = replace(record, remote=site.url if site else "")
    faults.point("setup_before_register")
    ws.register(record)  # the first durable act of the run, and exclusive
    store = checkpoint_store(repo, ws, keyring, site)
    return _setup_and_run(record, task, repo, agent, store, opts, site=site)


def _repo_and_base(task: Task, opts: Options, repo_path: Path | None) -> tuple[Repository, Oid]:
    """The repository a new run works in and its base commit: ``--repo``, else the task's
    ``path``, else the task's own sandbox repository in the workspace."""
    if repo_path is not None:
        return user_repo(repo_path, task.initial.commit)
    if task.initial.path is not None:
        return user_repo(Path(task.initial.path), task.initial.commit)
    return opts.workspace.sandbox_repo(task)


def _new_record(
    rid: str,
    task: Task,
    repo: Repository,
    base: Oid,
    agent: ScriptAgent,
    recorded_spec: str,
    opts: Options,
) -> RunRecord:
    """The registry record of a new run, not yet set up (its worktree is still to be made)."""
    ws = opts.workspace
    return RunRecord(
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
        scenario_parts=base_parts(task, repo, str(base)),
        setup_done=False,
        key_file=str(ws.key_file.resolve()),
    )


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
        lambda repo, base: base_parts(task, repo, base),
    )  # fmt: skip
    if differs:
        raise BadInput(
            f"run {record.run_id} already exists with other inputs: {'; '.join(differs)}; "
            f"continue it with `gitrun resume {record.run_id}` or pick another --run-id"
        )
    return resume(record.run_id, opts, Path(task.task_dir))


def _setup_and_run(
    record: RunRecord,
    task: Task,
    repo: Repository,
    agent: ScriptAgent,
    store: CheckpointStore,
    opts: Options,
    *,
    lease: LeaseManager | None = None,
    site: RemoteSite | None = None,
) -> RunState:
    if lease is None:
        lease = lease_store(repo, record.run_id, opts, site)
        lease.acquire(0, opts.takeover_after)
    try:
        faults.point("setup_lease_taken")
        rt = _first_runtime(record, task, repo, agent, store, lease, opts, site)
        starting.mark_set_up(opts.workspace, repo, record.run_id, lease.fence)
        opts.say(f"run {record.run_id}: worktree {record.worktree}, branch gitrun/{record.run_id}")
        return _drive(rt)
    finally:
        _release(lease)


def _first_runtime(
    record: RunRecord,
    task: Task,
    repo: Repository,
    agent: ScriptAgent,
    store: CheckpointStore,
    lease: LeaseManager,
    opts: Options,
    site: RemoteSite | None = None,
) -> Runtime:
    """Create the run's branch and worktree under the lease, and its runtime at the first
    checkpoint: the setup the ``setup_done`` mark then records. A --remote run's branch
    and record go to the remote before its first checkpoint does."""
    from gitrun.engine.runtime import begin

    env = Environment.create(
        repo,
        record.run_id,
        oid(record.base_commit),
        Path(record.worktree),
        f"{task.id}@{task.version}",
        fence=lease.fence,
        site=site,
    )
    if site is not None:
        remote_run.publish(site, record, task, lease.fence)
    return begin(
        task=task,
        env=env,
        store=store,
        lease=lease,
        agent=agent,
        worker=opts.worker,
        base_commit=record.base_commit,
        scenario_parts=base_parts(task, repo, record.base_commit),
        say=opts.say,
        approvals=opts.approvals,
        isolation=opts.isolation,
        secrets=opts.secrets,
        output_log=opts.output_log,
    )


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


class _MovedOn(Exception):
    """The checkpoint moved while a resume checked it: another resume carried the run on
    (the refusal it caused is ``error``)."""

    def __init__(self, error: GitrunError) -> None:
        super().__init__(error.message)
        self.error = error


def resume(run_id: str, opts: Options, task_dir: Path | None = None) -> RunState:
    """Verify the checkpoint, take the lease, reconcile the environment, carry on.
    A --remote run another machine started is adopted here first (see remote_run)."""
    if not opts.workspace.exists(check_run_id(run_id)) and opts.remote_for():
        _adopt(run_id, opts, task_dir)
    for attempt in range(4):
        try:
            return _resume_once(run_id, opts, task_dir)
        except _MovedOn as moved:
            if attempt == 3:
                raise moved.error from None
            # Look again: the run may be finished now, or owned, or ours to resume.
    raise GitrunError("not reached")  # the last attempt returns or raises


def _resume_once(run_id: str, opts: Options, task_dir: Path | None) -> RunState:
    opened = open_run(run_id, opts, task_dir)
    remote_run.check_same_remote(opts, opened.record)
    record, task = opened.record, opened.task
    from gitrun.engine.agents import load_agent

    agent, _ = load_agent(record.agent, task)
    if the_ref(opened) is None:
        restarted = _restart_unstarted(opened, run_id, agent, opts)
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
        return report_finished(opened, state, opts)
    lease = lease_store(opened.repo, record.run_id, opts, opened.site)
    _check_resumable(opened, ref, stored, lease, agent, opts)
    lease.acquire(state.generation, opts.takeover_after, floor=lease_floor(opened, state))
    try:
        return _resume_under_lease(opened, lease, agent, approvals, opts)
    finally:
        _release(lease)


def _restart_unstarted(
    opened: Opened, run_id: str, agent: ScriptAgent, opts: Options
) -> RunState | None:
    """A run without a checkpoint ref: restart its setup, unless the run says it was set
    up (its mark or its witness exists), in which case the ref is missing, not the setup.
    None when the ref is there after all (resume that instead)."""
    witness = opened.store.witness
    if opened.record.setup_done or (witness is not None and witness.path(run_id).exists()):
        if the_ref(opened) is not None:  # its owner wrote the first checkpoint since we looked
            return None
        raise starting.mark_missing(opened.repo, opened.record, opened.store.witnessed(run_id))
    return _restart_setup(opened, agent, opts)


def _check_resumable(
    opened: Opened, ref: str, stored: Stored, lease: LeaseManager, agent: ScriptAgent, opts: Options
) -> None:
    """Ownership, then every refusal, before anything is written: a refused resume
    changes nothing, not even the lease (reconcile runs again under the lease)."""
    from gitrun.engine.recovery import reconcile

    try:
        lease.check_takeable(opts.takeover_after)
        if stored.state.phase != NEEDS_REVIEW:
            reconcile(build_runtime(opened, ref, stored, lease, agent, opts), apply=False)
    except GitrunError as exc:
        _release(lease)
        # A resume started at the same moment took the lease after our first look and
        # moved the run on under us: that, not the run it changed, is the answer.
        lease.check_takeable(opts.takeover_after)
        _release(lease)
        if gitstore.read_ref(opened.repo, ref) != stored.oid:
            raise _MovedOn(exc) from None  # ... or took it, finished and let go meanwhile
        raise


def _resume_under_lease(
    opened: Opened, lease: LeaseManager, agent: ScriptAgent, approvals: Approvals, opts: Options
) -> RunState:
    """Carry on from the checkpoint read under the lease: the previous owner may have
    advanced (or finished) the run between our first read and our lease."""
    ref, stored = load_verified(opened)
    approvals.require_roots(stored.state)
    if not opened.record.setup_done:  # killed between its first checkpoint and saying so
        starting.mark_set_up(opts.workspace, opened.repo, opened.record.run_id, lease.fence)
    if stored.state.phase in TERMINAL:
        return stored.state
    return _continue(build_runtime(opened, ref, stored, lease, agent, opts), opts)


def build_runtime(
    opened: Opened, ref: str, stored: Stored, lease: LeaseManager, agent: ScriptAgent, opts: Options
) -> Runtime:
    """The one factory of a runtime on a verified checkpoint for ``gitrun resume``, the
    benchmarks and the tests (:func:`gitrun.engine.runtime.at_checkpoint` over the run's
    stores; a new run's comes from :func:`gitrun.engine.runtime.begin`)."""
    from gitrun.engine.runtime import at_checkpoint

    return at_checkpoint(
        task=opened.task, env=opened.env, store=opened.store, ref=ref, loaded=stored,
        lease=lease, agent=agent, say=opts.say, approvals=opts.approvals,
        isolation=opts.isolation, secrets=opts.secrets, output_log=opts.output_log,
    )  # fmt: skip


def _continue(rt: Runtime, opts: Options) -> RunState:
    """Take in waiting evidence or reconcile, then drive the run on."""
    from gitrun.engine.recovery import reconcile

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
    lease = lease_store(opened.repo, record.run_id, opts, opened.site)
    lease.acquire(0, opts.takeover_after)
    if the_ref(opened) is not None:
        _release(lease)
        return None
    try:
        starting.check_unstarted(opened.repo, record)
        with fenced(opened.repo, record.run_id, lease.fence):
            starting.discard_setup(opened.repo, opened.record)
        # A first checkpoint killed inside its ref transaction left <ref>.lock on a ref
        # named after the discarded instance, which no later write locks.
        starting.clear_stale_locks(opened.repo, opened.record.run_id)
    except BaseException:
        _release(lease)
        raise
    return _setup_and_run(
        record, opened.task, opened.repo, agent, opened.store, opts, lease=lease, site=opened.site
    )


def _adopt(run_id: str, opts: Options, task_dir: Path | None) -> None:
    """Register here a --remote run that another machine started (its task dir needed)."""
    if task_dir is None:
        raise BadInput(
            f"run {run_id} is not registered in {opts.workspace.root}; to take it over from "
            f"{opts.remote_for()} pass --task DIR (the run's task directory on this machine)"
        )
    task = load_task(task_dir)
    repo, _ = _repo_and_base(task, opts, None)
    site = RemoteSite(repo, str(opts.remote_for()))
    if not remote_run.on_remote(site, run_id):
        raise BadInput(f"run {run_id} is neither registered here nor on {site.url}")
    remote_run.adopt(site, run_id, task, opts)
