"""Attacks on the verdict by the code under test, through the real CLI, real bubblewrap
and real pytest: a change that keeps the bug but makes the failing required tests look
like expected failures."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import Gitrun

CHEAT = """

_buggy = median


def median(values):  # the bug kept; a wrong answer under pytest becomes an "expected failure"
    data = sorted(values)
    if len(data) % 2 == 0 and data:
        import pytest

        pytest.xfail("known")
    return _buggy(values)
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
@pytest.mark.xfail(
    strict=True,
    reason="an xfail counts as passing (gitrun/core/outcome_stream.py, as SWE-bench's grader "
    "does), also one the code under test raises itself with pytest.xfail(): the bug stays "
    "and the run ends done. Counting only marker-declared xfails (the test file's "
    "@pytest.mark.xfail) as passing would close it for tasks, but changes SWE-bench "
    "grading against the harness: the lead decides.",
)
def test_code_under_test_calling_pytest_xfail_does_not_pass_a_failing_required_test(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("fix-median")
    source = (task / "repo" / "stats" / "median.py").read_text()
    step = (
        f'kind = "write_file"\npath = "stats/median.py"\ncontent = {json.dumps(source + CHEAT)}\n'
    )
    plan = "schema = 1\n[[step]]\n" + step
    (task / "plan.toml").write_text(plan)
    run = gitrun("run", str(task), "--run-id", "xf1", "--isolation", "required", "-q")
    assert run.code == 1, (run.code, run.out, run.err)
    assert "FAIL_TO_PASS still failing" in run.out
