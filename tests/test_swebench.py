"""``gitrun swebench``: SWE-bench files in, SWE-bench reports out, each instance a gitrun run."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Gitrun, git
from swebench_data import BUNDLE, OWNER, bundle

MEDIAN = f"{OWNER}__fix-median-1"
SLUG = f"{OWNER}__slugify-unicode-1"
IDS = sorted([MEDIAN, SLUG])
# A batch's time limit. The module's first batch also builds the test environments (a venv
# and a pip install each): on a loaded machine that took over 120 s. Not what is tested.
BATCH_SECONDS = 240  # under the suite's 300 s per test: this one names the command


def batch(
    gitrun: Gitrun, world: Path, preds: str, *extra: str, run_id: str = "r1", code: int = 0
) -> Any:
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", preds,
        "--repos", str(world / "repos"), "--run-id", run_id,
        "--report-dir", str(world / "out"), "--json", *extra,
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == code, res.err
    return json.loads(res.out)


def instance_report(world: Path, model: str, iid: str, run_id: str = "r1") -> Any:
    path = world / "out" / "logs" / "run_evaluation" / run_id / model / iid / "report.json"
    return json.loads(path.read_text())


def receipts(world: Path, repo: str) -> dict[str, int]:
    """Receipt commits on each gitrun branch of ``repo``."""
    where = world / "repos" / f"{OWNER}__{repo}"
    out = {}
    for ref in git(where, "for-each-ref", "--format=%(refname)", "refs/heads/gitrun").split():
        out[ref] = len(git(where, "rev-list", f"main..{ref}").split())
    return out


def preds_file(world: Path, name: str, patches: dict[str, str], model: str = "m") -> str:
    path = world / f"{name}.jsonl"
    path.write_text("".join(
        json.dumps({"instance_id": i, "model_name_or_path": model, "model_patch": p}) + "\n"
        for i, p in patches.items()
    ))  # fmt: skip
    return str(path)


def test_the_bundled_dataset_is_what_the_builder_makes_with_the_same_base_commits(
    tmp_path: Path,
) -> None:
    for name, text in bundle(tmp_path / "b").items():
        assert (BUNDLE / name).read_text() == text, name


def test_gold_resolves_every_instance_in_swebench_report_shapes(
    gitrun: Gitrun, world: Path
) -> None:
    report = batch(gitrun, world, "gold")
    on_disk = json.loads((world / "out" / "gold.r1.json").read_text())
    assert on_disk == {
        k: v for k, v in report.items() if k not in ("report_file", "line", "error_lines")
    }
    assert on_disk["schema_version"] == 2
    assert (on_disk["total_instances"], on_disk["resolved_instances"]) == (2, 2)
    assert on_disk["resolved_ids"] == on_disk["completed_ids"] == IDS
    assert on_disk["error_ids"] == on_disk["empty_patch_ids"] == []
    one = instance_report(world, "gold", MEDIAN)
    body = one[MEDIAN]
    assert set(body) == {
        "patch_is_None", "patch_exists", "patch_successfully_applied", "resolved",
        "infra_failure", "tests_status",
    }  # fmt: skip
    assert body["resolved"]
    assert body["patch_successfully_applied"]
    assert body["patch_exists"]
    f2p = body["tests_status"]["FAIL_TO_PASS"]
    assert f2p["failure"] == []
    assert "tests/test_median.py::test_even_length_four" in f2p["success"]
    out_dir = world / "out" / "logs" / "run_evaluation" / "r1" / "gold" / MEDIAN
    output = (out_dir / "test_output.txt").read_text()
    # the test command's own output (pytest's closing line) between the harness's markers,
    # its exit status after them, then gitrun's summary
    said = re.search(r"^=+ \d+ passed in [\d.]+s =+$", output, re.M)
    assert said is not None, output
    start, end = output.index(">>>>> Start Test Output"), output.index(">>>>> End Test Output")
    assert start < said.start() < end < output.index(">>>>> Test Exit Code: 0")
    assert output.index("result: resolved") > end
    assert json.loads((out_dir / "gitrun.json").read_text())["stage"] == "strict"
    # each instance: one gitrun run with exactly two receipts (prediction, test patch)
    assert list(receipts(world, "fix-median").values()) == [2]


def test_empty_predictions_are_empty_patch_and_never_run(gitrun: Gitrun, world: Path) -> None:
    report = batch(gitrun, world, str(BUNDLE / "preds-empty.jsonl"))
    assert report["empty_patch_ids"] == IDS
    assert report["completed_instances"] == 0
    assert receipts(world, "fix-median") == {}


def test_wrong_predictions_resolve_nothing(gitrun: Gitrun, world: Path) -> None:
    report = batch(gitrun, world, str(BUNDLE / "preds-wrong.jsonl"))
    assert report["unresolved_ids"] == IDS
    assert report["resolved_instances"] == 0
    body = instance_report(world, "wrong-model", MEDIAN)[MEDIAN]
    assert body["patch_successfully_applied"]
    assert not body["resolved"]
    assert (
        "tests/test_median.py::test_even_length" in body["tests_status"]["FAIL_TO_PASS"]["failure"]
    )
    out_dir = world / "out" / "logs" / "run_evaluation" / "r1" / "wrong-model" / MEDIAN
    output = (out_dir / "test_output.txt").read_text()
    assert re.search(r"^FAILED tests/test_median.py::test_even_length", output, re.M), output
    assert re.search(r"^=+ \d+ failed, \d+ passed in ", output, re.M), output


def _gold(iid: str) -> str:
    for line in (BUNDLE / "instances.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["instance_id"] == iid:
            return str(rec["patch"])
    raise LookupError(iid)


def test_wrong_hunk_counts_are_applied_by_the_recount_stage_and_recorded_so(
    gitrun: Gitrun, world: Path
) -> None:
    damaged = _gold(MEDIAN).replace("@@ -18,4 +18,4 @@", "@@ -18,7 +18,9 @@")
    assert damaged != _gold(MEDIAN)
    report = batch(
        gitrun, world, preds_file(world, "p", {MEDIAN: damaged}), "--instance-ids", MEDIAN
    )
    assert report["resolved_ids"] == [MEDIAN]
    meta = world / "out" / "logs" / "run_evaluation" / "r1" / "m" / MEDIAN / "gitrun.json"
    assert json.loads(meta.read_text())["stage"] == "recount"
    log = git(world / "repos" / f"{OWNER}__fix-median", "log", "--format=%B", "--all")
    assert "apply stage: recount" in log


def test_a_patch_that_needs_fuzz_is_refused_and_never_applied(gitrun: Gitrun, world: Path) -> None:
    fuzzy = _gold(MEDIAN).replace("     mid = n // 2\n", "     mid = len(data) // 2\n")
    report = batch(
        gitrun, world, preds_file(world, "p", {MEDIAN: fuzzy}), "--instance-ids", MEDIAN, code=1
    )
    assert report["error_ids"] == [MEDIAN]
    assert report["resolved_instances"] == 0
    assert "patch did not apply" in report["gitrun_error_reasons"][MEDIAN]
    # as the harness leaves it: no report.json (so its run report counts an error too),
    # the reason in run_instance.log after its marker
    where = world / "out" / "logs" / "run_evaluation" / "r1" / "m" / MEDIAN
    assert sorted(p.name for p in where.iterdir()) == ["gitrun.json", "run_instance.log"]
    assert ">>>>> Patch Apply Failed:" in (where / "run_instance.log").read_text()
    assert receipts(world, "fix-median") == {}  # no run, no write


def test_a_prediction_adding_a_conftest_that_forces_passes_is_refused(
    gitrun: Gitrun, world: Path
) -> None:
    cheat = (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/conftest.py\n@@ -0,0 +1,6 @@\n+import pytest\n+\n+\n"
        "+@pytest.hookimpl(hookwrapper=True)\n+def pytest_runtest_makereport(item, call):\n"
        "+    (yield).get_result().outcome = 'passed'\n"
    )
    report = batch(gitrun, world, preds_file(world, "p", {MEDIAN: cheat}), "--instance-ids", MEDIAN)
    assert report["resolved_instances"] == 0
    assert report["unresolved_ids"] == [MEDIAN]
    out_dir = world / "out" / "logs" / "run_evaluation" / "r1" / "m" / MEDIAN
    assert "test infrastructure (conftest.py)" in (out_dir / "test_output.txt").read_text()


def test_what_a_prediction_does_to_the_test_patch_files_does_not_count(
    gitrun: Gitrun, world: Path
) -> None:
    """A prediction that rewrites the failing tests into passing ones: reset to base."""
    repo = world / "repos" / f"{OWNER}__fix-median"
    test = repo / "tests" / "test_median.py"
    test.write_text(test.read_text().replace("== 2.5", "== 3").replace("== 15", "== 20"))
    cheat = git(repo, "diff")
    git(repo, "checkout", "--", ".")
    report = batch(gitrun, world, preds_file(world, "p", {MEDIAN: cheat}), "--instance-ids", MEDIAN)
    assert report["unresolved_ids"] == [MEDIAN]


def test_a_changed_prediction_runs_only_that_instance_again(gitrun: Gitrun, world: Path) -> None:
    wrong = {json.loads(x)["instance_id"]: json.loads(x)["model_patch"]
             for x in (BUNDLE / "preds-wrong.jsonl").read_text().splitlines()}  # fmt: skip
    first = batch(gitrun, world, preds_file(world, "a", wrong))
    before = receipts(world, "fix-median") | receipts(world, "slugify-unicode")
    again = batch(gitrun, world, preds_file(world, "a", wrong))
    assert receipts(world, "fix-median") | receipts(world, "slugify-unicode") == before
    assert again == first
    changed = wrong | {MEDIAN: _gold(MEDIAN)}
    third = batch(gitrun, world, preds_file(world, "b", changed))
    assert third["resolved_ids"] == [MEDIAN]
    assert third["unresolved_ids"] == [SLUG]
    assert receipts(world, "slugify-unicode") == {k: v for k, v in before.items() if "slug" in k}
    assert len(receipts(world, "fix-median")) == 2  # the old run, and one new one


def six(world: Path) -> tuple[Path, list[str]]:
    """The bundled instances three times over (other ids): six runs in two repositories."""
    records = [json.loads(x) for x in (BUNDLE / "instances.jsonl").read_text().splitlines()]
    many = [r | {"instance_id": f"{r['instance_id']}-{n}"} for r in records for n in range(3)]
    dataset = world / "six.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in many))
    return dataset, sorted(r["instance_id"] for r in many)


def test_two_workers_on_one_repository_give_the_same_report(gitrun: Gitrun, world: Path) -> None:
    dataset, ids = six(world)
    res = gitrun.run((
        "swebench", "--dataset", str(dataset), "--predictions", "gold", "--max-workers", "2",
        "--repos", str(world / "repos"), "--run-id", "w2", "--report-dir", str(world / "out"),
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 0, res.err
    report = json.loads((world / "out" / "gold.w2.json").read_text())
    assert report["resolved_ids"] == ids
    assert set(receipts(world, "fix-median").values()) == {2}
    assert_in_flight_shown_before_result(res.err, ids, 6)


def assert_in_flight_shown_before_result(err: str, ids: list[str], total: int) -> None:
    """Plain progress lines: each instance is shown running, with the counts, before its
    result line."""
    lines = err.splitlines()
    for iid in ids:
        running = [n for n, x in enumerate(lines) if re.search(rf"running {re.escape(iid)}\b", x)]
        done = [n for n, x in enumerate(lines) if f"] {iid}: resolved" in x]
        assert running, (iid, err)
        assert done, (iid, err)
        assert running[0] < done[0], (iid, err)
        assert re.search(rf"\[\d+/{total}\] .*resolved \d+, errors \d+", lines[running[0]]), err


def test_plain_progress_shows_the_instance_in_flight_before_its_result(
    gitrun: Gitrun, world: Path
) -> None:
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", "gold",
        "--repos", str(world / "repos"), "--run-id", "p", "--report-dir", str(world / "out"),
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 0, res.err
    lines = res.err.splitlines()
    first = next(n for n, x in enumerate(lines) if "running" in x)
    assert re.search(rf"\[0/2\] running {IDS[0]} \(resolved 0, errors 0\)", lines[first]), res.err
    assert_in_flight_shown_before_result(res.err, IDS, 2)


def test_kill_9_at_random_moments_then_rerun_gives_the_same_report_each_instance_once(
    gitrun: Gitrun, world: Path
) -> None:
    rng = random.Random(13)
    dataset, ids = six(world)
    args = (
        "swebench", "--dataset", str(dataset), "--predictions", "gold",
        "--repos", str(world / "repos"), "--run-id", "k", "--report-dir", str(world / "out"),
    )  # fmt: skip
    interrupted = 0
    for _ in range(6):
        proc = gitrun.popen(*args)
        time.sleep(rng.uniform(0.1, 1.5))
        if proc.poll() is None:
            interrupted += 1
            proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert interrupted >= 3  # the kills really cut batches short
    res = gitrun.run(args, timeout=BATCH_SECONDS)
    assert res.code == 0, res.err
    report = json.loads((world / "out" / "gold.k.json").read_text())
    assert report["resolved_ids"] == ids
    assert report["error_ids"] == []
    before = {}
    for repo in ("fix-median", "slugify-unicode"):
        before[repo] = receipts(world, repo)
        assert len(before[repo]) == 3  # one run per instance
        assert set(before[repo].values()) == {2}  # each write exactly once
    res2 = gitrun.run(args, timeout=BATCH_SECONDS)  # and once more: the same report, nothing run
    assert res2.code == 0
    assert json.loads((world / "out" / "gold.k.json").read_text()) == report
    assert {repo: receipts(world, repo) for repo in before} == before


def test_tests_run_in_the_instances_own_venv_built_once_per_spec(
    gitrun: Gitrun, world: Path, envs: Path
) -> None:
    specs = json.loads((BUNDLE / "specs.json").read_text())
    probe = "python -c 'import sys; sys.exit(\"swebench-envs\" not in sys.prefix)' && "
    for spec in specs.values():
        spec["test_cmd"] = probe + spec["test_cmd"]
    (world / "repos" / "gitrun-swebench.json").write_text(json.dumps(specs))
    report = batch(gitrun, world, "gold")
    assert report["resolved_ids"] == IDS  # only when the venv's python ran the tests
    markers = sorted(envs.glob("*/gitrun-env.json"))
    assert len(markers) == 2  # one per (repo, version); the same spec reuses its venv

    def built() -> dict[Path, tuple[int, int, int]]:
        """Each environment's marker (inode, mtime) and how much its build log holds."""
        return {
            m.parent: (
                m.stat().st_ino,
                m.stat().st_mtime_ns,
                (m.parent / "build.log").stat().st_size,
            )
            for m in envs.glob("*/gitrun-env.json")
        }

    before = built()
    assert batch(gitrun, world, "gold", run_id="r2")["resolved_ids"] == IDS
    assert built() == before  # a warm cache: no step of any build ran again


