"""``gitrun swebench`` throughput (1 and 2 workers) and per-instance overhead (issue #13).

The dataset is the bundled one (tests/data/swebench) repeated: each sandbox instance
copied under several instance ids, so N instances are N gitrun runs. The bare work is
what an instance minimally needs: ``git worktree add`` at the base, ``git apply`` of the
prediction and the test patch, and the same test command (same venv, the same test
directives, ``-rA`` and JUnit option).
Environments are built before timing (a warm cache), for both, and the benchmark fails if
any environment is built again during the timed runs (cached by spec digest).

Per instance, median and p95 of wall and CPU (this process's children, with every process
they waited for; with bubblewrap the tests' own processes are in neither CPU column, see
``_PID_NAMESPACE``, so the CPU overhead is gitrun's own work): gitrun as one CLI call per
instance (``--instance-ids ID``: each pays a CLI start and a batch's set-up and reports),
the bare work the same way; the overhead is the difference. The last row is the overhead
inside one batch: its total over N, less the bare median (the figure the README quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _common import Pressure  # noqa: E402
from swebench_data import BUNDLE, TEST_CMD, copied_dataset, make_repos  # noqa: E402

# Where gitrun's verifier runs the tests in bubblewrap's own pid namespace, whose init does
# not pass its children's CPU time up to ours, the bare test command runs in one too (the
# whole file system as it is, read-write): both CPU columns then count the same thing,
# everything outside the tests' own processes.
_PID_NAMESPACE = (
    ["bwrap", "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
     "--die-with-parent"] if shutil.which("bwrap") else []
)  # fmt: skip


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _gitrun(
    tmp: Path, dataset: Path, run_id: str, workers: int, env: dict[str, str], *ids: str
) -> tuple[float, float]:
    """Wall and CPU seconds of one ``gitrun swebench`` call (``ids``: only those)."""
    argv = [sys.executable, "-m", "gitrun", "swebench", "--dataset", str(dataset),
            "--predictions", "gold", "--repos", str(tmp / "repos"), "--run-id", run_id,
            "--max-workers", str(workers), "--report-dir", str(tmp / "out"), "--json",
            "--workspace", str(tmp / f"ws-{run_id}")]  # fmt: skip
    argv += ["--instance-ids", *ids] if ids else []
    cpu, start = _children_cpu(), time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    took, used = time.perf_counter() - start, _children_cpu() - cpu
    if done.returncode != 0 or json.loads(done.stdout)["resolved_instances"] == 0:
        raise SystemExit(f"gitrun swebench failed: {done.stderr[-500:]}")
    return took, used


def _q(samples: list[float]) -> tuple[float, float]:
    """Median and p95 (inclusive quantiles)."""
    return statistics.median(samples), statistics.quantiles(samples, n=20, method="inclusive")[-1]


def _built(envs: Path) -> dict[str, tuple[int, int]]:
    return {str(m): (m.stat().st_ino, m.stat().st_mtime_ns) for m in envs.glob("*/gitrun-env.json")}


def _bare(
    tmp: Path, dataset: Path, env: dict[str, str], env_bin: dict[str, str]
) -> tuple[list[float], list[float]]:
    """Each instance's bare work: wall and CPU seconds."""
    walls, cpus = [], []
    for n, line in enumerate(dataset.read_text().splitlines()):
        rec = json.loads(line)
        repo = tmp / "repos" / rec["repo"].replace("/", "__")
        wt = tmp / f"bare-{n}"
        cpu, start = _children_cpu(), time.perf_counter()
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(wt),
                        rec["base_commit"]], check=True, env=env)  # fmt: skip
        for patch in (rec["patch"], rec["test_patch"]):
            subprocess.run(["git", "-C", str(wt), "apply", "-"], input=patch.encode(),
                           check=True, env=env)  # fmt: skip
        tests = " ".join(re.findall(r"diff --git a/.* b/(.*)", rec["test_patch"]))
        script = f'export PATH={env_bin[rec["repo"]]}:"$PATH"\n{TEST_CMD} {tests} -rA "$@"'
        argv = [*_PID_NAMESPACE, "bash", "-c", script, "x", f"--junitxml={tmp}/j{n}.xml",
                "-p", "no:cacheprovider"]  # fmt: skip
        subprocess.run(argv, cwd=wt, env=env, capture_output=True, check=False)
        walls.append(time.perf_counter() - start)
        cpus.append(_children_cpu() - cpu)
    return walls, cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="8 instances (default 12)")
    args = ap.parse_args()
    copies = 4 if args.quick else 6
    tmp = Path(tempfile.mkdtemp(prefix="gitrun-bench-swe-"))
    envs = Path(tempfile.mkdtemp(prefix="gitrun-bench-swe-envs-", dir="/var/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "GITRUN_"))}
    env |= {"GITRUN_SWEBENCH_ENVS": str(envs), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@x.invalid",
            "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@x.invalid"}  # fmt: skip
    try:
        make_repos(tmp / "repos")
        shutil.copy(BUNDLE / "specs.json", tmp / "repos" / "gitrun-swebench.json")
        dataset = copied_dataset(tmp, copies)
        count = 2 * copies
        (tmp / "warm").mkdir()
        _gitrun(tmp, copied_dataset(tmp / "warm", 1), "warm", 1, env)  # build the venvs
        bins: dict[str, str] = {}
        for marker in envs.glob("*/gitrun-env.json"):
            spec = json.loads(marker.read_text())
            bins[spec["env"].split("@")[0]] = str(marker.parent / "bin")
        warm, pressure = _built(envs), Pressure()
        one, one_cpu = _gitrun(tmp, dataset, "w1", 1, env)
        two, _ = _gitrun(tmp, dataset, "w2", 2, env)
        ids = [json.loads(x)["instance_id"] for x in dataset.read_text().splitlines()]
        each = [_gitrun(tmp, dataset, f"i{n}", 1, env, iid) for n, iid in enumerate(ids)]
        bare_wall, bare_cpu = _bare(tmp, dataset, env, bins)
        if _built(envs) != warm:
            raise SystemExit("an environment was built again on a warm cache")
        g_wall, g_cpu = [w for w, _ in each], [c for _, c in each]
        rows = {
            "gitrun (one CLI call per instance)": (g_wall, g_cpu),
            "bare: worktree + 2 x git apply + same test command": (bare_wall, bare_cpu),
        }
        print("<!-- bench:swebench:begin -->")
        print(f"| gitrun swebench, {count} instances | wall s | instances/s |")
        print("|---|---:|---:|")
        print(f"| 1 worker | {one:.2f} | {count / one:.2f} |")
        print(f"| 2 workers | {two:.2f} | {count / two:.2f} |")
        print(f"\n2 workers / 1 worker throughput: **{one / two:.2f}x** (same run, 2 cores)\n")
        print("| per instance, s | wall median | wall p95 | CPU median | CPU p95 |")
        print("|---|---:|---:|---:|---:|")
        for label, (walls, cpus) in rows.items():
            cells = " | ".join(f"{v:.3f}" for v in (*_q(walls), *_q(cpus)))
            print(f"| {label} | {cells} |")
        (gw, gw95), (bw, bw95) = _q(g_wall), _q(bare_wall)
        (gc, gc95), (bc, bc95) = _q(g_cpu), _q(bare_cpu)
        print(f"| **gitrun overhead per instance** | {gw - bw:.3f} | {gw95 - bw95:.3f} | "
              f"{gc - bc:.3f} | {gc95 - bc95:.3f} |")  # fmt: skip
        print(f"| **in one batch** (1 worker, total / N − bare median; one CLI start) | "
              f"{one / count - bw:.3f} | | {one_cpu / count - bc:.3f} | |")  # fmt: skip
        print("\nenvironments built again during the timed runs: 0 (warm cache)\n")
        print(pressure.line())
        print("<!-- bench:swebench:end -->")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(envs, ignore_errors=True)


if __name__ == "__main__":
    main()
