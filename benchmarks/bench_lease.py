"""Lease acquire/renew latency and total throughput as the number of racing workers grows.

N worker processes (``spawn`` start method, never fork with libgit2) race on M runs in
one repository. Each worker repeats a cycle for a fixed time: pick a run at random, try
to acquire its lease (``LeaseManager.acquire``; a live lease held by another worker
refuses at once with ``LeaseHeld``, counted as *busy*), load and verify the run's
checkpoint, make two fenced checkpoint advances (``CheckpointStore.advance`` with the
lease ref locked in the same transaction), renew the lease, release it. fsync on.

Reported per N: median/p95 of a successful acquire, a busy (refused) acquire, a renew,
a fenced advance; and total cycles, lease operations and checkpoint advances per second
across all workers. At the end every run's checkpoint chain is checked: generations
advanced exactly by the number of acknowledged advances, none skipped or duplicated.
Issue #5 asks to report how these change with N (no fixed target). On a machine with
fewer cores than N the workers also compete for CPU; the machine line says how many
cores there are.

    python benchmarks/bench_lease.py [--quick] [--workers 1,2,4,8] [--runs 16] [--seconds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import _common as c

from gitrun.core.errors import CasFailed, LeaseHeld, LeaseLost
from gitrun.store.checkpoint import CheckpointStore
from gitrun.store.gitstore import open_repo, read_ref
from gitrun.store.keys import load_keyring
from gitrun.store.lease import LeaseManager

KINDS = ("acquire", "busy", "renew", "advance", "load", "release")


def setup(tmp: Path, runs: int) -> list[tuple[str, str]]:
    """M stopped runs in one repository: (run id, checkpoint ref) each."""
    layout = c.Layout(2, 5, file_size=256)
    repo, base = c.make_repo(tmp / "repo", layout)
    task = c.make_task(tmp / "task", tmp / "repo", base)
    out = []
    for i in range(runs):
        run = c.start_run(
            repo,
            base,
            task,
            run_id=f"lease-{i:02d}",
            worktree=tmp / f"wt-{i:02d}",
            key_file=tmp / "keys" / "checkpoint.keyring",
            lease_seconds=30,
        )
        run.lease.release()
        out.append((f"lease-{i:02d}", run.ref))
    return out


def worker(
    repo_path: str,
    key_file: str,
    runs: list[tuple[str, str]],
    name: str,
    seed: int,
    ready: Any,
    go: Any,
    seconds: float,
    results: Any,
) -> None:
    """One racing worker process (spawned). Puts its samples and counts on ``results``."""
    repo = open_repo(repo_path)
    store = CheckpointStore(repo, load_keyring(Path(key_file)))
    rng = random.Random(seed)
    samples: dict[str, list[int]] = {k: [] for k in KINDS}
    counts = {"cycles": 0, "lost": 0}
    advanced: dict[str, int] = {}
    ready.put(name)
    go.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run_id, ref = rng.choice(runs)
        lm = LeaseManager(repo, run_id, name, 30.0)
        t0 = time.perf_counter_ns()
        try:
            lm.acquire(0)
        except LeaseHeld:
            samples["busy"].append(time.perf_counter_ns() - t0)
            continue
        samples["acquire"].append(time.perf_counter_ns() - t0)
        try:
            t0 = time.perf_counter_ns()
            stored = store.load(ref, scenario_parts=None)
            samples["load"].append(time.perf_counter_ns() - t0)
            state, oid = stored.state, stored.oid
            for _ in range(2):
                nxt = replace(
                    state,
                    generation=state.generation + 1,
                    identity=name,
                    lease_version=lm.fence.version,
                    updated_at=time.time(),
                )
                t0 = time.perf_counter_ns()
                oid = store.advance(ref, nxt, oid, lm.fence)
                samples["advance"].append(time.perf_counter_ns() - t0)
                advanced[run_id] = advanced.get(run_id, 0) + 1
                state = nxt
            t0 = time.perf_counter_ns()
            lm.renew(state.generation)
            samples["renew"].append(time.perf_counter_ns() - t0)
            counts["cycles"] += 1
        except (LeaseLost, CasFailed):
            counts["lost"] += 1  # must not happen: nobody takes a live lease here
        finally:
            t0 = time.perf_counter_ns()
            lm.release()
            samples["release"].append(time.perf_counter_ns() - t0)
    results.put((name, samples, counts, advanced))


def generations(repo_path: str, key_file: str, runs: list[tuple[str, str]]) -> dict[str, int]:
    repo = open_repo(repo_path)
    store = CheckpointStore(repo, load_keyring(Path(key_file)))
    out = {}
    for run_id, ref in runs:
        if read_ref(repo, ref) is None:
            raise RuntimeError(f"{ref} vanished")
        out[run_id] = store.load(ref, scenario_parts=None).state.generation
    return out


def race(
    n: int, repo_path: str, key_file: str, runs: list[tuple[str, str]], seconds: float
) -> tuple[dict[str, list[int]], dict[str, int], dict[str, int]]:
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=worker,
            args=(
                repo_path,
                key_file,
                runs,
                f"w{n}-{i}",
                1000 * n + i,
                ready,
                go,
                seconds,
                results,
            ),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    go.set()
    merged: dict[str, list[int]] = {k: [] for k in KINDS}
    counts = {"cycles": 0, "lost": 0}
    advanced: dict[str, int] = {}
    for _ in procs:
        _, samples, cnt, adv = results.get(timeout=seconds + 120)
        for k, v in samples.items():
            merged[k] += v
        for k, v in cnt.items():
            counts[k] += v
        for k, v in adv.items():
            advanced[k] = advanced.get(k, 0) + v
    for p in procs:
        p.join(timeout=30)
        if p.exitcode != 0:
            raise RuntimeError(f"worker {p.name} exited with {p.exitcode}")
    return merged, counts, advanced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 s per N instead of 4 s")
    ap.add_argument("--workers", default="1,2,4,8", help="comma-separated N values")
    ap.add_argument("--runs", type=int, default=16, help="M runs raced on (default 16)")
    ap.add_argument("--seconds", type=float, default=None, help="racing time per N (default 4)")
    args = ap.parse_args()
    seconds = args.seconds or (1.0 if args.quick else 4.0)
    ns = [int(x) for x in args.workers.split(",")]

    print(f"lease benchmark: {c.machine_line()}")
    pressure = c.Pressure()
    rows = []
    with c.bench_dir("lease") as tmp:
        runs = setup(tmp, args.runs)
        repo_path, key_file = str(tmp / "repo"), str(tmp / "keys" / "checkpoint.keyring")
        before = generations(repo_path, key_file, runs)
        acked: dict[str, int] = {}
        for n in ns:
            merged, counts, advanced = race(n, repo_path, key_file, runs, seconds)
            for k, v in advanced.items():
                acked[k] = acked.get(k, 0) + v
            st = {k: c.stats(v) for k, v in merged.items()}
            lease_ops = len(merged["acquire"]) + len(merged["renew"]) + len(merged["release"])
            rows.append((n, st, counts, lease_ops, len(merged["advance"])))
            print(
                f"  N={n}: {counts['cycles']} cycles, {len(merged['busy'])} busy acquires, "
                f"{counts['lost']} lost",
                flush=True,
            )
        after = generations(repo_path, key_file, runs)
    bad = [r for r, _ in runs if after[r] - before[r] != acked.get(r, 0)]
    chain = (
        (
            "every run's generation advanced exactly by its acknowledged advances "
            f"({sum(acked.values()):,} in all): OK"
        )
        if not bad
        else f"GENERATION MISMATCH on {bad}"
    )

    lines = [
        "### Lease contention",
        "",
        f"{args.runs} runs in one repository, {seconds:g} s per N; cycle = acquire, load+verify "
        "checkpoint, 2 fenced advances, renew, release.",
        "",
        "| N workers | acquire median ms | p95 | busy (refused) acquire median | p95 "
        "| renew median | p95 | fenced advance median | p95 | cycles/s | lease ops/s "
        "| advances/s | busy acquires |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, st, counts, lease_ops, advances in rows:
        lines.append(
            f"| {n} | {st['acquire'].cells()} | {st['busy'].cells()} | {st['renew'].cells()} | "
            f"{st['advance'].cells()} | {counts['cycles'] / seconds:.1f} | "
            f"{lease_ops / seconds:.1f} | {advances / seconds:.1f} | {st['busy'].n} |"
        )
    lost = sum(r[2]["lost"] for r in rows)
    lines += ["", f"Chains: {chain}. Lost leases / failed CAS while holding a live lease: {lost}."]
    print()
    c.markdown_block("lease", lines, pressure)


if __name__ == "__main__":
    main()
