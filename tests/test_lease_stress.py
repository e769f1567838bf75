"""Stress: N workers race ``gitrun resume`` on M crashed runs until every run is done.

Each worker is a loop of real ``gitrun resume`` processes over all the runs (workers
start in pairs on the same run, then go round); a worker is finished when every run answered
"done" to it. Runs are crashed at different points of the step protocol (SIGKILL), on
the three bundled sandboxes sharing their repositories, so workers also contend on the
same ref databases. Afterwards every run is audited from git: done, every key written
exactly once, the checkpoint chain's generations exactly 1..n (none skipped or
duplicated), and ``git fsck`` clean.

``GITRUN_STRESS_WORKERS`` (2..8, default 4) and ``GITRUN_STRESS_RUNS`` (default 4) size
the default variant; the ``slow`` variant runs 8 workers on 16 runs.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun
from test_lease import assert_done_exactly_once, audit, crash_run

SANDBOX_WRITES = {"fix-median": 1, "slugify-unicode": 2, "guarded-config": 1}
CRASH_POINTS = [
    "after_intent_checkpoint",
    "write_ref_moved",
    "after_file_sync",
    "before_verify",
    "after_receipt_index",
    "checkpoint_ref_moved:3",
    "mid_file_sync",
    "write_ref_locked",
]
ALLOWED_CODES = {0, 4, 6}  # done, owned by another worker, lost the lease to another worker


def _env_int(name: str, default: int, low: int, high: int) -> int:
    value = int(os.environ.get(name, default))
    if not low <= value <= high:
        raise pytest.UsageError(f"{name} must be in {low}..{high}, not {value}")
    return value


# Read at import: the hermetic fixture scrubs GITRUN_* from the environment of each test.
WORKERS = _env_int("GITRUN_STRESS_WORKERS", 4, 2, 8)
RUNS = _env_int("GITRUN_STRESS_RUNS", 4, 1, 64)


def _worker(
    gitrun: Gitrun, n: int, run_ids: list[str], deadline: float
) -> list[tuple[str, int, str]]:
    """Resume every run until each says done; returns (run, exit code, stderr) per try."""
    tries: list[tuple[str, int, str]] = []
    first = (n // 2) % len(run_ids)  # workers start in pairs on the same run
    pending = run_ids[first:] + run_ids[:first]
    while pending and time.monotonic() < deadline:
        for run_id in list(pending):
            argv = ("resume", run_id, "-q", "--worker-id", f"stress-{n}")
            result = gitrun.run(argv, timeout=90)
            tries.append((run_id, result.code, result.err))
            if result.code not in (4, 6):
                pending.remove(run_id)  # done (0) or a failure the test reports
        if pending:
            time.sleep(0.1)
    return tries


def _stress(gitrun: Gitrun, workers: int, runs: int, budget: float) -> None:
    names = sorted(SANDBOX_WRITES)
    plan = {
        f"s{i}": (names[i % len(names)], CRASH_POINTS[i % len(CRASH_POINTS)]) for i in range(runs)
    }
    for run_id, (sandbox, point) in plan.items():
        crash_run(gitrun, SANDBOXES / sandbox, run_id, point)

    deadline = time.monotonic() + budget
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_worker, gitrun, n, list(plan), deadline) for n in range(workers)]
        tries = [t for f in futures for t in f.result()]

    codes = Counter(code for _, code, _ in tries)
    bad = [(run_id, code, err) for run_id, code, err in tries if code not in ALLOWED_CODES]
    assert not bad, bad
    assert codes[4] > 0, codes  # the workers did race for ownership
    done_answers = Counter(run_id for run_id, code, _ in tries if code == 0)
    assert done_answers == dict.fromkeys(plan, workers), (done_answers, codes)
    for run_id, (sandbox, _) in plan.items():
        result = audit(gitrun, run_id)
        assert_done_exactly_once(result, writes=SANDBOX_WRITES[sandbox])
    for sandbox in {s for s, _ in plan.values()}:
        fsck = subprocess.run(
            ["git", "-C", str(gitrun.repo(sandbox)), "fsck", "--strict", "--no-dangling"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert fsck.returncode == 0, fsck.stderr
        refs = Path(gitrun.repo(sandbox), ".git", "refs")
        assert not list(refs.rglob("*.lock")), "a ref lock file was left behind"


@pytest.mark.timeout(120)
def test_workers_racing_on_crashed_runs_finish_each_once_with_no_generation_skipped(
    gitrun: Gitrun,
) -> None:
    _stress(gitrun, WORKERS, RUNS, budget=90)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eight_workers_racing_on_sixteen_crashed_runs_finish_every_run_exactly_once(
    gitrun: Gitrun,
) -> None:
    _stress(gitrun, 8, 16, budget=480)
