"""``gitrun swebench … --remote URL --executor ray``: a shared batch as Ray tasks.

The unit is one instance: one Ray task claims it on the remote, evaluates it as a gitrun
run on the node Ray placed it on, and lands its result there (the same claim, heartbeat
and fenced landing as :mod:`gitrun.app.swebench_remote`, for this one instance). Ray's
resources place the work (``num_cpus`` per instance; optionally a custom resource per
environment spec, so an instance runs where its environment is built), and Ray retries a
task whose worker died. The git remote stays the only truth: a retried task that finds its
instance done returns that result; one that finds it claimed by a dead attempt waits for
the claim to expire and takes it over (the instance's gitrun run continues from its last
checkpoint on that node); a landing fenced by a lost claim is refused as a whole. So a
task that runs twice, in part or whole, lands at most one result.

The driver claims nothing: it publishes the batch's queue, submits one task per instance
not yet done, shows progress from the remote (claims as ``running``, results as they
land) and writes each instance's log files from the remote's signed records, as every
worker of a shared batch does. Killed and started again, it submits the instances not
done, and the report comes out the same.

No secret travels through Ray: a task's arguments are the batch's context (paths, the
remote's URL, the run id) and the instance; each node reads the batch's shared key from
its own file (``--key-file``, the same path on every node).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gitrun.app import swebench_env
from gitrun.app.swebench_queue import CLAIMED, DONE, Entry, Queue
from gitrun.app.swebench_remote import Heartbeat, Pool, Shared, open_queue, write_logs
from gitrun.app.swebench_repos import find_repo
from gitrun.app.swebench_run import EMPTY, Context, Job, gitrun_run_id, log_dir
from gitrun.app.workspace import Workspace
from gitrun.core.codec import digest
from gitrun.core.errors import BadInput, Exit, GitrunError
from gitrun.integrations.ray_cluster import connected, node_name, require_ray

Shown = Callable[[str, dict[str, Any] | None], None]  # (instance id, its result or None)
WHAT = "--executor ray"
TASK_PREFIX = "gitrun-swebench:"  # a task's name (and its worker's process title: ray::NAME)
POLL_SECONDS = 2.0  # how often the driver reads the remote for progress while tasks run


class OnNode(GitrunError):
    """A gitrun error raised in a Ray task, as the driver reports it (same exit code)."""

    def __init__(self, exit_code: Exit, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def env_resource(job: Job) -> str:
    """The custom Ray resource naming the test environment ``job`` runs in: the digest of
    what the environment is built from (its spec, the repository and version, the base
    commit where the spec installs the repository), as the environment cache names it.
    Give it to the nodes that have that environment built."""
    built = swebench_env.env_spec(job.spec, job.inst, job.inst.base_commit)
    return "gitrun-env-" + digest(built).split(":")[-1][:12]


def _objects_dir(repo_dir: Path) -> Path:
    """The object directory of the repository at ``repo_dir`` (its common git dir's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    done = subprocess.run(
        ["git", "-C", str(repo_dir), "rev-parse", "--path-format=absolute", "--git-common-dir"],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise BadInput(f"{repo_dir} is not a git repository: {done.stderr.strip()[:200]}")
    return Path(done.stdout.strip()) / "objects"


def settle(ctx: Context, job: Job, rid: str) -> dict[str, Any]:
    """Run on a Ray node: see instance run ``rid`` done on the remote — claim it and
    evaluate it here, or wait out another's claim — and return its result as landed."""
    queue = open_queue(ctx)
    ws = Path(ctx.workspace) if ctx.workspace else Workspace().root
    repo_dir = find_repo(Path(ctx.repos), job.inst.repo, ws, job.inst.base_commit)
    queue.borrow([_objects_dir(repo_dir)])  # the landing push sends the run's branch
    iid = job.inst.instance_id
    seen: list[dict[str, Any]] = []
    shared = Shared(ctx, queue, {rid: job}, lambda _, out: seen.append(out) if out else None)
    heart, pool = Heartbeat(queue, ctx.claim_seconds / 3), Pool(ctx, 1)
    heart.start()
    try:
        shared.loop(pool, heart, queue.refresh())
    finally:
        pool.close()
        heart.give_back()
    last = seen[-1] if seen else {}
    return {"instance_id": iid, "result": shared.results[iid], "reason": last.get("reason"),
            "node": node_name(), "worker": queue.worker}  # fmt: skip


@dataclass
class _Watch:
    """The driver's view of the batch on the remote: what it showed, and each result."""

    ctx: Context
    queue: Queue
    runs: dict[str, Job]
    show: Shown
    running: set[str] = field(default_factory=set)
    results: dict[str, str] = field(default_factory=dict)  # instance id -> result

    def take_in(self, entries: dict[str, Entry]) -> None:
        now = time.time()
        for rid, entry in sorted(entries.items()):
            job = self.runs.get(rid)
            if job is None:
                continue
            iid = job.inst.instance_id
            if entry.state == DONE and iid not in self.results:
                self.results[iid] = str((entry.result or {}).get("result"))
                write_logs(log_dir(self.ctx, job.pred.model, iid), self.queue.files(entry))
                self.show(iid, {"instance_id": iid, "result": self.results[iid],
                                "reason": f"evaluated by {entry.owner}"})  # fmt: skip
            elif entry.state == CLAIMED and entry.live(now) and iid not in self.running:
                self.running.add(iid)
                self.show(iid, None)

    @staticmethod
    def landed(entry: Entry | None) -> bool:
        return entry is not None and entry.state == DONE

    def done(self) -> bool:
        return len(self.results) == len(self.runs)


@dataclass(frozen=True)
class RayExecutor:
    """Runs a shared batch's instances as Ray tasks (``run_shared``'s signature)."""

    address: str | None = None  # None: a local cluster of --max-workers CPUs, started here
    cpus: float = 1.0  # CPUs each instance's task asks for
    env_resources: bool = False  # each instance also asks for its environment's resource
    retries: int = 3  # Ray's retries of a task whose worker died

    def placement(self, job: Job) -> dict[str, Any]:
        """The Ray options of ``job``'s task: its name, resources and retries."""
        opts: dict[str, Any] = {
            "name": TASK_PREFIX + job.inst.instance_id,
            "num_cpus": self.cpus,
            "max_retries": self.retries,
            "retry_exceptions": False,  # a gitrun error is an answer, not a crash
        }
        if self.env_resources:
            opts["resources"] = {env_resource(job): 0.001}
        return opts

    def __call__(self, ctx: Context, jobs: list[Job], manifest: dict[str, Any], workers: int,
                 show: Shown) -> dict[str, str]:  # fmt: skip
        """Every instance's result once the whole batch is done on the remote."""
        require_ray(WHAT)  # before anything is published
        if ctx.remote is None:
            raise BadInput(
                "--executor ray needs --remote URL: the batch's git remote, which every Ray "
                "node reaches, is where instances are claimed and results land (a bare "
                "repository's path will do on one machine)"
            )
        queue = open_queue(ctx)
        runs = {gitrun_run_id(ctx, j)[0]: j for j in jobs if j.pred.patch and j.pred.patch.strip()}
        for job in jobs:
            if job not in runs.values():
                show(job.inst.instance_id, {"instance_id": job.inst.instance_id, "result": EMPTY})
        queue_doc = manifest | {"runs": sorted(runs)}
        watch = _Watch(ctx, queue, runs, show)
        if all(watch.landed(e) for e in (queue.refresh().get(r) for r in runs)):
            watch.take_in(queue.manifest(queue_doc))  # the report from the remote alone
            return watch.results
        with connected(self.address, workers, WHAT) as ray:  # refused before publishing
            self._check_resources(ray, list(runs.values()))
            entries = queue.manifest(queue_doc)
            watch.take_in(entries)
            task = ray.remote(settle)
            pending = {
                task.options(**self.placement(job)).remote(ctx, job, rid): rid
                for rid, job in sorted(runs.items())
                if not watch.landed(entries.get(rid))
            }
            try:
                self._follow(ray, pending, queue, watch)
            except BaseException:
                for ref in pending:  # each gives its claim back on its way out
                    ray.cancel(ref)
                raise
        return watch.results

    def _follow(self, ray: Any, pending: dict[Any, str], queue: Queue, watch: _Watch) -> None:
        read = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_SECONDS)
            for ref in ready:
                self._result(ray, ref, watch.runs[pending.pop(ref)])
            if ready or time.monotonic() - read >= POLL_SECONDS:
                watch.take_in(queue.refresh())
                read = time.monotonic()
        watch.take_in(queue.refresh())
        if not watch.done():  # every task returned only once its instance was done there
            missing = sorted(j.inst.instance_id for j in watch.runs.values()
                             if j.inst.instance_id not in watch.results)  # fmt: skip
            raise GitrunError(f"the remote holds no result for {', '.join(missing[:5])}")

    def _result(self, ray: Any, ref: Any, job: Job) -> None:
        """Raise what a task that ended without a result raised (after Ray's retries)."""
        from ray.exceptions import RayError, RayTaskError

        try:
            ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, GitrunError):
                where = f"on Ray node {exc.ip}" if getattr(exc, "ip", None) else "on Ray"
                raise OnNode(cause.exit_code, f"{job.inst.instance_id} {where}: {cause}") from exc
            raise GitrunError(
                f"{job.inst.instance_id}: its Ray task failed: {type(cause).__name__}: {cause}"
            ) from exc
        except RayError as exc:
            raise GitrunError(
                f"{job.inst.instance_id}: its Ray task failed {self.retries + 1} times "
                f"({type(exc).__name__}); nothing of it landed unless its result is on the "
                "remote: run the same command again to continue the batch"
            ) from exc

    def _check_resources(self, ray: Any, jobs: list[Job]) -> None:
        """Refuse up front what no node could ever run (Ray would wait for it forever)."""
        have = ray.cluster_resources()
        if float(have.get("CPU", 0)) < self.cpus:
            raise BadInput(
                f"--ray-cpus {self.cpus:g}: the Ray cluster has {have.get('CPU', 0):g} CPUs "
                "in all; ask for fewer per instance or add nodes"
            )
        if not self.env_resources:
            return
        needed = {env_resource(j): j.inst.env_key for j in jobs}
        missing = sorted(n for n in needed if n not in have)
        if missing:
            names = ", ".join(f"{n} ({needed[n]})" for n in missing[:5])
            raise BadInput(
                f"--ray-env-resources: no node of the Ray cluster offers {names}: start "
                "the nodes that have these environments built with `ray start … --resources "
                f"'{{\"{missing[0]}\": 1}}'` (docs/ray.md), or leave out --ray-env-resources"
            )
