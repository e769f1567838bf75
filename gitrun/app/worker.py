"""``gitrun worker``: claim and evaluate a published SWE-bench batch until none is left.

The submitting side publishes a batch once (``gitrun swebench ... --remote URL --publish``,
:func:`publish`): the batch's manifest on the remote (``refs/gitrun/swebench/B/manifest``)
then holds its queue *and* its inputs (the dataset and predictions files as given, the
test spec of every instance, the batch's settings), signed with the batch's shared
checkpoint key. A worker needs only the remote's URL, that key file and its own copy of
the repositories: it reads the inputs from the remote, checks their signature, plans the
batch exactly as the submitter did (the queue it derives must be the published one), and
then is one more worker of the shared batch (:mod:`gitrun.app.swebench_remote`): claims
on the remote, a heartbeat, each result landed in one atomic push fenced by its claim.
When every instance is done on the remote it writes the batch's report and returns; a
worker started after that writes the report at once and evaluates nothing. The remote is
the only truth: any number of workers, started by any scheduler, in any order.

Two entry points for an engine that places work itself (Ray): :func:`run_worker` is one
worker slot (claim until none is left), :func:`run_one_instance` is one instance (claim
it, or wait for whoever holds it; its result either way), both safe to run again after a
crash or a retry: claims, leases and the runs' idempotent starts make a second attempt
land nothing twice.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gitrun.app import swebench
from gitrun.app.inputs import read_input
from gitrun.app.swebench_remote import open_queue, run_shared
from gitrun.app.swebench_repos import find_repo
from gitrun.app.swebench_run import EMPTY, Context, Job, gitrun_run_id
from gitrun.app.workspace import Workspace
from gitrun.core import swebench as core
from gitrun.core.errors import BadInput, CheckpointRejected
from gitrun.core.swebench import Instance
from gitrun.store.remote_git import git_env

__all__ = [
    "Batch",
    "InstanceOutcome",
    "WorkerConfig",
    "open_batch",
    "publish",
    "run_one_instance",
    "run_worker",
]

SCHEMA = 1  # of batch.json, the published settings


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker needs: the remote and the batch on it, this node's repositories
    (``DIR/owner__name`` or ``DIR/owner/name``, bare or not), where the logs and report go,
    and this node's workspace and copy of the batch's key file (defaults: as for every
    gitrun command; ``GITRUN_HOME``, ``GITRUN_KEY_FILE``). ``slots``: instances this worker
    evaluates at once (spawned processes; 1 evaluates inline)."""

    remote: str
    batch: str
    repos: Path
    report_dir: Path = Path()
    workspace: Path | None = None
    key_file: Path | None = None
    slots: int = 1


@dataclass(frozen=True)
class Batch:
    """A published batch as a worker plans it: picklable, no secret in it (the key stays
    in the node's key file; ``context`` names the file)."""

    config: WorkerConfig
    context: Context
    instances: tuple[Instance, ...]
    jobs: tuple[Job, ...]
    submitted: tuple[str, ...]
    run_ids: dict[str, str] = field(default_factory=dict)  # instance id -> gitrun run id

    @property
    def manifest(self) -> dict[str, Any]:
        """The queue every worker derives (the same as ``gitrun swebench --remote``'s)."""
        return {"instances": [i.instance_id for i in self.instances],
                "submitted": list(self.submitted)}  # fmt: skip

    def job(self, instance_id: str) -> Job:
        found = next((j for j in self.jobs if j.inst.instance_id == instance_id), None)
        if found is None:
            raise BadInput(
                f"instance {instance_id} is not in batch {self.config.batch} (or has no "
                "prediction there)"
            )
        return found


@dataclass(frozen=True)
class InstanceOutcome:
    """One instance's result in the batch, whoever evaluated it."""

    instance_id: str
    run_id: str | None  # its gitrun run (None: an empty prediction, never run)
    result: str  # resolved, unresolved, empty_patch or error
    evaluated_here: bool  # False: another worker landed it (or it was done before)


def _remote(req: swebench.Request, workspace: Path | None, key_file: Path | None) -> str:
    remote = req.remote or Workspace(workspace, key_file).config_remote
    if remote is None:
        raise BadInput(
            "--publish needs the batch's shared remote: pass --remote URL (or set remote in "
            "the workspace's config.toml)"
        )
    return remote


def _specs_looked_up(req: swebench.Request, instances: list[Instance]) -> dict[str, Any]:
    """The spec each instance without its own would be tested with, keyed by its
    ``repo@version``: the submitter's spec file, else the installed swebench package's
    map; published, so no node depends on its own copy of either."""
    path = req.specs or req.repos / swebench.SPEC_FILE
    given = core.parse_specs(read_input(path, "--specs")) if path.is_file() else {}
    out: dict[str, Any] = {}
    for inst in instances:
        if inst.spec is not None:
            continue
        spec = given.get(inst.env_key) or given.get(inst.repo)
        spec = spec or swebench.harness_spec(inst.repo, inst.version)
        if spec is not None:
            out[inst.env_key] = spec.to_json()
    return out


