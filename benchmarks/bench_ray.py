"""bench_throughput's table with a Ray column: ``gitrun swebench --executor ray`` (issue #31).

The same world, bare work and targets as ``benchmarks/bench_throughput.py`` (tests that
sleep; N workers >= 0.9 x N one worker's throughput; overhead <= 0.25 s median over the
bare work), plus the executor ``ray``: for N workers, a local Ray cluster of N CPUs
(``ray start --head``, started before the clock and stopped after), then the batch
through a bare git remote (a path) with ``--executor ray --ray-address``: one Ray task per
instance, each claiming, evaluating and landing its instance. Timed: the driver's whole
command (connecting to the cluster included). CPU: the driver's and the cluster's
processes' (user + system, their waited-for children included), read from ``/proc``.

    python benchmarks/bench_ray.py --quick            # local and ray, 1 and 2 workers
    python benchmarks/bench_ray.py --executors ray    # Ray alone
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_throughput as bt  # hermetic HOME and git first; puts tests/ on sys.path
from ray_helpers import cmdline, pids, ray_head, tree

CLOCK = os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _cluster_cpu(roots: set[int]) -> float:
    """User + system seconds of the cluster's processes and their reaped children."""
    total = 0
    for pid in tree(roots):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / CLOCK


def ray(setup: bt.Setup, n: int, run_id: str) -> bt.Timed:
    """The batch as Ray tasks on a local cluster of ``n`` CPUs (started untimed)."""
    bare = setup.tmp / f"remote-{run_id}.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True, env=setup.env)
    temp = Path(tempfile.mkdtemp(prefix="gb-", dir="/tmp"))
    with ray_head(temp, n, setup.env) as head:
        address = head.address()
        roots = {p for p in pids() if str(temp) in cmdline(p)}
        argv = [sys.executable, "-m", "gitrun", "swebench", "--dataset",
                str(setup.world.dataset), "--predictions", str(setup.world.predictions),
                "--repos", str(setup.world.repos), "--run-id", run_id, "--max-workers", str(n),
                "--report-dir", str(setup.tmp / f"out-{run_id}"), "--remote", str(bare),
                "--executor", "ray", "--ray-address", address, "--workspace",
                str(setup.tmp / f"ws-{run_id}"), "--key-file", str(setup.key)]  # fmt: skip
        cpu, busy, start = _children_cpu(), _cluster_cpu(roots), time.perf_counter()
        done = subprocess.run(argv, env=setup.env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        used = _children_cpu() - cpu + _cluster_cpu(roots) - busy
        if done.returncode != 0:
            raise SystemExit(f"gitrun failed ({done.returncode}): {done.stderr[-800:]}")
    shutil.rmtree(temp, ignore_errors=True)  # the cluster's session files
    return bt.Timed(wall, used)


bt.EXECUTORS["ray"] = ray

if __name__ == "__main__":
    if "--executors" not in sys.argv:
        sys.argv += ["--executors", "local,ray"]
    bt.main()