def test_two_batch_commands_on_one_run_id_share_the_work_and_write_once(
    gitrun: Gitrun, world: Path
) -> None:
    args = (
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", "gold",
        "--repos", str(world / "repos"), "--run-id", "two", "--report-dir", str(world / "out"),
    )  # fmt: skip
    procs = [gitrun.popen(*args) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=BATCH_SECONDS)
        assert proc.returncode == 0, err
    report = json.loads((world / "out" / "gold.two.json").read_text())
    logs = world / "out" / "logs" / "run_evaluation" / "two" / "gold"
    why = {p.parent.name: p.read_text()[-600:] for p in logs.glob("*/test_output.txt")}
    assert report["resolved_ids"] == IDS, (report, why)
    for repo in ("fix-median", "slugify-unicode"):
        assert list(receipts(world, repo).values()) == [2]


def test_an_environment_cache_under_tmp_is_refused_by_name_before_anything_runs(
    gitrun: Gitrun, world: Path
) -> None:
    res = gitrun(
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", "gold",
        "--repos", str(world / "repos"), "--run-id", "t", "--report-dir", str(world / "out"),
        "--json", GITRUN_SWEBENCH_ENVS=f"/tmp/gitrun-swe-envs-{world.name}",
    )  # fmt: skip
    assert not Path(f"/tmp/gitrun-swe-envs-{world.name}").exists()
    assert res.code == 2
    assert len(res.err.strip().splitlines()) == 1
    assert "lies under /tmp" in res.err
    assert "GITRUN_SWEBENCH_ENVS" in res.err
    assert not (world / "out").exists()
    assert receipts(world, "fix-median") == {}


