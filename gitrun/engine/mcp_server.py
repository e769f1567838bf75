"""The session protocol as an MCP server over stdio, on the official ``mcp`` SDK.

Every tool is one session method (:meth:`gitrun.engine.session.Session.dispatch`, the
code path the JSON-RPC lines use too): a write is one gated step with a receipt commit,
a client ``idempotency_key`` replays its receipt. A refusal is a tool result with
``isError`` whose text names the rule and what to do; the run's state (``observe``) is
the resource ``gitrun://run/<id>/state``. The SDK serves each request as its own task;
the session's blocking work (a step, an exec, the tests) runs in a worker thread
(``anyio.to_thread.run_sync``, as the SDK's own MCPServer runs sync tools), one call at a
time under :attr:`McpSession.lock`, so pings and ``tools/list`` answer while a command
runs, and the lease renewal between calls (under the same lock) never races a step.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import anyio.to_thread
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

from gitrun.core.errors import Exit, GitrunError, LeaseLost
from gitrun.engine.jsonrpc import PARSE_ERROR, RpcError
from gitrun.engine.session import Session
from gitrun.engine.session_rpc import KEY_PATTERN, MUTATING, PARAMS, error_of

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from gitrun.core.records import RunState
    from gitrun.engine.runtime import Runtime
    from gitrun.engine.session_agent import SessionAgent

KEY_NOTE = f"Optional retry key ({KEY_PATTERN}): the same key and intent replays the receipt."
TOOLS: dict[str, str] = {
    "observe": "The run's phase, HEAD commit and tree, budgets left, recent receipts, last tests.",
    "read_file": "Read a file of HEAD (text, or base64), optionally a 1-based line range.",
    "list_files": "List the files of the run's HEAD, optionally matching a glob (* and **).",
    "search": "Search HEAD's text files for a literal (or regex) pattern; returns path:line hits.",
    "write_file": "Create or overwrite a file with the given UTF-8 content: one receipt commit.",
    "delete_file": "Delete a file: one receipt commit.",
    "apply_patch": "Apply a unified diff (git diff format) to HEAD: one receipt commit.",
    "exec": "Run a shell command in the worktree; its file changes become one receipt commit.",
    "run_tests": "Run the task's tests on HEAD now (sandboxed); the run goes on.",
    "finish": "End the run: the task's verifier decides done or failed. Call it once, last.",
    "rewind": "Restore the tree of an earlier receipt commit or generation, as one new step.",
}
PARAM_NOTES: dict[str, str] = {
    "path": "Repository-relative POSIX path, e.g. src/app.py.",
    "content": "The file's complete new content.",
    "patch": "A unified diff with --- a/PATH and +++ b/PATH headers.",
    "command": "A bash -c string, or an argv list.",
    "cwd": "Directory inside the worktree to run in (default: its root).",
    "timeout_seconds": "Seconds before the command is killed (the policy caps it).",
    "env": "Variables to set for the command, {NAME: value} (never GITRUN_*).",
    "start_line": "First line to read (1-based).",
    "end_line": "Last line to read (inclusive).",
    "glob": "Glob over paths: * within a directory, ** across directories.",
    "pattern": "The text to look for.",
    "regex": "Treat pattern as a Python regular expression.",
    "idempotency_key": KEY_NOTE,
    "to": "A receipt commit (full or a unique prefix) or a checkpoint generation number.",
}
_JSON_TYPES = {str: "string", int: "integer", bool: "boolean", dict: "object"}
T = TypeVar("T")


def _schema_of(kind: type | tuple[type, ...]) -> dict[str, Any]:
    if kind == (int, float):
        return {"type": "number"}
    if kind == (str, list):
        return {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
    if kind == (str, int):
        return {"type": ["string", "integer"]}
    if isinstance(kind, tuple):
        raise GitrunError(f"no JSON schema for the parameter type {kind}")
    return {"type": _JSON_TYPES[kind]}


def input_schema(method: str) -> dict[str, Any]:
    """The tool's JSON input schema, from the protocol's own parameter table."""
    props = {
        name: {**_schema_of(kind), "description": PARAM_NOTES.get(name, name)}
        for name, (kind, _) in PARAMS[method].items()
    }
    required = [name for name, (_, needed) in PARAMS[method].items() if needed]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


def refusal_text(exc: GitrunError | RpcError, session: Session) -> tuple[str, dict[str, Any]]:
    """The isError text (rule, message, what to do) and its structured data."""
    err = exc if isinstance(exc, RpcError) else error_of(exc, session.rt.state)
    data = dict(err.data or {})
    rule = str(data.get("rule", "bad-params"))
    data.setdefault("rule", rule)
    data.setdefault("message", err.message)
    data.setdefault("exit_code", int(Exit.BAD_INPUT))
    if isinstance(exc, RpcError):
        todo = "fix the arguments (see the tool's input schema) and call again"
    elif int(data["exit_code"]) == int(Exit.REFUSED):
        todo = "nothing was written; propose another action (observe shows the run)"
    else:
        todo = "nothing was written; read the message, observe shows the run"
    detail = err.message.removeprefix(f"{rule}: ")
    return f"refused by rule {rule}: {detail}. What to do: {todo}.", data


class McpSession:
    """One MCP connection onto one gitrun session."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.fatal: BaseException | None = None
        self.uri = f"gitrun://run/{session.rt.state.run_id}/state"
        self.scope: anyio.CancelScope | None = None
        self.lock = anyio.Lock()  # one session call (or lease renewal) at a time

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, after the calls before it: the loop stays free."""
        async with self.lock:
            return await anyio.to_thread.run_sync(fn, *args)

    def tools(self) -> list[types.Tool]:
        policy = self.session.rt.task.policy
        return [
            types.Tool(name=name, description=text, input_schema=input_schema(name))
            for name, text in TOOLS.items()
            if name in self.session.methods
            and (name not in MUTATING or name in policy.allowed_actions)
        ]

    async def list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        del ctx, params
        return types.ListToolsResult(tools=self.tools())

    async def call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        del ctx
        try:
            arguments = dict(params.arguments or {})
            result = await self._off_loop(self.session.dispatch, params.name, arguments)
        except (RpcError, GitrunError) as exc:
            text, data = refusal_text(exc, self.session)
            if isinstance(exc, LeaseLost) or (
                isinstance(exc, GitrunError) and exc.exit_code == Exit.INTERNAL
            ):
                self._stop(exc)
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=text)],
                structured_content=data,
                is_error=True,
            )
        except Exception as exc:
            self._stop(exc)
            bug = f"internal error: {type(exc).__name__}: {exc}; the server stops"
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=bug)], is_error=True
            )
        text = json.dumps(result, ensure_ascii=False, sort_keys=True)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], structured_content=result
        )

    def _stop(self, exc: BaseException) -> None:
        """A lost lease or a gitrun bug ends the server (after this answer is sent)."""
        self.fatal = exc
        if self.scope is not None:
            self.scope.deadline = anyio.current_time() + 0.5

    async def list_resources(self, ctx: Any, params: Any) -> types.ListResourcesResult:
        del ctx, params
        run_id = self.session.rt.state.run_id
        state = types.Resource(
            name=f"run {run_id} state",
            uri=self.uri,
            description="The run's state, as the observe tool returns it (JSON).",
            mime_type="application/json",
        )
        return types.ListResourcesResult(resources=[state])

    async def read_resource(
        self, ctx: Any, params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        del ctx
        if str(params.uri) != self.uri:
            raise ValueError(f"no resource {params.uri}; this server has {self.uri}")
        text = json.dumps(
            await self._off_loop(self.session.dispatch, "observe", {}), sort_keys=True
        )
        contents = types.TextResourceContents(uri=self.uri, mime_type="application/json", text=text)
        return types.ReadResourceResult(contents=[contents])

    async def renew(self) -> None:
        """Keep the lease while the client thinks (between tool calls, never during one:
        a running step renews it itself)."""
        rt = self.session.rt
        interval = max(0.2, rt.lease.duration / 4)
        while True:
            await anyio.sleep(interval)
            try:
                await self._off_loop(lambda: rt.lease.maybe_renew(rt.state.generation))
            except GitrunError as exc:  # lost to another worker: stop serving, write nothing
                self._stop(exc)
                return

    async def main(self) -> None:
        state = self.session.rt.state
        server: Server[Any] = Server(
            "gitrun",
            version="0.1.0",
            instructions=f"gitrun run {state.run_id}: {self.session.rt.task.title}. Every "
            "write is a durable, gated step with a receipt commit; call finish when done.",
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
            on_list_resources=self.list_resources,
            on_read_resource=self.read_resource,
        )
        with anyio.CancelScope() as scope:
            self.scope = scope
            async with stdio_server() as (read, write), anyio.create_task_group() as tg:
                screened_in, screened = anyio.create_memory_object_stream[
                    SessionMessage | Exception
                ](0)
                tg.start_soon(screen, read, screened_in, write)
                tg.start_soon(self.renew)
                await server.run(screened, write, server.create_initialization_options())
                tg.cancel_scope.cancel()


class Sink(Protocol):
    """Where the SDK's stdio transport takes messages to the client."""

    async def send(self, item: SessionMessage, /) -> None: ...


async def screen(
    read: AsyncIterable[SessionMessage | Exception],
    forward: MemoryObjectSendStream[SessionMessage | Exception],
    write: Sink,
) -> None:
    """Pass the client's messages on; answer a line the SDK could not read (malformed
    JSON, a lone surrogate, nested too deeply) with -32700 itself: the SDK only logs it,
    and a client waiting for that answer would wait for ever."""
    async with forward:
        async for item in read:
            if not isinstance(item, Exception):
                await forward.send(item)
                continue
            error = types.ErrorData(
                code=PARSE_ERROR,
                message="parse error: the line is no JSON-RPC message (malformed JSON, a lone "
                "surrogate escape, or nested too deeply); the session goes on",
            )
            await write.send(
                SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=None, error=error))
            )


def serve(rt: Runtime, agent: SessionAgent) -> RunState:
    """Serve the run over MCP on stdio until the client leaves; then the session's end."""
    session = Session(rt, agent)
    session.begin()
    conn = McpSession(session)
    try:
        anyio.run(conn.main)
    finally:  # the SDK gave fd 1 back: what gitrun prints now must not reach the client
        sys.stdout.flush()
        os.dup2(2, 1)
    if conn.fatal is not None:
        raise conn.fatal
    return session.end()
