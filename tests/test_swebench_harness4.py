"""swebench 4.x, the last line of releases with ``MAP_REPO_VERSION_TO_SPECS``, as the source
of gitrun's specs and as the judge of its logs.

The suite pins swebench 5.0.2 (no spec map: its rows carry ``eval_script``), so this
module installs the real swebench 4.1.0 from PyPI once (``pip install --no-deps --target``:
the 5.0.2 the suite has installed brings every module 4.1.0 imports) into a cache outside
the test's directory, and puts it ahead of 5.0.2 on ``PYTHONPATH`` for gitrun and for the
judge. The package does not know the bundled repositories: the cached copy gets their
entry added to its own spec and log-parser maps, as a 4.x user adds a repository of their
own (``swebench/harness/constants/python.py``, ``swebench/harness/log_parsers/python.py``).

A dataset with only the harness's own fields (``SWEbenchInstance``) and no gitrun spec
file then runs end to end: gitrun takes the spec from the package's map and the test
directives from the package's ``get_test_directives``; the test command it runs is the
one 4.1.0's eval script runs; and 4.1.0's ``get_eval_report`` and ``make_run_report``
over gitrun's log directory reach gitrun's verdict instance by instance.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from helpers import Gitrun, git
from swebench_data import BUNDLE, OWNER

from gitrun.app.swebench_env import EnvironmentFailed, find_python

SWEBENCH_4 = "4.1.0"
MEDIAN = f"{OWNER}__fix-median-1"
SLUG = f"{OWNER}__slugify-unicode-1"
BATCH_SECONDS = 240
# pip's words when the package index cannot be reached (then the module is skipped, saying so)
_UNREACHABLE = (
    "Could not fetch URL", "NewConnectionError", "Network is unreachable",
    "Temporary failure in name resolution", "Max retries exceeded", "No matching distribution",
)  # fmt: skip
# The bundled repositories' entries, added to the cached package's map: the bundled spec
# file's (tests/data/swebench/specs.json) without gitrun's test_directives switch (the
# harness always appends the directives).
_SPECS = {
    repo: {k: v for k, v in entry.items() if k != "test_directives"}
    for repo, entry in json.loads((BUNDLE / "specs.json").read_text()).items()
}
# The judge, run by 4.1.0's interpreter path: for each row, the test command its eval
# script runs and its grading of gitrun's test_output.txt; then its run report.
JUDGE = """
import json, sys
from pathlib import Path
import swebench
from swebench.harness.constants import START_TEST_OUTPUT, SWEbenchInstance
from swebench.harness.grading import get_eval_report
from swebench.harness.reporting import make_run_report
from swebench.harness.test_spec.test_spec import make_test_spec

rows = [json.loads(x) for x in Path(sys.argv[1]).read_text().splitlines()]
preds = {p["instance_id"]: p for p in map(json.loads, Path(sys.argv[2]).read_text().splitlines())}
run_id, out = sys.argv[3], {"version": swebench.__version__, "instances": {}}
out["fields"] = sorted(SWEbenchInstance.__annotations__)
for row in rows:
    spec = make_test_spec(row)
    lines = spec.eval_script_list
    pred = preds[row["instance_id"]]
    log = Path("logs/run_evaluation", run_id, pred["model_name_or_path"], row["instance_id"])
    report = get_eval_report(spec, pred, str(log / "test_output.txt"), True) \\
        if (log / "test_output.txt").is_file() else None
    out["instances"][row["instance_id"]] = {
        "test_cmd": lines[lines.index(f": '{START_TEST_OUTPUT}'") + 1], "report": report}
