"""The runtime: drives the pure state machine (:mod:`gitrun.core.machine`) over the stores.

Every next :class:`RunState` is computed by :func:`gitrun.core.machine.transition`; this
module only observes, asks the agent and the gate, and performs the effects the machine
hands out (a checkpoint advance, a write, a verifier run). A crash between any two
effects leaves a checkpoint from which :mod:`gitrun.engine.recovery` continues exactly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gitrun.adapter import sandbox
from gitrun.adapter.environment import Approval, Environment, Observation
from gitrun.adapter.exec_step import ExecContext, ExecRefused, ToolContext
from gitrun.adapter.gate import Gate
from gitrun.adapter.gitview import GitView
from gitrun.adapter.sandbox import CommandCannotStart, Confinement
from gitrun.adapter.shell import Hidden
from gitrun.core import faults
from gitrun.core import machine as m
from gitrun.core.contracts import CheckpointLog, LeaseStore, LoadedCheckpoint
from gitrun.core.errors import EnvironmentDrift, Frozen, GateRejected, GitrunError, ReceiptConflict
from gitrun.core.records import (
    AWAITING_APPROVAL,
    EXEC,
    NEEDS_REVIEW,
    RUNNING,
    TOOL,
    EnvState,
    Event,
    Precondition,
    Receipt,
    RunState,
    new_key,
)
from gitrun.core.task import Task
from gitrun.engine import crashes, riding
from gitrun.engine.agents import Finish, ScriptAgent
from gitrun.engine.approvals import Approvals, clear_inbox
from gitrun.engine.verifier import Secrets, VerifierResult, verify_tree
from gitrun.store import gitstore, trees

Say = Callable[[str], None]


@dataclass
class Runtime:
    """One run's loop over its stores, typed on their contracts (:mod:`gitrun.core.contracts`):
    the git stores, the remote ones or the tests' memory ones drive the same loop."""

    task: Task
    env: Environment
    store: CheckpointLog[Any]  # the checkpoint id's type is the store's own (git: an Oid)
    ref: str
    lease: LeaseStore
    agent: ScriptAgent
    state: RunState
    checkpoint: Any  # the store's id of the checkpoint at the head; None before the first
    say: Say
    approvals: Approvals
    isolation: str | None = None  # the command line's --isolation; None: the task's
    secrets: Secrets = field(default_factory=Secrets)  # hidden from the code under test
    abandoned: GateRejected | None = None  # why the last pending action was dropped (sessions)
    output_log: Path | None = None  # where the verifier keeps the test command's output
    tool: ToolContext | None = None  # a tool step's: what the tool reported, the scan cache

    def __post_init__(self) -> None:
        self._segment_start = time.time()
        self.rider = riding.Rider(self.say)  # an intent written, its ref move riding
        self.gate = Gate(self.task, self.env.worktree, self.env.repo)

    # -- the machine and its effects ---------------------------------------------------

    def apply(self, event: m.MachineEvent) -> None:
        """Hand ``event`` to the state machine and perform its effects, in order."""
        _, effects = m.transition(self.state, event)
        for effect in effects:
            self._perform(effect)

    def _perform(self, effect: m.Effect) -> None:
        if isinstance(effect, m.Persist):
            self.commit(effect.state)
        elif isinstance(effect, m.Hold):
            # A receipt recorded, not written: it rides in the next checkpoint.
            self.state = effect.state
            faults.point("receipt_riding")
        elif isinstance(effect, m.Say):
            if not self.rider.hold(effect.line):  # an intent's line waits until it is durable
                self.say(effect.line)
        elif isinstance(effect, m.Execute):
            self._execute(effect)
        elif isinstance(effect, m.RunVerifier):
            crashes.verify_unless_repeated(self, effect, self._verify)
        elif isinstance(effect, m.ClearInbox):
            clear_inbox(self.env.repo, self.state.run_id, effect.kind, self.env.site)
        elif isinstance(effect, m.SyncIndex):
            # Bound how far the worktree's index lags, so a full observation (resume,
            # verify) never does work that grows with the length of the run.
            self.env.sync_index()
        # Freeze: the run's phase now waits for a human; run() stops and raises Frozen.

    def pause(self) -> None:
        """The driver stops here (not done, not frozen): write a receipt still riding,
        so the checkpoint a stopped run leaves is its whole state."""
        self.apply(m.Pause(time.time()))

    def commit(self, state: RunState) -> None:
        """Persist: make ``state`` the next checkpoint (generation + 1); the events it
        carries (a receipt riding since the last one included) go into the chain. A
        step's intent to write files is written, its ref move riding with the write's
        (:mod:`gitrun.engine.riding`); any other persist lands it first."""
        self.land()
        now = time.time()
        fence = self.lease.fence
        nxt = m.stamp(
            state,
            generation=self.state.generation + 1,
            elapsed=now - self._segment_start,
            worker=self.lease.worker,
            lease_version=fence.version,
            now=now,
        )
        if self.rider.proposing and riding.may_ride(self, nxt):
            riding.start(self, nxt)  # its ref move staged in the step's transaction
        else:
            self.checkpoint = self.store.advance(self.ref, nxt, self.checkpoint, fence)
        self._segment_start = now
        self.state = nxt.evolve(events=())
        if self.rider.prepared is None:
            self.lease.maybe_renew(self.state.generation)

    def land(self) -> None:
        """A riding intent becomes the checkpoint (moved on its own unless its write moved it)."""
        riding.land(self)

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> RunState:
        """Step until done, failed, or frozen (raises :class:`Frozen`).

        Steps leave the worktree's index behind HEAD (rewriting it costs O(files) per
        step); it is brought up to date here, so a stopped run looks clean to plain git.
        """
        try:
            while self.state.phase == RUNNING:
                if self.state.pending is not None:
                    self.execute_pending()
                else:
                    self.step()
        except Frozen:
            self.env.sync_index()
            raise
        self.env.sync_index()
        if self.state.phase in (AWAITING_APPROVAL, NEEDS_REVIEW):
            raise Frozen(self.frozen_message())
        return self.state

    def frozen_message(self) -> str:
        return m.frozen_message(self.state)

    def step(self) -> None:
        """Observe, propose, gate, and persist the intent (or the rejection)."""
        faults.point("before_propose")
        s = self.state
        if s.phase != RUNNING or s.pending is not None:
            raise Frozen(f"run {s.run_id} is {s.phase}; no new proposal is accepted")
        obs = self.env.observe(full=False)
        decision = self.agent.propose(obs, s.cursor)
        if isinstance(decision, Finish):
            self.apply(m.Finished(time.time()))
            return
        tree = self.env.head().tree  # one read for the gate's check and its risk
        try:
            action = self.gate.check(decision, tree, s.budgets, self._segment_start)
        except GateRejected as exc:
            last = not exc.rule.startswith("budget-") and self.agent.is_last(s.cursor)
            self.apply(
                m.ProposalRejected(exc.rule, exc.message, decision.summary(), time.time(), last)
            )
            return
        pre = Precondition(obs.instance_id, obs.head, obs.tree)
        risk = self.gate.risk(action, tree)
        key = self.agent.proposal_key() or new_key()  # a session client's own key
        with self.rider.proposal():
            self.apply(m.Proposed(action, key, action.intent_digest(), risk, pre, time.time()))
        if self.rider.prepared is None:  # else passed where the intent's ref moves
            faults.point("after_intent_checkpoint")

    def execute_pending(self) -> None:
        """Execute the pending intent with its own key (windows 2 and 3), then record it.

        A write not yet made is gated again first, against its precondition tree (and,
        inside the adapter, against the disk as it is now): a policy rejection abandons
        it, drift on disk refuses and leaves it pending for after the human's fix. One
        that crashed gitrun twice at one point goes to review (:mod:`~gitrun.engine.crashes`).
        """
        key = self.state.pending.key if self.state.pending is not None else None
        if crashes.review_repeated(self):
            return
        try:
            self._execute_pending()
        except BaseException as exc:
            riding.land_after_failure(self)  # a refusal leaves the intent pending, durable
            crashes.remember(self, key, exc)
            raise

    def _execute_pending(self) -> None:
        s = self.state
        p = s.pending
        if p is None:
            raise GitrunError("no pending action to execute")
        if s.phase != RUNNING:
            raise Frozen(self.frozen_message())
        found = self.env.lookup(p.key, since=p.precondition.head)
        if found is not None:
            self.land()
            self.accept(found, replayed=True)
            return
        tree = trees.tree_at(self.env.repo, p.precondition.tree)
        if tree is None:
            raise EnvironmentDrift(
                "tree-missing", f"the intent's tree {p.precondition.tree} is gone"
            )
        try:
            self.gate.check_action(p.action, tree, on_disk=False)
        except GateRejected as exc:
            self._abandon(exc)
            return
        grant = self.approvals.grant(p) if p.risk is not None else None
        self.apply(m.ExecuteDue(time.time(), grant))

    def _execute(self, effect: m.Execute) -> None:
        """Execute: one write with the intent's key under the lease, then its receipt."""
        p, grant = effect.pending, effect.grant
        approval = None if grant is None else Approval(grant.fingerprint, grant.expires_at)
        tool = (self.tool or ToolContext(self.gate)) if p.action.kind == TOOL else None
        shell = self.exec_context() if p.action.kind == EXEC else tool
        if shell is not None:
            self.land()  # a command's intent is durable before it starts
        txn = self.rider.prepared.txn if self.rider.prepared is not None else None
        try:
            outcome = self.env.execute(
                p.action, p.key, p.intent_digest, p.precondition, self.lease.fence, approval,
                shell=shell, txn=txn,
            )  # fmt: skip
        except ReceiptConflict as conflict:
            self.conflict(conflict.receipt)
            return
        except ExecRefused as exc:  # the command's change broke a rule; the worktree is back
            self._abandon(exc)
            return
        self.land()
        self.accept(outcome.receipt, replayed=outcome.replayed, grant=grant)

    def exec_context(self) -> ExecContext:
        """How an exec step runs: confined as the verifier is, the lease kept renewed."""
        hide = self._secrets()
        renew = lambda: self.lease.maybe_renew(self.state.generation)  # noqa: E731
        view = GitView(
            self.state.env.base_commit, self.env.branch.removeprefix("refs/heads/"),
            gitstore.common_dir(self.env.repo) / "objects", Path(self.env.wt.path),
        )  # fmt: skip
        hidden = Hidden(hide.dirs, hide.files)
        return ExecContext(self.gate, self._confinement(), hidden, renew, git=view)

    def _abandon(self, exc: GateRejected) -> None:
        """Drop a pending action the gate refuses at execute time (the machine's
        PendingRejectedAtExecute); the reason is kept for a session to answer with."""
        self.abandoned = exc
        self.apply(m.PendingRejectedAtExecute(exc.rule, exc.message, time.time()))

    def accept(self, receipt: Receipt, replayed: bool, grant: m.Grant | None = None) -> None:
        """Record a receipt, unless it cannot be reconciled without a human."""
        p = self.state.pending
        risky = p is not None and p.risk is not None and grant is None
        if risky and p is not None and receipt.intent_digest == p.intent_digest:
            grant = self.approvals.grant(p)  # (another digest is a conflict: no grant needed)
        tip = str(self.env.head().id)
        self.apply(m.WriteReceipt(receipt, replayed, tip, time.time(), grant))

    def conflict(self, receipt: Receipt) -> None:
        """The pending key is committed with another intent: freeze for review."""
        self.apply(m.ReceiptConflict(receipt, str(self.env.head().id), time.time()))

    # -- verification ------------------------------------------------------------------

    def _verify(self, effect: m.RunVerifier) -> None:
        """RunVerifier: the tests on a fresh copy of the last write's tree, in a sandbox."""
        faults.point("before_verify")
        obs = self.clean_at(effect)
        confinement = self._confinement()
        where = f"bwrap, network {confinement.network}" if confinement.confined else "none"
        self.say(f"verifier: {' '.join(self.task.verifier.command)} (isolation: {where})")
        extra: dict[str, Any] = {"network": confinement.network}
        if not confinement.confined:
            extra["unconfined_because"] = confinement.reason
        try:
            result, made = self._run_tests(effect.tree, confinement)
        except CommandCannotStart as exc:
            cannot = m.VerifierCannotStart(
                obs.head, obs.tree, obs.status_digest, str(exc),
                tuple(self.task.verifier.required), time.time(), extra, confinement.kind,
            )  # fmt: skip
            self.apply(cannot)
            return
        faults.point("after_verify")
        if made != effect.tree:
            raise EnvironmentDrift("verifier-tree", f"verified {made}, not {effect.tree}")
        after = self.env.observe(full=True)
        if after.fingerprint() != obs.fingerprint():
            raise EnvironmentDrift(
                "verifier-changed-tree",
                f"the test command changed the worktree: {list(after.dirty[:5])}",
            )
        verdict = m.VerifierResult(
            result.passed, obs.head, made, obs.status_digest, result.summary,
            dict(result.outcomes), result.exit_code, result.timed_out, time.time(),
            extra, confinement.kind,
        )  # fmt: skip
        self.apply(verdict)

    def clean_at(self, effect: m.RunVerifier) -> Observation:
        """The worktree must be exactly the last write before its tests run."""
        obs = self.env.observe(full=True)
        if obs.dirty:
            raise EnvironmentDrift(
                "uncommitted-edits", f"uncommitted changes before verify: {list(obs.dirty[:5])}"
            )
        if obs.head != effect.head or obs.tree != effect.tree:
            raise EnvironmentDrift(
                "head-moved", f"HEAD {obs.head} is not the last write {effect.head}"
            )
        return obs

    def _run_tests(self, tree: str, confinement: Confinement) -> tuple[VerifierResult, str]:
        return verify_tree(
            self.task.verifier,
            self.env.repo,
            tree,
            confinement=confinement,
            secrets=self._secrets(),
            heartbeat=lambda: self.lease.maybe_renew(self.state.generation),
            progress=_every(5.0, self.say),
            # several heartbeats per lease, so even a 1 s lease is renewed before it expires
            heartbeat_interval=min(1.0, self.lease.duration / 4),
            keep_log=self.output_log,
        )

    def _confinement(self) -> Confinement:
        """The isolation in force: the command line's setting, else the task's."""
        setting = self.isolation or self.task.verifier.isolation
        try:
            return sandbox.resolve(setting)
        except sandbox.SandboxUnavailable as exc:
            raise sandbox.SandboxUnavailable(
                f"{exc}; then: gitrun resume {self.state.run_id} "
                "(or resume with --isolation auto to run the tests unconfined)"
            ) from exc

    def _secrets(self) -> Secrets:
        """The workspace, the keyring and the repository's common dir: never shown to tests."""
        dirs = [*self.secrets.dirs, gitstore.common_dir(self.env.repo)]
        files = list(self.secrets.files)
        if os.environ.get("GITRUN_HOME"):
            dirs.append(Path(os.environ["GITRUN_HOME"]))
        if os.environ.get("GITRUN_KEY_FILE"):
            files.append(Path(os.environ["GITRUN_KEY_FILE"]))
        return Secrets(tuple(dirs), tuple(files))