def publish(
    req: swebench.Request, workspace: Path | None = None, key_file: Path | None = None
) -> str:
    """Publish the batch ``req`` describes on its remote, for ``gitrun worker``s: its queue
    and its inputs, signed with the batch's key (which must exist). Nothing is evaluated.
    Publishing the same batch again changes nothing; other inputs under the same run id
    are refused by name. The one-line summary."""
    remote = _remote(req, workspace, key_file)
    dataset = read_input(req.dataset, "--dataset")
    gold = req.predictions == core.GOLD
    preds = None if gold else read_input(Path(req.predictions), "--predictions")
    with tempfile.TemporaryDirectory(prefix="gitrun-publish-") as tmp:
        (Path(tmp) / "dataset.jsonl").write_bytes(dataset)
        if preds is not None:
            (Path(tmp) / "predictions.jsonl").write_bytes(preds)
        given = core.GOLD if gold else str(Path(tmp) / "predictions.jsonl")
        planned = replace(req, dataset=Path(tmp) / "dataset.jsonl", predictions=given)
        instances, jobs, submitted = swebench.plan_jobs(planned)
        specs = _specs_looked_up(req, instances)
    wanted = None
    if req.instance_ids:
        wanted = sorted({w for v in req.instance_ids for w in v.replace(",", " ").split()})
    settings = {"schema": SCHEMA, "batch": req.run_id, "claim_seconds": req.lease_seconds,
                "predictions": core.GOLD if gold else "predictions.jsonl",
                "instance_ids": wanted}  # fmt: skip
    inputs = {
        "batch.json": (json.dumps(settings, indent=1, sort_keys=True) + "\n").encode(),
        "dataset.jsonl": dataset,
        "specs.json": (json.dumps(specs, indent=1, sort_keys=True) + "\n").encode(),
    } | ({} if preds is None else {"predictions.jsonl": preds})
    ctx = Context(req.run_id, str(req.repos), str(req.report_dir), _str(workspace),
                  _str(key_file), remote=remote, claim_seconds=req.lease_seconds)  # fmt: skip
    runs = sorted(gitrun_run_id(ctx, j)[0] for j in jobs if j.pred.patch and j.pred.patch.strip())
    queue = open_queue(ctx)
    manifest = {"instances": [i.instance_id for i in instances], "submitted": submitted}
    queue.manifest(manifest | {"runs": runs}, inputs)
    queue.published()  # published before, by another key? the workers would refuse it: exit 5
    return (
        f"batch {req.run_id} published on {remote}: {len(runs)} instance(s) to evaluate, "
        f"{len(instances) - len(runs)} without a prediction to run; start workers with "
        f"`gitrun worker --remote {remote} --batch {req.run_id} --repos DIR`"
    )


def _str(path: Path | None) -> str | None:
    return str(path.resolve()) if path is not None else None


def _settings(files: dict[str, bytes], batch: str) -> dict[str, Any]:
    try:
        doc = json.loads(files["batch.json"])
        claim = float(doc["claim_seconds"])
        ok = doc["schema"] == SCHEMA and doc["batch"] == batch and claim > 0
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointRejected("batch-inputs", f"batch {batch}'s batch.json: {exc}") from exc
    if not ok or "dataset.jsonl" not in files:
        raise CheckpointRejected(
            "batch-inputs", f"batch {batch} was published by another gitrun version (schema "
            f"{doc.get('schema')}, want {SCHEMA}): run workers of the version that published it",
        )  # fmt: skip
    return dict(doc)


