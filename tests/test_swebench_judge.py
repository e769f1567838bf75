"""The real ``swebench`` package as the judge of ``gitrun swebench``'s logs.

The harness's own grading (``run_instance(..., rewrite_reports=True)``, the path behind
``swebench report``, which re-grades a saved ``test_output.txt`` with ``get_eval_report``;
then ``make_run_report``) is pointed at the log directory gitrun wrote, and must reach
gitrun's verdict instance by instance: the same resolved, unresolved, empty-patch and
error ids, the same per-instance report. No Docker is involved: those functions read
files only (``client=None``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import Gitrun
from hypothesis import example, given, settings
from hypothesis import strategies as st
from swebench import types as harness_types  # the test extra's judge: never skipped
from swebench.harness.constants import EvalType
from swebench.harness.grading import get_eval_tests_report, get_resolution_status
from swebench.harness.reporting import make_run_report
from swebench.harness.run_evaluation import run_instance
from swebench_data import BUNDLE, OWNER

from gitrun.core import swebench as core

MEDIAN = f"{OWNER}__fix-median-1"
SLUG = f"{OWNER}__slugify-unicode-1"
BATCH_SECONDS = 240
# The harness's fields of a run report (5.x); gitrun adds its own beside them.
HARNESS_FIELDS = (
    "total_instances", "submitted_instances", "completed_instances", "resolved_instances",
    "unresolved_instances", "infra_failure_instances", "ambiguous_failure_instances",
    "empty_patch_instances", "error_instances", "completed_ids", "incomplete_ids",
    "empty_patch_ids", "submitted_ids", "resolved_ids", "unresolved_ids", "infra_failure_ids",
    "ambiguous_failure_ids", "failure_reasons", "error_ids", "schema_version",
)  # fmt: skip


def _records() -> list[dict[str, Any]]:
    return [json.loads(x) for x in (BUNDLE / "instances.jsonl").read_text().splitlines()]


def _predictions(world: Path, kind: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """The ``--predictions`` argument and the predictions as the harness holds them."""
    records = _records()
    if kind == "gold":
        return "gold", {
            r["instance_id"]: {"instance_id": r["instance_id"], "model_name_or_path": "gold",
                               "model_patch": r["patch"]} for r in records
        }  # fmt: skip
    if kind in ("empty", "wrong", "wrong-one"):
        path = BUNDLE / f"preds-{kind.removesuffix('-one')}.jsonl"
    else:  # one instance's patch does not apply, the other is the gold one
        fuzzy = records[0]["patch"].replace("     mid = n // 2\n", "     mid = len(data) // 2\n")
        if fuzzy == records[0]["patch"]:
            raise AssertionError("the not-applying prediction must differ from the gold one")
        path = world / "preds-mixed.jsonl"
        path.write_text(
            json.dumps({"instance_id": records[0]["instance_id"], "model_name_or_path": "mixed",
                        "model_patch": fuzzy}) + "\n"
            + json.dumps({"instance_id": records[1]["instance_id"], "model_name_or_path": "mixed",
                          "model_patch": records[1]["patch"]}) + "\n"
        )  # fmt: skip
    preds = [json.loads(x) for x in path.read_text().splitlines()]
    return str(path), {p["instance_id"]: p for p in preds}


def _spec(rec: dict[str, Any]) -> harness_types.TestSpec:
    """The harness's test spec for a bundled instance: its pytest log parser."""
    return harness_types.TestSpec(
        instance_id=rec["instance_id"], image="", eval_script_list=[], repo=rec["repo"],
        version=rec["version"], FAIL_TO_PASS=json.loads(rec["FAIL_TO_PASS"]),
        PASS_TO_PASS=json.loads(rec["PASS_TO_PASS"]), log_parser="parse_log_pytest",
        eval_type="pass_and_fail",
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["gold", "empty", "wrong", "not-applying", "wrong-one"])
def test_the_harness_grading_gitruns_logs_reaches_gitruns_verdict_instance_by_instance(
    gitrun: Gitrun, world: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arg, preds = _predictions(world, kind)
    out = world / "out"
    # wrong-one: --instance-ids picks one of the two instances the predictions file names
    chosen = ["--instance-ids", MEDIAN] if kind == "wrong-one" else []
    records = [r for r in _records() if not chosen or r["instance_id"] in chosen]
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", arg,
        "--repos", str(world / "repos"), "--run-id", "j", "--report-dir", str(out), "--json",
        *chosen,
    ), timeout=BATCH_SECONDS)  # fmt: skip
    ours = json.loads(res.out)
    assert res.code == (1 if ours["error_ids"] else 0), res.err
    model = next(iter(preds.values()))["model_name_or_path"]
    expected = {
        "gold": {"resolved_ids": [MEDIAN, SLUG]},
        "empty": {"empty_patch_ids": [MEDIAN, SLUG]},
        "wrong": {"unresolved_ids": [MEDIAN, SLUG]},
        "not-applying": {"error_ids": [MEDIAN], "resolved_ids": [SLUG]},
        "wrong-one": {"unresolved_ids": [MEDIAN], "submitted_ids": [MEDIAN, SLUG]},
    }[kind]
    for field, ids in expected.items():
        assert ours[field] == ids, (field, ours)

    # the harness re-grades, in a copy of gitrun's log directory, every instance that has
    # a test_output.txt, as `swebench report` does, and writes its own reports
    judge = world / "judge"
    shutil.copytree(out, judge)
    monkeypatch.chdir(judge)  # the harness's log directory is relative: logs/run_evaluation
    for rec in records:
        iid = rec["instance_id"]
        where = judge / "logs" / "run_evaluation" / "j" / model / iid
        if not (where / "test_output.txt").is_file():
            assert not (where / "report.json").exists()
            continue
        got = run_instance(_spec(rec), preds[iid], None, "j", rewrite_reports=True)
        assert got is not None
        gitruns = json.loads((out / where.relative_to(judge) / "report.json").read_text())
        assert got[1] == gitruns, iid  # the same report.json, test lists and all
    theirs = json.loads(
        make_run_report(preds, records, "j", None, str(judge / "harness")).read_text()
    )
    assert {k: theirs[k] for k in HARNESS_FIELDS} == {k: ours[k] for k in HARNESS_FIELDS}


