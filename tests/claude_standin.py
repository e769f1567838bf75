"""A scripted stand-in for the Anthropic Messages API, served on loopback, and the real
Claude Code CLI (installed from npm by the tests) pointed at it.

Each request of the agent loop (one carrying ``tools``) is answered with the next
scripted tool call, as server-sent events in the Messages API's order; once the script
is used up, or for any other request (a title, a summary), a text answer ends the turn.
The n-th tool call is chosen by counting the ``tool_result`` blocks the request carries,
so a retried request gets the same answer. No network, no model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

CLAUDE_CODE_VERSION = "2.1.332"  # the version REFERENCE checked; pinned here
CLAUDE_CACHE = Path(os.environ.get("GITRUN_CLAUDE_CACHE", Path.home() / ".cache" / "gitrun-claude"))


def install_claude() -> Path:
    """The pinned Claude Code, installed with npm into a cache directory (once); skips
    the calling test with the reason when npm or its registry cannot be reached."""
    prefix = CLAUDE_CACHE / CLAUDE_CODE_VERSION
    binary = prefix / "node_modules" / ".bin" / "claude"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: Claude Code cannot be installed for these tests")
    CLAUDE_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CLAUDE_CACHE / f"{CLAUDE_CODE_VERSION}.lock")):  # xdist workers: one
        if not binary.exists():
            _npm_install(npm, prefix)
    if not binary.exists():
        pytest.skip("npm could not install Claude Code: see the warning above")
    return binary


def _npm_install(npm: str, prefix: Path) -> None:
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
         f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        why = done.stderr[-300:]
        pytest.skip(f"npm could not install Claude Code (registry unreachable?): {why}")


@dataclass
class Script:
    """The tool calls the stand-in hands out, in order: (name, input)."""

    calls: Sequence[tuple[str, dict[str, Any]]]
    prefix: str = "toolu_gitrun_"  # its tool_use ids: a resumed conversation's own are not counted
    requests: list[dict[str, Any]] = field(default_factory=list)

    def tool_id(self, n: int) -> str:
        return f"{self.prefix}{n:04d}"

    def conversation(self) -> str:
        """The last request's whole conversation as JSON text: what the model was shown."""
        return json.dumps(self.requests[-1].get("messages", [])) if self.requests else ""

    def results(self) -> list[str]:
        """The text of every tool_result Claude Code sent back for this script's calls."""
        out: dict[str, str] = {}
        for body in self.requests:
            for m in body.get("messages", []):
                for b in m.get("content") if isinstance(m.get("content"), list) else []:
                    ours = str(b.get("tool_use_id", "")).startswith(self.prefix)
                    if b.get("type") == "tool_result" and ours:
                        out[b["tool_use_id"]] = json.dumps(b.get("content"))
        return [out[k] for k in sorted(out)]


def _events(
    message: dict[str, Any], block: dict[str, Any], delta: dict[str, Any], stop: str
) -> bytes:
    events = [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": block}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop,
                                                               "stop_sequence": None},
                           "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return b"".join(f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in events)


def answer(script: Script, body: dict[str, Any]) -> bytes:
    """The SSE answer to one request."""
    n = sum(
        1
        for m in body.get("messages", [])
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict)
        and b.get("type") == "tool_result"
        and str(b.get("tool_use_id", "")).startswith(script.prefix)
    )
    message: dict[str, Any] = {"id": f"msg_{n}", "type": "message", "role": "assistant",
               "model": "claude-sonnet-4-5", "content": [], "stop_reason": None,
               "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}  # fmt: skip
    if body.get("tools") and n < len(script.calls):
        name, tool_input = script.calls[n]
        block = {"type": "tool_use", "id": script.tool_id(n), "name": name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input)}
        return _events(message, block, delta, "tool_use")
    block = {"type": "text", "text": ""}
    return _events(message, block, {"type": "text_delta", "text": "done"}, "end_turn")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    script: Script

    def do_POST(self) -> None:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            raw = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                raw += self.rfile.read(size)
                self.rfile.readline()
        else:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.loads(raw or b"{}")
        self.script.requests.append(body)
        data = answer(self.script, body)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


@contextmanager
def standin(script: Script) -> Iterator[str]:
    """Serve ``script`` on 127.0.0.1; yields the base URL."""
    handler = type("Handler", (_Handler,), {"script": script})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def claude_env(base_url: str, home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Claude Code's environment for a test: the stand-in, a private HOME, no traffic."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-test-not-a-key",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "MCP_CONNECTION_NONBLOCKING": "false",
    }
    env.update(extra or {})
    return env
