"""The contenders shared by ``bench_checkpoint`` and ``bench_peers``: a gitrun checkpoint
advance of a real intent state, LangGraph's ``SqliteSaver`` and a DBOS Transact step.

Each builder returns an operation ``op(i)`` (one timed unit of work for round ``i``) or
says why it is skipped. The peers come with the ``bench`` extra; a peer that is not
installed, or DBOS failing to start, is skipped with the install command, never an error.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import _common as c

from gitrun.core.codec import canonical_bytes, encode
from gitrun.core.records import Event
from gitrun.engine.runtime import Runtime

INSTALL_HINT = "pip install -e .[bench]   (langgraph-checkpoint-sqlite, dbos)"
SYNC_NAMES = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}

Op = Callable[[int], None]


def gitrun_advance_op(tmp: Path, *, witness: bool = True) -> tuple[Op, bytes, str]:
    """A real run's intent checkpoint, re-advanced generation after generation, through
    ``CheckpointStore.advance`` (with the freshness witness, as the service always has)."""
    layout = c.Layout(10, 10)
    repo, base = c.make_repo(tmp / "repo", layout)
    task = c.make_task(tmp / "task", tmp / "repo", base)
    run = c.start_run(
        repo,
        base,
        task,
        run_id="ckpt",
        worktree=tmp / "wt",
        key_file=tmp / "keys" / "checkpoint.keyring",
        actions=c.write_actions(layout, 4, salt=f"ckpt-{witness}"),
        witness=witness,
    )
    rt = run.runtime
    steady_fanout(repo.path)
    for _ in range(3):
        c.runtime_step(rt)
    rt.step()  # an intent: the state now holds a pending action and a receipt
    rt.land()  # its checkpoint made the ref's (it would ride with the write otherwise)
    template = replace(rt.state, events=_last_events(rt))
    store, ref, fence = run.store, run.ref, run.lease.fence
    if rt.checkpoint is None:
        raise RuntimeError("the bench run has no checkpoint after its first intent")
    head_oid, head_gen = rt.checkpoint, rt.state.generation

    def op(_: int) -> None:
        nonlocal head_oid, head_gen
        gen = head_gen + 1
        state = replace(template, generation=gen, updated_at=time.time())
        head_oid = store.advance(ref, state, head_oid, fence)
        head_gen = gen

    payload = canonical_bytes(encode(template))
    message = bytes(repo[rt.checkpoint].raw_message)  # type: ignore[attr-defined]
    return op, message, f"{len(payload):,} B payload, {len(message):,} B commit message"


def steady_fanout(git_dir: str) -> None:
    """Steady state: every loose-object fan-out directory exists, as in any repository
    past a few thousand loose objects (a young one pays one more mkdir per new prefix)."""
    for prefix in range(256):
        (Path(git_dir) / "objects" / f"{prefix:02x}").mkdir(exist_ok=True)


def _last_events(rt: Runtime) -> tuple[Event, ...]:
    """The trace events the last checkpoint carried (an intent event): realistic size."""
    if rt.checkpoint is None:
        raise RuntimeError("the bench run has no checkpoint")
    stored = rt.store.load(rt.ref, scenario_parts=None, offered=rt.checkpoint)
    return stored.state.events


def sqlite_saver_op(
    tmp: Path, doc: dict[str, Any], pending: dict[str, Any]
) -> tuple[Op | None, str]:
    """LangGraph ``SqliteSaver.put`` of a checkpoint whose channel value is ``doc``, plus
    ``put_writes`` of ``pending``, on a file database (WAL, ``synchronous=FULL``)."""
    try:
        from langchain_core.runnables import RunnableConfig
        from langgraph.checkpoint.base import empty_checkpoint
        from langgraph.checkpoint.sqlite import SqliteSaver
    except ImportError as exc:
        return (
            None,
            f"skipped: langgraph-checkpoint-sqlite not importable ({exc.name}); {INSTALL_HINT}",
        )
    conn = sqlite3.connect(str(tmp / "langgraph.sqlite"), check_same_thread=False)
    saver = SqliteSaver(conn)
    saver.setup()
    # The saver's own defaults, made explicit so a change of default cannot skew the race.
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    config = cast(RunnableConfig, {"configurable": {"thread_id": "bench", "checkpoint_ns": ""}})

    def op(i: int) -> None:
        nonlocal config
        ckpt = empty_checkpoint()
        ckpt["channel_values"] = {"state": doc}
        ckpt["channel_versions"] = {"state": i + 1}
        new_config = saver.put(
            config, ckpt, {"source": "loop", "step": i, "parents": {}}, {"state": i + 1}
        )
        saver.put_writes(new_config, [("pending", pending)], task_id=f"task-{i}")
        config = new_config

    return op, pragmas(conn)


def pragmas(conn: sqlite3.Connection) -> str:
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    sync = SYNC_NAMES[conn.execute("PRAGMA synchronous").fetchone()[0]]
    return f"journal_mode={mode}, synchronous={sync}"


class DbosPeer:
    """DBOS Transact with a SQLite system database (local, no network, no Postgres).

    ``step_fn`` becomes one ``@DBOS.step``; the whole interleaved loop runs inside one
    ``@DBOS.workflow`` so that each DBOS step can be timed beside the other contenders,
    as a step of a long-running workflow (a gitrun run's step is one too)."""

    def __init__(self, tmp: Path, step_fn: Callable[[int], object]) -> None:
        from dbos import DBOS

        self.DBOS = DBOS
        self.db_file = tmp / "dbos.sqlite"
        url = f"sqlite:///{self.db_file}"
        self.instance = DBOS(
            config={"name": "gitrun-bench", "system_database_url": url, "log_level": "ERROR"}
        )

        def bench_step(i: int) -> object:
            return step_fn(i)

        def bench_workflow(rounds: int) -> int:
            self.body(rounds)
            return rounds

        # Decorated by call, not by @: without the bench extra dbos is untyped (Any).
        self.step: Callable[[int], object] = DBOS.step(name="bench_step")(bench_step)
        self.workflow: Callable[[int], int] = DBOS.workflow(name="bench_workflow")(bench_workflow)
        self.body: Callable[[int], None] = lambda rounds: None
        DBOS.launch()
        self.info = f"system database sqlite:///…/dbos.sqlite ({self.pragmas()})"

    def pragmas(self) -> str:
        """The SQLite settings DBOS runs with, read through its own engine when possible."""
        try:
            engine = self.instance._sys_db.engine  # private: only to report its settings
            with engine.connect() as conn:
                raw = conn.connection.dbapi_connection
                if raw is not None:
                    return pragmas(cast(sqlite3.Connection, raw))
        except Exception:  # noqa: S110 - an internal that moved: use the file's own view
            pass
        with sqlite3.connect(self.db_file) as fresh:
            return pragmas(fresh) + " (a fresh connection's view)"

    def op(self, i: int) -> None:
        self.step(i)

    def run(self, body: Callable[[int], None], rounds: int) -> None:
        self.body = body
        self.workflow(rounds)

    def close(self) -> None:
        self.DBOS.destroy(destroy_registry=True)


def dbos_peer(tmp: Path, step_fn: Callable[[int], object]) -> tuple[DbosPeer | None, str]:
    try:
        import dbos  # noqa: F401
    except ImportError as exc:
        return None, f"skipped: dbos not importable ({exc.name}); {INSTALL_HINT}"
    try:
        return DbosPeer(tmp, step_fn), ""
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        return None, f"skipped: DBOS could not start with a SQLite system database ({why})"


def interleave(
    ops: dict[str, Op],
    warmup: int,
    samples: dict[str, list[int]],
    cpu: dict[str, list[int]] | None = None,
) -> Callable[[int], None]:
    """The round-robin loop: one operation of each contender per round, the order rotated
    each round, so a change in disk speed during the run hits every contender alike.
    Rounds before ``warmup`` are dropped; ``cpu`` (if given) gets each operation's CPU
    time on this thread, to tell computation from waiting on the disk."""
    order = list(ops)

    def body(rounds: int) -> None:
        for i in range(rounds):
            rotated = order[i % len(order) :] + order[: i % len(order)]
            for name in rotated:
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                ops[name](i)
                dt = time.perf_counter_ns() - t0
                dc = time.thread_time_ns() - c0
                if i >= warmup:
                    samples[name].append(dt)
                    if cpu is not None:
                        cpu[name].append(dc)

    return body
