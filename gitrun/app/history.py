"""A run's history for people: ``gitrun log`` (its steps, from the verified checkpoint
chain and the receipts) and ``gitrun rewind`` (one new step restoring an earlier tree).
"""

from __future__ import annotations

from typing import Any

from gitrun.adapter.show import diffstat
from gitrun.app.opening import Options, lease_store, load_verified, open_run
from gitrun.core.codec import encode
from gitrun.core.errors import BadInput, CheckpointRejected, GateRejected
from gitrun.core.records import NEEDS_REVIEW, TERMINAL


def parse_target(text: str) -> str | int:
    """``--to``: a generation number (all digits, shorter than a commit prefix) or a commit."""
    return int(text) if text.isdigit() and len(text) < 7 else text


def run_log(run_id: str, opts: Options) -> dict[str, Any]:
    """The run's steps in order: generation, key, action, receipt commit, diffstat, and
    the verifier verdicts the checkpoints recorded."""
    opened = open_run(run_id, opts)
    ref, stored = load_verified(opened)
    chain = list(reversed(opened.store.chain(ref)))  # oldest first, each one verified
    first_gen: dict[str, int] = {}
    verdicts: dict[str, dict[str, Any]] = {}
    for s in (c.state for c in chain):
        first_gen.setdefault(s.env.head, s.generation)
        if s.verifier is not None:
            verdicts[s.verifier.head] = encode(s.verifier)
    repo = opened.env.repo
    steps = [
        {
            "generation": first_gen.get(r.commit),
            "key": r.key,
            "action": r.action,
            "commit": r.commit,
            "tree": r.tree,
            "paths": list(r.paths),
            "diffstat": diffstat(repo, r.parent, r.commit),
            "verifier": verdicts.get(r.commit),
        }
        for r in opened.env.receipts()
    ]
    state = stored.state
    base = {"commit": state.env.base_commit, "generation": first_gen.get(state.env.base_commit),
            "verifier": verdicts.get(state.env.base_commit)}  # fmt: skip
    return {"run_id": run_id, "phase": state.phase, "generation": state.generation,
            "head": state.env.head, "base": base, "steps": steps}  # fmt: skip


def log_text(info: dict[str, Any]) -> str:
    """``gitrun log``: one line per step, oldest first, then the verdicts."""
    base = info["base"]
    lines = [f"run {info['run_id']}: {info['phase']} at generation {info['generation']}",
             f"gen  {'commit':<12}  {'key':<36} {'action':<12} diffstat      paths",
             f"{base['generation'] or '-':>3}  {base['commit'][:12]}  (base)"]  # fmt: skip
    for s in info["steps"]:
        d = s["diffstat"]
        stat = f"{d['files']}f +{d['insertions']} -{d['deletions']}"
        gen = "-" if s["generation"] is None else s["generation"]
        lines.append(
            f"{gen:>3}  {s['commit'][:12]}  {s['key']:<36} {s['action']:<12} {stat:<13} "
            + ",".join(s["paths"])
        )
    for s in [info["base"], *info["steps"]]:
        v = s["verifier"]
        if v is not None:
            verdict = "passed" if v["passed"] else "failed"
            lines.append(f"verifier on {s['commit'][:12]}: {verdict} ({v['summary']})")
    return "\n".join(lines)


def rewind(run_id: str, opts: Options, to: str, key: str | None = None) -> dict[str, Any]:
    """One rewind step on a session run, under its lease (no server may serve it now)."""
    from gitrun.app.service import build_runtime
    from gitrun.engine.agents import load_agent
    from gitrun.engine.jsonrpc import RpcError
    from gitrun.engine.recovery import reconcile
    from gitrun.engine.session import Session
    from gitrun.engine.session_agent import SessionAgent

    opened = open_run(run_id, opts)
    agent, _ = load_agent(opened.record.agent, opened.task)
    if not isinstance(agent, SessionAgent):
        raise BadInput(
            f"run {run_id} is driven by --agent {opened.record.agent}; gitrun rewind works on "
            "session runs (gitrun session, gitrun mcp, --agent cmd:...)"
        )
    _, stored = load_verified(opened)
    if stored.state.agent != agent.identity:
        raise CheckpointRejected("agent-changed", "the agent's inputs changed since the checkpoint")
    if stored.state.phase in TERMINAL:
        raise GateRejected("run-ended", f"run {run_id} is {stored.state.phase}; nothing to rewind")
    opts.approvals.require_roots(stored.state)
    lease = lease_store(opened.repo, run_id, opts, opened.site)
    lease.acquire(stored.state.generation, opts.takeover_after)
    try:
        ref, stored = load_verified(opened)  # the previous owner may have moved on
        rt = build_runtime(opened, ref, stored, lease, agent, opts)
        if rt.state.phase != NEEDS_REVIEW:
            reconcile(rt)
        session = Session(rt, agent)
        session.begin()
        params: dict[str, Any] = {"to": parse_target(to)}
        if key is not None:
            params["idempotency_key"] = key
        try:
            answer = session.dispatch("rewind", params)
        except RpcError as exc:
            raise BadInput(f"rewind: {exc.message}") from exc
        finally:
            rt.env.sync_index()
        rt.pause()  # its receipt rides; this process writes no other checkpoint
        return answer
    finally:
        lease.release()