def _every(seconds: float, say: Say) -> Say:
    """``say``, but at most once per ``seconds`` (progress of a long test run)."""
    last = [time.monotonic()]

    def throttled(line: str) -> None:
        now = time.monotonic()
        if now - last[0] >= seconds:
            last[0] = now
            say(line)

    return throttled


def initial_state(
    *,
    run_id: str,
    task: Task,
    agent: str,
    worker: str,
    env_state: EnvState,
    lease_version: int,
    scenario_parts: dict[str, str],
) -> RunState:
    from gitrun.core.records import Scope, first_state
    from gitrun.core.task import scenario_fingerprint

    now = time.time()
    p = task.policy
    state = first_state(
        run_id=run_id,
        task=(task.id, task.version),
        policy=(p.id, p.version),
        scenario=(scenario_fingerprint(scenario_parts), scenario_parts),
        agent=agent,
        identity=worker,
        scope=Scope(p.allowed_actions, p.write_allowlist, p.forbidden_paths, p.version),
        env=env_state,
        lease_version=lease_version,
        at=now,
    )
    return state.with_events(Event("started", now, {"worker": worker, "agent": agent}))


def begin(
    *,
    task: Task,
    env: Environment,
    store: CheckpointLog[Any],
    lease: LeaseStore,
    agent: ScriptAgent,
    worker: str,
    base_commit: str,
    scenario_parts: dict[str, str],
    say: Say,
    approvals: Approvals,
    isolation: str | None = None,
    secrets: Secrets | None = None,
    output_log: Path | None = None,
) -> Runtime:
    """Observe a fresh worktree, write checkpoint generation 1, and return the runtime."""
    from gitrun.store.checkpoint import checkpoint_ref

    obs = env.observe(full=True)
    env_state = EnvState(
        obs.instance_id, str(env.worktree), env.branch, base_commit,
        obs.head, obs.tree, obs.status_digest, obs.head, 0,
    )  # fmt: skip
    state = initial_state(
        run_id=env.run_id,
        task=task,
        agent=agent.identity,
        worker=worker,
        env_state=env_state,
        lease_version=lease.fence.version,
        scenario_parts=scenario_parts,
    )
    ref = checkpoint_ref(env.run_id, task.id, obs.instance_id)
    oid = store.advance(ref, state, None, lease.fence)
    # The first checkpoint's events are in the chain: the next one starts a new batch.
    return Runtime(
        task, env, store, ref, lease, agent, replace(state, events=()), oid, say, approvals,
        isolation, secrets or Secrets(), output_log=output_log,
    )  # fmt: skip


def at_checkpoint(
    *,
    task: Task,
    env: Environment,
    store: CheckpointLog[Any],
    ref: str,
    loaded: LoadedCheckpoint[Any],
    lease: LeaseStore,
    agent: ScriptAgent,
    say: Say,
    approvals: Approvals,
    isolation: str | None = None,
    secrets: Secrets | None = None,
    output_log: Path | None = None,
) -> Runtime:
    """The runtime on a verified checkpoint of ``store`` (``gitrun resume``, any store).
    Its events are already in the chain: the next checkpoint starts a new batch."""
    return Runtime(
        task, env, store, ref, lease, agent, replace(loaded.state, events=()), loaded.oid,
        say, approvals, isolation, secrets or Secrets(), output_log=output_log,
    )  # fmt: skip
