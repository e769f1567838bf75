"""Agent runs as Ray tasks: a trainer's rollouts as gitrun runs (the ``ray`` extra).

A trainer or orchestrator hands :func:`submit` one :class:`AgentRun` (the task, the run id,
an agent spec or a session callback, the remote) and gets a Ray ``ObjectRef`` of the run's
:class:`RunOutcome`: its phase, the verifier's verdict, and its receipts (one per write
step, as ``gitrun receipts`` lists them). :func:`run_many` runs a batch of them and
returns the outcomes in order. The same :func:`run_here` runs one in this process,
without Ray.

A Ray task that dies (its worker killed, its node lost) is retried by Ray with the same
run id: gitrun continues the run from its last checkpoint, and a write step that had
committed is replayed from its receipt, never done twice. A session callback is called
again from its start; the keys of :func:`gitrun.integrations.session_client.step_key`
make its repeated requests replays. A run id is one rollout: give each rollout its own.

No secret travels through Ray: the run names its key file (``key_file``, a path each node
reads on its own disk), never the key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gitrun.core.errors import BadInput
from gitrun.integrations.ray_cluster import connected, node_name, require_ray
from gitrun.integrations.session_client import SessionClient, SessionOptions

if TYPE_CHECKING:
    from gitrun.app.opening import Options

Session = Callable[[SessionClient], object]  # the agent: drives the run through its session


@dataclass(frozen=True)
class AgentRun:
    """One run: what ``gitrun run TASK --run-id ID --agent SPEC`` would be given."""

    task_dir: str
    run_id: str
    agent: str = "plan"  # plan, plan:FILE, patch:FILE or cmd:COMMAND; unused with a session
    repo: str | None = None  # default: the task's own repository
    remote: str | None = None  # the shared git remote holding the run (any node resumes it)
    workspace: str | None = None  # default: GITRUN_HOME / the user's data dir, on the node
    key_file: str | None = None  # the checkpoint keyring's path on the node (never its bytes)
    lease_seconds: float = 30.0
    isolation: str | None = None  # auto, required or none (default: the task's)


@dataclass(frozen=True)
class RunOutcome:
    """What a run came to, as its verified checkpoint says."""

    run_id: str
    phase: str  # done, failed, awaiting_approval, needs_review, running (its agent left)
    stop_reason: str | None
    passed: bool  # the verifier passed at the last HEAD
    summary: str  # the verifier's one line ("" before any verdict)
    outcomes: dict[str, str]  # required test -> passed / failed / ...
    head: str  # the run's branch head commit
    receipts: tuple[dict[str, Any], ...]  # one per write step, oldest first
    node: str  # the host the run ended on

    @property
    def reward(self) -> float:
        """1.0 when the verifier passed, else 0.0: the simplest reward an RL loop takes."""
        return 1.0 if self.passed else 0.0


def run_here(run: AgentRun, session: Session | None = None) -> RunOutcome:
    """Run (or continue) ``run`` in this process and return its outcome; with ``session``
    the callback drives it through ``gitrun session`` (what each Ray task calls)."""
    from gitrun.app import service
    from gitrun.app.opening import cli_options

    workspace = Path(run.workspace) if run.workspace else None
    key_file = Path(run.key_file) if run.key_file else None
    opts = cli_options(workspace, key_file, lease_seconds=run.lease_seconds,
                       isolation=run.isolation, remote=run.remote)  # fmt: skip
    if session is None:
        service.start(Path(run.task_dir), opts, repo_path=Path(run.repo) if run.repo else None,
                      agent_spec=run.agent, run_id=run.run_id)  # fmt: skip
    elif not _finished(run.run_id, opts):  # a retry of a finished rollout: its outcome
        client = SessionClient(SessionOptions(
            Path(run.task_dir), run.run_id, repo=Path(run.repo) if run.repo else None,
            workspace=workspace, key_file=key_file, lease_seconds=run.lease_seconds,
            isolation=run.isolation, remote=run.remote,
        ))  # fmt: skip
        try:
            session(client)
        finally:
            client.close()
    return _outcome(service.status(run.run_id, opts).as_dict())


def _finished(run_id: str, opts: Options) -> bool:
    """Whether this workspace holds run ``run_id`` ended (done or failed)."""
    from gitrun.app import service
    from gitrun.core.errors import UnknownRun
    from gitrun.core.records import TERMINAL

    try:
        return service.status(run_id, opts).phase in TERMINAL
    except UnknownRun:
        return False


def _outcome(info: dict[str, Any]) -> RunOutcome:
    verdict = info.get("verifier") or {}
    return RunOutcome(
        run_id=str(info["run_id"]), phase=str(info.get("phase")),
        stop_reason=info.get("stop_reason"), passed=bool(verdict.get("passed")),
        summary=str(verdict.get("summary") or ""), outcomes=dict(verdict.get("outcomes") or {}),
        head=str(info.get("head") or ""), receipts=tuple(info.get("receipts") or ()),
        node=node_name(),
    )  # fmt: skip


def task_options(
    num_cpus: float = 1.0, resources: dict[str, float] | None = None, max_retries: int = 3
) -> dict[str, Any]:
    """The Ray options of a run's task: a killed worker's task is retried (the run
    continues), a gitrun error is not (it is the run's answer)."""
    return {"num_cpus": num_cpus, "resources": resources or {}, "max_retries": max_retries,
            "retry_exceptions": False}  # fmt: skip


def submit(
    run: AgentRun,
    session: Session | None = None,
    *,
    num_cpus: float = 1.0,
    resources: dict[str, float] | None = None,
    max_retries: int = 3,
) -> Any:
    """``run`` as a Ray task on the cluster this process is connected to (``ray.init``
    first); a Ray ``ObjectRef`` of its :class:`RunOutcome` (``ray.get`` raises what the
    run raised: a :class:`gitrun.core.errors.GitrunError` is in ``.cause``)."""
    ray = require_ray("gitrun.integrations.ray_runs")
    task = ray.remote(run_here).options(
        name=f"gitrun-run:{run.run_id}", **task_options(num_cpus, resources, max_retries)
    )
    return task.remote(run, session)


def run_many(
    runs: Sequence[AgentRun],
    sessions: Sequence[Session | None] | None = None,
    *,
    address: str | None = None,
    num_cpus: float = 1.0,
    local_cpus: int | None = None,
) -> list[RunOutcome]:
    """Every run's outcome, in order, each run a Ray task (``sessions[i]``, if given, drives
    ``runs[i]``): on the cluster at ``address``, the one this process is connected to, or
    a local one of ``local_cpus`` CPUs started for the call."""
    drivers = list(sessions) if sessions is not None else [None] * len(runs)
    if len(drivers) != len(runs):
        raise BadInput(f"run_many: {len(runs)} runs but {len(drivers)} sessions")
    with connected(address, local_cpus, "gitrun.integrations.ray_runs") as ray:
        refs = [submit(r, s, num_cpus=num_cpus) for r, s in zip(runs, drivers, strict=True)]
        outcomes: list[RunOutcome] = ray.get(refs)
    return outcomes
