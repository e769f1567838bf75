"""Agent sessions: an agent in any language drives one run over JSON-RPC 2.0 lines.

The session is the run's agent (docs/design.md §4). Each mutating request becomes one gated
step through the runtime's public methods: ``step()`` persists the intent (with the
client's idempotency key when it brings one), ``execute_pending()`` makes the fenced
write and records the receipt (it rides in the next checkpoint; the session's end writes
one if the agent leaves first). A client key already on the branch is looked up first:
the same intent answers with the original receipt (``replayed``), another intent is the
seed's conflict and the run goes to ``needs_review``. ``docs/protocol.md`` is the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gitrun.adapter import exec_step, shell
from gitrun.adapter.gate import normalise_path
from gitrun.adapter.gittypes import Repository, Tree, commit_at, first_parent, tree_at
from gitrun.adapter.sandbox import CommandCannotStart
from gitrun.core.codec import encode
from gitrun.core.errors import AgentGone, Exit, Frozen, GateRejected, GitrunError, LeaseLost
from gitrun.core.records import (
    AWAITING_APPROVAL,
    EXEC,
    NEEDS_REVIEW,
    RUNNING,
    TERMINAL,
    Action,
    Receipt,
    RunState,
)
from gitrun.engine import jsonrpc, session_read, session_rewind
from gitrun.engine.agents import Finish
from gitrun.engine.jsonrpc import INVALID_PARAMS, METHOD_NOT_FOUND, RpcError
from gitrun.engine.session_rpc import (
    KEY_PATTERN,
    MUTATING,
    PROTOCOL,
    check_key,
    check_params,
    error_of,
    exec_action,
    receipt_json,
)
from gitrun.engine.verifier import verify_tree

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime
    from gitrun.engine.session_agent import SessionAgent

MAX_RECENT_RECEIPTS = 10
MAX_OUTPUT_TAIL = 8000


def propose(rt: Runtime, agent: SessionAgent, checked: Action, key: str | None) -> RunState:
    """Hand ``checked`` to the run as the agent's next proposal and step to its intent.
    The runtime refusing it (a budget: the run may have ended) is GateRejected; a risky
    action waiting for an approval is Frozen. The state, with the step pending."""
    rt.abandoned = None
    agent.slot.put(checked, key)
    rt.step()
    s = rt.state
    if s.pending is None:
        raise GateRejected(s.stop_reason or "refused", f"the run is {s.phase}: {s.stop_reason}")
    if s.phase == AWAITING_APPROVAL:
        raise Frozen(rt.frozen_message())
    return s


class Session:
    """One connection: requests in, responses out, each write one runtime step."""

    def __init__(
        self, rt: Runtime, agent: SessionAgent, transport: jsonrpc.Transport | None = None
    ) -> None:
        self.rt = rt
        self.agent = agent
        self.transport = transport
        self.keys: dict[str, Receipt] | None = None  # every key on the branch, read once
        self.last_tests: dict[str, Any] | None = None
        self.finished = False
        self.methods: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "initialize": self.initialize,
            "observe": self.observe,
            "read_file": self._reader(session_read.read_file),
            "list_files": self._reader(session_read.list_files),
            "search": self._reader(session_read.search),
            "write_file": self.write_file,
            "delete_file": self.delete_file,
            "apply_patch": self.apply_patch,
            "exec": self.exec,
            "run_tests": self.run_tests,
            "finish": self.finish,
            "rewind": self.rewind,
        }

    # -- the loop ----------------------------------------------------------------------

    def begin(self) -> None:
        """Before the first request: an intent an earlier gitrun persisted, once, same key."""
        rt = self.rt
        if rt.state.phase == RUNNING and rt.state.pending is not None:
            rt.execute_pending()

    def serve(self) -> RunState:
        """The JSON-RPC loop on :attr:`transport` until ``finish`` or the agent's EOF."""
        rt, transport = self.rt, self.transport
        if transport is None:
            raise GitrunError("a JSON-RPC session needs a transport")
        self.begin()
        interval = max(0.2, rt.lease.duration / 4)
        while not self.finished:
            line = transport.read_line(interval)
            if isinstance(line, jsonrpc.Timeout):
                rt.lease.maybe_renew(rt.state.generation)  # an agent may think for minutes
                continue
            if isinstance(line, jsonrpc.Eof):
                break
            self.handle(line)
            if transport.closed:
                break
        return self.end()

    def end(self) -> RunState:
        """The agent left: write the last receipt if it still rides, then say how it ended."""
        rt = self.rt
        rt.pause()
        rt.env.sync_index()
        s = rt.state
        if s.phase in (AWAITING_APPROVAL, NEEDS_REVIEW):
            raise Frozen(rt.frozen_message())
        if s.phase not in TERMINAL:
            raise AgentGone(
                f"the agent left run {s.run_id} before finish (generation {s.generation}, "
                f"{s.receipts.count} writes); continue it with: gitrun resume {s.run_id}"
            )
        return s

    def handle(self, line: bytes) -> None:
        """Answer one line; no input ends the session, only a lost lease or a gitrun bug."""
        transport = self.transport
        if transport is None:
            raise GitrunError("a JSON-RPC session needs a transport")
        if not line.strip():
            return
        try:
            req = jsonrpc.parse(line)
        except RpcError as err:
            transport.send(jsonrpc.error(jsonrpc.request_id(err), err))
            return
        try:
            answer = jsonrpc.result(req.id, self.call(req))
        except RpcError as err:
            answer = jsonrpc.error(req.id, err)
        except GitrunError as exc:
            answer = jsonrpc.error(req.id, error_of(exc, self.rt.state))
            if isinstance(exc, LeaseLost) or exc.exit_code == Exit.INTERNAL:
                transport.send(answer)
                raise
        except Exception as exc:
            bug = RpcError(jsonrpc.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}")
            transport.send(jsonrpc.error(req.id, bug))
            raise
        if not req.notification:
            transport.send(answer)

    def call(self, req: jsonrpc.Request) -> dict[str, Any]:
        return self.dispatch(req.method, req.params)

    def dispatch(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """One method, whatever the transport (JSON-RPC lines, MCP): its result, or raises
        :class:`RpcError` (bad method or params) or a :class:`GitrunError` (refused)."""
        method = self.methods.get(name)
        if method is None:
            raise RpcError(METHOD_NOT_FOUND, f"no method {name!r}; see docs/protocol.md")
        check_params(name, params)
        return method(params)

    # -- read-only ---------------------------------------------------------------------

    def initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        wanted = params.get("protocol")
        if wanted is not None and wanted != PROTOCOL:
            raise RpcError(INVALID_PARAMS, f"this gitrun speaks {PROTOCOL}, not {wanted}")
        t, s = self.rt.task, self.rt.state
        p = t.policy
        tools = [m for m in self.methods if m not in MUTATING or m in p.allowed_actions]
        return {
            "protocol": PROTOCOL,
            "run_id": s.run_id,
            "task": {"id": t.id, "title": t.title, "version": t.version},
            "policy": {
                "id": p.id,
                "version": p.version,
                "allowed_actions": list(p.allowed_actions),
                "write_allowlist": list(p.write_allowlist),
                "forbidden_paths": list(p.forbidden_paths),
                "allow_symlinks": p.allow_symlinks,
            },
            "budgets": encode(t.budgets),
            "tools": tools,
            "limits": {
                "max_read_bytes": session_read.MAX_READ_BYTES,
                "max_list_entries": session_read.MAX_LIST_ENTRIES,
                "max_matches": session_read.MAX_MATCHES,
                "idempotency_key_pattern": KEY_PATTERN,
            },
        }

    def observe(self, params: dict[str, Any]) -> dict[str, Any]:
        del params
        s = self.rt.state
        limits, used = self.rt.task.budgets, s.budgets
        pending = s.pending
        return {
            "run_id": s.run_id,
            "phase": s.phase,
            "stop_reason": s.stop_reason,
            "generation": s.generation,
            "head": {"commit": s.env.head, "tree": s.env.tree},
            "budgets": {
                "used": {
                    "proposals": used.proposals,
                    "steps": used.steps,
                    "wall_seconds": round(used.wall_seconds, 3),
                },
                "left": {
                    "proposals": limits.max_proposals - used.proposals,
                    "steps": limits.max_steps - used.steps,
                    "wall_seconds": round(limits.max_wall_seconds - used.wall_seconds, 3),
                },
            },
            "pending": None
            if pending is None
            else {
                "key": pending.key,
                "action": pending.action.summary(),
                "intent_digest": pending.intent_digest,
                "risk": pending.risk,
            },
            "receipt_count": s.receipts.count,
            "receipts": self._recent(),
            "verifier": None if s.verifier is None else {**encode(s.verifier), "final": True},
            "last_tests": self.last_tests,
        }

    def _recent(self) -> list[dict[str, Any]]:
        """The newest receipts, newest first, read from the branch (bounded)."""
        out: list[dict[str, Any]] = []
        commit = commit_at(self.rt.env.repo, self.rt.state.env.head)
        while commit is not None and len(out) < MAX_RECENT_RECEIPTS:
            receipt = self.rt.env.receipt_of(commit)
            if receipt is None:
                break
            out.append(receipt_json(receipt))
            commit = first_parent(commit)
        return out

    def _tree(self) -> Tree:
        tree = tree_at(self.rt.env.repo, self.rt.state.env.tree)
        if tree is None:
            raise GitrunError(f"the run's tree {self.rt.state.env.tree} is missing")
        return tree

    def _reader(
        self, fn: Callable[[Repository, Tree, dict[str, Any]], dict[str, Any]]
    ) -> Callable[[dict[str, Any]], dict[str, Any]]:
        def read(params: dict[str, Any]) -> dict[str, Any]:
            return {"commit": self.rt.state.env.head, **fn(self.rt.env.repo, self._tree(), params)}

        return read

    # -- writes ------------------------------------------------------------------------

    def write_file(self, params: dict[str, Any]) -> dict[str, Any]:
        action = Action.of_bytes(
            "write_file", path=params["path"], content=params["content"].encode("utf-8")
        )
        return self.mutate(action, check_key(params.get("idempotency_key")))

    def delete_file(self, params: dict[str, Any]) -> dict[str, Any]:
        action = Action("delete_file", path=params["path"])
        return self.mutate(action, check_key(params.get("idempotency_key")))

    def apply_patch(self, params: dict[str, Any]) -> dict[str, Any]:
        action = Action.of_bytes("apply_patch", patch=params["patch"].encode("utf-8"))
        return self.mutate(action, check_key(params.get("idempotency_key")))

    def exec(self, params: dict[str, Any]) -> dict[str, Any]:
        key = check_key(params.get("idempotency_key"))
        return self.mutate(exec_action(params), key)

    def rewind(self, params: dict[str, Any]) -> dict[str, Any]:
        """Restore an earlier receipt's (or generation's) tree as one new gated step."""
        self._require_running()
        action = session_rewind.rewind_action(self.rt, params["to"])
        return self.mutate(action, check_key(params.get("idempotency_key")))

    def mutate(self, action: Action, key: str | None) -> dict[str, Any]:
        """One gated step: replay a known client key, else intent, write, receipt."""
        rt = self.rt
        self._require_running()
        if key is not None:
            replayed = self._replay(action, key)
            if replayed is not None:
                return replayed
        checked = rt.gate.check_action(action, self._tree())  # refused: nothing is written
        writes = rt.env.write_count
        s = propose(rt, self.agent, checked, key)
        if s.pending is None:
            raise GitrunError("propose() returned a state with nothing pending")
        pending_key = s.pending.key
        rt.execute_pending()
        s = rt.state
        if s.phase == NEEDS_REVIEW:
            raise Frozen(
                f"idempotency key {pending_key} was already used for another intent: "
                f"{rt.frozen_message()}"
            )
        last = s.receipts.last
        if s.pending is not None or last is None or last.key != pending_key:
            raise rt.abandoned or GateRejected("refused", f"the step {pending_key} was abandoned")
        if self.keys is not None:
            self.keys[last.key] = last
        return {**receipt_json(last, replayed=rt.env.write_count == writes), **self._extras(last)}

    def _replay(self, action: Action, key: str) -> dict[str, Any] | None:
        """The original receipt of a client key with the same intent; None to step on
        (an unknown key, or another intent: the step then opens the review case)."""
        rt = self.rt
        if key in rt.state.quarantined_keys:
            raise GateRejected("key-quarantined", f"idempotency key {key} is quarantined")
        if self.keys is None:  # once per session: the index refs are a cache, history rules
            self.keys = {r.key: r for r in rt.env.receipts()}
        if key not in self.keys:
            return None
        found = rt.env.lookup(key) or self.keys[key]  # re-read; rebuilds a lost index ref
        if found.intent_digest == self._normalised(action).intent_digest():
            return {**receipt_json(found, replayed=True), **self._extras(found)}
        return None

    def _normalised(self, action: Action) -> Action:
        """The action as the gate would record it (clean path; exec's defaults filled in)
        without the checks that depend on HEAD: a retried delete has nothing left to delete."""
        if action.kind == EXEC:
            return self.rt.gate.check_action(action, self._tree(), on_disk=False)
        if action.path is not None:
            return replace(action, path=normalise_path(action.path))
        return action

    def _extras(self, receipt: Receipt) -> dict[str, Any]:
        """What an exec result adds to its receipt: the exit code and the kept output."""
        if receipt.action != EXEC:
            return {}
        stdout, stderr = exec_step.output_of(self.rt.env.repo, receipt) or (b"", b"")
        cut = shell.truncated(stdout), shell.truncated(stderr)
        return {
            "exit_code": receipt.exit_code,
            "stdout": stdout.decode("utf-8", "replace"),
            "stderr": stderr.decode("utf-8", "replace"),
            "stdout_truncated": cut[0],
            "stderr_truncated": cut[1],
            "output": (stdout + stderr).decode("utf-8", "replace"),  # gitrun/1's first form
            "output_truncated": any(cut),
            "output_blob": receipt.output,
        }

    def _require_running(self) -> None:
        s = self.rt.state
        if s.phase in (AWAITING_APPROVAL, NEEDS_REVIEW):
            raise Frozen(self.rt.frozen_message())
        if s.phase != RUNNING:
            raise GateRejected("run-ended", f"run {s.run_id} is {s.phase} ({s.stop_reason})")

    # -- tests and the end ---------------------------------------------------------------

    def run_tests(self, params: dict[str, Any]) -> dict[str, Any]:
        """The task's verifier on HEAD's tree now, in its sandbox; the run goes on."""
        del params
        rt = self.rt
        confinement = rt._confinement()
        try:
            result, made = verify_tree(
                rt.task.verifier,
                rt.env.repo,
                rt.state.env.tree,
                confinement=confinement,
                secrets=rt._secrets(),
                heartbeat=lambda: rt.lease.maybe_renew(rt.state.generation),
                heartbeat_interval=min(1.0, rt.lease.duration / 4),
            )
        except CommandCannotStart as exc:
            raise GateRejected("verifier-cannot-start", str(exc)) from exc
        tail = result.output_tail
        self.last_tests = {
            "passed": result.passed,
            "summary": result.summary,
            "outcomes": dict(result.outcomes),
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "duration_seconds": round(result.duration_seconds, 3),
            "tree": made,
            "isolation": confinement.kind,
            "final": False,
        }
        return {
            **self.last_tests,
            "output_tail": tail[-MAX_OUTPUT_TAIL:],
            "output_truncated": len(tail) > MAX_OUTPUT_TAIL,
        }

    def finish(self, params: dict[str, Any]) -> dict[str, Any]:
        """The final verifier: the run ends done or failed, and the session with it."""
        del params
        rt = self.rt
        self._require_running()
        self.agent.slot.put(Finish("the agent called finish"), None)
        rt.step()
        s = rt.state
        self.finished = s.phase in TERMINAL
        return {
            "phase": s.phase,
            "stop_reason": s.stop_reason,
            "head": {"commit": s.env.head, "tree": s.env.tree},
            "verifier": None if s.verifier is None else {**encode(s.verifier), "final": True},
        }
