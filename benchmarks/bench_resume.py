"""Resume time for runs of 10 and 1,000 write steps: what resuming costs before any new
work is done. It must not grow with the number of steps (issue #4).

Each run is built for real, in its own repository of 1,000 files (lease, worktree,
signed checkpoints, a runtime step per write, driven by a scripted agent; each write
edits a file no earlier write touched) and then stopped cleanly between two steps
(lease released, no pending intent), as an interrupted run would be left. Then,
interleaving the two runs:

* **core** (in-process, fresh objects each time) — ``service.open_run`` (registry,
  task file, repository, keyring), ``service.load_verified`` (find the checkpoint ref,
  verify the HMAC and the chain link, scenario check against the task file),
  ``LeaseManager.acquire`` (a takeover: a new worker each time), and
  ``recovery.reconcile`` (instance, cached receipt against its commit, HEAD, full
  ``git status``). The lease is released afterwards, untimed.
* **service.resume** (in-process) — the real ``gitrun resume`` use case, stopped where
  it would start stepping (``service._drive`` is replaced by a no-op for the
  measurement). It also parses the plan file: both runs share one plan of
  ``steps + 10`` actions, so that cost is the same for both.
* **core, fresh process** — the core sequence once per new Python process (imports
  excluded, cold libgit2 caches), a few times.

    python benchmarks/bench_resume.py [--quick] [--steps 10,1000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import _common as c

from gitrun.app import service
from gitrun.app.workspace import RunRecord, Workspace
from gitrun.engine.agents import ScriptAgent, load_plan
from gitrun.engine.recovery import reconcile
from gitrun.store.lease import LeaseManager

TARGET = 1.25  # "beyond noise": the larger run's median within 25% of the smaller's
LAYOUT = c.Layout(20, 50, file_size=256)  # 1,000 files: a 1,000-step run touches each once


def write_plan(path: Path, count: int) -> None:
    lines = ["schema = 1", ""]
    for action in c.write_actions(LAYOUT, count, salt="resume"):
        lines += [
            "[[step]]",
            'kind = "write_file"',
            f"path = {json.dumps(action.path)}",
            f"content = {json.dumps(action.content)}",
            "",
        ]
    path.write_text("\n".join(lines))


def build(root: Path, steps_list: list[int]) -> tuple[Workspace, dict[int, str]]:
    """One workspace; a stopped run of each length, each in its own repository (so the
    refs a run leaves behind, one receipt index ref per write, are its own)."""
    ws = Workspace(root / "home", root / "home" / "keys" / "checkpoint.keyring")
    plan_file = root / "plan.toml"
    write_plan(plan_file, max(steps_list) + 10)
    agent = load_plan(plan_file)
    runs: dict[int, str] = {}
    for steps in steps_list:
        t0 = time.perf_counter()
        run_id = f"resume-{steps}"
        repo_path = root / f"repo-{steps}"
        repo, base = c.make_repo(repo_path, LAYOUT)
        task = c.make_task(root / f"task-{steps}", repo_path, base)
        worktree = ws.worktree_path(run_id)
        ws.save(
            RunRecord(
                run_id,
                str(repo_path),
                task.task_dir,
                str(worktree),
                f"refs/heads/gitrun/{run_id}",
                f"plan:{plan_file}",
                str(base),
                time.time(),
            )
        )
        run = c.start_run(
            repo,
            base,
            task,
            run_id=run_id,
            worktree=worktree,
            key_file=ws.key_file,
            actions=agent.actions,
            lease_seconds=30,
        )
        for _ in range(steps):
            c.runtime_step(run.runtime)
        run.runtime.pause()  # a stopped run checkpoints its last receipt, as a session's end does
        if run.runtime.state.budgets.steps != steps or run.runtime.state.pending is not None:
            raise RuntimeError(f"run {run_id} did not stop cleanly after {steps} steps")
        run.lease.release()
        runs[steps] = run_id
        print(f"  built a run of {steps:,} steps in {time.perf_counter() - t0:.1f}s", flush=True)
    return ws, runs


def core_resume(ws: Workspace, run_id: str, worker: str) -> dict[str, int]:
    """open + load/verify + lease + reconcile, timed piecewise; the lease released after."""
    opts = service.Options(workspace=ws, worker=worker, lease_seconds=30)
    t0 = time.perf_counter_ns()
    opened = service.open_run(run_id, opts)
    ref, stored = service.load_verified(opened)
    t1 = time.perf_counter_ns()
    lease = LeaseManager(opened.repo, run_id, worker, 30)
    lease.acquire(stored.state.generation)
    t2 = time.perf_counter_ns()
    agent = load_plan_cached(opened.record.agent)
    rt = service.build_runtime(opened, ref, stored, lease, agent, opts)
    what = reconcile(rt)
    t3 = time.perf_counter_ns()
    lease.release()
    if what != "exact":
        raise RuntimeError(f"reconcile of {run_id} said {what!r}, expected 'exact'")
    return {"total": t3 - t0, "load": t1 - t0, "lease": t2 - t1, "reconcile": t3 - t2}


_plans: dict[str, ScriptAgent] = {}


def load_plan_cached(spec: str) -> ScriptAgent:
    """reconcile never asks the agent anything: parse the plan once, outside the timing."""
    if spec not in _plans:
        _plans[spec] = load_plan(Path(spec.removeprefix("plan:")))
    return _plans[spec]


def service_resume(ws: Workspace, run_id: str, worker: str) -> int:
    opts = service.Options(workspace=ws, worker=worker, lease_seconds=30)
    real_drive = service._drive
    service._drive = lambda rt: rt.state
    try:
        t0 = time.perf_counter_ns()
        service.resume(run_id, opts)
        return time.perf_counter_ns() - t0
    finally:
        service._drive = real_drive


def child(home: str, run_id: str, worker: str) -> None:
    ws = Workspace(Path(home), Path(home) / "keys" / "checkpoint.keyring")
    load_plan_cached(ws.load(run_id).agent)
    print(json.dumps(core_resume(ws, run_id, worker)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="runs of 10 and 100 steps, fewer repetitions"
    )
    ap.add_argument("--steps", default=None, help="comma-separated run lengths (default 10,1000)")
    ap.add_argument(
        "--iterations", type=int, default=None, help="in-process resumes per run (default 60)"
    )
    ap.add_argument(
        "--fresh", type=int, default=None, help="fresh-process resumes per run (default 8)"
    )
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    steps_list = [
        int(s) for s in (args.steps or ("10,100" if args.quick else "10,1000")).split(",")
    ]
    iterations = args.iterations or (10 if args.quick else 60)
    fresh = args.fresh if args.fresh is not None else (1 if args.quick else 8)
    warmup = 3

    print(f"resume benchmark: {c.machine_line()}")
    pressure = c.Pressure()
    with c.bench_dir("resume") as tmp:
        ws, runs = build(tmp, steps_list)
        core: dict[int, dict[str, list[int]]] = {s: {} for s in steps_list}
        full: dict[int, list[int]] = {s: [] for s in steps_list}
        cold: dict[int, list[int]] = {s: [] for s in steps_list}
        t0 = time.perf_counter()
        for i in range(warmup + iterations):
            order = steps_list if i % 2 == 0 else list(reversed(steps_list))
            for steps in order:
                parts = core_resume(ws, runs[steps], f"resumer-core-{i}")
                total = service_resume(ws, runs[steps], f"resumer-svc-{i}")
                if i >= warmup:
                    for k, v in parts.items():
                        core[steps].setdefault(k, []).append(v)
                    full[steps].append(total)
        for i in range(fresh):
            for steps in steps_list:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        str(ws.root),
                        runs[steps],
                        f"resumer-cold-{i}",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                cold[steps].append(json.loads(out.stdout.strip().splitlines()[-1])["total"])
        print(
            f"  {iterations} in-process and {fresh} fresh-process resumes per run "
            f"in {time.perf_counter() - t0:.1f}s"
        )

    lines = [
        "### Resume",
        "",
        "| run length | core median ms | p95 ms | load+verify | lease acquire | reconcile "
        "| `service.resume` median ms | p95 ms | fresh process median ms | p95 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    st = {s: {k: c.stats(v) for k, v in core[s].items()} for s in steps_list}
    for s in steps_list:
        f, cl = c.stats(full[s]), c.stats(cold[s])
        lines.append(
            f"| {s:,} steps | {st[s]['total'].cells()} | {st[s]['load'].median_ms:.3f} | "
            f"{st[s]['lease'].median_ms:.3f} | {st[s]['reconcile'].median_ms:.3f} | {f.cells()} | "
            + (cl.cells() if cl.n else "— | —")
            + " |"
        )
    small, large = steps_list[0], steps_list[-1]
    lines += [
        "",
        f"| ratio {large:,} / {small:,} steps (target <= {TARGET}x: no growth beyond noise) "
        "| median | p95 | verdict |",
        "|---|---:|---:|:---:|",
    ]
    rows = [
        ("core (load + verify + lease + reconcile)", st[large]["total"], st[small]["total"]),
        ("`service.resume` up to the first new step", c.stats(full[large]), c.stats(full[small])),
    ]
    if cold[small]:
        rows.append(("core, fresh process", c.stats(cold[large]), c.stats(cold[small])))
    for label, big, sml in rows:
        r = big.median_ms / sml.median_ms
        lines.append(
            f"| {label} | {r:.2f}x | {big.p95_ms / sml.p95_ms:.2f}x | {c.verdict(r, TARGET)} |"
        )
    print()
    c.markdown_block("resume", lines, pressure)


if __name__ == "__main__":
    main()
