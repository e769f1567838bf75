"""Latency of one write step, for small and large repositories, early and late in a run.

Two kinds of measurement; every (repository, kind, position) case is its own run
(branch + worktree, contents salted per run so no run finds its objects pre-written):

* **adapter write** — ``Environment.execute`` of one ``write_file``: key lookup, tree
  built from the parent tree, commit with trailers, fenced compare-and-swap of the
  branch, receipt index ref, file sync (worktree file + index). No gate, no checkpoint.
* **runtime step** — what ``gitrun run`` does per write: observe, gate, intent
  checkpoint, the adapter write; its receipt rides in the next checkpoint
  (``Runtime.step`` + ``Runtime.execute_pending``), driven by a scripted agent of N
  ``write_file`` actions.

"Write #k" is a window of ``--window`` consecutive writes starting at the k-th write of
the run (earlier writes run too, unmeasured). The late runs are first driven to write
#(late - early); then all runs advance together, one write each per round in rotating
order, so early and late windows are measured side by side and a change in disk speed
(other processes) hits every case alike. Repositories are laid out as nested
directories (``src/pkgNNN/modNNN.py``, 100 per directory, ~2 KB each). Target (issue
#15, tighter than issue #2's 1.5x): the larger cases within 1.2x of the smaller ones (100
files; write #10), compared on the median. The floor is a bare
write+fsync+rename(+dir fsync) of a 2 KB file on the same disk, in the same run.

    python benchmarks/bench_write_step.py [--quick] [--kinds adapter,runtime]
        [--late 1000] [--window 100] [--large-files 10000]

Issue #15's full growth check (write #10,000 in a 100,000-file repository; ~10 minutes,
most of it driving the late runs and checking out the large worktrees):

    python benchmarks/bench_write_step.py --kinds runtime --late 10000 --large-files 100000

``--quick`` is a smoke run: runtime step only, a 2,500-file large repository, write #10
against write #100 (checking out 10,000 files per worktree alone takes seconds).
"""

from __future__ import annotations

import argparse
import time

import _common as c

from gitrun.core.records import Action, Precondition, new_key

TARGET = 1.2


class AdapterWriter:
    """One ``Environment.execute`` per call; the precondition is read outside the timing."""

    def __init__(self, run: c.Run, actions: tuple[Action, ...]) -> None:
        self.env, self.fence, self.actions = run.env, run.lease.fence, actions

    def __call__(self, n: int) -> int:
        action = self.actions[n - 1]
        obs = self.env.observe(full=False)
        pre = Precondition(obs.instance_id, obs.head, obs.tree)
        key, dig = new_key(), action.intent_digest()
        t0 = time.perf_counter_ns()
        self.env.execute(action, key, dig, pre, self.fence)
        return time.perf_counter_ns() - t0


class RuntimeStepper:
    """One full runtime step per call (observe, gate, intent ckpt, write; receipt rides)."""

    def __init__(self, run: c.Run) -> None:
        self.rt = run.runtime

    def __call__(self, n: int) -> int:
        t0 = time.perf_counter_ns()
        c.runtime_step(self.rt)
        dt = time.perf_counter_ns() - t0
        if self.rt.state.budgets.steps != n:
            raise RuntimeError(f"step {n}: the run recorded {self.rt.state.budgets.steps} writes")
        return dt


Case = tuple[c.Layout, str, int]  # (repository layout, adapter|runtime, write position)


