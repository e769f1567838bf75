"""The verifier runs real pytest subprocesses on tiny projects and judges F2P / P2P."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from gitrun.core import junit
from gitrun.core.errors import BadInput, LeaseLost
from gitrun.engine import verifier
from gitrun.engine.verifier import VerifierResult, VerifierSpec, run_verifier

pytestmark = pytest.mark.timeout(60)

TEST_A = """
import os
import pytest
from tests.base import Base


def test_fixed():
    pass


def test_still_broken():
    assert 1 == 2, "boom-marker"


def test_stable():
    pass


def test_regressed():
    raise AssertionError("regressed")


@pytest.fixture
def broken_fixture():
    raise RuntimeError("fixture blew up")


def test_errors(broken_fixture):
    pass


@pytest.mark.skip(reason="not today")
def test_skipped():
    pass


@pytest.mark.xfail(reason="known bug")
def test_expected_failure():
    assert False


@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1


class TestOuter(Base):
    def test_method(self):
        pass

    class TestInner:
        def test_nested(self):
            pass


def test_environment():
    assert "GITRUN_CRASH_AT" not in os.environ
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
"""

BASE = """
class Base:
    def test_inherited(self):
        pass
"""

TEST_SLOW = """
import os
import subprocess
import sys
import time


def test_takes_a_while():
    time.sleep(2.5)


def test_sleeps_with_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfile = os.environ["VERIFIER_PIDFILE"]
    with open(pidfile + ".tmp", "w") as handle:
        handle.write(f"{child.pid} {os.getpid()}")
    os.replace(pidfile + ".tmp", pidfile)
    time.sleep(30)
