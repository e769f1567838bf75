"""Cost of one ``apply_patch`` runtime step, and of the patch parsing and applying in it.

A step reads a pending patch in four places: the gate at intake, the risk rules, the gate
again when it executes, and the adapter's write (issue #15: "parse once"). This drives
``Runtime.step`` + ``Runtime.execute_pending`` over a scripted agent of N patches to one
file of ``--lines`` lines, each patch changing every 10th line (``--lines / 10`` hunks),
and reports per step: the median and p95 of the whole step (fsync on), the time spent
inside :func:`gitrun.core.patch.parse_patch` and :func:`gitrun.core.patch.apply_file_patch`,
and how many times each was called.

    python benchmarks/bench_patch_step.py [--lines 400] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common as c
import pygit2

from gitrun.core import patch as patch_module
from gitrun.core import patch_plan
from gitrun.core.records import Action
from gitrun.store import trees

WARMUP = 5


class Counted:
    """Wrap ``patch_plan``'s parse and apply: calls and nanoseconds inside them."""

    def __init__(self) -> None:
        self.calls = {"parse": 0, "apply": 0}
        self.ns = 0
        setattr(patch_plan, "parse_patch", self._wrap("parse", patch_module.parse_patch))  # noqa: B010
        setattr(patch_plan, "apply_file_patch", self._wrap("apply", patch_module.apply_file_patch))  # noqa: B010

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            t0 = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                self.ns += time.perf_counter_ns() - t0

        return counted


def patch_text(path: str, lines: int, version: int) -> str:
    out = [f"diff --git a/{path} b/{path}", f"--- a/{path}", f"+++ b/{path}"]
    for i in range(0, lines, 10):
        out += [
            f"@@ -{i + 1},1 +{i + 1},1 @@",
            f"-line {i} v{version}",
            f"+line {i} v{version + 1}",
        ]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=400, help="lines of the patched file")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    counted = Counted()
    with c.bench_dir("patch-step") as tmp:
        repo, base = c.make_repo(tmp / "repo", c.Layout(10, 10))
        content = "".join(f"line {i} v0\n" for i in range(args.lines)).encode()
        parent = repo[base].peel(pygit2.Commit)
        changes = {"src/big.py": (repo.create_blob(content), trees.BLOB)}
        tree = trees.tree_with_changes(repo, parent.tree, changes)
        head = trees.deterministic_commit(repo, tree, "big file", [base])
        repo.references.create("refs/heads/main", head, force=True)
        task = c.make_task(tmp / "task", tmp / "repo", head)
        actions = tuple(
            Action("apply_patch", patch=patch_text("src/big.py", args.lines, v))
            for v in range(args.steps)
        )
        run = c.start_run(
            repo, head, task, run_id="patch", worktree=tmp / "wt",
            key_file=tmp / "keys" / "checkpoint.keyring", actions=actions,
        )  # fmt: skip
        steps, inside = [], []
        calls: dict[str, int] = {}
        for _ in range(args.steps):
            before, counted.ns = dict(counted.calls), 0
            steps.append(c.timed(lambda: c.runtime_step(run.runtime)))
            inside.append(counted.ns)
            calls = {k: counted.calls[k] - before[k] for k in before}
        if run.runtime.state.budgets.steps != args.steps:
            raise RuntimeError(f"the run recorded {run.runtime.state.budgets.steps} writes")
    s = c.stats(steps[WARMUP:])
    print(f"apply_patch step benchmark: {c.machine_line()}")
    print(
        f"{args.lines}-line file, {len(range(0, args.lines, 10))} hunks per patch, "
        f"{args.steps - WARMUP} steps measured"
    )
    print("| step median ms | p95 ms | parse+apply ms (median) | parses/step | applies/step |")
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {s.cells()} | {statistics.median(inside[WARMUP:]) / 1e6:.3f} "
        f"| {calls['parse']} | {calls['apply']} |"
    )


if __name__ == "__main__":
    main()
