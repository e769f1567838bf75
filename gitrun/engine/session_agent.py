"""The agent of a session run: it proposes what the session's current request asks.

``session`` serves the protocol on this process's stdin/stdout; ``cmd:COMMAND`` spawns
COMMAND and serves it over the child's pipes (:mod:`gitrun.engine.agentproc`). The identity is
the spec's, so a resumed run accepts the same agent however often it was restarted.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gitrun.adapter.environment import Observation
from gitrun.core.codec import digest
from gitrun.core.errors import BadInput, GitrunError
from gitrun.core.records import Action, RunState
from gitrun.engine import jsonrpc
from gitrun.engine.agents import Finish, ScriptAgent

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime


class _Slot:
    """The decision the session hands the runtime for its next ``step()``."""

    def __init__(self) -> None:
        self.decision: Action | Finish | None = None
        self.key: str | None = None

    def put(self, decision: Action | Finish, key: str | None) -> None:
        self.decision, self.key = decision, key

    def take(self) -> Action | Finish:
        decision = self.decision
        if decision is None:
            raise GitrunError("the session stepped the runtime without a request")
        self.decision = None
        return decision


@dataclass(frozen=True)
class SessionAgent(ScriptAgent):
    """The agent of a session run: proposes what the current request asks, nothing else.

    ``spec`` is ``session`` (the protocol on this process's stdin/stdout) or
    ``cmd:COMMAND`` (gitrun spawns COMMAND and serves it over the child's pipes), or
    ``mcp`` (an MCP server on this process's stdin/stdout, :mod:`gitrun.engine.mcp_server`),
    or ``claude`` (Claude Code's hooks, each a gitrun process recording one tool call:
    :mod:`gitrun.app.tool_steps`)."""

    name: str = "session"
    actions: tuple[Action, ...] = ()
    spec: str = "session"
    slot: _Slot = field(default_factory=_Slot, compare=False, repr=False)

    @property
    def identity(self) -> str:
        if self.spec in ("session", "mcp", "claude"):
            return self.spec
        return f"session:cmd:{digest(self.spec)}"

    def propose(self, observation: Observation, cursor: int) -> Action | Finish:
        del observation, cursor
        return self.slot.take()

    def is_last(self, cursor: int) -> bool:
        del cursor
        return False  # a refused request never ends a session run: the agent decides again

    def proposal_key(self) -> str | None:
        return self.slot.key

    def drive(self, rt: Runtime) -> RunState:
        """Serve the protocol until ``finish`` or until the agent leaves."""
        from gitrun.engine.session import Session

        if self.spec == "session":
            return Session(rt, self, stdio_transport()).serve()
        if self.spec == "mcp":
            from gitrun.engine import mcp_server

            return mcp_server.serve(rt, self)
        if self.spec == "claude":  # Claude Code's hooks drive it, one process per call
            rt.pause()
            rt.env.sync_index()
            return rt.state
        from gitrun.engine.agentproc import serve_child

        command = self.spec.removeprefix("cmd:")
        return serve_child(command, rt, lambda t: Session(rt, self, t).serve())


def session_agent(spec: str) -> SessionAgent:
    """The session agent for ``session``, ``mcp`` or ``cmd:COMMAND`` (shlex-split, not empty)."""
    if spec.startswith("cmd:"):
        try:
            argv = shlex.split(spec.removeprefix("cmd:"))
        except ValueError as exc:
            raise BadInput(f"--agent {spec!r}: cannot split the command: {exc}") from exc
        if not argv:
            raise BadInput("--agent cmd: names no command; use --agent cmd:'python3 agent.py'")
        from gitrun.engine.agentproc import network_setting

        network_setting()  # a bad GITRUN_AGENT_NETWORK: refused before anything exists
    return SessionAgent(spec=spec)


def stdio_transport() -> jsonrpc.Transport:
    """The protocol on stdin/stdout; anything else this process prints goes to stderr."""
    sys.stdout.flush()
    out = os.dup(1)
    os.dup2(2, 1)
    return jsonrpc.Transport(0, out)
