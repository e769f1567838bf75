"""Run a task's test command in a worktree and judge FAIL_TO_PASS / PASS_TO_PASS.

The verdict follows the SWE-bench harness: the run passes when every FAIL_TO_PASS and
every PASS_TO_PASS test passes (an expected failure, ``xfail``, counts as passing, as it
does there). Per-test outcomes come from a JUnit XML report (pytest's ``xunit1`` family),
never from scraping the console.

Tests are matched by the ``(classname, name)`` pair pytest derives from a node id, not
by rebuilding ``file::name``: a test method inherited from a base class in another
module carries the *base* module in ``file``, while ``classname`` always follows the
node id.

The child runs without a shell, in its own session (so the whole process group can be
killed), with stdout and stderr going to a file outside the worktree, and bytecode
writing disabled, so a verifier run leaves the worktree as it found it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gitrun.errors import BadInput

PASSED = "passed"
FAILED = "failed"
ERROR = "error"
SKIPPED = "skipped"
MISSING = "missing"

MAX_REPORT_BYTES = 20 * 1024 * 1024
"""A JUnit report larger than this is refused rather than parsed."""

_RANK = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}
_CHILD_OUTCOME = {"failure": FAILED, "error": ERROR, "skipped": SKIPPED}
_SCRUBBED_ENV = ("GITRUN_CRASH_AT",)  # the runtime's fault injection must not reach the tests
_SPEC_FIELDS = frozenset({"command", "junit", "fail_to_pass", "pass_to_pass", "timeout_seconds"})
_POLL_SECONDS = 0.05
_TAIL_LINES = 40
_TAIL_BYTES = 16 * 1024
_LISTED_IDS = 3


@dataclass(frozen=True)
class VerifierSpec:
    """How to verify a task: the test command and the tests that must pass."""

    command: tuple[str, ...]
    junit: bool
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    timeout_seconds: float

    def __post_init__(self) -> None:
        for name in ("command", "fail_to_pass", "pass_to_pass"):
            object.__setattr__(self, name, _str_tuple(name, getattr(self, name)))
        if not self.command:
            raise BadInput("verifier command is empty")
        if not isinstance(self.junit, bool):
            raise BadInput("verifier junit must be true or false")
        if not _positive_number(self.timeout_seconds):
            raise BadInput(
                f"verifier timeout_seconds must be positive, not {self.timeout_seconds!r}"
            )
        if self.junit and not self.required:
            raise BadInput("a JUnit verifier needs at least one FAIL_TO_PASS or PASS_TO_PASS id")

    @property
    def required(self) -> tuple[str, ...]:
        """Every FAIL_TO_PASS and PASS_TO_PASS id once, in spec order."""
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    def to_json(self) -> dict[str, object]:
        """The canonical JSON form (lists, not tuples)."""
        return {
            "command": list(self.command),
            "junit": self.junit,
            "fail_to_pass": list(self.fail_to_pass),
            "pass_to_pass": list(self.pass_to_pass),
            "timeout_seconds": float(self.timeout_seconds),
        }

    @classmethod
    def from_json(cls, data: object) -> VerifierSpec:
        """Decode :meth:`to_json` output strictly: unknown or missing fields are refused."""
        if not isinstance(data, Mapping):
            raise BadInput("verifier spec must be a JSON object")
        unknown, missing = set(data) - _SPEC_FIELDS, _SPEC_FIELDS - set(data)
        if unknown or missing:
            raise BadInput(f"verifier spec: unknown {sorted(unknown)}, missing {sorted(missing)}")
        junit, timeout = data["junit"], data["timeout_seconds"]
        if not isinstance(junit, bool):
            raise BadInput("verifier junit must be true or false")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise BadInput(f"verifier timeout_seconds must be a number, not {timeout!r}")
        return cls(
            command=_str_tuple("command", data["command"]),
            junit=junit,
            fail_to_pass=_str_tuple("fail_to_pass", data["fail_to_pass"]),
            pass_to_pass=_str_tuple("pass_to_pass", data["pass_to_pass"]),
            timeout_seconds=float(timeout),
        )


@dataclass(frozen=True)
class VerifierResult:
    """What one verifier run found; ``outcomes`` covers only the required ids."""

    passed: bool
    outcomes: dict[str, str]
    exit_code: int | None
    timed_out: bool
    duration_seconds: float
    summary: str
    output_tail: str

    def to_json(self) -> dict[str, object]:
        """The canonical JSON form."""
        return {
            "passed": self.passed,
            "outcomes": dict(self.outcomes),
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "duration_seconds": round(self.duration_seconds, 3),
            "summary": self.summary,
            "output_tail": self.output_tail,
        }


@dataclass(frozen=True)
class _Run:
    exit_code: int | None
    timed_out: bool
    duration_seconds: float


class _UnusableReport(Exception):
    """The JUnit report is absent, too large, malformed or refused."""


class _Ticker:
    """Calls heartbeat and progress every ``interval`` seconds of elapsed time."""

    def __init__(
        self,
        heartbeat: Callable[[], None] | None,
        progress: Callable[[str], None] | None,
        interval: float,
    ) -> None:
        self._heartbeat = heartbeat
        self._progress = progress
        self._interval = interval
        self._next_at = interval

    def tick_if_due(self, elapsed: float) -> None:
        if elapsed < self._next_at:
            return
        self._next_at = elapsed + self._interval
        if self._heartbeat is not None:
            self._heartbeat()
        if self._progress is not None:
            self._progress(f"verifier: running {int(elapsed)}s")


def run_verifier(
    spec: VerifierSpec,
    workdir: Path,
    *,
    heartbeat: Callable[[], None] | None = None,
    progress: Callable[[str], None] | None = None,
    heartbeat_interval: float = 1.0,
) -> VerifierResult:
    """Run ``spec.command`` in ``workdir`` and judge the required tests.

    ``heartbeat`` is called every ``heartbeat_interval`` seconds (the runtime renews its
    lease there); if it raises, the child's process group is killed and the error
    propagates. A command that cannot start raises :class:`BadInput`.
    """
    if not workdir.is_dir():
        raise BadInput(f"verifier workdir {workdir} is not a directory")
    if not _positive_number(heartbeat_interval):
        raise BadInput(f"heartbeat_interval must be positive, not {heartbeat_interval!r}")
    ticker = _Ticker(heartbeat, progress, heartbeat_interval)
    with tempfile.TemporaryDirectory(prefix="gitrun-verifier-", ignore_cleanup_errors=True) as tmp:
        scratch = Path(tmp)
        if scratch.resolve().is_relative_to(workdir.resolve()):
            raise BadInput(f"temporary directory {scratch} lies inside the worktree {workdir}")
        report = scratch / "junit.xml"
        with (scratch / "output.log").open("w+b") as log:
            run = _execute(_argv(spec, report), workdir, log, spec.timeout_seconds, ticker)
            tail = _tail(log)
        outcomes, summary = _verdict(spec, run, report)
        if spec.junit and not report.exists() and tail.strip():
            # e.g. "No module named pytest": the one line that tells the user what to do
            summary += f" (the command said: {tail.strip().splitlines()[-1][:200]})"
    passed = (
        not run.timed_out
        and (spec.junit or run.exit_code == 0)
        and all(outcome == PASSED for outcome in outcomes.values())
    )
    return VerifierResult(
        passed=passed,
        outcomes=outcomes,
        exit_code=run.exit_code,
        timed_out=run.timed_out,
        duration_seconds=run.duration_seconds,
        summary=summary,
        output_tail=tail,
    )


def _argv(spec: VerifierSpec, report: Path) -> list[str]:
    argv = [part.replace("{python}", sys.executable) for part in spec.command]
    if spec.junit:
        # no:cacheprovider keeps pytest from writing .pytest_cache into the worktree
        argv += [f"--junitxml={report}", "-o", "junit_family=xunit1", "-p", "no:cacheprovider"]
    return argv


def _child_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _SCRUBBED_ENV}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _execute(
    argv: list[str], workdir: Path, log: IO[bytes], timeout: float, ticker: _Ticker
) -> _Run:
    try:
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            start_new_session=True,
        )
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise BadInput(f"verifier command {argv[0]!r} cannot start: {reason}") from exc
    start = time.monotonic()
    try:
        timed_out = _wait(proc, start, timeout, ticker)
    finally:
        _kill_group(proc)
    duration = time.monotonic() - start
    return _Run(None if timed_out else proc.returncode, timed_out, duration)


def _wait(proc: subprocess.Popen[bytes], start: float, timeout: float, ticker: _Ticker) -> bool:
    """Poll until the child exits (False) or the timeout passes (True)."""
    while not _exited(proc):
        elapsed = time.monotonic() - start
        if elapsed >= timeout:
            return True
        ticker.tick_if_due(elapsed)
        time.sleep(_POLL_SECONDS)
    return False


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child exited, leaving it unreaped where the OS allows.

    An unreaped child keeps its pid, so the pid still names its process group when
    :func:`_kill_group` sweeps up grandchildren it left behind.
    """
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, proc.pid, flags) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (if its pid still names it) and reap the child."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(log: IO[bytes]) -> str:
    size = os.fstat(log.fileno()).st_size
    log.seek(max(0, size - _TAIL_BYTES))
    lines = log.read().decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-_TAIL_LINES:])