"""

WRITE_REPORT = (
    "import sys\n"
    "path = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--junitxml='))\n"
    "open(path, 'w', encoding='utf-8').write(sys.argv[1])\n"
)

RUN_A = ("{python}", "-m", "pytest", "-q", "tests/test_a.py")
A = "tests/test_a.py::"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "base.py").write_text(BASE)
    (root / "tests" / "test_a.py").write_text(TEST_A)
    (root / "tests" / "test_slow.py").write_text(TEST_SLOW)
    return root


@pytest.fixture
def pidfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "outside" / "pids"
    path.parent.mkdir()
    monkeypatch.setenv("VERIFIER_PIDFILE", str(path))
    return path


def spec(
    f2p: tuple[str, ...] = (),
    p2p: tuple[str, ...] = (),
    *,
    command: tuple[str, ...] = RUN_A,
    junit: bool = True,
    timeout: float = 60.0,
) -> VerifierSpec:
    return VerifierSpec(command, junit, f2p, p2p, timeout)


def report_writer(xml: str) -> tuple[str, ...]:
    """A command that writes ``xml`` wherever --junitxml points, as a hostile task could."""
    return ("{python}", "-c", WRITE_REPORT, xml)


def listing(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


def wait_for_pids(path: Path, within: float = 15.0) -> list[int]:
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never wrote its pid file")
        time.sleep(0.02)
    return [int(pid) for pid in path.read_text().split()]


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def all_dead(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    try:
        while any(is_alive(pid) for pid in pids):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
    finally:
        for pid in pids:  # never leave a sleeper behind, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_fail_to_pass_test_that_now_passes_makes_the_run_pass(project: Path) -> None:
    result = run_verifier(spec((A + "test_fixed",), (A + "test_stable",)), project)

    assert result.passed
    assert result.outcomes == {A + "test_fixed": "passed", A + "test_stable": "passed"}
    assert result.summary == "2/2 required tests passed"
    assert not result.timed_out
    assert result.exit_code == 1  # other tests in the file fail; only required ids count


def test_fail_to_pass_test_still_failing_fails_the_run_and_names_it(project: Path) -> None:
    result = run_verifier(spec((A + "test_still_broken",), (A + "test_stable",)), project)

    assert not result.passed
    assert result.outcomes[A + "test_still_broken"] == "failed"
    assert result.summary == f"FAIL_TO_PASS still failing: {A}test_still_broken"
    assert "boom-marker" in result.output_tail


def test_pass_to_pass_regression_is_detected(project: Path) -> None:
    required = spec((A + "test_fixed",), (A + "test_stable", A + "test_regressed"))

    result = run_verifier(required, project)

    assert not result.passed
    assert result.outcomes[A + "test_regressed"] == "failed"
    assert result.summary == f"PASS_TO_PASS regressed: {A}test_regressed"


def test_required_id_absent_from_the_report_is_missing(project: Path) -> None:
    result = run_verifier(spec((A + "test_fixed", A + "test_never_written")), project)

    assert not result.passed
    assert result.outcomes[A + "test_never_written"] == "missing"
    assert result.summary == f"FAIL_TO_PASS still failing: {A}test_never_written (missing)"


def test_every_outcome_is_read_from_the_junit_report(project: Path) -> None:
    expected = {
        A + "test_errors": "error",
        A + "test_skipped": "skipped",
        A + "test_expected_failure": "passed",  # SWE-bench grades XFAIL as passing
        A + "test_param[1]": "passed",
        A + "test_param[2]": "failed",
        A + "TestOuter::test_method": "passed",
        A + "TestOuter::TestInner::test_nested": "passed",
        A + "TestOuter::test_inherited": "passed",  # its file attribute is tests/base.py
    }
    result = run_verifier(spec(p2p=tuple(expected)), project)

    assert result.outcomes == expected
    assert result.summary.startswith("PASS_TO_PASS regressed: ")


def test_worktree_is_left_without_new_files(project: Path) -> None:
    before = listing(project)

    result = run_verifier(spec((A + "test_fixed",)), project)

    assert result.passed
    assert listing(project) == before


def test_child_gets_no_crash_injection_and_no_bytecode_writing(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITRUN_CRASH_AT", "after-commit")

    result = run_verifier(spec((A + "test_environment",)), project)

    assert result.passed, result.output_tail


def test_without_junit_the_exit_code_decides_coarsely(project: Path) -> None:
    green = spec((A + "test_fixed",), command=(*RUN_A[:-1], A + "test_fixed"), junit=False)
    red = spec((A + "test_fixed",), command=(*RUN_A[:-1], A + "test_regressed"), junit=False)

    passed, failed = run_verifier(green, project), run_verifier(red, project)

    assert (passed.passed, passed.exit_code) == (True, 0)
    assert passed.outcomes == {A + "test_fixed": "passed"}
    assert (failed.passed, failed.exit_code) == (False, 1)
    assert failed.outcomes == {A + "test_fixed": "failed"}
    assert "coarse" in failed.summary


@needs_proc
def test_timeout_kills_the_whole_process_group(project: Path, pidfile: Path) -> None:
    pids: list[int] = []
    command = ("{python}", "-m", "pytest", "tests/test_slow.py::test_sleeps_with_a_child")
    started = time.monotonic()

    result = run_verifier(
        spec((A + "test_fixed",), command=command, timeout=1.0),
        project,
        heartbeat=lambda: pids.extend([] if pids else wait_for_pids(pidfile)),
        heartbeat_interval=0.1,
    )

    assert time.monotonic() - started < 10
    assert result.timed_out
    assert (result.passed, result.exit_code) == (False, None)
    assert result.outcomes == {A + "test_fixed": "error"}
    assert result.summary.startswith("timed out after 1s")
    assert all_dead(pids)


def test_heartbeat_and_progress_are_called_repeatedly_during_a_long_run(project: Path) -> None:
    beats: list[float] = []
    lines: list[str] = []
    command = ("{python}", "-m", "pytest", "tests/test_slow.py::test_takes_a_while")

    result = run_verifier(
        spec(("tests/test_slow.py::test_takes_a_while",), command=command),
        project,
        heartbeat=lambda: beats.append(time.monotonic()),
        progress=lines.append,
        heartbeat_interval=0.2,
    )

    assert result.passed
    assert len(beats) >= 8
    assert all(later - earlier >= 0.15 for earlier, later in itertools.pairwise(beats))
    assert len(lines) == len(beats)
    assert lines[-1].startswith("verifier: running ")


@needs_proc
def test_heartbeat_raising_kills_the_child_and_reraises(project: Path, pidfile: Path) -> None:
    pids: list[int] = []
    command = ("{python}", "-m", "pytest", "tests/test_slow.py::test_sleeps_with_a_child")

    def heartbeat() -> None:
        pids.extend(wait_for_pids(pidfile))
        raise LeaseLost("worker-2", "lease taken over by worker-2")

    started = time.monotonic()
    with pytest.raises(LeaseLost, match="taken over"):
        run_verifier(spec((A + "test_fixed",), command=command), project, heartbeat=heartbeat)

    assert time.monotonic() - started < 10
    assert all_dead(pids)


def test_report_declaring_a_doctype_is_refused() -> None:
    laughs = (
        '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
        '<!ENTITY lol2 "&lol;&lol;&lol;&lol;">]><testsuites><testsuite>'
        '<testcase classname="tests.test_a" name="test_fixed">&lol2;</testcase>'
        "</testsuite></testsuites>"
    )

    with pytest.raises(junit.UnusableReport, match="declares a DOCTYPE or ENTITY"):
        junit.parse_junit(laughs.encode())


def test_a_command_writing_its_own_report_without_pytest_is_verdict_tampered(
    project: Path,
) -> None:
    report = '<testsuites><testcase classname="tests.test_a" name="test_fixed"/></testsuites>'

    result = run_verifier(spec((A + "test_fixed",), command=report_writer(report)), project)

    assert not result.passed
    assert result.outcomes == {A + "test_fixed": "error"}
    assert result.summary == (
        "verdict-tampered: a JUnit report was written but pytest streamed no outcome"
    )


def test_report_over_the_size_cap_is_refused(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(junit, "MAX_REPORT_BYTES", 100)
    report = '<testsuites><testcase classname="tests.test_a" name="test_fixed"/></testsuites>'
    command = report_writer(report + " " * 50)

    result = run_verifier(spec((A + "test_fixed",), command=command), project)

    assert result.outcomes == {A + "test_fixed": "error"}
    assert "larger than 100 bytes" in result.summary


def test_command_that_writes_no_report_counts_as_an_error(project: Path) -> None:
    result = run_verifier(spec((A + "test_fixed",), command=("{python}", "-c", "pass")), project)

    assert (result.passed, result.exit_code) == (False, 0)
    assert result.summary == "verifier error: no JUnit report was written"


def test_a_command_that_writes_no_report_says_in_the_summary_what_it_printed(
    project: Path,
) -> None:
    command = ("{python}", "-c", "import sys; sys.exit('No module named pytest')")
    result = run_verifier(spec((A + "test_fixed",), command=command), project)

    assert not result.passed
    assert result.summary.startswith("verifier error: no JUnit report was written")
    assert "No module named pytest" in result.summary


def test_testcase_without_file_attribute_is_matched_through_its_classname() -> None:
    report = (
        "<testsuite>"
        '<testcase classname="tests.test_a.TestOuter" name="test_method"/>'
        '<testcase classname="tests.test_a" name="test_fixed"><skipped/></testcase>'
        "</testsuite>"
    )
    cases = junit.parse_junit(report.encode())

    assert cases[junit.junit_key(A + "TestOuter::test_method")] == "passed"
    assert cases[junit.junit_key(A + "test_fixed")] == "skipped"


def test_unknown_command_raises_bad_input_naming_it(project: Path) -> None:
    with pytest.raises(BadInput, match="no-such-verifier-command") as caught:
        run_verifier(spec((A + "test_fixed",), command=("no-such-verifier-command",)), project)

    assert "\n" not in str(caught.value)


def test_spec_round_trips_through_canonical_json() -> None:
    original = spec((A + "test_fixed",), (A + "test_stable",), timeout=5)

    encoded = original.to_json()

    assert encoded["command"] == list(RUN_A)
    assert VerifierSpec.from_json(json.loads(json.dumps(encoded))) == original


def test_spec_decoding_refuses_unknown_fields_and_bare_string_commands() -> None:
    with pytest.raises(BadInput, match="unknown"):
        VerifierSpec.from_json({**spec((A + "x",)).to_json(), "shell": True})
    with pytest.raises(BadInput, match="command"):
        VerifierSpec.from_json({**spec((A + "x",)).to_json(), "command": "pytest"})


def test_junit_spec_without_required_tests_is_refused() -> None:
    with pytest.raises(BadInput, match="at least one"):
        spec()


def test_the_whole_output_is_kept_where_asked_not_only_its_tail(
    project: Path, tmp_path: Path
) -> None:
    kept = tmp_path / "kept" / "output.log"

    run_verifier(spec((A + "test_fixed",)), project, keep_log=kept)

    text = kept.read_text()
    assert "boom-marker" in text  # the failing assertion, printed early in pytest's output
    assert re.search(r"^\d+ failed, \d+ passed.* in [\d.]+s$", text, re.M), text


def test_a_kept_output_over_the_bound_keeps_its_end_and_says_it_was_cut(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verifier, "KEPT_LOG_BYTES", 1000)
    kept = tmp_path / "output.log"
    command = ("{python}", "-c", "print('early ' * 2000); print('the-last-line')")

    run_verifier(spec((A + "test_fixed",), command=command, junit=False), project, keep_log=kept)

    lines = kept.read_text().splitlines()
    assert lines[0].startswith("[gitrun: output truncated: the first ")
    assert lines[-1] == "the-last-line"
    assert "early" in lines[1]
    assert len(kept.read_bytes()) < 1200


def test_result_serialises_to_json() -> None:
    result = VerifierResult(True, {A + "t": "passed"}, 0, False, 1.23456, "1/1", "tail")

    assert json.loads(json.dumps(result.to_json()))["duration_seconds"] == 1.235
