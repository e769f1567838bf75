"""Interleaved A/B of gitrun source trees: the step and the advance of ``bench_peers.py``,
each tree in its own process, batches in turn, in one run on one disk.

Each ``--tree NAME=PATH`` is a checkout of gitrun (a ``git worktree`` of the commit to
compare; the first is the baseline). One child process per tree imports gitrun from that
path and sets up the peers benchmark's two gitrun contenders (a full runtime step with a
2 KiB ``write_file``, and a checkpoint advance with its witness); the parent then asks
every child for a batch of steps and a batch of advances in turn, the order rotated
every round, so a change in disk speed or in the other load on the machine hits every
tree alike. Wall and CPU (user+sys of the whole child, its threads included) are taken
per operation; the table gives medians and each tree's change against the first.

    python benchmarks/bench_ab.py --tree A=/tmp/ab/base --tree B=/tmp/ab/change \\
        [--rounds 30] [--batch 10] [--strace 20]

``--strace N`` also counts, per operation, every system call and every lock taken
(``flock`` with ``LOCK_EX``) under ``strace -f`` over N operations of each tree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPS = ("step", "advance")


def _child(tree: str, work: str, count: int) -> None:
    """Serve batches over stdin/stdout: ``<op> <n>`` -> a JSON list of (wall, cpu) ns."""
    sys.path.insert(0, tree)
    # An editable install's finder would hand out the installed tree: drop it.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path[1:1] = [str(HERE), str(HERE.parent)]  # _common puts its root first unless present
    import _common as c
    import _peers
    from bench_peers import StepContender

    import gitrun

    if not str(Path(gitrun.__file__).resolve()).startswith(str(Path(tree).resolve())):
        raise RuntimeError(f"gitrun came from {gitrun.__file__}, not {tree}")
    step = StepContender(Path(work) / "step", count)
    advance, _, _ = _peers.gitrun_advance_op(Path(work) / "advance")
    done = {"step": 0, "advance": 0}
    fns = {"step": step.op, "advance": advance}
    print("ready", flush=True)
    for line in sys.stdin:
        op, _, n = line.strip().partition(" ")
        if op == "strace":
            _traced(fns, done, int(n))
            print("[]", flush=True)
            continue
        out = []
        for _ in range(int(n)):
            w0, c0 = time.perf_counter_ns(), time.process_time_ns()
            fns[op](done[op])
            out.append((time.perf_counter_ns() - w0, time.process_time_ns() - c0))
            done[op] += 1
        print(json.dumps(out), flush=True)
    del c


def _traced(fns: dict, done: dict[str, int], n: int) -> None:  # type: ignore[type-arg]
    import _syncs

    for op in OPS:
        _syncs._mark(f"{_syncs.BEGIN}-{op}")
        for _ in range(n):
            fns[op](done[op])
            done[op] += 1
        _syncs._mark(f"{_syncs.END}-{op}")


class Child:
    def __init__(self, name: str, tree: str, work: Path, count: int, trace: Path | None) -> None:
        self.name = name
        cmd = [sys.executable, __file__, "--child", tree, str(work), str(count)]
        if trace is not None:
            cmd = ["strace", "-f", "-qq", "-o", str(trace), *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._line() != "ready":
            raise RuntimeError(f"tree {name} did not start")

    def _line(self) -> str:
        if self.proc.stdout is None:
            raise RuntimeError("no pipe")
        return self.proc.stdout.readline().strip()

    def ask(self, op: str, n: int) -> list[tuple[int, int]]:
        if self.proc.stdin is None:
            raise RuntimeError("no pipe")
        self.proc.stdin.write(f"{op} {n}\n")
        self.proc.stdin.flush()
        return [(int(w), int(c)) for w, c in json.loads(self._line())]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _strace_counts(trace: Path, n: int) -> dict[str, tuple[float, float]]:
    """Per op: (system calls, exclusive flocks) per operation between its markers."""
    lines = trace.read_text().splitlines()
    out = {}
    for op in OPS:
        begin = next(i for i, ln in enumerate(lines) if f"begin-{op}" in ln)
        end = next(i for i, ln in enumerate(lines) if f"end-{op}" in ln)
        calls = [ln for ln in lines[begin + 1 : end] if "resumed>" not in ln and "+++" not in ln]
        locks = sum("flock(" in ln and "LOCK_EX" in ln for ln in calls)
        out[op] = (len(calls) / n, locks / n)
    return out


Samples = dict[tuple[str, str], list[tuple[int, int]]]


def measure(trees: list[tuple[str, str]], tmp: Path, args: argparse.Namespace) -> Samples:
    """Every tree's step and advance, batch by batch in turn (the order rotated)."""
    count = args.rounds * args.batch + args.warmup + args.strace + 5
    children = [Child(n, p, tmp / n, count, None) for n, p in trees]
    samples: Samples = {(ch.name, op): [] for ch in children for op in OPS}
    try:
        for ch in children:
            for op in OPS:
                ch.ask(op, args.warmup)
        for r in range(args.rounds):
            order = children[r % len(children) :] + children[: r % len(children)]
            for op in OPS if r % 2 == 0 else OPS[::-1]:
                for ch in order:
                    samples[(ch.name, op)] += ch.ask(op, args.batch)
    finally:
        for ch in children:
            ch.close()
    return samples


def table(trees: list[tuple[str, str]], samples: Samples) -> list[str]:
    lines = [
        "| tree | op | wall median ms | CPU median ms | wall vs first | CPU vs first |",
        "|---|---|---|---|---|---|",
    ]
    base: dict[str, tuple[float, float]] = {}
    for name, _ in trees:
        for op in OPS:
            wall = statistics.median(w for w, _ in samples[(name, op)]) / 1e6
            cpu = statistics.median(c for _, c in samples[(name, op)]) / 1e6
            base.setdefault(op, (wall, cpu))
            dw, dc = (wall / base[op][0] - 1) * 100, (cpu / base[op][1] - 1) * 100
            lines.append(f"| {name} | {op} | {wall:.3f} | {cpu:.3f} | {dw:+.1f}% | {dc:+.1f}% |")
    return lines


def traced(trees: list[tuple[str, str]], tmp: Path, n: int) -> list[str]:
    """System calls and exclusive flocks per operation, under strace, per tree."""
    lines = ["| tree | op | system calls per op | exclusive flocks per op |", "|---|---|---|---|"]
    for name, path in trees:
        trace = tmp / f"{name}.strace"
        ch = Child(name, path, tmp / f"{name}-strace", n + 5, trace)
        ch.ask("strace", n)
        ch.close()
        for op, (calls, locks) in _strace_counts(trace, n).items():
            lines.append(f"| {name} | {op} | {calls:.0f} | {locks:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH (first: baseline)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--strace", type=int, default=0, help="count syscalls over N ops per tree")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return
    if len(args.tree) < 2:
        ap.error("give at least two --tree NAME=PATH")
    trees = [(n, p) for n, _, p in (t.partition("=") for t in args.tree)]
    with tempfile.TemporaryDirectory(prefix="gitrun-ab-") as tmp:
        samples = measure(trees, Path(tmp), args)
        print(f"interleaved A/B: {args.rounds} rounds of {args.batch} per tree and op, "
              f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
        print("\n".join(table(trees, samples)))
        if args.strace and shutil.which("strace"):
            print()
            print("\n".join(traced(trees, Path(tmp), args.strace)))


if __name__ == "__main__":
    main()