def test_a_bare_repository_is_run_in_a_shared_working_clone_and_left_unchanged(
    gitrun: Gitrun, world: Path
) -> None:
    repos = world / "repos"
    work = repos / f"{OWNER}__fix-median"
    bare = repos / OWNER / "fix-median.git"
    bare.parent.mkdir()
    git(world, "clone", "-q", "--bare", str(work), str(bare))
    shutil.rmtree(work)
    refs = git(bare, "for-each-ref")
    report = batch(gitrun, world, "gold", "--instance-ids", MEDIAN)
    assert report["resolved_ids"] == [MEDIAN]
    assert git(bare, "for-each-ref") == refs  # the user's bare repository is not written


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"--dataset": "missing.jsonl"}, "no such file"),
        ({"--predictions": "bad.jsonl"}, "line 1 is not JSON"),
        ({"--instance-ids": "nope"}, "nope is not in"),
        ({"--predictions": "stranger.jsonl"}, "instance nobody__nothing-1 is not in the dataset"),
        ({"spec": "gone"}, "no test_cmd in the record"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2_with_nothing_run(
    gitrun: Gitrun, world: Path, change: dict[str, str], words: str
) -> None:
    (world / "bad.jsonl").write_text("{not json\n")
    stranger = {"instance_id": "nobody__nothing-1", "model_name_or_path": "m", "model_patch": "x"}
    (world / "stranger.jsonl").write_text(json.dumps(stranger) + "\n")
    if change.pop("spec", None):
        (world / "repos" / "gitrun-swebench.json").unlink()
    opts = {"--dataset": str(BUNDLE / "instances.jsonl"), "--predictions": "gold"}
    opts |= {k: str(world / v) if k != "--instance-ids" else v for k, v in change.items()}
    argv = [x for kv in opts.items() for x in kv]
    res = gitrun("swebench", *argv, "--repos", str(world / "repos"), "--run-id", "b")
    assert res.code == 2
    assert res.err.startswith("gitrun: ")
    assert len(res.err.strip().splitlines()) == 1
    assert words in res.err
    assert receipts(world, "fix-median") == {}


@pytest.mark.parametrize("form", ["spaces", "commas", "repeated"])
def test_instance_ids_take_the_harness_form_and_the_repeated_one(
    gitrun: Gitrun, world: Path, form: str
) -> None:
    ids = {
        "spaces": ["--instance-ids", SLUG, MEDIAN],
        "commas": ["--instance-ids", f"{SLUG},{MEDIAN}"],
        "repeated": ["--instance-ids", SLUG, "--instance-ids", MEDIAN],
    }[form]
    report = batch(gitrun, world, str(BUNDLE / "preds-wrong.jsonl"), *ids)
    assert report["unresolved_ids"] == IDS


def test_a_batch_with_errors_exits_1_with_one_line_per_kind(gitrun: Gitrun, world: Path) -> None:
    fuzzy = _gold(MEDIAN).replace("     mid = n // 2\n", "     mid = len(data) // 2\n")
    broken = (
        "diff --git a/nothing.py b/nothing.py\n--- a/nothing.py\n+++ b/nothing.py\n"
        "@@ -1 +1 @@\n-a\n+b\n"
    )
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"),
        "--predictions", preds_file(world, "p", {MEDIAN: fuzzy, SLUG: broken}),
        "--repos", str(world / "repos"), "--run-id", "e", "--report-dir", str(world / "out"),
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 1, res.err
    said = [x for x in res.err.splitlines() if x.startswith("gitrun: ")]
    assert len(said) == 1, res.err
    assert said[0].startswith("gitrun: 2 patch not applied error(s): "), said
    assert MEDIAN in said[0]
    assert SLUG in said[0]
    assert "0/2 resolved, 0 empty, 2 errors" in res.out


def _respec(world: Path, **change: Any) -> None:
    """The spec file with ``change`` applied to every repository's entry."""
    specs = json.loads((BUNDLE / "specs.json").read_text())
    for spec in specs.values():
        spec.update(change)
    (world / "repos" / "gitrun-swebench.json").write_text(json.dumps(specs))


def _gitrun_json(world: Path, iid: str, run_id: str = "r1", model: str = "gold") -> Any:
    where = world / "out" / "logs" / "run_evaluation" / run_id / model / iid
    assert not (where / "report.json").exists()  # an error: the harness counts it one too
    return json.loads((where / "gitrun.json").read_text())


def test_a_python_version_not_on_the_machine_is_an_infra_error_naming_it(
    gitrun: Gitrun, world: Path
) -> None:
    _respec(world, python="3.1")
    report = batch(gitrun, world, "gold", "--instance-ids", MEDIAN, code=1)
    assert report["error_ids"] == [MEDIAN]
    assert report["unresolved_ids"] == report["resolved_ids"] == []
    assert report["infra_failure_ids"] == [MEDIAN]
    assert report["failure_reasons"] == {MEDIAN: "environment"}
    meta = _gitrun_json(world, MEDIAN)
    assert meta["error_kind"] == "environment"
    assert "python 3.1 is not available on this machine" in meta["reason"]
    assert "python 3.1 is not available" in report["gitrun_error_reasons"][MEDIAN]


def test_an_install_step_that_fails_is_an_infra_error_with_its_last_line(
    gitrun: Gitrun, world: Path
) -> None:
    _respec(world, install="python -m pip install -e ./no-such-dir")
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", "gold",
        "--repos", str(world / "repos"), "--run-id", "r1", "--report-dir", str(world / "out"),
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 1, res.err
    said = [x for x in res.err.splitlines() if x.startswith("gitrun: ")]
    assert len(said) == 1
    assert said[0].startswith("gitrun: 2 environment error(s): "), said
    assert "environment step install failed (1)" in said[0]
    reason = _gitrun_json(world, MEDIAN)["reason"]
    assert "no-such-dir" in reason
    assert "build.log" in reason


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_a_test_command_that_writes_into_the_environment_is_an_infra_error_not_unresolved(
    gitrun: Gitrun, world: Path
) -> None:
    """The harness's own specs re-run `install` inside the eval script; in gitrun the
    environment is read-only to the tests, and the gold patch must not come out unresolved."""
    # what an install step does: write into the venv (pip would fetch and build first)
    install = "python -c 'import pathlib, sys; pathlib.Path(sys.prefix, \"x.pth\").touch()'"
    _respec(world, test_cmd=f"{install} && pytest -rA tests")
    report = batch(gitrun, world, "gold", "--instance-ids", MEDIAN, code=1)
    assert report["error_ids"] == [MEDIAN]
    assert report["infra_failure_ids"] == [MEDIAN]
    meta = _gitrun_json(world, MEDIAN)
    assert meta["error_kind"] == "read_only_write"
    assert "Read-only file system" in meta["reason"]
    assert "pre_install/install" in meta["reason"]


def test_the_repository_is_installed_before_the_tests_and_the_tested_tree_shadows_it(
    gitrun: Gitrun, world: Path, envs: Path
) -> None:
    """`install` runs once, before the tests, in a copy at the base commit (which has the
    bug): the distribution is installed, yet the gold patch resolves, so the tests import
    the tested tree, not the installed copy."""
    probe = "python -c 'import importlib.metadata as m; m.version(\"stats\")' && pytest -rA tests"
    _respec(world, install="python -m pip install -e .", test_cmd=probe)
    report = batch(gitrun, world, "gold", "--instance-ids", MEDIAN)
    assert report["resolved_ids"] == [MEDIAN]

    def installed() -> list[Any]:
        built = [json.loads(m.read_text()) for m in envs.glob("*/gitrun-env.json")]
        return [b for b in built if b["install"]]

    assert len(installed()) == 1
    assert installed()[0]["tree"]  # keyed by the base tree it installed
    wrong = json.loads((BUNDLE / "preds-wrong.jsonl").read_text().splitlines()[0])
    report = batch(gitrun, world, preds_file(world, "w", {MEDIAN: wrong["model_patch"]}),
                   "--instance-ids", MEDIAN, run_id="r2")  # fmt: skip
    assert report["unresolved_ids"] == [MEDIAN]
    assert len(installed()) == 1  # the same base: the environment is not built again


def test_the_spec_python_is_the_interpreter_the_tests_run_on(gitrun: Gitrun, world: Path) -> None:
    probe = "python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' && pytest -rA tests"
    _respec(world, test_cmd=probe)
    assert batch(gitrun, world, "gold")["resolved_ids"] == IDS


def test_a_swebench_5_row_runs_its_eval_scripts_test_command_in_the_specs_environment(
    gitrun: Gitrun, world: Path
) -> None:
    """A 5.x row carries the harness's eval script: its test command (between the markers)
    is run, in the environment the spec entry builds."""
    rows = []
    for line in (BUNDLE / "instances.jsonl").read_text().splitlines():
        rec = json.loads(line)
        named = json.loads(rec["FAIL_TO_PASS"]) + json.loads(rec["PASS_TO_PASS"])
        tests = " ".join(sorted({t.split("::")[0] for t in named}))
        rec["eval_script"] = "\n".join([
            "#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate",
            "conda activate testbed", "cd /testbed", f"git checkout {rec['base_commit']} {tests}",
            ": '>>>>> Start Test Output'", f"pytest -rA {tests}",
            ": '>>>>> End Test Output'", f"git checkout {rec['base_commit']} {tests}",
        ])  # fmt: skip
        rec |= {"image": "none", "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail"}
        rows.append(json.dumps(rec))
    dataset = world / "v5.jsonl"
    dataset.write_text("\n".join(rows) + "\n")
    res = gitrun.run((
        "swebench", "--dataset", str(dataset), "--predictions", "gold", "--json",
        "--repos", str(world / "repos"), "--run-id", "v5", "--report-dir", str(world / "out"),
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 0, res.err
    assert json.loads(res.out)["resolved_ids"] == IDS
    out = world / "out" / "logs" / "run_evaluation" / "v5" / "gold" / MEDIAN / "test_output.txt"
    assert "+ pytest -rA tests/test_mean.py tests/test_median.py -rA\n" in out.read_text()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_tests_that_need_the_network_are_an_infra_error_as_the_harness_classifies_them(
    gitrun: Gitrun, world: Path
) -> None:
    fetch = "python -c 'import socket; socket.getaddrinfo(\"pypi.org\", 443)'"
    _respec(world, test_cmd=f"{fetch} && pytest -rA tests")
    report = batch(gitrun, world, "gold", "--instance-ids", MEDIAN, code=1)
    assert report["error_ids"] == [MEDIAN]
    assert report["failure_reasons"] == {MEDIAN: "environment"}
    meta = _gitrun_json(world, MEDIAN)
    assert meta["error_kind"] == "environment"
    assert "network_unreachable" in meta["reason"]
