"""A client of one run's ``gitrun session`` subprocess that survives gitrun's crashes.

The client speaks the session protocol (docs/protocol.md) over the child's pipes. When
the child dies under a request (a SIGKILL, an OOM kill), the client starts
``gitrun resume RUN --takeover-after 0`` and sends the same request again: mutating
requests carry an idempotency key, so the step happens once whatever the crash point.
Taking the dead child's lease at once is safe because every write is fenced by the
lease generation, and the client has reaped the child before it takes over.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gitrun.engine.jsonrpc import Eof, Timeout, Transport

RESULT_CODES = {0: "done", 1: "failed", 3: "frozen for a human", 8: "left by its agent"}


def step_key(prefix: str, position: int, previous: str, params: dict[str, Any]) -> str:
    """A restart-safe idempotency key (docs/protocol.md, "Keys that make a restart free"):
    the request's position in this client's sequence, chained to the previous key and the
    request's parameters. A client started again that asks the same things in the same
    order makes the same keys (answered ``replayed``, nothing re-run); a different request
    gets a new key — a new step, never a receipt conflict."""
    asked = {k: v for k, v in params.items() if k != "idempotency_key"}
    chain = {"previous": previous, "params": asked}
    body = json.dumps(chain, sort_keys=True, separators=(",", ":"))
    return f"{prefix}-{position:05d}-{hashlib.sha256(body.encode()).hexdigest()[:16]}"


class SessionRefused(Exception):
    """A JSON-RPC error answer: ``rule`` and ``exit_code`` as docs/protocol.md lists them."""

    def __init__(self, code: int, message: str, rule: str, exit_code: int) -> None:
        super().__init__(message)
        self.code, self.message, self.rule, self.exit_code = code, message, rule, exit_code


class SessionEnded(Exception):
    """The session process exited without answering and is not restarted."""

    def __init__(self, returncode: int, stderr_tail: str) -> None:
        what = RESULT_CODES.get(returncode, f"exit code {returncode}")
        super().__init__(f"the gitrun session ended ({what}): {stderr_tail.strip()[-400:]}")
        self.returncode = returncode


@dataclass
class SessionOptions:
    """How to start gitrun for one run: the task, the run id, the workspace, the CLI."""

    task_dir: Path
    run_id: str
    repo: Path | None = None
    workspace: Path | None = None
    key_file: Path | None = None
    lease_seconds: float = 30.0
    answer_timeout: float = 900.0  # longer than any exec or verifier timeout of a task
    max_restarts: int = 3
    gitrun: list[str] = field(default_factory=lambda: [sys.executable, "-m", "gitrun"])
    env: dict[str, str] | None = None  # the child's environment (default: this process's)
    isolation: str | None = None  # --isolation (default: the task's)
    takeover_after: float | None = None  # the first start's --takeover-after (an agent
    # started again after a crash need not wait for the dead gitrun's lease to expire)
    remote: str | None = None  # --remote: the shared git remote holding the run's refs

    def common(self) -> list[str]:
        """The options every gitrun command of this run takes."""
        out = ["--lease-seconds", str(self.lease_seconds)]
        if self.isolation is not None:
            out += ["--isolation", self.isolation]
        if self.workspace is not None:
            out += ["--workspace", str(self.workspace)]
        if self.key_file is not None:
            out += ["--key-file", str(self.key_file)]
        if self.remote is not None:
            out += ["--remote", self.remote]
        return out


class SessionClient:
    """One run's session: :meth:`request` answers or raises, restarting a killed gitrun."""

    def __init__(self, options: SessionOptions) -> None:
        self.options = options
        self.restarts = 0
        self.deaths: list[int] = []  # exit codes of the gitrun processes that died under a request
        self._next_id = 0
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.proc = self._spawn(self._start_argv())

    @property
    def pid(self) -> int:
        """The pid of the gitrun process serving the run now."""
        return self.proc.pid

    def _start_argv(self) -> list[str]:
        o = self.options
        argv = ["session", str(o.task_dir), "--run-id", o.run_id, *o.common()]
        if o.takeover_after is not None:
            argv += ["--takeover-after", str(o.takeover_after)]
        return argv + (["--repo", str(o.repo)] if o.repo is not None else [])

    def _resume_argv(self) -> list[str]:
        return ["resume", self.options.run_id, "--takeover-after", "0", *self.options.common()]

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [*self.options.gitrun, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=self.options.env,
            bufsize=0,
        )
        if proc.stdin is None or proc.stdout is None:
            raise OSError("gitrun session: no pipes")
        self._transport = Transport(proc.stdout.fileno(), proc.stdin.fileno())
        return proc

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The result of ``method``; :class:`SessionRefused` for an error answer."""
        while True:
            reply = self._exchange(method, params or {})
            if reply is not None:
                return _result(reply)
            returncode = self._reap()
            if returncode >= 0 or self.restarts >= self.options.max_restarts:
                raise SessionEnded(returncode, self.stderr_tail())
            self.restarts += 1
            self.deaths.append(returncode)
            self.proc = self._spawn(
                self._resume_argv() if self._registered() else self._start_argv()
            )

    def _exchange(self, method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """Send one request and read its answer; None when the process went away."""
        self._next_id += 1
        message = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params}
        if not self._transport.send(message):
            return None
        line = self._transport.read_line(self.options.answer_timeout)
        if isinstance(line, Timeout):
            raise TimeoutError(f"gitrun answered no {method} in {self.options.answer_timeout}s")
        if isinstance(line, Eof):
            return None
        reply: dict[str, Any] = json.loads(line)
        if reply.get("id") != self._next_id:
            raise ValueError(f"gitrun answered request {reply.get('id')}, not {self._next_id}")
        return reply

    def _reap(self, timeout: float = 60) -> int:
        """Close our ends, wait for the child; its exit code (negative: killed by a signal)."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        return self.proc.wait(timeout=timeout)

    def _registered(self) -> bool:
        """Whether the workspace knows the run (a kill can land before its registration)."""
        argv = [*self.options.gitrun, "status", self.options.run_id, *self._store_args()]
        done = subprocess.run(argv, capture_output=True, env=self.options.env, check=False)
        return done.returncode == 0

    def _store_args(self) -> list[str]:
        o = self.options
        out = ["--workspace", str(o.workspace)] if o.workspace is not None else []
        return out + (["--key-file", str(o.key_file)] if o.key_file is not None else [])

    def status(self) -> dict[str, Any]:
        """``gitrun status RUN --json``: the run as its checkpoint records it."""
        argv = [*self.options.gitrun, "status", self.options.run_id, "--json", *self._store_args()]
        done = subprocess.run(argv, capture_output=True, env=self.options.env, check=True)
        info: dict[str, Any] = json.loads(done.stdout)
        return info

    def close(self, timeout: float = 120) -> int:
        """Close the session (EOF) and wait for gitrun's exit code; again: the same code."""
        try:
            return self._reap(timeout)
        finally:
            self._log.close()

    def stderr_tail(self, limit: int = 4000) -> str:
        """The end of what the gitrun processes of this client wrote on stderr."""
        if self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read()[-limit:].decode(errors="replace")


def _result(reply: dict[str, Any]) -> dict[str, Any]:
    if "error" in reply:
        err = reply["error"]
        data = err.get("data") or {}
        raise SessionRefused(
            err["code"], data.get("message", err["message"]), data.get("rule", ""),
            data.get("exit_code", 70),
        )  # fmt: skip
    result: dict[str, Any] = reply["result"]
    return result
