"""SWE-bench batch throughput with N workers, and gitrun's per-instance overhead (issue #31).

The instances' tests sleep (``tests/sleepy_world.py``): work that waits, not computes,
so N workers can reach N times one worker's throughput up to the core count. Targets:

* **throughput**: N workers >= 0.9 x N times one worker's instances per second (N = 1, 2;
  more with ``--workers``), under each executor;
* **overhead**: gitrun's time per instance over the bare work, <= 0.25 s (median). The
  bare work is what the instance minimally needs, measured in the same run on the same
  instances, in alternating pairs: ``git worktree add`` at the base, ``git apply`` of the
  prediction and of the test patch, the same test command in the same venv.

Executors (``--executors``, each a function of :data:`EXECUTORS`; add one there):

* ``local``: ``gitrun swebench --max-workers N`` (the local pool, no remote);
* ``workers``: the batch published on a bare git remote (a path), then N ``gitrun worker``
  processes, each with its own workspace, as a scheduler would start them.

Wall and CPU (user + system of every process, children included) are printed for each.
Environments are built before timing (a warm cache).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
# hermetic before gitrun (and libgit2) load: no user or system git config, no GITRUN_*
for _name in list(os.environ):
    if _name.startswith(("GIT_", "GITRUN_")):
        del os.environ[_name]
_HOME = tempfile.mkdtemp(prefix="gitrun-bench-tp-home-")
os.environ |= {"HOME": _HOME, "XDG_CONFIG_HOME": f"{_HOME}/.config", "GIT_CONFIG_NOSYSTEM": "1"}

from sleepy_world import World, make_world  # noqa: E402


@dataclass(frozen=True)
class Setup:
    """One benchmark run's world: the instances, the key, the environment cache."""

    tmp: Path
    world: World
    key: Path
    env: dict[str, str]
    count: int


@dataclass(frozen=True)
class Timed:
    wall: float
    cpu: float  # user + system, of this process's children (they were waited for)


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _gitrun(setup: Setup, *args: str, workspace: Path) -> list[str]:
    return [sys.executable, "-m", "gitrun", *args, "--workspace", str(workspace),
            "--key-file", str(setup.key)]  # fmt: skip


def _check(proc: subprocess.CompletedProcess[str] | subprocess.Popen[str], err: str) -> None:
    if proc.returncode != 0:
        raise SystemExit(f"gitrun failed ({proc.returncode}): {err[-800:]}")


def local(setup: Setup, n: int, run_id: str) -> Timed:
    """``gitrun swebench --max-workers N``: the local pool."""
    argv = _gitrun(setup, "swebench", "--dataset", str(setup.world.dataset), "--predictions",
                   str(setup.world.predictions), "--repos", str(setup.world.repos),
                   "--run-id", run_id, "--max-workers", str(n), "--report-dir",
                   str(setup.tmp / "out"), workspace=setup.tmp / f"ws-{run_id}")  # fmt: skip
    cpu, start = _children_cpu(), time.perf_counter()
    done = subprocess.run(argv, env=setup.env, capture_output=True, text=True, check=False)
    timed = Timed(time.perf_counter() - start, _children_cpu() - cpu)
    _check(done, done.stderr)
    return timed


