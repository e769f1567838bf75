"""Per-test outcomes from a JUnit XML report (pytest's ``xunit1`` family), parsed safely.

Tests are matched by the ``(classname, name)`` pair pytest derives from a node id
(:func:`junit_key`). A report is size-capped, must be UTF-8 and may declare no DTD or
entity; a test reported twice counts as its worst report, and an ``xfail`` as passing (as
SWE-bench grades it). Pure apart from reading the report file; :mod:`gitrun.engine.verifier`
runs the command that writes it.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = [
    "ERROR",
    "FAILED",
    "MAX_REPORT_BYTES",
    "MISSING",
    "PASSED",
    "SKIPPED",
    "UnusableReport",
    "junit_key",
    "parse_junit",
    "read_junit",
    "report_bytes",
    "worse",
]

PASSED = "passed"
FAILED = "failed"
ERROR = "error"
SKIPPED = "skipped"
MISSING = "missing"

MAX_REPORT_BYTES = 20 * 1024 * 1024
"""A JUnit report larger than this is refused rather than parsed."""

_RANK = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}
_CHILD_OUTCOME = {"failure": FAILED, "error": ERROR, "skipped": SKIPPED}


class UnusableReport(Exception):
    """The JUnit report is absent, too large, malformed or refused."""


def junit_key(node_id: str) -> tuple[str, str]:
    """The ``(classname, name)`` pytest's JUnit report gives the test ``node_id``.

    Mirrors pytest's ``mangle_test_address``: ``tests/test_x.py::TestC::test_m[1]`` ->
    ``("tests.test_x.TestC", "test_m[1]")``.
    """
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    module = names[0].replace("/", ".")
    names[0] = module.removesuffix(".py")
    return ".".join(names[:-1]), names[-1] + bracket + params


def read_junit(path: Path) -> dict[tuple[str, str], str]:
    """Outcomes by ``(classname, name)`` from the JUnit report at ``path``, size-capped."""
    data = report_bytes(path)
    if data is None:
        raise UnusableReport("no JUnit report was written")
    return parse_junit(data)


def report_bytes(path: Path) -> bytes | None:
    """The report's bytes (None when there is none), refused over :data:`MAX_REPORT_BYTES`."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_REPORT_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UnusableReport(f"JUnit report unreadable: {exc.strerror}") from None
    if len(data) > MAX_REPORT_BYTES:
        raise UnusableReport(f"JUnit report larger than {MAX_REPORT_BYTES} bytes")
    return data


def parse_junit(data: bytes) -> dict[tuple[str, str], str]:
    """Outcomes by ``(classname, name)``; a report declaring a DTD or entities is refused."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UnusableReport("JUnit report is not UTF-8") from None
    upper = text.upper()
    if "<!DOCTYPE" in upper or "<!ENTITY" in upper:
        raise UnusableReport("JUnit report refused: it declares a DOCTYPE or ENTITY")
    try:
        # Safe: DTDs are refused above, and parsing a str forces expat to UTF-8, so the
        # check saw exactly the characters the parser sees (no encoding tricks).
        root = ET.fromstring(text)  # noqa: S314
    except ET.ParseError as exc:
        raise UnusableReport(f"JUnit report is not well-formed XML: {exc}") from None
    cases: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        cases[key] = worse(cases.get(key, PASSED), _case_outcome(case))
    return cases


def _case_outcome(case: ET.Element) -> str:
    outcome = PASSED
    for child in case:
        found = _CHILD_OUTCOME.get(child.tag, PASSED)
        if found == SKIPPED and child.get("type") == "pytest.xfail":
            found = PASSED  # SWE-bench grades XFAIL as passing
        outcome = worse(outcome, found)
    return outcome


def worse(first: str, second: str) -> str:
    """The worse of two outcomes: a test reported twice counts as its worst report."""
    return first if _RANK[first] >= _RANK[second] else second
