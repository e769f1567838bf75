"""``gitrun swebench``: a batch of SWE-bench instances, each one gitrun run, and the reports.

Workers are processes started with ``spawn`` (never ``fork``: libgit2 holds locks and
threads). An instance whose gitrun run another batch command holds is retried until that
run ends, then reported from its final checkpoint: two commands on one run id share the
work and never evaluate an instance twice.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gitrun.app import swebench_env
from gitrun.app.inputs import read_input
from gitrun.app.swebench_progress import Display, Lines, display
from gitrun.app.swebench_run import BUSY, ERROR, Context, Job, evaluate, log_dir
from gitrun.app.workspace import Workspace
from gitrun.core import swebench
from gitrun.core.errors import BadInput
from gitrun.core.swebench import Instance, RepoSpec
from gitrun.store.atomicfile import atomic_write

SPEC_FILE = "gitrun-swebench.json"
__all__ = ["SPEC_FILE", "Executor", "Request", "display", "plan_jobs", "run_batch", "spread_ids"]
IDS_OPTION = "--instance-ids"


def spread_ids(argv: list[str]) -> list[str]:
    """``swebench --instance-ids A B`` as the harness spells it: each value after the
    option (up to the next option) becomes its own ``--instance-ids``, which Typer takes
    repeated; other command lines are returned unchanged."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] != "swebench" or IDS_OPTION not in argv:
        return argv
    out: list[str] = []
    taking = False
    for arg in argv:
        if arg == "--":
            taking = False
        elif arg.startswith("-"):
            taking = arg == IDS_OPTION
        elif taking and out[-1] != IDS_OPTION:
            out.append(IDS_OPTION)
        out.append(arg)
    return out


@dataclass(frozen=True)
class Request:
    dataset: Path
    predictions: str  # a path, or "gold"
    repos: Path
    run_id: str
    max_workers: int = 1
    instance_ids: Sequence[str] | None = None
    report_dir: Path = Path()
    specs: Path | None = None  # default: REPOS/gitrun-swebench.json
    remote: str | None = None  # shared with workers elsewhere through this git remote
    lease_seconds: float = 30.0  # how long an instance's claim (and run lease) lasts


def _read(path: Path, what: str) -> bytes:
    return read_input(path, f"--{what}")  # ``-``: standard input


def _specs(req: Request) -> dict[str, RepoSpec]:
    path = req.specs or req.repos / SPEC_FILE
    return swebench.parse_specs(_read(path, "specs")) if path.is_file() else {}


def plan_jobs(req: Request) -> tuple[list[Instance], list[Job], list[str]]:
    """The instances selected, a job for each predicted one, and the submitted ids."""
    swebench.safe_component(req.run_id, "--run-id")
    instances = list(swebench.parse_instances(_read(req.dataset, "dataset"), str(req.dataset)))
    data = None if req.predictions == swebench.GOLD else _read(Path(req.predictions), "predictions")
    preds = swebench.parse_predictions(data, instances)  # every id must be in the dataset
    if req.instance_ids:
        # each value may hold several ids, space- or comma-separated (the harness's nargs)
        wanted = {w for v in req.instance_ids for w in v.replace(",", " ").split()}
        unknown = sorted(wanted - {i.instance_id for i in instances})
        if unknown:
            raise BadInput(f"--instance-ids: {unknown[0]} is not in {req.dataset}")
        instances = [i for i in instances if i.instance_id in wanted]
    specs, jobs = _specs(req), []
    for inst in instances:
        pred = preds.get(inst.instance_id)
        if pred is None:
            continue
        spec, directives = inst.spec or specs.get(inst.env_key) or specs.get(inst.repo), None
        if spec is None:  # the package's spec, and its own test directives with it
            spec = harness_spec(inst.repo, inst.version)
            directives = None if spec is None else harness_directives(inst)
        if inst.spec is None:
            spec = _with_eval_script(inst, spec)
        if spec is None:
            raise BadInput(
                f"instance {inst.instance_id}: no test_cmd in the record, no entry for "
                f"{inst.env_key} or {inst.repo} in {req.specs or req.repos / SPEC_FILE}, none "
                "in the installed swebench package's spec map, and no eval_script"
            )
        jobs.append(Job(inst, pred, spec, directives))
    # submitted, as the harness counts it: every prediction of the file (those outside
    # --instance-ids too); gold: the instances selected
    submitted = sorted(preds) if data is not None else [j.inst.instance_id for j in jobs]
    return instances, jobs, submitted


def harness_spec(repo: str, version: str) -> RepoSpec | None:
    """The installed ``swebench`` package's spec for ``repo`` at ``version`` (4.x's
    ``MAP_REPO_VERSION_TO_SPECS``; 5.x has no such map), the test directives on, as
    the harness runs them; None without the package or the entry."""
    try:
        from swebench.harness import constants  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    table = getattr(constants, "MAP_REPO_VERSION_TO_SPECS", None)
    entry = table.get(repo, {}).get(version) if isinstance(table, dict) else None
    if not isinstance(entry, dict):
        return None
    spec = swebench.spec_from(entry, f"swebench's spec for {repo}@{version}", strict=False)
    return None if spec is None else replace(spec, directives=True)


