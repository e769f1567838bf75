"""A SWE-bench-format batch whose tests sleep: work that waits, not computes.

``make_world(DIR, count, sleep)`` builds ``DIR/repos/bench__sleepy`` (one git repository,
its base commit byte-for-byte the same everywhere: fixed identity and dates) and a
dataset of ``count`` instances on it. Each instance's test command sleeps ``sleep``
seconds, then checks ``state.txt`` says ``fixed``: a gold prediction resolves it, a
wrong one (every third instance in the predictions file) does not. No package is
installed: the test environment is a bare venv of the running interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = "bench/sleepy"
GOLD = "--- a/state.txt\n+++ b/state.txt\n@@ -1 +1 @@\n-broken\n+fixed\n"
WRONG = "--- a/state.txt\n+++ b/state.txt\n@@ -1 +1 @@\n-broken\n+mended\n"
TEST_PATCH = (
    "diff --git a/checks/{n}.txt b/checks/{n}.txt\nnew file mode 100644\n"
    "--- /dev/null\n+++ b/checks/{n}.txt\n@@ -0,0 +1 @@\n+check {n}\n"
)


@dataclass(frozen=True)
class World:
    repos: Path
    dataset: Path
    predictions: Path
    want: dict[str, str]  # instance id -> the verdict it must get


def _git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {
        "GIT_AUTHOR_NAME": "swe", "GIT_AUTHOR_EMAIL": "swe@gitrun.invalid",
        "GIT_COMMITTER_NAME": "swe", "GIT_COMMITTER_EMAIL": "swe@gitrun.invalid",
        "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
        "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
    }  # fmt: skip
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, check=True)
    return done.stdout.decode().strip()


def make_repo(repos: Path) -> str:
    """The repository under ``repos``; its base commit."""
    work = repos / REPO.replace("/", "__")
    (work / "checks").mkdir(parents=True)
    (work / "state.txt").write_text("broken\n")
    (work / "checks" / "README").write_text("one file per instance's test patch\n")
    _git(work, "init", "-q", "-b", "main")
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", "base: sleepy")
    return _git(work, "rev-parse", "HEAD")


def make_world(where: Path, count: int, sleep: float, wrong_every: int = 3) -> World:
    """``count`` instances whose tests sleep ``sleep`` s; every ``wrong_every``-th
    prediction is wrong (0: all gold)."""
    base = make_repo(where / "repos")
    rows, preds, want = [], [], {}
    for n in range(count):
        iid = f"sleepy-{n:03d}"
        rows.append({
            "instance_id": iid, "repo": REPO, "base_commit": base, "patch": GOLD,
            "test_patch": TEST_PATCH.format(n=n), "FAIL_TO_PASS": ["check"], "PASS_TO_PASS": [],
            "version": "1", "test_cmd": f"sleep {sleep:g} && grep -qx fixed state.txt",
        })  # fmt: skip
        wrong = wrong_every > 0 and n % wrong_every == wrong_every - 1
        preds.append({"instance_id": iid, "model_name_or_path": "m",
                      "model_patch": WRONG if wrong else GOLD})  # fmt: skip
        want[iid] = "unresolved" if wrong else "resolved"
    dataset, predictions = where / "dataset.jsonl", where / "preds.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    predictions.write_text("".join(json.dumps(p) + "\n" for p in preds))
    return World(where / "repos", dataset, predictions, want)