def _verdict(spec: VerifierSpec, run: _Run, report: Path) -> tuple[dict[str, str], str]:
    required = spec.required
    if run.timed_out:
        summary = f"timed out after {spec.timeout_seconds:g}s; required tests not judged"
        return dict.fromkeys(required, ERROR), summary
    if not spec.junit:
        outcome = PASSED if run.exit_code == 0 else FAILED
        summary = f"command exited {run.exit_code} (coarse verdict: no per-test report)"
        return dict.fromkeys(required, outcome), summary
    try:
        cases = read_junit(report)
    except _UnusableReport as exc:
        return dict.fromkeys(required, ERROR), f"verifier error: {exc}"
    outcomes = {node: cases.get(junit_key(node), MISSING) for node in required}
    return outcomes, _summary(spec, outcomes)


def _summary(spec: VerifierSpec, outcomes: Mapping[str, str]) -> str:
    still = [node for node in spec.fail_to_pass if outcomes[node] != PASSED]
    regressed = [node for node in spec.pass_to_pass if outcomes[node] != PASSED]
    if not still and not regressed:
        return f"{len(outcomes)}/{len(outcomes)} required tests passed"
    parts = []
    if still:
        parts.append("FAIL_TO_PASS still failing: " + _listing(still, outcomes))
    if regressed:
        parts.append("PASS_TO_PASS regressed: " + _listing(regressed, outcomes))
    return "; ".join(parts)