def harness_directives(inst: Instance) -> tuple[str, ...] | None:
    """The test directives the installed ``swebench`` 4.x package's own
    ``get_test_directives`` gives for ``inst`` (the harness appends them to its spec's
    test command); None where the package has no such function (5.x)."""
    try:
        from swebench.harness.test_spec.python import (  # type: ignore[import-not-found,unused-ignore]
            get_test_directives,
        )
    except ImportError:
        return None
    row = {"repo": inst.repo, "instance_id": inst.instance_id, "test_patch": inst.test_patch}
    found = get_test_directives(row)
    if not isinstance(found, list) or not all(isinstance(d, str) for d in found):
        return None
    return tuple(found)


def _with_eval_script(inst: Instance, spec: RepoSpec | None) -> RepoSpec | None:
    """A 5.x row's test command (its ``eval_script``'s lines between the harness's markers,
    directives included) in place of the spec's; the spec still builds the environment
    (without one: gitrun's interpreter with nothing installed)."""
    cmd = swebench.eval_script_test_cmd(inst.eval_script) if inst.eval_script else None
    if cmd is None:
        return spec
    return RepoSpec(cmd) if spec is None else replace(spec, test_cmd=cmd, directives=False)


def _context(req: Request, workspace: Path | None, key_file: Path | None) -> Context:
    """With a remote, ``lease_seconds`` is the claim's (other machines take an instance
    over), and each run's own lease (this workspace's alone) keeps its default."""
    ctx = Context(req.run_id, str(req.repos.resolve()), str(req.report_dir.resolve()),
                  str(workspace.resolve()) if workspace else None,
                  str(key_file.resolve()) if key_file else None)  # fmt: skip
    if req.remote is None:
        return replace(ctx, lease_seconds=req.lease_seconds)
    return replace(ctx, remote=req.remote, claim_seconds=req.lease_seconds)


_started: Any = None  # in a worker process: the queue its instance ids go to as they start


def _init_worker(started: Any) -> None:
    global _started  # noqa: PLW0603 - one per spawned worker process, set once
    _started = started


def _work(arg: tuple[Context, Job]) -> dict[str, Any]:
    if _started is not None:
        _started.put(arg[1].inst.instance_id)
    return evaluate(*arg)


Started = Callable[[str], None]


def _rounds(
    ctx: Context, jobs: Sequence[Job], workers: int, started: Started
) -> Iterator[dict[str, Any]]:
    """Every job's result; a job another command holds is tried again after a pause."""
    todo = list(jobs)
    while todo:
        busy: list[Job] = []
        by_id = {j.inst.instance_id: j for j in todo}
        for out in _map(ctx, todo, workers, started):
            if out["result"] == BUSY:
                busy.append(by_id[out["instance_id"]])
            else:
                yield out
        if busy:
            time.sleep(1.0)
        todo = busy


