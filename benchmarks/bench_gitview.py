"""What the git view adds to an exec step (issue #30: at most 20 ms, median).

One run per repository size, exec steps of ``true`` driven by ``Runtime.step`` +
``Runtime.execute_pending`` (intent checkpoint, the command confined as ``gitrun run``
confines it — bubblewrap when usable — scan, receipt commit), alternating step by step
between the git view on (as gitrun runs it) and off (the exec context without a view),
so both are measured side by side on the same worktree. Printed per size: median and p95
of both, the median of the paired differences (the target: steps of a few hundred ms on a
loaded machine vary by more than the view costs, pairing cancels the drift), the view's
own set-up
(:func:`gitrun.adapter.gitview.make`, alone) — plus, for information, one ``git status``
inside a step.

    python benchmarks/bench_gitview.py [--steps 40] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import _common as c

from gitrun.adapter import gitview, sandbox
from gitrun.core.records import EXEC, Action
from gitrun.core.task import load_task

WARMUP = 4
TARGET_MS = 20.0


def allow_exec(toml: Path) -> None:
    text = toml.read_text().replace('"apply_patch"]', '"apply_patch", "exec"]')
    text = text.replace(
        'forbidden_paths = ["tests/**"]\n',
        'forbidden_paths = ["tests/**"]\n\n'
        '[policy.exec]\nallow = ["*"]\nmax_timeout_seconds = 30\n',
    )
    toml.write_text(text)


def measure(layout: c.Layout, steps: int) -> dict[str, float]:
    with c.bench_dir("gitview") as tmp:
        repo, base = c.make_repo(tmp / "repo", layout)
        task = c.make_task(tmp / "task", tmp / "repo", base)
        allow_exec(Path(task.task_dir) / "task.toml")
        task = load_task(task.task_dir)
        status = Action(EXEC, command="git status --porcelain >/dev/null")
        actions = (*(Action(EXEC, command="true") for _ in range(2 * steps)), status)
        run = c.start_run(
            repo, base, task, run_id="view", worktree=tmp / "wt",
            key_file=tmp / "keys" / "checkpoint.keyring", actions=actions,
        )  # fmt: skip
        rt = run.runtime
        with_view = rt.exec_context
        without = lambda: dataclasses.replace(with_view(), git=None)  # noqa: E731
        on: list[int] = []
        off: list[int] = []
        for pair in range(steps):  # one step each way per pair, the order alternating
            for view_on in (True, False) if pair % 2 == 0 else (False, True):
                rt.exec_context = with_view if view_on else without  # type: ignore[method-assign]
                (on if view_on else off).append(c.timed(lambda: c.runtime_step(rt)))
        paired = [a - b for a, b in zip(on[WARMUP:], off[WARMUP:], strict=True)]
        rt.exec_context = with_view  # type: ignore[method-assign]
        status_ns = c.timed(lambda: c.runtime_step(rt))
        ctx = with_view()
        view = ctx.git
        if view is None:
            raise RuntimeError("the runtime made no git view")
        made: list[int] = []
        for _ in range(steps):
            with tempfile.TemporaryDirectory() as scratch:
                where = Path(scratch) / "git"
                made.append(
                    c.timed(
                        lambda w=where: gitview.make(  # type: ignore[misc]
                            view, repo, w, tmp / "wt", confined=ctx.confinement.confined
                        )
                    )
                )
        s_on, s_off, s_made = c.stats(on[WARMUP:]), c.stats(off[WARMUP:]), c.stats(made)
        return {
            "added": statistics.median(paired) / 1e6,
            "on_med": s_on.median_ms, "on_p95": s_on.p95_ms,
            "off_med": s_off.median_ms, "off_p95": s_off.p95_ms,
            "made_med": s_made.median_ms, "made_p95": s_made.p95_ms,
            "status_step": status_ns / 1e6, "confined": float(ctx.confinement.confined),
        }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps each way per size")
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    layouts = [c.Layout(10, 10)] if args.quick else [c.Layout(10, 10), c.Layout(50, 60)]
    t0 = time.monotonic()
    pressure = c.Pressure()
    rows = [(lay, measure(lay, steps)) for lay in layouts]
    iso = sandbox.resolve("auto")
    print(c.BEGIN.format(name="gitview"))
    print(f"git view in an exec step: {c.machine_line()}, {time.monotonic() - t0:.0f} s")
    print(f"exec of `true`, isolation {iso.kind}, {steps - WARMUP} steps each way per size")
    print()
    print(
        "| repository | step with view ms (median, p95) | without ms (median, p95) "
        "| added ms (median of pairs) | view set-up ms (median, p95) | `git status` step ms "
        "| target |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for lay, r in rows:
        added = r["added"]
        verdict = "PASS" if added <= TARGET_MS else "MISS"
        print(
            f"| {lay.label()} | {r['on_med']:.2f}, {r['on_p95']:.2f} "
            f"| {r['off_med']:.2f}, {r['off_p95']:.2f} | {added:.2f} "
            f"| {r['made_med']:.2f}, {r['made_p95']:.2f} | {r['status_step']:.1f} "
            f"| ≤ {TARGET_MS:g} ms: {verdict} |"
        )
    print()
    print(pressure.line())
    print(c.END.format(name="gitview"))


if __name__ == "__main__":
    main()
