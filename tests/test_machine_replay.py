"""The pure machine against today's runtime: replay a real run's audit chain through it.

Each checkpoint after the first was written by ``Runtime``/``Approvals`` from its
predecessor. Rebuilding the events from the new checkpoint's trace and applying
``machine.transition`` to the predecessor, one by one, must give that checkpoint again,
field for field (event times aside: the runtime reads the clock once per field). This is
what lets the runtime delegate to the machine with no change in behaviour.

A write's receipt has no checkpoint of its own: it is held and rides in the next one, so
a checkpoint's trace is one event, or a receipt (held: no advance) and then the event
that advanced; a receipt alone is the driver's pause.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import RISKY_SANDBOXES, SANDBOX_NAMES, SANDBOXES, Gitrun

from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.codec import decode, digest, encode
from gitrun.core.errors import Exit
from gitrun.core.machine import (
    AGENT_WRITE_REFUSED,
    Finished,
    Grant,
    Hold,
    MachineEvent,
    Pause,
    PendingRejectedAtExecute,
    Persist,
    ProposalRejected,
    Proposed,
    VerifierCannotStart,
    VerifierResult,
    WriteReceipt,
    approval_in,
    stamp,
    transition,
)
from gitrun.core.records import Event, Receipt, RunState

pytestmark = pytest.mark.timeout(180)
RESULT = ("exit_code", "timed_out")
RUN = "r-replay"


def events_for(prev: RunState, nxt: RunState) -> list[MachineEvent]:
    """The machine events that ``nxt``'s trace records: a held receipt, then the one that
    advanced (a receipt alone was written by a pause)."""
    kinds = [e.kind for e in nxt.events]
    if kinds == ["receipt"]:
        return [event_for(prev, nxt, nxt.events[0]), Pause(nxt.events[0].at)]
    if len(kinds) == 2 and kinds[0] == "receipt" and kinds[1] != "receipt":
        return [event_for(prev, nxt, e) for e in nxt.events]
    if len(kinds) != 1:
        raise AssertionError(f"one advancing trace event per checkpoint, got {kinds}")
    return [event_for(prev, nxt, nxt.events[0])]


def event_for(prev: RunState, nxt: RunState, ev: Event) -> MachineEvent:
    """The machine event one trace event of ``nxt`` records."""
    d = ev.data
    if ev.kind == "intent":
        p = nxt.pending
        assert p is not None
        return Proposed(p.action, d["key"], d["digest"], d["risk"], p.precondition, p.proposed_at)
    if ev.kind == "gate_rejected" and d.get("at") == "execute":
        return PendingRejectedAtExecute(d["rule"], d["message"], ev.at)
    if ev.kind == "gate_rejected":
        last = nxt.stop_reason == AGENT_WRITE_REFUSED
        return ProposalRejected(d["rule"], d["message"], d["action"], ev.at, last)
    if ev.kind == "receipt":
        r = decode(Receipt, d["receipt"])
        return WriteReceipt(r, d["replayed"], r.commit, ev.at, grant_in(prev))
    if ev.kind == "approval":
        p = nxt.pending
        assert p is not None
        return approval_in(
            prev, p.approval, d["signer"], nxt.used_nonces[-1], d["expires_at"], ev.at
        )
    if ev.kind == "verifier":
        return verdict_for(nxt, d)
    raise AssertionError(f"no replay for trace event {ev.kind}")


def verdict_for(nxt: RunState, d: dict[str, Any]) -> VerifierResult | VerifierCannotStart:
    """The verifier's event: a verdict, or a command that could not start."""
    extra = {k: v for k, v in d.items() if k not in (*encode(nxt.verifier), *RESULT)}
    if nxt.stop_reason == "verifier_cannot_start":
        return VerifierCannotStart(
            d["head"], d["tree"], nxt.env.status_digest, d["summary"],
            tuple(d["outcomes"]), d["at"], extra, d["isolation"],
        )  # fmt: skip
    return VerifierResult(
        d["passed"], d["head"], d["tree"], nxt.env.status_digest, d["summary"],
        d["outcomes"], d["exit_code"], d["timed_out"], d["at"], extra, d["isolation"],
    )  # fmt: skip


def grant_in(state: RunState) -> Grant | None:
    """What ``Approvals.binding`` verifies of the pending's evidence."""
    p = state.pending
    if p is None or p.approval is None:
        return None
    return Grant(digest(p.approval), float(p.approval["claims"]["expires_at"]))


def timeless(state: RunState) -> RunState:
    """The state with its clock readings and the chain over them blanked."""
    return replace(
        state,
        events=tuple(Event(e.kind, 0.0, e.data) for e in state.events),
        trace_chain="",
        budgets=replace(state.budgets, wall_seconds=0.0),
    )


