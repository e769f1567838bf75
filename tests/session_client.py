"""Test helpers for the session protocol: a client over a real ``gitrun session`` process,
and a tiny validator for the JSON Schema subset docs/protocol.md uses."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, ClassVar

from conftest import ROOT, Gitrun

from gitrun.engine.jsonrpc import EOF, Eof, Timeout, Transport

PROTOCOL_DOC = ROOT / "docs" / "protocol.md"
_BLOCK = re.compile(r"<!-- schema (\S+) -->\n```json\n(.*?)\n```", re.S)


def load_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """(schemas by "method.params"/"method.result", shared defs) from docs/protocol.md."""
    found = {name: json.loads(body) for name, body in _BLOCK.findall(PROTOCOL_DOC.read_text())}
    defs = found.pop("defs")
    return found, defs


_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def problems(value: Any, schema: dict[str, Any], defs: dict[str, Any], at: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (type, enum, const, pattern, maxLength, minimum, required,
    properties, additionalProperties, items, oneOf, $ref): empty when it holds."""
    if "$ref" in schema:
        return problems(value, defs[schema["$ref"]], defs, at)
    if "oneOf" in schema:
        fits = [s for s in schema["oneOf"] if not problems(value, s, defs, at)]
        return [] if len(fits) == 1 else [f"{at}: matches {len(fits)} of oneOf"]
    out: list[str] = []
    if "const" in schema and value != schema["const"]:
        out.append(f"{at}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{at}: {value!r} not in {schema['enum']}")
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return [*out, f"{at}: {type(value).__name__} is not {kinds}"]
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        out.append(f"{at}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        out.append(f"{at}: {len(value)} characters > maxLength {schema['maxLength']}")
    if _is(value, "number") and "minimum" in schema and value < schema["minimum"]:
        out.append(f"{at}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        out += _object_problems(value, schema, defs, at)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += problems(item, schema["items"], defs, f"{at}[{i}]")
    return out


def _object_problems(
    value: dict[str, Any], schema: dict[str, Any], defs: dict[str, Any], at: str
) -> list[str]:
    out = [f"{at}: missing {name}" for name in schema.get("required", []) if name not in value]
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in props:
            out += problems(item, props[name], defs, f"{at}.{name}")
        elif extra is False:
            out.append(f"{at}: unexpected member {name}")
        elif isinstance(extra, dict):
            out += problems(item, extra, defs, f"{at}.{name}")
    return out


class Rpc:
    """A client of one real ``gitrun session`` subprocess: JSON lines over pipes."""

    opened: ClassVar[list[Rpc]] = []  # reaped after each test (see :func:`reap_all`)

    def __init__(
        self, gitrun: Gitrun, *args: str, command: str = "session", timeout: float = 60, **env: str
    ) -> None:
        self.log = (gitrun.home.parent / f"session-{id(self)}.log").open("w+b")
        self.proc = subprocess.Popen(
            gitrun.argv(command, *args),  # `gitrun resume` of a session run serves too
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=gitrun.env(**env),
            cwd=gitrun.home.parent,
            bufsize=0,
        )
        if self.proc.stdin is None or self.proc.stdout is None:
            raise AssertionError("no pipes")
        self.transport = Transport(self.proc.stdout.fileno(), self.proc.stdin.fileno())
        self.timeout = timeout
        self.next_id = 0
        self.schemas, self.defs = load_schemas()
        Rpc.opened.append(self)

    def send_raw(self, data: bytes) -> None:
        if self.proc.stdin is None:
            raise AssertionError("stdin closed")
        self.proc.stdin.write(data)

    def read(self, timeout: float | None = None) -> dict[str, Any] | Eof:
        line = self.transport.read_line(timeout or self.timeout)
        if isinstance(line, Timeout):
            raise TimeoutError(f"no answer in time; stderr: {self.stderr()}")
        if isinstance(line, Eof):
            return EOF
        doc: dict[str, Any] = json.loads(line)  # every stdout line is a JSON object
        return doc

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one request, return the whole response (checked against the schemas)."""
        self.next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            msg["params"] = params
        self.send_raw((json.dumps(msg) + "\n").encode())
        reply = self.read()
        assert not isinstance(reply, Eof), f"session closed; stderr: {self.stderr()}"
        assert reply["id"] == self.next_id
        if "error" in reply:
            assert not problems(reply["error"], self.defs["error"], self.defs), reply
        elif f"{method}.result" in self.schemas:
            found = problems(reply["result"], self.schemas[f"{method}.result"], self.defs)
            assert not found, (method, found, reply["result"])
        return reply

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """The result of a request that must succeed."""
        reply = self.request(method, params)
        assert "result" in reply, reply
        result: dict[str, Any] = reply["result"]
        return result

    def fail(self, method: str, **params: Any) -> dict[str, Any]:
        """The error of a request that must fail."""
        reply = self.request(method, params)
        assert "error" in reply, reply
        error: dict[str, Any] = reply["error"]
        return error

    def close(self, timeout: float = 60) -> int:
        """Close stdin (EOF), wait for the exit code; kill and fail on a hang."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.log.close()

    @classmethod
    def reap_all(cls) -> None:
        """Kill and reap every session a test left running."""
        while cls.opened:
            rpc = cls.opened.pop()
            if rpc.proc.poll() is None:
                rpc.proc.kill()
            rpc.proc.wait()
            for f in (rpc.proc.stdin, rpc.proc.stdout, rpc.log):
                if f is not None and not f.closed:
                    f.close()

    def stderr(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")