def workers(setup: Setup, n: int, run_id: str) -> Timed:
    """The batch published on a bare remote (not timed), then N ``gitrun worker`` processes
    started at once, each with its own workspace; timed until the last one exits."""
    bare = setup.tmp / f"remote-{run_id}.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True, env=setup.env)
    publish = _gitrun(setup, "swebench", "--dataset", str(setup.world.dataset),
                      "--predictions", str(setup.world.predictions), "--repos",
                      str(setup.world.repos), "--run-id", run_id, "--remote", str(bare),
                      "--publish", workspace=setup.tmp / f"ws-{run_id}-submit")  # fmt: skip
    done = subprocess.run(publish, env=setup.env, capture_output=True, text=True, check=False)
    _check(done, done.stderr)
    argvs = [_gitrun(setup, "worker", "--remote", str(bare), "--batch", run_id, "--repos",
                     str(setup.world.repos), "--report-dir", str(setup.tmp / f"out-{run_id}-{w}"),
                     workspace=setup.tmp / f"ws-{run_id}-{w}") for w in range(n)]  # fmt: skip
    cpu, start = _children_cpu(), time.perf_counter()
    procs = [subprocess.Popen(a, env=setup.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for a in argvs]  # fmt: skip
    errs = [p.communicate()[1] for p in procs]
    timed = Timed(time.perf_counter() - start, _children_cpu() - cpu)
    for proc, err in zip(procs, errs, strict=True):
        _check(proc, err)
    return timed


# name -> run the whole batch with N workers under this executor; the Ray helper adds "ray"
EXECUTORS: dict[str, Callable[[Setup, int, str], Timed]] = {"local": local, "workers": workers}


def overhead(setup: Setup, pairs: int) -> tuple[list[Timed], list[Timed]]:
    """Per instance, alternating: gitrun's evaluation of it (in this process, as one
    worker evaluates it: ``swebench_run.evaluate``) and the bare work; both timed."""
    os.environ |= {k: v for k, v in setup.env.items() if k.startswith("GITRUN_")}
    from gitrun.app import swebench
    from gitrun.app.swebench_run import Context, evaluate, test_command

    req = swebench.Request(setup.world.dataset, str(setup.world.predictions),
                           setup.world.repos, "ovh", report_dir=setup.tmp / "out-ovh")  # fmt: skip
    _, jobs, _ = swebench.plan_jobs(req)
    ctx = Context("ovh", str(setup.world.repos), str(setup.tmp / "out-ovh"),
                  str(setup.tmp / "ws-ovh"), str(setup.key))  # fmt: skip
    env_bin = next((setup.tmp / "envs").glob("*/bin"))
    repo = next(setup.world.repos.iterdir())
    ours: list[Timed] = []
    bare: list[Timed] = []
    for n, job in enumerate(jobs[: pairs + 1]):
        order = (0, 1) if n % 2 == 0 else (1, 0)
        got: dict[int, Timed] = {}
        for which in order:
            cpu = time.process_time() + _children_cpu()
            start = time.perf_counter()
            if which == 0:
                out = evaluate(ctx, job)
                if out["result"] not in ("resolved", "unresolved"):
                    raise SystemExit(f"gitrun did not grade {job.inst.instance_id}: {out}")
            else:
                _bare_work(setup, repo, job.inst.base_commit, (job.pred.patch or "",
                           job.inst.test_patch), test_command(job), env_bin, n)  # fmt: skip
            got[which] = Timed(time.perf_counter() - start,
                               time.process_time() + _children_cpu() - cpu)  # fmt: skip
        if n > 0:  # the first pair warms imports and caches up
            ours.append(got[0])
            bare.append(got[1])
    return ours, bare


def _bare_work(setup: Setup, repo: Path, base: str, patches: tuple[str, str], test_cmd: str,
               env_bin: Path, n: int) -> None:  # fmt: skip
    wt = setup.tmp / f"bare-{n}"
    git = ["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(wt), base]
    subprocess.run(git, env=setup.env, check=True, capture_output=True)
    for patch in patches:
        subprocess.run(["git", "-C", str(wt), "apply", "-"], input=patch.encode(),
                       env=setup.env, check=True, capture_output=True)  # fmt: skip
    script = f'export PATH={env_bin}:"$PATH"\n{test_cmd}'
    subprocess.run(["bash", "-c", script], cwd=wt, env=setup.env, capture_output=True, check=False)


def _q(values: list[float]) -> tuple[float, float]:
    """Median and p95 (inclusive quantiles)."""
    if len(values) < 2:
        return values[0], values[0]
    return statistics.median(values), statistics.quantiles(values, n=20, method="inclusive")[-1]


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**MISS**"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 instances, 6 pairs (default 16, 12)")
    ap.add_argument("--sleep", type=float, default=1.0, help="seconds each instance's tests wait")
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    ap.add_argument("--executors", default=",".join(EXECUTORS), help="comma-separated")
    args = ap.parse_args()
    count, pairs = (8, 6) if args.quick else (16, 12)
    counts = [int(w) for w in args.workers.split(",")]
    names = args.executors.split(",")
    unknown = [n for n in names if n not in EXECUTORS]
    if unknown:
        ap.error(f"unknown executor {unknown[0]}; choose from {', '.join(EXECUTORS)}")
    tmp = Path(tempfile.mkdtemp(prefix="gitrun-bench-tp-"))
    envs = Path(tempfile.mkdtemp(prefix="gitrun-bench-tp-envs-", dir="/var/tmp"))
    (tmp / "envs").symlink_to(envs)
    env = dict(os.environ) | {"GITRUN_SWEBENCH_ENVS": str(envs)}
    try:
        world = make_world(tmp / "world", max(count, pairs + 1), args.sleep)
        from gitrun.store.keys import load_keyring

        load_keyring(tmp / "batch.keyring")
        setup = Setup(tmp, world, tmp / "batch.keyring", env, count)
        print(f"# bench_throughput: {platform.node()} ({os.cpu_count()} cores), "
              f"{count} instances, tests sleep {args.sleep:g}s")  # fmt: skip
        warm = Setup(tmp, make_world(tmp / "warm", 1, 0), setup.key, env, 1)
        local(warm, 1, "warm")  # builds the (one) venv: a warm cache for everything below
        ours, bare = overhead(setup, pairs)
        results = {(name, n): EXECUTORS[name](setup, n, f"{name}{n}") for name in names
                   for n in counts}  # fmt: skip
        _print(setup, counts, names, results, ours, bare, args.sleep)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(envs, ignore_errors=True)
        shutil.rmtree(_HOME, ignore_errors=True)


def _print(setup: Setup, counts: list[int], names: list[str],
           results: dict[tuple[str, int], Timed], ours: list[Timed], bare: list[Timed],
           sleep: float) -> None:  # fmt: skip
    print("<!-- bench:throughput:begin -->")
    print(f"| {setup.count} instances (tests sleep {sleep:g}s) | workers | wall s | CPU s "
          "| instances/s | x one worker | target |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in names:
        one = results[(name, counts[0])].wall if counts[0] == 1 else None
        for n in counts:
            got = results[(name, n)]
            speed = "" if one is None else f"{one / got.wall:.2f}x"
            target = "" if one is None or n == 1 else (
                f"{_verdict(one / got.wall >= 0.9 * n)} (>= {0.9 * n:.1f}x)")  # fmt: skip
            print(f"| {name} | {n} | {got.wall:.2f} | {got.cpu:.2f} | "
                  f"{setup.count / got.wall:.2f} | {speed} | {target} |")  # fmt: skip
    diff = [o.wall - b.wall for o, b in zip(ours, bare, strict=True)]
    dcpu = [o.cpu - b.cpu for o, b in zip(ours, bare, strict=True)]
    print()
    print(f"| per instance, {len(ours)} pairs | wall median s | wall p95 s | CPU median s "
          "| CPU p95 s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for label, rows in (("gitrun (one worker evaluating it)", ours),
                        ("bare: worktree + 2 x git apply + same tests", bare)):  # fmt: skip
        w, c = _q([r.wall for r in rows]), _q([r.cpu for r in rows])
        print(f"| {label} | {w[0]:.3f} | {w[1]:.3f} | {c[0]:.3f} | {c[1]:.3f} |")
    w, c = _q(diff), _q(dcpu)
    print(f"| **gitrun overhead** (paired difference) | {w[0]:.3f} | {w[1]:.3f} | {c[0]:.3f} "
          f"| {c[1]:.3f} |")  # fmt: skip
    print(f"\nOverhead target <= 0.25 s (median): {_verdict(w[0] <= 0.25)}")
    for name in names:
        if counts[0] == 1:
            per = results[(name, 1)].wall / setup.count - _q([b.wall for b in bare])[0]
            print(f"\n{name}, 1 worker: wall per instance minus the bare median: "
                  f"{per:.3f} s (CLI start in; workers: the remote's pushes too)")  # fmt: skip
    print("<!-- bench:throughput:end -->")


if __name__ == "__main__":
    main()