def _listing(nodes: list[str], outcomes: Mapping[str, str]) -> str:
    shown = [n if outcomes[n] == FAILED else f"{n} ({outcomes[n]})" for n in nodes[:_LISTED_IDS]]
    more = len(nodes) - _LISTED_IDS
    return ", ".join(shown) + (f" (+{more} more)" if more > 0 else "")


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
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_REPORT_BYTES + 1)
    except FileNotFoundError:
        raise _UnusableReport("no JUnit report was written") from None
    except OSError as exc:
        raise _UnusableReport(f"JUnit report unreadable: {exc.strerror}") from None
    if len(data) > MAX_REPORT_BYTES:
        raise _UnusableReport(f"JUnit report larger than {MAX_REPORT_BYTES} bytes")
    return parse_junit(data)


def parse_junit(data: bytes) -> dict[tuple[str, str], str]:
    """Outcomes by ``(classname, name)``; a report declaring a DTD or entities is refused."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _UnusableReport("JUnit report is not UTF-8") from None
    upper = text.upper()
    if "<!DOCTYPE" in upper or "<!ENTITY" in upper:
        raise _UnusableReport("JUnit report refused: it declares a DOCTYPE or ENTITY")
    try:
        # Safe: DTDs are refused above, and parsing a str forces expat to UTF-8, so the
        # check saw exactly the characters the parser sees (no encoding tricks).
        root = ET.fromstring(text)  # noqa: S314
    except ET.ParseError as exc:
        raise _UnusableReport(f"JUnit report is not well-formed XML: {exc}") from None
    cases: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        cases[key] = _worse(cases.get(key, PASSED), _case_outcome(case))
    return cases


def _case_outcome(case: ET.Element) -> str:
    outcome = PASSED
    for child in case:
        found = _CHILD_OUTCOME.get(child.tag, PASSED)
        if found == SKIPPED and child.get("type") == "pytest.xfail":
            found = PASSED  # SWE-bench grades XFAIL as passing
        outcome = _worse(outcome, found)
    return outcome


def _worse(first: str, second: str) -> str:
    """The worse of two outcomes: a test reported twice counts as its worst report."""
    return first if _RANK[first] >= _RANK[second] else second


def _positive_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


def _str_tuple(name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise BadInput(f"verifier {name} must be a list of strings")
    items = tuple(value)
    if not all(isinstance(item, str) and item for item in items):
        raise BadInput(f"verifier {name} must hold only non-empty strings")
    return items
