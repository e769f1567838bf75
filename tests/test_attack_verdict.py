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
from test_swebench_verdict import prediction, reset_paths
from test_swebench_verdict import run as swebench_run

from gitrun.core.runner_files import shadowing_module

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


# A whole stand-in for pytest: it speaks gitrun's verdict channel itself (the token from
# the inherited descriptor, a begin, a passing record per required test, the JUnit report
# and an end carrying its digest) and never runs a test.
FAKE_RUNNER = r"""
import hashlib, json, os, sys

_fd = int(os.environ.pop("PYTEST_GITRUN_VERDICT"))
_token = b""
while not _token.endswith(b"\n"):
    _token += os.read(_fd, 1)


def _send(record):
    record["t"] = _token.decode().strip()
    os.write(_fd, (json.dumps(record) + "\n").encode())


def console_main():
    path = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml=")][0]
    ids = ["tests/test_median.py::" + n for n in (
        "test_even_length", "test_even_length_two_values", "test_even_length_four",
        "test_odd_length", "test_single", "test_unsorted_input", "test_empty_raises")]
    ids += ["tests/test_mean.py::test_mean_basic", "tests/test_mean.py::test_mean_empty_raises"]
    _send({"k": "begin", "v": 1})
    cases = ""
    for node in ids:
        for when in ("setup", "call", "teardown"):
            _send({"k": "test", "id": node, "when": when, "o": "passed", "x": False})
        module, name = node.split("::")
        cls = module[:-3].replace("/", ".")
        cases += '<testcase classname="%s" name="%s" time="0.001"/>' % (cls, name)
    with open(path, "w") as fh:
        fh.write('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
                 'errors="0" failures="0" skipped="0" tests="%d">%s</testsuite></testsuites>'
                 % (len(ids), cases))
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    _send({"k": "end", "status": 0, "junit": digest})
    print("%d passed" % len(ids))
    sys.stdout.flush()
    os._exit(0)


console_main()  # whoever imports "pytest" first (pytest's own _pytest modules) runs this
"""


@pytest.fixture
def installing_world(world: Path) -> Path:
    """The SWE-bench world, its fix-median spec installing the repository (as most real
    specs do: ``pip install -e .``): the tested tree and its ``src/`` come first on
    ``PYTHONPATH`` then."""
    specs_file = world / "repos" / "gitrun-swebench.json"
    specs = json.loads(specs_file.read_text())
    specs["gitrun-sandboxes/fix-median"]["install"] = "true"
    specs_file.write_text(json.dumps(specs))
    return world


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
@pytest.mark.parametrize("path", ["src/pytest.py", "argparse.py", "src/_pytest/__init__.py"])
def test_a_prediction_adding_a_module_ahead_of_the_runner_does_not_stand_in_for_it(
    gitrun: Gitrun, installing_world: Path, path: str
) -> None:
    """With ``install`` in the spec the tested tree and its ``src/`` come first on
    ``PYTHONPATH``, ahead of the standard library and site-packages: a prediction that
    keeps the bug and adds ``src/pytest.py`` (pytest's own ``_pytest`` modules import
    it), ``src/_pytest/`` or a root ``argparse.py`` (pytest imports it at start-up),
    each a stand-in that speaks gitrun's verdict channel itself, was graded resolved
    (9/9 required tests "passed") under bubblewrap. Such a new module is now reset to
    the base like every other runner file, and the tests run on the real pytest."""
    patch = prediction(installing_world, {path: FAKE_RUNNER})
    report, meta, log = swebench_run(gitrun, installing_world, patch)
    assert report["resolved_ids"] == [], log
    assert reset_paths(meta) == [path]
    assert "FAIL_TO_PASS still failing" in meta["summary"]


def test_only_a_new_module_named_like_the_stdlib_or_the_runner_counts_as_a_shadow() -> None:
    """The rule the attack above needs, and what it leaves alone: pytest's own repository
    (its ``src/_pytest`` is the code under test), a new file inside a package the base
    has, a plain directory (a namespace portion never beats the standard library), and a
    module whose name is no standard-library or runner module."""
    pytest_repo = {("src/", "_pytest"), ("src/", "pytest"), ("", "src"), ("", "testing")}
    assert shadowing_module("src/pytest.py", set()) == "pytest"
    assert shadowing_module("src/_pytest/__init__.py", set()) == "_pytest"
    assert shadowing_module("argparse.py", set()) == "argparse"
    assert shadowing_module("json/__init__.py", set()) == "json"
    assert shadowing_module("_socket.cpython-311-x86_64-linux-gnu.so", set()) == "_socket"
    assert shadowing_module("src/_pytest/__init__.py", pytest_repo) is None
    assert shadowing_module("src/_pytest/newmodule.py", pytest_repo) is None
    assert shadowing_module("code/helpers.py", set()) is None
    assert shadowing_module("src/flask/__init__.py", set()) is None
    assert shadowing_module("lib/argparse.py", set()) is None