def replay(home: Path) -> list[str]:
    """Check every checkpoint advance of run r-replay; the trace kinds replayed."""
    chain = [s.state for s in reversed(service.checkpoints(RUN, service.Options(Workspace(home))))]
    replayed: list[str] = []
    for prev, nxt in itertools.pairwise(chain):
        state = replace(prev, events=())
        *riding, last = events_for(prev, nxt)
        for event in riding:  # a receipt: held in memory, no checkpoint of its own
            state, effects = transition(state, event)
            assert isinstance(event, WriteReceipt)
            assert Hold(state) in effects
            assert not any(isinstance(e, Persist) for e in effects)
        if isinstance(last, VerifierResult | VerifierCannotStart):
            assert transition(state, Finished(last.at))[0] is state
        state, effects = transition(state, last)
        assert Persist(state) in effects
        got = stamp(
            state,
            generation=nxt.generation,
            elapsed=0.0,
            worker=nxt.identity,
            lease_version=nxt.lease_version,
            now=nxt.updated_at,
        )
        assert timeless(got) == timeless(nxt), (
            f"generation {nxt.generation} ({nxt.events[-1].kind})"
        )
        replayed += [e.kind for e in nxt.events]
    return replayed


@pytest.mark.parametrize("name", SANDBOX_NAMES)
def test_the_machine_reproduces_every_checkpoint_of_a_real_run(tmp_path: Path, name: str) -> None:
    home = tmp_path / "home"
    res = Gitrun(home)("run", str(SANDBOXES / name), "--run-id", RUN)
    assert res.code == 0, res.err
    replayed = replay(home)
    assert replayed[-1] == "verifier"
    assert {"intent", "receipt"} <= set(replayed)


def test_the_machine_reproduces_an_approved_runs_checkpoints(tmp_path: Path) -> None:
    home, keys = tmp_path / "home", tmp_path / "keys"
    cli = Gitrun(home)
    roots = str(keys / "roots.json")
    made = cli(
        "keys", "new", "alice", "--role", "approver", "--dir", str(keys), "--trust-roots", roots
    )
    assert made.code == 0, made.err
    assert cli("run", str(SANDBOXES / RISKY_SANDBOXES[0]), "--run-id", RUN).code == Exit.FROZEN
    approved = cli("approve", RUN, "--key", str(keys / "alice.key"), "--ttl", "1h")
    assert approved.code == 0, approved.err
    resumed = cli("resume", RUN, "--trust-roots", roots)
    assert resumed.code == 0, resumed.err
    replayed = replay(home)
    assert "approval" in replayed
    assert replayed[-1] == "verifier"


def test_the_machine_reproduces_a_refused_last_write_and_a_verifier_that_cannot_start(
    tmp_path: Path,
) -> None:
    task = tmp_path / "task"
    shutil.copytree(SANDBOXES / "fix-median", task)
    with (task / "plan.toml").open("a") as plan:
        plan.write('\n[[step]]\nkind = "write_file"\npath = "tests/x.py"\ncontent = "no\\n"\n')
    refused = Gitrun(tmp_path / "refused")
    assert refused("run", str(task), "--run-id", RUN).code == Exit.FAILED
    assert replay(tmp_path / "refused")[-2:] == ["receipt", "gate_rejected"]
    assert last_state(tmp_path / "refused").stop_reason == "agent_write_refused"

    shutil.copytree(SANDBOXES / "fix-median", task, dirs_exist_ok=True)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace('command = ["{python}"', 'command = ["/nonexistent"'))
    nostart = Gitrun(tmp_path / "nostart")
    assert nostart("run", str(task), "--run-id", RUN, "--isolation", "none").code == Exit.FAILED
    assert replay(tmp_path / "nostart")[-1] == "verifier"
    assert last_state(tmp_path / "nostart").stop_reason == "verifier_cannot_start"


def last_state(home: Path) -> RunState:
    return service.checkpoints(RUN, service.Options(Workspace(home)))[0].state


@pytest.mark.parametrize("name", SANDBOX_NAMES)
def test_a_write_step_is_two_commit_points_its_receipt_riding_in_the_next_checkpoint(
    tmp_path: Path, name: str
) -> None:
    # The intent checkpoint and the write commit: no checkpoint holds a receipt alone.
    home = tmp_path / "home"
    assert Gitrun(home)("run", str(SANDBOXES / name), "--run-id", RUN).code == 0
    chain = [s.state for s in reversed(service.checkpoints(RUN, service.Options(Workspace(home))))]
    traces = [[e.kind for e in s.events] for s in chain]
    writes = sum(t.count("receipt") for t in traces)
    intents = sum(t.count("intent") for t in traces)
    assert writes == intents >= 1
    assert traces[0] == ["started"]
    assert traces[-1][-1] == "verifier"
    assert len(chain) == 1 + intents + sum(t.count("gate_rejected") for t in traces) + 1
    for prev, nxt in itertools.pairwise(chain):
        kinds = [e.kind for e in nxt.events]
        if "receipt" in kinds:  # the write of the previous checkpoint's intent, ridden in
            assert kinds[0] == "receipt"
            assert len(kinds) == 2
            assert prev.pending is not None
            assert nxt.receipts.last is not None
            assert nxt.receipts.last.key == prev.pending.key
            assert nxt.receipts.last.parent == prev.env.head
    end, last = chain[-1], chain[-1].receipts.last
    assert end.verifier is not None
    assert last is not None
    assert end.verifier.head == end.env.head == last.commit  # bound to the last write's HEAD