out["run_report"] = json.loads(make_run_report(preds, rows, run_id).read_text())
Path(sys.argv[4]).write_text(json.dumps(out))
"""


def _registration() -> tuple[str, str]:
    """What a 4.x user appends to the package's spec and log-parser maps for a repository
    of their own: here the bundled ones, version "1", tested with pytest."""
    specs = {repo: {"1": spec} for repo, spec in sorted(_SPECS.items())}
    return (
        "\n\n# gitrun's test suite: the bundled repositories (the package does not know them)\n"
        f"MAP_REPO_VERSION_TO_SPECS_PY.update({specs!r})\n",
        "\n\n# gitrun's test suite: the bundled repositories are tested with pytest\n"
        f"MAP_REPO_TO_PARSER_PY.update({{r: parse_log_pytest for r in {sorted(_SPECS)!r}}})\n",
    )


def _rows() -> list[dict[str, Any]]:
    return [json.loads(x) for x in (BUNDLE / "instances.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def swebench4() -> Path:
    """swebench 4.1.0 with the bundled repositories' entry, installed once per machine
    (a cached directory; .ci/run prepares it) and put on ``PYTHONPATH`` by the tests."""
    spec_lines, parser_lines = _registration()
    root = Path(os.environ.get("GITRUN_TEST_CACHE") or "/var/tmp/gitrun-test-cache")
    key = hashlib.sha256((spec_lines + parser_lines).encode()).hexdigest()[:12]
    home = root / f"swebench-{SWEBENCH_4}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{home.name}.lock")):
        if (home / "ok").is_file():
            return home
        shutil.rmtree(home, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
             "--target", str(home), f"swebench=={SWEBENCH_4}"],
            capture_output=True, text=True, check=False, timeout=300,
        )  # fmt: skip
        if done.returncode != 0:
            said = done.stdout + done.stderr
            if any(w in said for w in _UNREACHABLE):
                pytest.skip(f"swebench {SWEBENCH_4} could not be installed: PyPI unreachable")
            raise AssertionError(f"pip install swebench=={SWEBENCH_4} failed:\n{said[-2000:]}")
        package = home / "swebench" / "harness"
        with (package / "constants" / "python.py").open("a") as fh:
            fh.write(spec_lines)
        with (package / "log_parsers" / "python.py").open("a") as fh:
            fh.write(parser_lines)
        (home / "ok").write_text(SWEBENCH_4 + "\n")
    return home


def _preds(world: Path, kind: str) -> Path:
    """A predictions file as the harness takes it: the gold patches, or wrong ones."""
    if kind == "gold":
        preds = [{"instance_id": r["instance_id"], "model_name_or_path": "gold",
                  "model_patch": r["patch"]} for r in _rows()]  # fmt: skip
    else:
        preds = [json.loads(x) for x in (BUNDLE / f"preds-{kind}.jsonl").read_text().splitlines()]
    path = world / f"preds-{kind}.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in preds))
    return path


def _judge(swebench4: Path, world: Path, preds: Path, run_id: str) -> Any:
    """swebench 4.1.0's eval-script test commands, grading and run report over ``world/out``."""
    done = subprocess.run(
        [sys.executable, "-c", JUDGE, str(BUNDLE / "instances.jsonl"), str(preds), run_id,
         str(world / "judged.json")],
        cwd=world / "out", env=os.environ | {"PYTHONPATH": str(swebench4)},
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((world / "judged.json").read_text())


@pytest.mark.parametrize(("kind", "resolved"), [("gold", [MEDIAN, SLUG]), ("wrong", [])])
def test_a_lite_dataset_runs_with_specs_and_directives_from_swebench_4_and_4_agrees(
    gitrun: Gitrun, world: Path, swebench4: Path, kind: str, resolved: list[str]
) -> None:
    (world / "repos" / "gitrun-swebench.json").unlink()  # the package's specs, nothing else
    preds = _preds(world, kind)
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", str(preds),
        "--repos", str(world / "repos"), "--run-id", "h4", "--report-dir", str(world / "out"),
        "--json",
    ), {"PYTHONPATH": str(swebench4)}, timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 0, res.err
    ours = json.loads(res.out)
    assert ours["resolved_ids"] == resolved
    assert ours["unresolved_ids"] == sorted({MEDIAN, SLUG} - set(resolved))

    judged = _judge(swebench4, world, preds, "h4")
    assert judged["version"] == SWEBENCH_4
    assert all(sorted(row) == judged["fields"] for row in _rows())  # the harness's own fields
    model = json.loads(preds.read_text().splitlines()[0])["model_name_or_path"]
    for iid, theirs in judged["instances"].items():
        where = world / "out" / "logs" / "run_evaluation" / "h4" / model / iid
        meta = json.loads((where / "gitrun.json").read_text())
        # the test command 4.1.0's eval script runs (spec + its directives); gitrun adds -rA
        assert meta["test_command"] == theirs["test_cmd"] + " -rA", iid
        report = json.loads((where / "report.json").read_text())
        report[iid].pop("infra_failure")  # 5.x's field, which 4.x does not write
        assert theirs["report"] == report, iid
    fields = ("total_instances", "submitted_instances", "completed_instances",
              "resolved_instances", "unresolved_instances", "empty_patch_instances",
              "error_instances", "completed_ids", "incomplete_ids", "empty_patch_ids",
              "submitted_ids", "resolved_ids", "unresolved_ids", "error_ids")  # fmt: skip
    assert {k: judged["run_report"][k] for k in fields} == {k: ours[k] for k in fields}


