"""The test outcomes gitrun's pytest plugin streamed, read strictly; pure.

The plugin (``gitrun/engine/verdict_plugin.py``) writes one JSON line per record to a
socket only gitrun reads, each line carrying the run's random token: ``begin``, one
``test`` per report pytest logged, ``end`` with the exit status and the SHA-256 of the
JUnit report. :func:`read_stream` turns those lines into outcomes by the
``(classname, name)`` key of :func:`gitrun.core.junit.junit_key`, judged as the JUnit
report judges them (a failing setup or teardown is an error, an xfail passes, a test
reported twice counts as its worst report). Anything that is not exactly such a stream
— a line without the token, a record after ``end``, a second ``begin``, garbage — is
:class:`Tampered`: the verifier fails the run with the reason ``verdict-tampered``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gitrun.core.junit import ERROR, FAILED, PASSED, SKIPPED, junit_key, worse

__all__ = ["MAX_STREAM_BYTES", "TAMPERED", "Stream", "Tampered", "read_stream"]

TAMPERED = "verdict-tampered"
MAX_STREAM_BYTES = 64 * 1024 * 1024
"""A stream longer than this is not read further (the run is an error, not a verdict)."""

_KINDS = frozenset({"begin", "test", "end"})


class Tampered(Exception):
    """The outcome stream (or the report beside it) is not what gitrun's plugin wrote."""


@dataclass
class Stream:
    """What the plugin reported: whether it began and ended, the outcomes so far, and the
    end record's exit status and JUnit digest."""

    began: bool = False
    ended: bool = False
    status: int | None = None
    junit_sha256: str | None = None
    cases: dict[tuple[str, str], str] = field(default_factory=dict)


def read_stream(data: bytes, token: str) -> Stream:
    """The stream ``data`` as :class:`Stream`; :class:`Tampered` naming the first line
    that is not one of the plugin's records for this ``token``."""
    out = Stream()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        raise Tampered("the outcome stream ends in the middle of a line")
    for n, raw in enumerate(lines, 1):
        record = _record(raw, token, n)
        kind = record["k"]
        if out.ended:
            raise Tampered(f"line {n} of the outcome stream comes after its end record")
        if (kind == "begin") == out.began:
            what = "a second begin record" if out.began else "a record before begin"
            raise Tampered(f"line {n} of the outcome stream is {what}")
        if kind == "begin":
            out.began = True
        elif kind == "test":
            key = junit_key(_text(record, "id", n))
            out.cases[key] = worse(out.cases.get(key, PASSED), _outcome(record, n))
        else:
            out.ended = True
            status, junit = record.get("status"), record.get("junit")
            if not isinstance(status, int) or not (junit is None or isinstance(junit, str)):
                raise Tampered(f"line {n} of the outcome stream is a malformed end record")
            out.status, out.junit_sha256 = status, junit
    return out


def _record(raw: bytes, token: str, n: int) -> dict[str, object]:
    try:
        record = json.loads(raw.decode("utf-8", "surrogateescape"))
    except ValueError:
        raise Tampered(f"line {n} of the outcome stream is not JSON") from None
    if not isinstance(record, dict) or record.get("t") != token:
        raise Tampered(f"line {n} of the outcome stream does not carry the run's token")
    if record.get("k") not in _KINDS:
        raise Tampered(f"line {n} of the outcome stream has an unknown kind")
    return record


def _text(record: dict[str, object], key: str, n: int) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        raise Tampered(f"line {n} of the outcome stream has no {key}")
    return value


def _outcome(record: dict[str, object], n: int) -> str:
    """One report's outcome as the JUnit report records it (pytest's junitxml)."""
    when, outcome, xfail = _text(record, "when", n), _text(record, "o", n), record.get("x")
    if not isinstance(xfail, bool) or when not in ("setup", "call", "teardown"):
        raise Tampered(f"line {n} of the outcome stream is a malformed test record")
    if outcome == "passed":
        return PASSED
    if outcome == "skipped":
        return PASSED if xfail else SKIPPED  # SWE-bench grades XFAIL as passing
    if outcome == "failed":
        if xfail:
            return SKIPPED  # junitxml writes an xfail-marked failure as skipped
        return FAILED if when == "call" else ERROR
    return ERROR  # an outcome a named plugin invented (e.g. "rerun"): never a pass
