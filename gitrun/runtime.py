"""The runtime: the step protocol of DESIGN.md §3 as a state machine over checkpoints.

Each transition builds the next :class:`RunState`, and :meth:`Runtime.commit` makes it
durable (validated, signed, compare-and-swapped, fenced by the lease). A crash between
any two lines leaves a checkpoint from which :mod:`gitrun.recovery` continues exactly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pygit2

from gitrun import faults, gitstore, sandbox
from gitrun.agents import Finish, ScriptAgent
from gitrun.approvals import Approvals
from gitrun.checkpoint import CheckpointStore
from gitrun.codec import encode
from gitrun.environment import Environment, Observation
from gitrun.errors import (
    EnvironmentDrift,
    Frozen,
    GateRejected,
    GitrunError,
    ReceiptConflict,
    ReceiptDrift,
)
from gitrun.exec_step import ExecContext, ExecRefused
from gitrun.gate import Gate
from gitrun.lease import LeaseManager
from gitrun.records import (
    AWAITING_APPROVAL,
    DONE,
    EXEC,
    FAILED,
    NEEDS_REVIEW,
    RUNNING,
    Budgets,
    EnvState,
    Event,
    Pending,
    Precondition,
    Receipt,
    ReviewCase,
    RunState,
    VerifierEvent,
    new_key,
)
from gitrun.sandbox import CommandCannotStart, Confinement
from gitrun.shell import Hidden
from gitrun.task import Task
from gitrun.verifier import Secrets, VerifierResult, verify_tree

Say = Callable[[str], None]
AGENT_WRITE_REFUSED = "agent_write_refused"  # stop reason: the agent's last write was refused
INDEX_SYNC_EVERY = 32  # writes between two syncs of the worktree's index (O(files) each)


@dataclass
class Runtime:
    task: Task
    env: Environment
    store: CheckpointStore
    ref: str
    lease: LeaseManager
    agent: ScriptAgent
    state: RunState
    checkpoint: pygit2.Oid | None
    say: Say
    approvals: Approvals
    isolation: str | None = None  # the command line's --isolation; None: the task's
    secrets: Secrets = field(default_factory=Secrets)  # hidden from the code under test
    abandoned: GateRejected | None = None  # why the last pending action was dropped (sessions)

    def __post_init__(self) -> None:
        self._segment_start = time.time()
        self.gate = Gate(self.task, self.env.worktree, self.env.repo)

    # -- durability --------------------------------------------------------------------

    def commit(self, state: RunState) -> None:
        """Make ``state`` the next checkpoint (generation + 1)."""
        now = time.time()
        used = replace(
            state.budgets, wall_seconds=state.budgets.wall_seconds + (now - self._segment_start)
        )
        fence = self.lease.fence
        nxt = replace(
            state,
            generation=self.state.generation + 1,
            budgets=used,
            identity=self.lease.worker,
            lease_version=fence.version,
            updated_at=now,
        )
        self.checkpoint = self.store.advance(self.ref, nxt, self.checkpoint, fence)
        self._segment_start = now
        self.state = replace(nxt, events=())
        self.lease.maybe_renew(self.state.generation)

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
        s = self.state
        if s.phase == AWAITING_APPROVAL and s.pending is not None:
            return (
                f"run {s.run_id} waits for approval of {s.pending.action.summary()} "
                f"(risk: {s.pending.risk}; {s.stop_reason}); approve with: "
                f"gitrun approve {s.run_id} --key APPROVER.key, then: "
                f"gitrun resume {s.run_id} --trust-roots TRUST_ROOTS.json"
            )
        if s.phase == NEEDS_REVIEW and s.review is not None:
            return (
                f"run {s.run_id} needs review ({s.review.reason}) for key {s.review.key}; "
                f"see: gitrun review show {s.run_id}"
            )
        return f"run {s.run_id} is {s.phase} ({s.stop_reason})"

    def step(self) -> None:
        """Observe, propose, gate, and persist the intent (or the rejection)."""
        faults.point("before_propose")
        s = self.state
        if s.phase != RUNNING or s.pending is not None:
            raise Frozen(f"run {s.run_id} is {s.phase}; no new proposal is accepted")
        obs = self.env.observe(full=False)
        decision = self.agent.propose(obs, s.cursor)
        if isinstance(decision, Finish):
            self.verify()
            return
        tree = self.env.head().tree
        try:
            action = self.gate.check(decision, tree, s.budgets, self._segment_start)
        except GateRejected as exc:
            self._rejected(decision.summary(), exc)
            return
        budgets = replace(s.budgets, proposals=s.budgets.proposals + 1)
        risk = self.gate.risk(action)
        pending = Pending(
            action=action,
            key=self.agent.proposal_key() or new_key(),  # a session client's own key
            intent_digest=action.intent_digest(),
            risk=risk,
            precondition=Precondition(obs.instance_id, obs.head, obs.tree),
            approval=None,
            proposed_at=time.time(),
        )
        event = Event(
            "intent",
            time.time(),
            {
                "key": pending.key,
                "action": action.summary(),
                "digest": pending.intent_digest,
                "risk": risk,
            },
        )
        nxt = replace(s, pending=pending, cursor=s.cursor + 1, budgets=budgets).with_events(event)
        if risk is not None:
            nxt = replace(nxt, phase=AWAITING_APPROVAL, stop_reason="awaiting_approval")
        self.commit(nxt)
        self.say(
            f"intent {pending.key}: {action.summary()}"
            + (f" [needs approval: {risk}]" if risk else "")
        )
        faults.point("after_intent_checkpoint")

    def _rejected(self, summary: str, exc: GateRejected) -> None:
        s = self.state
        event = Event(
            "gate_rejected",
            time.time(),
            {"rule": exc.rule, "message": exc.message, "action": summary},
        )
        self.say(f"gate rejected {summary}: {exc.message}")
        if exc.rule.startswith("budget-"):
            self.commit(replace(s, phase=FAILED, stop_reason="budget_exhausted").with_events(event))
            return
        budgets = replace(s.budgets, proposals=s.budgets.proposals + 1)
        nxt = replace(s, cursor=s.cursor + 1, budgets=budgets).with_events(event)
        last = self.agent.is_last(s.cursor)
        if last:
            # The agent's last write did not land, so HEAD is not its work: a verifier
            # pass now would call a refused change done. An earlier refusal may be
            # recovered from by the writes after it (a plan's later steps).
            nxt = replace(nxt, phase=FAILED, stop_reason=AGENT_WRITE_REFUSED)
        self.commit(nxt)
        if last:
            self.say(f"run {s.run_id} failed: the agent's last write was refused ({exc.rule})")

    def execute_pending(self) -> None:
        """Execute the pending intent with its own key (windows 2 and 3), then record it.

        A write not yet made is gated again first, against its precondition tree (and,
        inside the adapter, against the disk as it is now): a policy rejection abandons
        it, drift on disk refuses and leaves it pending for after the human's fix.
        """
        s = self.state
        p = s.pending
        if p is None:
            raise GitrunError("no pending action to execute")
        if s.phase != RUNNING:
            raise Frozen(self.frozen_message())
        found = self.env.lookup(p.key, since=p.precondition.head)
        if found is not None:
            self.accept(found, replayed=True)
            return
        tree = self.env.repo.get(p.precondition.tree)
        if not isinstance(tree, pygit2.Tree):
            raise EnvironmentDrift(
                "tree-missing", f"the intent's tree {p.precondition.tree} is gone"
            )
        try:
            self.gate.check_action(p.action, tree, on_disk=False)
        except GateRejected as exc:
            self._abandon(exc)
            return
        approval = self.approvals.binding(self, p) if p.risk is not None else None
        shell = self.exec_context() if p.action.kind == EXEC else None
        try:
            outcome = self.env.execute(
                p.action, p.key, p.intent_digest, p.precondition, self.lease.fence, approval,
                shell=shell,
            )  # fmt: skip
        except ReceiptConflict as conflict:
            self.open_review(conflict.receipt, "same idempotency key, different intent digest")
            return
        except ExecRefused as exc:  # the command's change broke a rule; the worktree is back
            self._abandon(exc)
            return
        self.accept(outcome.receipt, replayed=outcome.replayed)

    def exec_context(self) -> ExecContext:
        """How an exec step runs: confined as the verifier is, the lease kept renewed."""
        hide = self._secrets()
        return ExecContext(
            self.gate,
            self._confinement(),
            Hidden(hide.dirs, hide.files),
            heartbeat=lambda: self.lease.maybe_renew(self.state.generation),
        )

    def _abandon(self, exc: GateRejected) -> None:
        """Drop a pending action the gate refuses at execute time: the run goes on."""
        s = self.state
        p = s.pending
        if p is None:
            raise GitrunError("no pending action to abandon")
        self.abandoned = exc
        data = {"rule": exc.rule, "message": exc.message, "action": p.action.summary()}
        event = Event("gate_rejected", time.time(), {**data, "key": p.key, "at": "execute"})
        self.say(f"gate rejected pending {p.action.summary()}: {exc.message}; abandoned")
        self.commit(replace(s, pending=None).with_events(event))

    def accept(self, receipt: Receipt, replayed: bool) -> None:
        """Record a receipt, unless it cannot be reconciled without a human."""
        p = self.state.pending
        if p is not None and receipt.intent_digest != p.intent_digest:
            self.open_review(receipt, "same idempotency key, different intent digest")
            return
        if p is not None and p.risk is not None:
            problem = self.approvals.receipt_problem(p, receipt)
            if problem is not None:
                self.open_review(receipt, problem)
                return
        self.record(receipt, replayed)

    def record(self, receipt: Receipt, replayed: bool) -> None:
        """Record the receipt of the pending intent: the deterministic transition."""
        s = self.state
        p = s.pending
        if p is None:
            raise GitrunError("a receipt needs a pending intent")
        if receipt.key != p.key or receipt.intent_digest != p.intent_digest:
            raise ReceiptDrift(
                "not-pending", f"receipt {receipt.commit} is not the pending intent's"
            )
        if (
            receipt.parent != p.precondition.head
            or receipt.instance_id != p.precondition.instance_id
        ):
            raise EnvironmentDrift(
                "foreign-commit",
                f"receipt {receipt.commit} was not made on the intent's precondition",
            )
        env = replace(
            s.env,
            head=receipt.commit,
            tree=receipt.tree,
            observation_version=receipt.commit,
            adapter_generation=s.env.adapter_generation + 1,
        )
        budgets = replace(s.budgets, steps=s.budgets.steps + 1)
        event = Event(
            "receipt",
            time.time(),
            {
                "receipt": encode(receipt),
                "replayed": replayed,
                "fingerprint": receipt.fingerprint(),
            },
        )
        self.commit(
            replace(
                s, pending=None, env=env, budgets=budgets, receipts=s.receipts.add(receipt)
            ).with_events(event)
        )
        how = "reconciled" if replayed else "committed"
        self.say(f"{how} {receipt.commit[:12]} for {receipt.key}")
        if self.state.env.adapter_generation % INDEX_SYNC_EVERY == 0:
            # Bound how far the worktree's index lags, so a full observation (resume,
            # verify) never does work that grows with the length of the run.
            self.env.sync_index()

    def open_review(self, receipt: Receipt, reason: str) -> None:
        s = self.state
        p = s.pending
        if p is None:
            raise GitrunError("a review case needs a pending intent")
        case = ReviewCase(
            action=p.action,
            key=p.key,
            pending_digest=p.intent_digest,
            receipt_digest=receipt.intent_digest,
            receipt=receipt,
            receipt_fingerprint=receipt.fingerprint(),
            environment_version=str(self.env.head().id),
            reason=reason,
            opened_at=time.time(),
        )
        event = Event("receipt_conflict", time.time(), {"case": encode(case)})
        self.commit(
            replace(s, phase=NEEDS_REVIEW, stop_reason="receipt_conflict", review=case).with_events(
                event
            )
        )
        self.say(f"review needed for {p.key}: {reason}; run frozen")

    def verify(self) -> None:
        """Run the verifier on a fresh copy of the last write's tree and finish the run."""
        faults.point("before_verify")
        obs = self.env.observe(full=True)
        if obs.dirty:
            raise EnvironmentDrift(
                "uncommitted-edits", f"uncommitted changes before verify: {list(obs.dirty[:5])}"
            )
        if obs.head != self.state.env.head or obs.tree != self.state.env.tree:
            raise EnvironmentDrift(
                "head-moved", f"HEAD {obs.head} is not the last write {self.state.env.head}"
            )
        confinement = self._confinement()
        where = f"bwrap, network {confinement.network}" if confinement.confined else "none"
        self.say(f"verifier: {' '.join(self.task.verifier.command)} (isolation: {where})")
        try:
            result, made = verify_tree(
                self.task.verifier,
                self.env.repo,
                pygit2.Oid(hex=self.state.env.tree),
                confinement=confinement,
                secrets=self._secrets(),
                heartbeat=lambda: self.lease.maybe_renew(self.state.generation),
                progress=_every(5.0, self.say),
                # several heartbeats per lease, so even a 1 s lease is renewed before it expires
                heartbeat_interval=min(1.0, self.lease.duration / 4),
            )
        except CommandCannotStart as exc:
            self._finish_verify(obs, obs.tree, confinement, None, str(exc))
            return
        faults.point("after_verify")
        if made != self.state.env.tree:
            raise EnvironmentDrift("verifier-tree", f"verified {made}, not {self.state.env.tree}")
        after = self.env.observe(full=True)
        if after.fingerprint() != obs.fingerprint():
            raise EnvironmentDrift(
                "verifier-changed-tree",
                f"the test command changed the worktree: {list(after.dirty[:5])}",
            )
        self._finish_verify(obs, made, confinement, result, result.summary)

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

    def _finish_verify(
        self,
        obs: Observation,
        tree: str,
        confinement: Confinement,
        result: VerifierResult | None,
        summary: str,
    ) -> None:
        """Checkpoint the verdict: done only with a passing result on the last write's tree."""
        passed = result is not None and result.passed
        outcomes = (
            dict(result.outcomes)
            if result is not None
            else dict.fromkeys(self.task.verifier.required, "error")
        )
        event = VerifierEvent(
            obs.head, tree, passed, summary, outcomes, time.time(), confinement.kind
        )
        if result is None:
            phase, reason = FAILED, "verifier_cannot_start"
        else:
            phase, reason = (DONE, "verified") if passed else (FAILED, "verifier_failed")
        s = self.state
        env = replace(s.env, status_digest=obs.status_digest)
        trace = Event(
            "verifier",
            time.time(),
            {
                **encode(event),
                "exit_code": None if result is None else result.exit_code,
                "timed_out": result is not None and result.timed_out,
                "network": confinement.network,
                **({} if confinement.confined else {"unconfined_because": confinement.reason}),
            },
        )
        self.commit(
            replace(s, phase=phase, stop_reason=reason, verifier=event, env=env).with_events(trace)
        )
        self.say(f"verifier: {summary}")


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
    from gitrun.records import SCHEMA_VERSION, ReceiptLog, Scope
    from gitrun.task import scenario_fingerprint

    now = time.time()
    p = task.policy
    state = RunState(
        schema=SCHEMA_VERSION,
        run_id=run_id,
        task_id=task.id,
        task_version=task.version,
        policy_id=p.id,
        policy_version=p.version,
        scenario_fingerprint=scenario_fingerprint(scenario_parts),
        scenario_parts=scenario_parts,
        agent=agent,
        identity=worker,
        generation=1,
        phase=RUNNING,
        stop_reason=None,
        cursor=0,
        budgets=Budgets(),
        scope=Scope(p.allowed_actions, p.write_allowlist, p.forbidden_paths, p.version),
        env=env_state,
        lease_version=lease_version,
        pending=None,
        receipts=ReceiptLog(),
        quarantined_keys=(),
        used_nonces=(),
        review=None,
        sealed=(),
        verifier=None,
        events=(),
        trace_count=0,
        trace_chain="",
        started_at=now,
        updated_at=now,
    )
    return state.with_events(Event("started", now, {"worker": worker, "agent": agent}))


def begin(
    *,
    task: Task,
    env: Environment,
    store: CheckpointStore,
    lease: LeaseManager,
    agent: ScriptAgent,
    worker: str,
    base_commit: str,
    scenario_parts: dict[str, str],
    say: Say,
    approvals: Approvals,
    isolation: str | None = None,
    secrets: Secrets | None = None,
) -> Runtime:
    """Observe a fresh worktree, write checkpoint generation 1, and return the runtime."""
    from gitrun.checkpoint import checkpoint_ref

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
        isolation, secrets or Secrets(),
    )  # fmt: skip