@contextmanager
def _published(cfg: WorkerConfig) -> Iterator[tuple[swebench.Request, Batch]]:
    """The published batch, read (its inputs in a temporary directory while the context
    lasts, for :func:`swebench.run_batch` to plan from), checked and planned: the queue
    this gitrun derives must be the published one, and this node's repositories must hold
    every base commit. Nothing is claimed."""
    probe = Context(cfg.batch, str(cfg.repos), str(cfg.report_dir), _str(cfg.workspace),
                    _str(cfg.key_file), remote=cfg.remote)  # fmt: skip
    queue, files = open_queue(probe).published()
    settings = _settings(files, cfg.batch)
    if not cfg.repos.is_dir():
        raise BadInput(f"--repos {cfg.repos}: no such directory (this node's repositories)")
    with tempfile.TemporaryDirectory(prefix="gitrun-worker-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        gold = settings["predictions"] == core.GOLD
        preds = core.GOLD if gold else str(Path(tmp) / "predictions.jsonl")
        req = swebench.Request(
            Path(tmp) / "dataset.jsonl", preds,
            cfg.repos, cfg.batch, cfg.slots, settings["instance_ids"], cfg.report_dir,
            Path(tmp) / "specs.json", cfg.remote, float(settings["claim_seconds"]),
        )  # fmt: skip
        ctx = Context(cfg.batch, str(cfg.repos.resolve()), str(cfg.report_dir.resolve()),
                      _str(cfg.workspace), _str(cfg.key_file), remote=cfg.remote,
                      claim_seconds=req.lease_seconds)  # fmt: skip
        instances, jobs, submitted = swebench.plan_jobs(req)
        run_ids = {j.inst.instance_id: gitrun_run_id(ctx, j)[0] for j in jobs
                   if j.pred.patch and j.pred.patch.strip()}  # fmt: skip
        batch = Batch(cfg, ctx, tuple(instances), tuple(jobs), tuple(submitted), run_ids)
        mine = batch.manifest | {"runs": sorted(run_ids.values())}
        if mine != queue:
            differs = sorted(k for k in {*mine, *queue} if mine.get(k) != queue.get(k))
            raise BadInput(
                f"batch {cfg.batch}'s published inputs give this gitrun another queue than "
                f"the published one ({', '.join(differs)} differ): run the workers with the "
                "gitrun version that published the batch"
            )
        _check_repos(cfg, [j for j in jobs if j.inst.instance_id in run_ids])
        yield req, batch


def open_batch(cfg: WorkerConfig) -> Batch:
    """Read, check and plan the published batch (one fetch; nothing is claimed). Raises
    ``UnknownBatch`` (exit 2) for no such batch, ``RemoteUnavailable`` (9) for a
    remote not reached, ``CheckpointRejected`` (5) for inputs not signed with this
    node's key, ``KeyFileError`` (2) for no key file, ``BadInput`` (2) for a repository
    missing from ``cfg.repos`` or lacking an instance's base commit."""
    with _published(cfg) as (_, batch):
        return batch


def _check_repos(cfg: WorkerConfig, jobs: list[Job]) -> None:
    """Every instance's base commit is in this node's repositories; else one line, exit 2,
    before anything is claimed (an instance run on a clone without its base commit would
    land an ``error`` verdict for the whole batch)."""
    root = Workspace(cfg.workspace, cfg.key_file).root
    wanted: dict[str, set[str]] = {}
    for job in jobs:
        wanted.setdefault(job.inst.repo, set()).add(job.inst.base_commit)
    for repo, commits in sorted(wanted.items()):
        path = find_repo(cfg.repos, repo, root, min(commits))  # a bare one: its working clone
        done = subprocess.run(
            ["git", "-C", str(path), "cat-file", "--batch-check"], env=git_env(),
            input="".join(f"{c}^{{commit}}\n" for c in sorted(commits)), capture_output=True,
            text=True, check=False, timeout=300,
        )  # fmt: skip
        missing = [line.split()[0] for line in done.stdout.splitlines() if "missing" in line]
        if done.returncode != 0 or missing:
            first = missing[0].removesuffix("^{commit}") if missing else "?"
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise BadInput(
                f"repository {repo} in {path} lacks the base commit {first}{more} of this "
                "batch: update this node's clone (git fetch), then start the worker again; "
                "nothing was claimed"
            )


def run_worker(cfg: WorkerConfig, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One worker of the published batch: claim and evaluate until every instance is done
    on the remote, then write the batch's report (the same on every worker) and return it
    (``report_file``, ``line``, ``error_lines`` added, as ``gitrun swebench`` returns).
    Progress lines go to ``say``. Safe to start any number of times, anywhere."""
    with _published(cfg) as (req, _):
        return swebench.run_batch(req, cfg.workspace, cfg.key_file, say)


def run_one_instance(
    cfg: WorkerConfig, instance_id: str, batch: Batch | None = None
) -> InstanceOutcome:
    """Claim and evaluate one instance of the batch, land its result, and return it; when
    another worker holds it, wait for its result (taking it over if that worker's claim
    expires); when it is done already, return that. Its log files are written under
    ``cfg.report_dir`` either way. Pass ``batch`` (from :func:`open_batch`) to skip
    re-reading the inputs. Once every instance is done, :func:`run_worker` writes the
    batch's report at once, evaluating nothing."""
    batch = batch or open_batch(cfg)
    job = batch.job(instance_id)
    rid = batch.run_ids.get(instance_id)
    if rid is None:
        return InstanceOutcome(instance_id, None, EMPTY, False)
    seen: dict[str, Any] = {}

    def show(iid: str, out: dict[str, Any] | None) -> None:
        if out is not None and iid == job.inst.instance_id and out.get("result") != "lost":
            seen.update(out)

    ctx = replace(batch.context, repos=str(cfg.repos.resolve()),
                  report_dir=str(cfg.report_dir.resolve()))  # fmt: skip
    results = run_shared(ctx, list(batch.jobs), batch.manifest, 1, show, only={rid})
    here = seen.get("reason") == "evaluated here"
    return InstanceOutcome(instance_id, rid, results[instance_id], here)
