"""Latency of one checkpoint advance, beside the disk floor and the stores a user might
pick instead, all in one run on the same disk.

* **gitrun** — ``CheckpointStore.advance`` of a realistic run state (an intent
  checkpoint taken from a real run: pending action, last receipt, trace events):
  validate, canonical JSON, HMAC-SHA256, write the commit object, then the fenced
  compare-and-swap of the checkpoint ref (lease ref locked and re-read in the same
  transaction), then the freshness witness (its lock, a read of both slots, one slot
  rewritten in place, ``fdatasync``), as the service always does. fsync on. Steady
  state: the repository's 256 loose-object fan-out directories exist.
* **gitrun without the witness** — the same advance on a store built without one (a
  second run in its own repository), to show what the witness costs.
* **witness write alone** — ``Witness.write`` of the next mark: one 1 KiB slot
  ``pwrite`` + ``fdatasync`` (no rename, no directory fsync).
* **floor** — the same bytes written to a temp file, fsynced, renamed over the
  target, directory fsynced: the least a crash-safe store can do.
* **LangGraph SqliteSaver** (optional) — ``put`` of a checkpoint carrying the same
  state as its channel value, plus ``put_writes`` of the pending action, on a file
  database with its defaults (WAL, ``synchronous=FULL``).
* **DBOS Transact step** (optional) — one ``@DBOS.step`` returning the same payload,
  inside a ``@DBOS.workflow``, SQLite system database.

All contenders run interleaved (one operation each per round, rotating order), so a
change in disk speed during the run hits them alike. Targets: gitrun's median within 3x
of the floor's (issue #3); a step, which makes one advance (its intent, carrying the
last step's receipt), no more than one floor write dearer for the witness (issue #9):
(with - without) <= floor, on the median. The peers come with the ``bench`` extra:
``pip install -e .[bench]``.

    python benchmarks/bench_checkpoint.py [--quick] [--iterations N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _common as c
import _peers

from gitrun.store.keys import load_keyring
from gitrun.store.witness import Mark, Witness

TARGET = 3.0

Op = _peers.Op


def witness_op(tmp: Path, key_file: Path) -> Op:
    """The witness write of an advance on its own: one slot rewritten in place."""
    witness = Witness(tmp / "witness-alone", load_keyring(key_file))
    ref = "refs/gitrun/runs/ckpt/checkpoints/bench/00000000-0000-0000-0000-000000000000"
    head = {"gen": 1}
    with witness.locked("ckpt"):
        witness.write(Mark("ckpt", ref, 1, "0" * 40))

    def op(_: int) -> None:
        head["gen"] += 1
        witness.write(Mark("ckpt", ref, head["gen"], f"{head['gen']:040x}"))

    return op


def floor_op(tmp: Path, payload: bytes) -> Op:
    directory = tmp / "floor"
    directory.mkdir()

    def op(_: int) -> None:
        c.floor_samples(directory, payload, 1, warmup=0)

    return op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (100)")
    ap.add_argument("--iterations", type=int, default=None, help="measured rounds (default 400)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--no-peers", action="store_true", help="skip LangGraph and DBOS")
    args = ap.parse_args()
    rounds = args.iterations or (100 if args.quick else 400)

    print(f"checkpoint benchmark: {c.machine_line()}")
    pressure = c.Pressure()
    with c.bench_dir("checkpoint") as tmp:
        g_op, message, size = _peers.gitrun_advance_op(tmp / "gitrun")
        bare_op, _, _ = _peers.gitrun_advance_op(tmp / "gitrun-bare", witness=False)
        doc = json.loads(message.split(b"\n\n")[1])
        pending = doc.get("pending") or {}
        ops: dict[str, Op] = {
            "gitrun": g_op,
            "bare": bare_op,
            "witness": witness_op(tmp, tmp / "gitrun" / "keys" / "checkpoint.keyring"),
            "floor": floor_op(tmp, message),
        }
        notes: dict[str, str] = {
            "gitrun": size,
            "bare": "same state, its own repository",
            "witness": "one 1,024 B slot, in place",
            "floor": f"same {len(message):,} bytes",
        }
        dbos: _peers.DbosPeer | None = None
        if args.no_peers:
            notes["langgraph"] = notes["dbos"] = "skipped: --no-peers"
        else:
            lg, note = _peers.sqlite_saver_op(tmp, doc, pending)
            notes["langgraph"] = note
            if lg is not None:
                ops["langgraph"] = lg
            text = message.decode()
            dbos, note = _peers.dbos_peer(tmp, lambda _: text)
            notes["dbos"] = note
            if dbos is not None:
                ops["dbos"] = dbos.op
                notes["dbos"] = f"step output = same payload; {dbos.info}"
        samples: dict[str, list[int]] = {name: [] for name in ops}
        body = _peers.interleave(ops, args.warmup, samples)

        t0 = time.perf_counter()
        if dbos is not None:
            dbos.run(body, rounds + args.warmup)
            dbos.close()
        else:
            body(rounds + args.warmup)
        took = time.perf_counter() - t0
        print(f"  {rounds} measured rounds (+{args.warmup} warm-up) in {took:.1f}s")

    # The witness's cost, paired by round: both advances ran in the same round, so a
    # slow disk moment hits both and cancels out of the difference.
    delta = c.stats([a - b for a, b in zip(samples["gitrun"], samples["bare"], strict=True)])
    render({name: c.stats(v) for name, v in samples.items()}, notes, pressure, delta)


LABELS = {
    "gitrun": "gitrun `CheckpointStore.advance` (validate, sign, commit, fenced ref CAS, witness)",
    "bare": "gitrun advance without the witness",
    "witness": "witness write alone (`pwrite` + `fdatasync`)",
    "floor": "floor: write+fsync+rename+dir fsync",
    "langgraph": "LangGraph `SqliteSaver.put` + `put_writes`",
    "dbos": "DBOS Transact step (SQLite system DB)",
}


def render(
    res: dict[str, c.Stats], notes: dict[str, str], pressure: c.Pressure, delta: c.Stats
) -> None:
    g = res["gitrun"]
    lines = [
        "### Checkpoint advance",
        "",
        "| store | median ms | p95 ms | gitrun / this (median) | notes |",
        "|---|---:|---:|---:|---|",
    ]
    for name, label in LABELS.items():
        if name in res:
            ratio = "—" if name == "gitrun" else f"{g.median_ms / res[name].median_ms:.2f}x"
            lines.append(f"| {label} | {res[name].cells()} | {ratio} | {notes[name]} |")
        else:
            lines.append(f"| {label} | — | — | — | {notes[name]} |")
    floor = res["floor"]
    r = g.median_ms / floor.median_ms
    extra, extra_p95 = delta.median_ms, delta.p95_ms
    per_step = extra / floor.median_ms  # one advance per step: the receipt rides in it
    lines += [
        "",
        f"gitrun / floor: {r:.2f}x median, {g.p95_ms / floor.p95_ms:.2f}x p95 "
        f"(target <= {TARGET:.0f}x on the median): **{c.verdict(r, TARGET)}**",
        "",
        f"The witness adds {extra:.3f} ms median ({extra_p95:.3f} ms p95) to an advance "
        "(with - without, paired by round); a step makes one advance, so "
        f"{extra:.3f} ms = {per_step:.2f} floor writes per step (target <= 1): "
        f"**{c.verdict(per_step, 1.0)}**",
    ]
    print()
    c.markdown_block("checkpoint", lines, pressure)


if __name__ == "__main__":
    main()