def test_a_refused_test_infrastructure_change_is_unresolved_for_the_harness_too(
    gitrun: Gitrun, world: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cheat = (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/conftest.py\n@@ -0,0 +1,2 @@\n+import pytest\n+\n"
    )
    pred = {"instance_id": MEDIAN, "model_name_or_path": "m", "model_patch": cheat}
    (world / "p.jsonl").write_text(json.dumps(pred) + "\n")
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions",
        str(world / "p.jsonl"), "--repos", str(world / "repos"), "--run-id", "j",
        "--report-dir", str(world / "out"), "--json",
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 0, res.err
    assert json.loads(res.out)["unresolved_ids"] == [MEDIAN]
    monkeypatch.chdir(world / "out")
    rec = next(r for r in _records() if r["instance_id"] == MEDIAN)
    got = run_instance(_spec(rec), pred, None, "j", rewrite_reports=True)
    assert got is not None
    assert got[1][MEDIAN]["resolved"] is False


# gitrun's outcome of a test -> the status the harness's pytest log parser gives it (a
# test that did not run is absent from the harness's status map)
_STATUS = {"passed": "PASSED", "failed": "FAILED", "error": "ERROR", "skipped": "SKIPPED"}
_OUTCOMES = st.sampled_from([*_STATUS, "missing"])


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    f2p=st.lists(_OUTCOMES, min_size=1, max_size=4),
    p2p=st.lists(_OUTCOMES, max_size=4),
    eval_type=st.sampled_from(["pass_and_fail", "fail_only"]),
)
@example(f2p=["missing"], p2p=["error"], eval_type="fail_only")
@example(f2p=["skipped"], p2p=["skipped"], eval_type="pass_and_fail")
def test_gitruns_grading_is_the_harness_grading_for_both_eval_types(
    f2p: list[str], p2p: list[str], eval_type: str
) -> None:
    """For every mix of outcomes and both of 5.x's eval types, gitrun's tests_status and
    resolved are what swebench 5.0.2's get_eval_tests_report and get_resolution_status
    give; a run in which no test ran at all is unresolved, as the harness's grader,
    finding no test in the log, leaves it."""
    f2p_ids = [f"t.py::f{n}" for n in range(len(f2p))]
    p2p_ids = [f"t.py::p{n}" for n in range(len(p2p))]
    outcomes = dict(zip(f2p_ids + p2p_ids, f2p + p2p, strict=True))
    row = {"repo": "o/r", "instance_id": "o__r-1", "base_commit": "0" * 40, "test_patch": "",
           "FAIL_TO_PASS": f2p_ids, "PASS_TO_PASS": p2p_ids, "eval_type": eval_type}  # fmt: skip
    inst = core.parse_instances(json.dumps([row]).encode())[0]
    ours = core.instance_report(inst, "p", True, outcomes)["o__r-1"]
    status_map = {t: _STATUS[o] for t, o in outcomes.items() if o in _STATUS}
    gold = {"FAIL_TO_PASS": f2p_ids, "PASS_TO_PASS": p2p_ids}
    theirs = get_eval_tests_report(status_map, gold, eval_type=EvalType(eval_type))
    assert ours["tests_status"] == theirs
    resolved = bool(status_map) and get_resolution_status(theirs) == "RESOLVED_FULL"
    assert ours["resolved"] is resolved