def test_without_a_spec_map_in_the_installed_package_a_lite_row_is_refused_by_name(
    gitrun: Gitrun, world: Path
) -> None:
    """swebench 5.x (the suite's pin) has no spec map: a Lite row with no spec anywhere
    is refused before anything runs, saying where a spec could come from."""
    (world / "repos" / "gitrun-swebench.json").unlink()
    res = gitrun(
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", "gold",
        "--repos", str(world / "repos"), "--run-id", "h5", "--report-dir", str(world / "out"),
    )  # fmt: skip
    assert res.code == 2, res.err
    assert len(res.err.strip().splitlines()) == 1
    assert f"instance {MEDIAN}" in res.err
    assert "gitrun-swebench.json" in res.err
    assert "spec map" in res.err
    assert not (world / "out").exists()


HUMANEVAL = "swe-bench/humaneval"  # a repository 4.1.0 itself knows: python 3.9, `python`


def _humaneval_row(repos: Path) -> dict[str, Any]:
    """A SWE-bench HumanEval-shaped instance (the harness's own repository name and
    version, a local repository): main.py with a bug, the test patch adding test.py."""
    work = repos / HUMANEVAL.replace("/", "__")
    work.mkdir(parents=True)
    (work / "main.py").write_text("def add(a, b):\n    return a - b\n")
    git(work, "init", "-q", "-b", "main")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "base")
    (work / "main.py").write_text("def add(a, b):\n    return a + b\n")
    patch = git(work, "diff")
    git(work, "checkout", "-q", "--", ".")
    (work / "test.py").write_text(  # passes only on the spec's interpreter
        "import sys\n\nfrom main import add\n\nassert sys.version_info[:2] == (3, 9)\n"
        "assert add(2, 3) == 5\n"
    )
    git(work, "add", "test.py")
    test_patch = git(work, "diff", "--cached")
    git(work, "rm", "-q", "--cached", "test.py")
    (work / "test.py").unlink()
    base = git(work, "rev-parse", "HEAD").strip()
    return {
        "repo": HUMANEVAL, "instance_id": "swe-bench__humaneval-0", "base_commit": base,
        "patch": patch, "test_patch": test_patch, "problem_statement": "add adds",
        "hints_text": "", "created_at": "2024-01-01T00:00:00Z", "version": "1.0",
        "FAIL_TO_PASS": json.dumps(["test.py"]), "PASS_TO_PASS": "[]",
        "environment_setup_commit": base,
    }  # fmt: skip


def test_a_real_swebench_4_spec_runs_on_the_interpreter_it_names_or_is_an_infra_error(
    gitrun: Gitrun, world: Path, swebench4: Path
) -> None:
    """The package's own HumanEval entry (python 3.9, test command ``python`` and the
    directive ``test.py`` its get_test_directives fixes for that repository), unchanged:
    run on a python 3.9 found on the machine; without one, an environment error naming it."""
    row = _humaneval_row(world / "repos")
    (world / "he.jsonl").write_text(json.dumps(row) + "\n")
    res = gitrun.run((
        "swebench", "--dataset", str(world / "he.jsonl"), "--predictions", "gold",
        "--repos", str(world / "repos"), "--run-id", "he", "--report-dir", str(world / "out"),
        "--json",
    ), {"PYTHONPATH": str(swebench4)}, timeout=BATCH_SECONDS)  # fmt: skip
    report = json.loads(res.out)
    where = world / "out" / "logs" / "run_evaluation" / "he" / "gold" / row["instance_id"]
    meta = json.loads((where / "gitrun.json").read_text())
    try:
        find_python("3.9")
    except EnvironmentFailed:
        assert res.code == 1, res.err
        assert report["error_ids"] == [row["instance_id"]]
        assert "python 3.9 is not available" in meta["reason"]
        return
    assert res.code == 0, res.err
    assert report["resolved_ids"] == [row["instance_id"]]
    assert meta["test_command"] == "python test.py"
    assert "command exited 0" in meta["summary"]  # no pytest: the coarse verdict