def _map(
    ctx: Context, jobs: Sequence[Job], workers: int, started: Started
) -> Iterator[dict[str, Any]]:
    """Each job's result as it ends; ``started`` hears each instance id as it begins."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            started(job.inst.instance_id)
            yield evaluate(ctx, job)
        return
    mp = multiprocessing.get_context("spawn")
    queue = mp.SimpleQueue()
    with mp.Pool(min(workers, len(jobs)), _init_worker, (queue,)) as pool:
        results = pool.imap_unordered(_work, [(ctx, j) for j in jobs])
        for _ in jobs:
            while True:
                while not queue.empty():
                    started(queue.get())
                try:
                    out: dict[str, Any] = results.next(timeout=0.2)
                except multiprocessing.TimeoutError:
                    continue
                break
            while not queue.empty():  # its start is shown before its result
                started(queue.get())
            yield out


Shown = Callable[[str, dict[str, Any] | None], None]  # (instance id, its result or None)
# How a shared batch runs: this machine's workers (run_shared), or an executor such as Ray's
# (gitrun.integrations.ray_batch), given (ctx, jobs, manifest, max_workers, shown).
Executor = Callable[[Context, list[Job], dict[str, Any], int, Shown], dict[str, str]]


def _shared(ctx: Context, req: Request, instances: list[Instance], jobs: list[Job],
            submitted: list[str], show: Display, shown: Callable[[dict[str, Any]], None],
            counts: dict[str, int], executor: Executor | None) -> None:  # fmt: skip
    """The batch shared with other workers through ``req.remote``."""
    from gitrun.app.swebench_remote import run_shared

    def said(iid: str, out: dict[str, Any] | None) -> None:
        if out is None:
            show.running(iid, counts)
        elif out["result"] == "lost":
            show.update(out, counts)
        else:
            shown(out)

    manifest = {"instances": [i.instance_id for i in instances], "submitted": submitted}
    (executor or run_shared)(ctx, jobs, manifest, req.max_workers, said)


class _Silent(Lines):
    def __init__(self) -> None:
        super().__init__(lambda _: None)


def run_batch(
    req: Request,
    workspace: Path | None = None,
    key_file: Path | None = None,
    say: Callable[[str], None] | None = None,
    executor: Executor | None = None,
) -> dict[str, Any]:
    """Evaluate the batch; write ``<model>.<run_id>.json`` (atomically) and return it, with
    ``report_file`` and a one-line summary (``line``) added. Progress goes to ``say`` (or a
    rich bar on a terminal); ``None`` is silent. An ``executor`` runs a shared batch (one
    with a remote) in place of this machine's workers."""
    instances, jobs, submitted = plan_jobs(req)
    swebench_env.checked_cache_root()  # refused before anything runs, not once per instance
    if req.remote is None:  # the workspace's config.toml may name the batch's remote
        req = replace(req, remote=Workspace(workspace, key_file).config_remote)
    if executor is not None and req.remote is None:
        raise BadInput(
            "this executor runs a shared batch: give --remote URL, the git remote where "
            "instances are claimed and results land (a bare repository's path will do on "
            "one machine)"
        )
    ctx = _context(req, workspace, key_file)
    results: dict[str, str] = {}
    counts = {"done": 0, "resolved": 0, "errors": 0}
    show: Display = _Silent() if say is None else display(say)
    show.start(len(jobs))

    def shown(out: dict[str, Any]) -> None:
        results[out["instance_id"]] = out["result"]
        counts["done"] += 1
        counts["resolved"] += out["result"] == "resolved"
        counts["errors"] += out["result"] == "error"
        show.update(out, counts)

    try:
        if req.remote is not None:
            _shared(ctx, req, instances, jobs, submitted, show, shown, counts, executor)
        else:
            for out in _rounds(ctx, jobs, req.max_workers, lambda i: show.running(i, counts)):
                shown(out)
    finally:
        show.stop()
    failures, errors, kinds = _failures(ctx, jobs, results)
    report = swebench.run_report(instances, submitted, results, failures, errors)
    model = jobs[0].pred.model if jobs else "none"
    path = req.report_dir / f"{model.replace('/', '__')}.{req.run_id}.json"
    atomic_write(path, (json.dumps(report, indent=4) + "\n").encode(), parent_mode=0o755)
    line = (
        f"swebench {req.run_id}: {report['resolved_instances']}/{len(jobs)} resolved, "
        f"{report['empty_patch_instances']} empty, {report['error_instances']} errors; "
        f"report {path}"
    )
    return report | {"report_file": str(path), "line": line, "error_lines": _error_lines(kinds)}


def _failures(
    ctx: Context, jobs: Sequence[Job], results: dict[str, str]
) -> tuple[dict[str, tuple[str, str]], dict[str, str], dict[str, list[tuple[str, str]]]]:
    """From each failed instance's log directory: its ``(reason, tier)`` as the harness
    5.x classifies the logs (gitrun's own kind first: an environment it could not build
    or a read-only write is an environment failure it knows of), gitrun's reason for each
    error, and the errors by kind."""
    failures: dict[str, tuple[str, str]] = {}
    errors: dict[str, str] = {}
    kinds: dict[str, list[tuple[str, str]]] = {}
    for job in jobs:
        iid = job.inst.instance_id
        if results.get(iid) not in ("unresolved", ERROR):
            continue
        where = log_dir(ctx, job.pred.model, iid)
        meta = _json_file(where / "gitrun.json")
        kind, reason = str(meta.get("error_kind") or "other"), str(meta.get("reason") or "?")
        if results[iid] == ERROR:
            errors[iid] = reason
            kinds.setdefault(kind, []).append((iid, reason))
        found = swebench.classify_text("\n".join(
            (where / n).read_text(errors="replace")
            for n in ("test_output.txt", "run_instance.log") if (where / n).is_file()
        ))  # fmt: skip
        if results[iid] == ERROR and kind in ("environment", "read_only_write"):
            found = (kind, swebench.TIER_ENVIRONMENT)
        if found is not None:
            failures[iid] = found
    return failures, errors, kinds


def _json_file(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _error_lines(kinds: dict[str, list[tuple[str, str]]]) -> list[str]:
    """One line per kind of error: how many, which (the first few), and the first reason."""
    out = []
    for kind, items in sorted(kinds.items()):
        ids = ", ".join(i for i, _ in items[:3]) + (
            f" (+{len(items) - 3} more)" if len(items) > 3 else ""
        )
        first = " ".join(items[0][1].split())[:240]
        out.append(f"{len(items)} {kind.replace('_', ' ')} error(s): {ids}: {first}")
    return out