def measure(
    layouts: list[c.Layout], kinds: list[str], early: int, late: int, window: int
) -> dict[Case, c.Stats]:
    """Every (layout, kind, position) case gets its own run. The late runs are first
    driven to write #(late - early) unmeasured; then all runs advance together, one
    write each per round, so the early windows and the late windows are measured side
    by side, interleaved, and a change in disk speed (other processes) hits all alike."""
    preroll = late - early
    with c.bench_dir("write") as tmp:
        cases: dict[Case, object] = {}
        for i, lay in enumerate(layouts):
            t0 = time.perf_counter()
            root = tmp / f"r{i}"
            repo, base = c.make_repo(root / "repo", lay)
            task = c.make_task(root / "task", root / "repo", base)
            key_file = tmp / "keys" / "checkpoint.keyring"
            for kind in kinds:
                for pos in (early, late):
                    run_id = f"{kind}-{pos}"
                    actions = c.write_actions(lay, late + window, salt=run_id)
                    run = c.start_run(
                        repo,
                        base,
                        task,
                        run_id=run_id,
                        worktree=root / f"wt-{run_id}",
                        key_file=key_file,
                        actions=actions,
                        witness_dir=root / "witness",  # run ids repeat across layouts
                    )
                    stepper = (
                        AdapterWriter(run, actions) if kind == "adapter" else RuntimeStepper(run)
                    )
                    cases[(lay, kind, pos)] = stepper
            print(
                f"  {lay.label()}: repo and {2 * len(kinds)} worktrees set up in "
                f"{time.perf_counter() - t0:.1f}s",
                flush=True,
            )
        t0 = time.perf_counter()
        late_cases = [case for case in cases if case[2] == late]
        for n in range(1, preroll + 1):
            for case in late_cases:
                cases[case](n)  # type: ignore[operator]
            if n % 250 == 0:
                print(
                    f"  pre-roll: {n}/{preroll} writes per late run "
                    f"({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
        print(
            f"  pre-roll of {len(late_cases)} late runs to write #{preroll}: "
            f"{time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        floor_case: Case = (layouts[0], "floor", 0)
        floor_dir, payload = tmp / "floor", c.file_text(0, 0, layouts[0].file_size).encode()
        cases[floor_case] = lambda _: c.floor_samples(floor_dir, payload, 1, warmup=0)[0]
        samples: dict[Case, list[int]] = {case: [] for case in cases}
        order = list(cases)
        t0 = time.perf_counter()
        for j in range(1, early + window):
            rotated = order[j % len(order) :] + order[: j % len(order)]
            for case in rotated:
                n = j if case[2] in (early, 0) else preroll + j
                dt = cases[case](n)  # type: ignore[operator]
                if n >= max(case[2], early):  # writes before the window are warm-up
                    samples[case].append(dt)
        print(f"  measured rounds: {time.perf_counter() - t0:.1f}s", flush=True)
    return {case: c.stats(v) for case, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: runtime step only, 2,500-file large repo, write #10 vs #100",
    )
    ap.add_argument("--early", type=int, default=10)
    ap.add_argument("--late", type=int, default=None, help="default 1000 (100 with --quick)")
    ap.add_argument(
        "--window", type=int, default=None, help="writes per window; default 100 (10 quick)"
    )
    ap.add_argument(
        "--large-files",
        type=int,
        default=None,
        help="large repo: N files, 100 per directory (default 10,000; 2,500 with --quick)",
    )
    ap.add_argument(
        "--kinds", default=None, help="adapter,runtime (default both; runtime only with --quick)"
    )
    args = ap.parse_args()
    late = args.late or (100 if args.quick else 1000)
    window = args.window or (10 if args.quick else 100)
    kinds = (args.kinds or ("runtime" if args.quick else "adapter,runtime")).split(",")
    small = c.Layout(10, 10)
    large_files = args.large_files or (2500 if args.quick else 10000)
    if large_files < 100 or large_files % 100:
        ap.error("--large-files must be a positive multiple of 100")
    large = c.Layout(large_files // 100, 100)

    print(f"write step benchmark: {c.machine_line()}")
    print(f"fsync on; windows of {window} writes at write #{args.early} and #{late}")
    pressure = c.Pressure()
    flat = measure([small, large], kinds, args.early, late, window)
    res = {
        lay: {k: {pos: flat[(lay, k, pos)] for pos in (args.early, late)} for k in kinds}
        for lay in (small, large)
    }
    floor = flat[(small, "floor", 0)]

    names = {
        "adapter": "adapter write (`Environment.execute`)",
        "runtime": "runtime step (intent ckpt + write; receipt rides)",
    }
    lines = [
        "| case | " + " | ".join(f"{names[k]} median ms | p95 ms" for k in kinds) + " |",
        "|---|" + "---:|---:|" * len(kinds),
    ]
    for lay in (small, large):
        for pos in (args.early, late):
            cells = " | ".join(res[lay][k][pos].cells() for k in kinds)
            lines.append(f"| {lay.files:,} files, write #{pos:,} | {cells} |")
    lines.append(
        f"| floor: write+fsync+rename+dir fsync, {small.file_size} B | "
        + " | ".join(floor.cells() for _ in kinds)
        + " |"
    )
    lines += [
        "",
        f"| ratio (target <= {TARGET}x, on the median) | "
        + " | ".join(f"{k} median | p95 | verdict" for k in kinds)
        + " |",
        "|---|" + "---:|---:|:---:|" * len(kinds),
    ]
    comparisons = [
        (
            f"{large.files:,} / {small.files:,} files at write #{args.early}",
            (large, args.early),
            (small, args.early),
        ),
        (
            f"{large.files:,} / {small.files:,} files at write #{late:,}",
            (large, late),
            (small, late),
        ),
        (
            f"write #{late:,} / #{args.early} in {small.files:,} files",
            (small, late),
            (small, args.early),
        ),
        (
            f"write #{late:,} / #{args.early} in {large.files:,} files",
            (large, late),
            (large, args.early),
        ),
        (
            f"{large.files:,} files #{late:,} / {small.files:,} files #{args.early}",
            (large, late),
            (small, args.early),
        ),
    ]
    for label, (lb, pb), (ls, ps) in comparisons:
        row: list[str] = []
        for k in kinds:
            big, sml = res[lb][k][pb], res[ls][k][ps]
            r = big.median_ms / sml.median_ms
            row.append(f"{r:.2f}x | {big.p95_ms / sml.p95_ms:.2f}x | {c.verdict(r, TARGET)}")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    for k in kinds:
        worst = max(
            res[lay][k][pos].median_ms for lay in (small, large) for pos in (args.early, late)
        )
        lines.append("")
        lines.append(
            f"{names[k]}: slowest median is {worst / floor.median_ms:.1f}x the floor "
            f"({floor.median_ms:.3f} ms)."
        )
    print()
    c.markdown_block("write_step", ["### Write step latency", "", *lines], pressure)


if __name__ == "__main__":
    main()
