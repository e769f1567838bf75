"""gitrun's durable step and checkpoint advance beside DBOS Transact, LangGraph and the
disk floor, interleaved in one process on the same disk with the same payload.

* **gitrun step** — a full runtime step through the real ``Runtime`` (observe, gate,
  intent checkpoint carrying the previous step's receipt, moved in the same journal
  record as the write commit; its own receipt rides in the next step's checkpoint;
  ``Runtime.step`` +
  ``Runtime.execute_pending``), fsync on, freshness witness on, in a 100-file
  repository: one ``write_file`` of about 2 KiB per step, each step its own content.
* **DBOS step** — one ``@DBOS.step`` of a long-running ``@DBOS.workflow`` (SQLite
  system database, fully local) that writes the same bytes durably (temp file, fsync,
  rename, directory fsync) and returns an output shaped like gitrun's receipt (same
  fields, the file's digest as its id); DBOS records that output before the step returns.
* **gitrun advance** — ``CheckpointStore.advance`` of a real intent checkpoint (about
  5.5 KB state) with its witness, as the product does.
* **LangGraph** — ``SqliteSaver.put`` of a checkpoint carrying the same state plus
  ``put_writes`` of its pending action (``journal_mode=WAL``, ``synchronous=FULL``).
* **floor** — a bare write+fsync+rename+dir fsync of the step's bytes.

One operation of each per round, the order rotated every round (the loop runs inside
the DBOS workflow), so a change in disk speed hits all alike. Targets (issue #15): a
step at most 1.0x a DBOS step, an advance at most 1.5x LangGraph, on the median. The
last line reads ``step/dbos=<ratio> advance/langgraph=<ratio>`` (``n/a`` for a peer
not installed: ``pip install -e .[bench]``).

    python benchmarks/bench_peers.py [--quick] [--iterations N] [--warmup N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as c
import _peers
import _syncs

from gitrun.core.codec import encode
from gitrun.core.records import Action

STEP_TARGET = 1.0
ADVANCE_TARGET = 1.5
LAYOUT = c.Layout(10, 10)


class StepContender:
    """The gitrun run driven one write per call; the same action list feeds the peers."""

    def __init__(self, tmp: Path, count: int) -> None:
        repo, base = c.make_repo(tmp / "repo", LAYOUT)
        task = c.make_task(tmp / "task", tmp / "repo", base)
        # One unmeasured first write, so a receipt exists to shape the DBOS output on.
        self.actions = c.write_actions(LAYOUT, count + 1, salt="peers")
        run = c.start_run(
            repo,
            base,
            task,
            run_id="peers",
            worktree=tmp / "wt",
            key_file=tmp / "keys" / "checkpoint.keyring",
            actions=self.actions,
        )
        _peers.steady_fanout(repo.path)
        self.rt = run.runtime
        c.runtime_step(self.rt)
        last = self.rt.state.receipts.last
        if last is None:
            raise RuntimeError("the first bench write left no receipt")
        self.receipt: dict[str, Any] = encode(last)

    def action(self, i: int) -> Action:
        """The action of round ``i`` (the first action was the unmeasured write)."""
        return self.actions[i + 1]

    def op(self, i: int) -> None:
        c.runtime_step(self.rt)
        if self.rt.state.budgets.steps != i + 2:
            raise RuntimeError(f"round {i}: the run recorded {self.rt.state.budgets.steps} writes")


def dbos_step_fn(tmp: Path, step: StepContender) -> Callable[[int], object]:
    """What the DBOS step does: the same bytes written durably, a receipt-shaped output."""
    directory = tmp / "dbos-files"
    directory.mkdir()

    def fn(i: int) -> object:
        action = step.action(i)
        data = (action.content or "").encode()
        c.durable_replace(directory, "target.py", data)
        out = dict(step.receipt)
        out.update(
            commit=hashlib.sha1(data, usedforsecurity=False).hexdigest(),
            intent_digest=action.intent_digest(),
            paths=[action.path],
            committed_at=int(time.time()),
        )
        return out

    return fn


def floor_fn(tmp: Path, step: StepContender) -> _peers.Op:
    directory = tmp / "floor"
    directory.mkdir()

    def op(i: int) -> None:
        c.durable_replace(directory, "target.py", (step.action(i).content or "").encode())

    return op


Samples = dict[str, list[int]]
Notes = dict[str, str]


def contenders(tmp: Path, count: int) -> tuple[dict[str, _peers.Op], Notes, _peers.DbosPeer | None]:
    """Every contender set up in ``tmp``, good for ``count`` operations each."""
    step = StepContender(tmp / "step", count)
    advance, message, size = _peers.gitrun_advance_op(tmp / "advance")
    size_b = len((step.action(0).content or "").encode())
    ops: dict[str, _peers.Op] = {"step": step.op, "advance": advance}
    notes = {
        "step": f"100-file repo, witness on, ~{size_b:,} B file per step",
        "advance": f"intent checkpoint, witness on; {size}",
        "floor": "the step's bytes",
    }
    doc = json.loads(message.split(b"\n\n")[1])
    lg, notes["langgraph"] = _peers.sqlite_saver_op(tmp, doc, doc.get("pending") or {})
    if lg is not None:
        ops["langgraph"] = lg
        notes["langgraph"] = f"same state as the advance; {notes['langgraph']}"
    dbos, note = _peers.dbos_peer(tmp, dbos_step_fn(tmp, step))
    if dbos is not None:
        ops["dbos"] = dbos.op
        note = f"same bytes written durably, receipt-shaped output; {dbos.info}"
    notes["dbos"] = note
    ops["floor"] = floor_fn(tmp, step)
    return ops, notes, dbos


def run_body(dbos: _peers.DbosPeer | None, body: Callable[[int], None], rounds: int) -> None:
    """Run ``body`` inside the DBOS workflow (so DBOS steps can run), or bare without it."""
    if dbos is not None:
        dbos.run(body, rounds)
        dbos.close()
    else:
        body(rounds)


def measure(rounds: int, warmup: int) -> tuple[Samples, Samples, Notes]:
    """Set every contender up, then run the interleaved rounds; wall and CPU samples."""
    with c.bench_dir("peers") as tmp:
        ops, notes, dbos = contenders(tmp, rounds + warmup)
        wall: Samples = {name: [] for name in ops}
        cpu: Samples = {name: [] for name in ops}
        body = _peers.interleave(ops, warmup, wall, cpu)
        t0 = time.perf_counter()
        run_body(dbos, body, rounds + warmup)
        print(f"  {rounds} measured rounds (+{warmup} warm-up) in {time.perf_counter() - t0:.1f}s")
    return wall, cpu, notes


def sync_child(name: str, count: int) -> None:
    """Under strace (``--syncs``): ``count`` operations of one contender between markers."""
    with c.bench_dir("peers-syncs") as tmp:
        ops, _, dbos = contenders(tmp, count + 5)

        def body(_: int) -> None:
            for i in range(5):
                ops[name](i)
            with _syncs.marked():
                for i in range(5, 5 + count):
                    ops[name](i)

        run_body(dbos, body, 0)


LABELS = {
    "step": "gitrun step (intent ckpt riding with the write commit: one record; receipt rides)",
    "dbos": "DBOS Transact step (durable file write + recorded output)",
    "advance": "gitrun `CheckpointStore.advance` (with witness)",
    "langgraph": "LangGraph `SqliteSaver.put` + `put_writes`",
    "floor": "floor: write+fsync+rename+dir fsync",
}


def ratio(res: dict[str, c.Stats], a: str, b: str) -> float | None:
    if a not in res or b not in res:
        return None
    return res[a].median_ms / res[b].median_ms


def paired(wall: Samples, a: str, b: str, k: int = 1) -> c.Stats | None:
    """Median/p95 of ``a - k*b`` per round: both ran in the same round, so a slow disk
    moment hits both and mostly cancels out of the difference."""
    if a not in wall or b not in wall:
        return None
    diffs = [x - k * y for x, y in zip(wall[a], wall[b], strict=True)]
    return c.stats([max(d, 0) for d in diffs]) if diffs else None


def render(
    wall: Samples,
    cpu: Samples,
    notes: Notes,
    load: str,
    counts: dict[str, _syncs.Counts] | None = None,
) -> str:
    res = {name: c.stats(v) for name, v in wall.items()}
    cpu_ms = {name: c.stats(v) for name, v in cpu.items()}
    floor = res["floor"]
    head = "| contender | median ms | p95 ms | CPU ms (median) | / floor |"
    rule = "|---|---:|---:|---:|---:|"
    if counts is not None:
        head += " syncs / op (fsync+fdatasync+syncfs) | files created / op |"
        rule += "---:|---:|"
    lines = ["### gitrun beside its peers", "", head + " notes |", rule + "---|"]
    for name, label in LABELS.items():
        extra = "" if counts is None else " — | — |"
        if counts is not None and name in counts:
            extra = f" {counts[name].cells()} |"
        if name not in res:
            lines.append(f"| {label} | — | — | — | — |{extra} {notes[name]} |")
            continue
        over = res[name].median_ms / floor.median_ms
        lines.append(
            f"| {label} | {res[name].cells()} | {cpu_ms[name].median_ms:.3f} | "
            f"{over:.1f}x |{extra} {notes[name]} |"
        )
    sd, al = ratio(res, "step", "dbos"), ratio(res, "advance", "langgraph")
    lines.append("")
    for what, r, target in (
        ("gitrun step / DBOS step", sd, STEP_TARGET),
        ("gitrun advance / LangGraph put+put_writes", al, ADVANCE_TARGET),
    ):
        shown = "n/a (peer skipped)" if r is None else f"{r:.2f}x ({c.verdict(r, target)})"
        lines.append(f"* {what}: {shown}, target <= {target:.1f}x on the median")
    lines += breakdown(res, wall)
    c.markdown_block("peers", [*lines, "", load])

    def cell(r: float | None) -> str:
        return "n/a" if r is None else f"{r:.2f}"

    return f"step/dbos={cell(sd)} advance/langgraph={cell(al)}"


def breakdown(res: dict[str, c.Stats], wall: Samples) -> list[str]:
    """Where a step's time goes, from differences paired by round."""
    step, adv = res["step"], res["advance"]
    rest = paired(wall, "step", "advance", k=1)
    out = [
        f"* Where a step goes: a checkpoint advance on its own (the advance row) is "
        f"{adv.median_ms:.3f} ms = {100 * adv.median_ms / step.median_ms:.0f}% of the step's "
        f"{step.median_ms:.3f} ms median; in the step the intent's checkpoint rides in the "
        "write's journal record, so it costs its commit, its rename and the witness, not "
        "a sync of its own"
    ]
    if rest is not None:
        out[-1] += (
            f"; step - advance (observe, gate, the write, worktree and index sync, Python) "
            f"is {rest.median_ms:.3f} ms, paired by round."
        )
    db = paired(wall, "dbos", "floor")
    if db is not None:
        out.append(
            f"* A DBOS step costs {db.median_ms:.3f} ms over the floor (its recorded "
            "output: one SQLite transaction), paired by round."
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (~20 s): 150 rounds")
    ap.add_argument("--iterations", type=int, default=None, help="measured rounds (default 1000)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument(
        "--syncs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count fsync/fdatasync and file creations per operation under strace "
        "(default on when strace is installed, off with --quick)",
    )
    ap.add_argument("--sync-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sync_child:
        sync_child(args.sync_child, args.iterations or 20)
        return
    rounds = args.iterations or (150 if args.quick else 1000)
    print(f"peers benchmark: {c.machine_line()}")
    pressure = c.Pressure()
    wall, cpu, notes = measure(rounds, args.warmup)
    load = pressure.line()  # the timed rounds only, not the strace runs after them
    counts = None
    if args.syncs if args.syncs is not None else not args.quick:
        counts = _syncs.count(Path(__file__), [n for n in LABELS if n in wall], 20)
    print()
    last = render(wall, cpu, notes, load, counts)
    print(last)


if __name__ == "__main__":
    main()
