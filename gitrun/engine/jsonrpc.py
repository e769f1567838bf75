"""JSON-RPC 2.0 framing: one JSON object per line over a pair of file descriptors.

Pure framing and error objects, no gitrun logic: :mod:`gitrun.engine.session` dispatches the
requests. Input is read with a timeout (the session renews its lease while it waits)
and bounded in size; a line that is not JSON, not a request, or too long gets an error
object and the stream goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import time
from dataclasses import dataclass
from typing import Any

from gitrun.core.errors import Exit

VERSION = "2.0"
MAX_LINE_BYTES = 16 * 1024 * 1024  # a request line longer than this is refused, then skipped
MAX_DEPTH = 64  # arrays and objects nested deeper than this are refused (-32600)
_SURROGATE = re.compile("[\ud800-\udfff]")

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
GITRUN_ERROR = -32000  # a gitrun error family; data.rule names it


@dataclass(frozen=True)
class Request:
    """A well-formed request: ``id`` is None for a notification (no response)."""

    method: str
    params: dict[str, Any]
    id: str | int | None
    notification: bool


@dataclass(frozen=True)
class RpcError(Exception):
    """An error to answer with: the JSON-RPC code, a message and gitrun's data."""

    code: int
    message: str
    data: dict[str, Any] | None = None

    def __str__(self) -> str:
        return self.message


class Eof:
    """The peer closed its end."""


class Timeout:
    """Nothing arrived in time."""


EOF = Eof()
TIMEOUT = Timeout()


class Transport:
    """Lines in from ``read_fd``, lines out to ``write_fd`` (bytes, UTF-8, ``\\n``)."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self._buf = bytearray()
        self._skipping = False  # inside an over-long line: drop bytes up to its newline
        self._eof = False
        self.closed = False

    def read_line(self, timeout: float) -> bytes | Eof | Timeout:
        """The next line (without its newline), :data:`EOF`, or :data:`TIMEOUT`.

        An over-long line comes back as ``b""`` + the marker the caller refuses; bytes
        beyond :data:`MAX_LINE_BYTES` are never buffered."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._take_line()
            if line is not None:
                return line
            if self._eof:
                return EOF
            left = deadline - time.monotonic()
            if left <= 0:
                return TIMEOUT
            ready, _, _ = select.select([self.read_fd], [], [], left)
            if not ready:
                return TIMEOUT
            try:
                chunk = os.read(self.read_fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._eof = True
                if self._buf and not self._skipping:
                    self._buf += b"\n"  # a last line without its newline still counts
                continue
            self._buf += chunk

    def _take_line(self) -> bytes | None:
        while True:
            nl = self._buf.find(b"\n")
            if self._skipping:
                if nl < 0:
                    self._buf.clear()
                    return None
                del self._buf[: nl + 1]
                self._skipping = False
                continue
            if nl < 0:
                if len(self._buf) > MAX_LINE_BYTES:
                    self._buf.clear()
                    self._skipping = True
                    return TOO_LONG
                return None
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if len(line) > MAX_LINE_BYTES:
                return TOO_LONG
            return line

    def send(self, message: dict[str, Any]) -> bool:
        """Write one message as one line; False when the peer has gone."""
        if self.closed:
            return False
        data = (json.dumps(message, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.write_fd, view)
                view = view[n:]
        except OSError:  # EPIPE: the agent died; the session ends at its EOF
            self.closed = True
            return False
        return True

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            os.close(self.write_fd)


TOO_LONG = b"\x00too-long"  # never a JSON line (JSON text cannot hold a raw NUL)


def parse(line: bytes) -> Request:
    """One request line, or :class:`RpcError` (-32700 not JSON, -32600 not a request)."""
    if line == TOO_LONG:
        raise RpcError(INVALID_REQUEST, f"request line longer than {MAX_LINE_BYTES} bytes")
    try:
        doc = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RpcError(PARSE_ERROR, f"parse error: {exc}") from exc
    except RecursionError as exc:  # deeper than the decoder's own stack allows
        raise RpcError(INVALID_REQUEST, f"request nested deeper than {MAX_DEPTH}") from exc
    check_document(doc)
    if isinstance(doc, list):
        raise RpcError(INVALID_REQUEST, "batch requests are not supported; send one per line")
    if not isinstance(doc, dict):
        raise RpcError(INVALID_REQUEST, "a request is a JSON object")
    rid = doc.get("id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, str | int)):
        raise RpcError(INVALID_REQUEST, "id must be a string, an integer or null")
    if doc.get("jsonrpc") != VERSION:
        raise RpcError(INVALID_REQUEST, 'a request has "jsonrpc": "2.0"', _with_id(rid))
    method = doc.get("method")
    if not isinstance(method, str):
        raise RpcError(INVALID_REQUEST, "method must be a string", _with_id(rid))
    params = doc.get("params", {})
    if isinstance(params, list) and not params:
        params = {}
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "params must be an object (named parameters)", _with_id(rid))
    unknown = sorted(set(doc) - {"jsonrpc", "id", "method", "params"})
    if unknown:
        raise RpcError(INVALID_REQUEST, f"unknown member {unknown[0]!r}", _with_id(rid))
    return Request(method, params, rid, "id" not in doc)


def check_document(doc: Any) -> None:
    """Refuse a document nested deeper than :data:`MAX_DEPTH` (-32600) or holding a lone
    surrogate escape (``"\\ud800"``: valid JSON syntax, no Unicode text; -32700), before
    anything reads it: either would fail later, deep inside gitrun, and end the session.
    Iterative, so no document exhausts the stack here."""
    rid = doc.get("id") if isinstance(doc, dict) else None
    data = _with_id(rid) if isinstance(rid, str | int) and not isinstance(rid, bool) else None
    todo: list[tuple[Any, int]] = [(doc, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise RpcError(
                    PARSE_ERROR, "parse error: a string holds a lone UTF-16 surrogate escape"
                )
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise RpcError(INVALID_REQUEST, f"request nested deeper than {MAX_DEPTH}", data)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                todo.append((key, depth))
            todo.append((item, depth + 1))


def _with_id(rid: str | int | None) -> dict[str, Any]:
    return {"_id": rid}


def request_id(err: RpcError) -> str | int | None:
    """The id a refused request carried, when it could be read."""
    if err.data is not None and "_id" in err.data:
        value = err.data["_id"]
        return value if isinstance(value, str | int) else None
    return None


def result(rid: str | int | None, value: Any) -> dict[str, Any]:
    return {"jsonrpc": VERSION, "id": rid, "result": value}


RULES = {
    PARSE_ERROR: "parse-error",
    INVALID_REQUEST: "invalid-request",
    METHOD_NOT_FOUND: "method-not-found",
    INVALID_PARAMS: "bad-params",
    INTERNAL_ERROR: "internal",
}


def error(rid: str | int | None, err: RpcError) -> dict[str, Any]:
    """The error response; ``data`` always holds ``rule``, ``message`` and ``exit_code``."""
    data = {k: v for k, v in (err.data or {}).items() if k != "_id"}
    data.setdefault("rule", RULES.get(err.code, "gitrun"))
    data.setdefault("message", err.message)
    code = Exit.INTERNAL if err.code == INTERNAL_ERROR else Exit.BAD_INPUT
    data.setdefault("exit_code", int(code))
    body = {"code": err.code, "message": err.message, "data": data}
    return {"jsonrpc": VERSION, "id": rid, "error": body}
