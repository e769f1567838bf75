"""A SWE-bench verdict cannot be faked: not by changing how pytest runs (the tree the tests
run on is judged, and every test-runner file the prediction changes is reset to the base),
not by rewriting the report after pytest wrote it (outcomes stream to gitrun as pytest
reports them), not by an instance id that walks out of ``--report-dir``.

Every attack here is a prediction that leaves the bug in place; each was graded
``resolved`` before, through the real CLI, real git and real pytest under bubblewrap.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import Gitrun, git
from swebench_data import BUNDLE, OWNER

MEDIAN = f"{OWNER}__fix-median-1"
FIX = Path(__file__).resolve().parent.parent / "sandboxes" / "fix-median" / "patches" / "fix.diff"
BATCH_SECONDS = 240

# A plugin that turns every report into a pass: what each attack gets pytest to load.
CHEAT = (
    "import pytest\n\n\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    (yield).get_result().outcome = 'passed'\n"
)
# Code under test that rewrites the JUnit report at exit into all-passing.
ATEXIT_REWRITE = (
    "\n\nimport atexit as _atexit, sys as _sys, re as _re\n\n\n"
    "def _forge():\n"
    "    path = [a.split('=', 1)[1] for a in _sys.argv if a.startswith('--junitxml=')][0]\n"
    "    text = open(path).read()\n"
    "    text = _re.sub(r'<failure.*?</failure>', '', text, flags=_re.S)\n"
    "    open(path, 'w').write(text.replace('failures=\"3\"', 'failures=\"0\"'))\n\n\n"
    "_atexit.register(_forge)\n"
)


def repo(world: Path) -> Path:
    return world / "repos" / f"{OWNER}__fix-median"


def prediction(world: Path, files: dict[str, str | None], *, fixed: bool = False) -> str:
    """The diff (by real git) that writes ``files`` (None: deletes) on the base, on top of
    the gold fix when ``fixed``; the repository is left as it was."""
    work = repo(world)
    if fixed:
        git(work, "apply", str(FIX))
    for path, text in files.items():
        target = work / path
        if text is None:
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    git(work, "add", "-A")
    diff = git(work, "diff", "--cached", "HEAD")
    git(work, "reset", "-q", "--hard", "HEAD")
    git(work, "clean", "-qfdx")
    return diff


def run(gitrun: Gitrun, world: Path, patch: str, iid: str = MEDIAN) -> tuple[Any, Any, str]:
    """One batch of one prediction: the run report, the instance's gitrun.json, its log."""
    preds = world / "p.jsonl"
    preds.write_text(json.dumps({"instance_id": iid, "model_name_or_path": "m",
                                 "model_patch": patch}) + "\n")  # fmt: skip
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", str(preds),
        "--repos", str(world / "repos"), "--run-id", "r1", "--report-dir", str(world / "out"),
        "--json", "--instance-ids", iid,
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 0, res.err
    where = world / "out" / "logs" / "run_evaluation" / "r1" / "m" / iid
    meta = json.loads((where / "gitrun.json").read_text())
    return json.loads(res.out), meta, (where / "test_output.txt").read_text()


def reset_paths(meta: Any) -> list[str]:
    return [entry["path"] for entry in meta.get("runner_reset", [])]


def pyproject(extra_ini: str = "", *, order: tuple[str, ...] = ("pythonpath", "testpaths")) -> str:
    lines = {"pythonpath": 'pythonpath = ["."]', "testpaths": 'testpaths = ["tests"]'}
    return (
        '[project]\nname = "stats"\nversion = "0.1.0"\nrequires-python = ">=3.11"\n\n'
        "[tool.pytest.ini_options]\n" + "".join(lines[k] + "\n" for k in order) + extra_ini
    )


# -- 1. changing how pytest runs ---------------------------------------------------------


def quoted(diff: str, path: str) -> str:
    """``diff`` with ``path`` written C-quoted, as git does for an unusual name."""
    return (
        diff.replace(f"diff --git a/{path} b/{path}", f'diff --git "a/{path}" "b/{path}"')
        .replace(f"+++ b/{path}", f'+++ "b/{path}"')
        .replace(f"--- a/{path}", f'--- "a/{path}"')
    )


CASES: dict[str, tuple[Callable[[Path], str], list[str]]] = {
    # the four the issue found, each graded resolved on main
    "c-quoted conftest.py": (lambda w: quoted(prediction(w, {"conftest.py": CHEAT}), "conftest.py"),
                             ["conftest.py"]),
    "pytest.toml loading a plugin": (lambda w: prediction(w, {
        "cheat.py": CHEAT, "pytest.toml": '[pytest]\naddopts = ["-p", "cheat"]\n'
        'pythonpath = ["."]\n'}), ["pytest.toml"]),
    ".pytest.toml": (lambda w: prediction(w, {
        "cheat.py": CHEAT, ".pytest.toml": '[pytest]\naddopts = ["-p", "cheat"]\n'}),
        [".pytest.toml"]),
    ".pytest.ini": (lambda w: prediction(w, {
        "cheat.py": CHEAT, ".pytest.ini": "[pytest]\naddopts = -p cheat\n"}), [".pytest.ini"]),
    "pyproject hunk without the word": (lambda w: prediction(w, {
        "cheat.py": CHEAT, "pyproject.toml": pyproject('addopts = "-p cheat"\n')}),
        ["pyproject.toml"]),
    "root dist-info with a pytest11 entry point": (lambda w: prediction(w, {
        "cheat.py": CHEAT,
        "cheat-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: cheat\nVersion: 1.0\n",
        "cheat-1.0.dist-info/entry_points.txt": "[pytest11]\ncheat = cheat\n"}),
        ["cheat-1.0.dist-info/METADATA", "cheat-1.0.dist-info/entry_points.txt"]),
    # more of the class
    "root egg-info with a pytest11 entry point": (lambda w: prediction(w, {
        "cheat.py": CHEAT,
        "cheat.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: cheat\nVersion: 1.0\n",
        "cheat.egg-info/entry_points.txt": "[pytest11]\ncheat = cheat\n"}),
        ["cheat.egg-info/PKG-INFO", "cheat.egg-info/entry_points.txt"]),
    "a pytest.py that shadows the runner": (lambda w: prediction(w, {"pytest.py": (
        "import sys\n"
        "path = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--junitxml=')][0]\n"
        "ids = ['test_even_length', 'test_even_length_two_values', 'test_even_length_four',\n"
        "       'test_odd_length', 'test_single', 'test_unsorted_input', 'test_empty_raises']\n"
        "cases = ''.join('<testcase classname=\"tests.test_median\" name=\"%s\"/>' % i\n"
        "                for i in ids)\n"
        "cases += '<testcase classname=\"tests.test_mean\" name=\"test_mean_basic\"/>'\n"
        "cases += '<testcase classname=\"tests.test_mean\" name=\"test_mean_empty_raises\"/>'\n"
        "open(path, 'w').write('<testsuites><testsuite>%s</testsuite></testsuites>' % cases)\n"
        "print('9 passed')\n")}), ["pytest.py"]),
    "conftest.py in a subdirectory, C-quoted": (lambda w: quoted(
        prediction(w, {"tests/conftest.py": CHEAT}), "tests/conftest.py"), ["tests/conftest.py"]),
    "tox.ini [pytest] in the test directory": (lambda w: prediction(w, {
        "cheat.py": CHEAT, "tests/tox.ini": "[pytest]\naddopts = -p cheat --rootdir=.\n"}),
        ["tests/tox.ini"]),
    "setup.cfg [tool:pytest] in the test directory": (lambda w: prediction(w, {
        "cheat.py": CHEAT,
        "tests/setup.cfg":
            "[metadata]\nname = x\n\n[tool:pytest]\naddopts = -p cheat --rootdir=.\n"}),
        ["tests/setup.cfg"]),
    "pyproject's pytest table removed, root setup.cfg takes over": (lambda w: prediction(w, {
        "cheat.py": CHEAT,
        "pyproject.toml": '[project]\nname = "stats"\nversion = "0.1.0"\n',
        "setup.cfg": "[tool:pytest]\naddopts = -p cheat\npythonpath = .\n"}),
        ["pyproject.toml", "setup.cfg"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_prediction_that_changes_how_pytest_runs_is_reset_and_resolves_nothing(
    gitrun: Gitrun, world: Path, case: str
) -> None:
    make, expected = CASES[case]
    report, meta, log = run(gitrun, world, make(world))
    assert report["resolved_ids"] == [], log
    assert report["unresolved_ids"] == [MEDIAN]
    assert sorted(reset_paths(meta)) == sorted(expected)
    assert "reset to the base before the tests ran" in meta["reason"]
    assert "test infrastructure (" in log
    assert "FAIL_TO_PASS still failing" in meta["summary"]


def test_the_same_changes_with_the_real_fix_still_resolve(gitrun: Gitrun, world: Path) -> None:
    """The reset takes away the runner change, not the fix: graded on its code."""
    patch = prediction(world, {"conftest.py": CHEAT, "cheat.pth": "import cheat\n",
                               "cheat.py": CHEAT}, fixed=True)  # fmt: skip
    report, meta, _ = run(gitrun, world, patch)
    assert report["resolved_ids"] == [MEDIAN]
    assert sorted(reset_paths(meta)) == ["cheat.pth", "conftest.py"]


def test_a_pyproject_edit_that_keeps_the_parsed_pytest_table_is_not_reset(
    gitrun: Gitrun, world: Path
) -> None:
    """Reordered keys, other spacing, a comment and an edit elsewhere in the file: what
    pytest reads is the same, so the prediction's file stands."""
    text = (
        pyproject(order=("testpaths", "pythonpath"))
        .replace('version = "0.1.0"', 'version = "0.2.0"\ndescription = "mentions pytest"')
        .replace('testpaths = ["tests"]', "testpaths   =   [ 'tests' ]  # pytest: unchanged")
    )
    patch = prediction(world, {"pyproject.toml": text}, fixed=True)
    report, meta, _ = run(gitrun, world, patch)
    assert report["resolved_ids"] == [MEDIAN]
    assert "runner_reset" not in meta
    tested = git(repo(world), "show", f"{meta_branch(world)}:pyproject.toml")
    assert "0.2.0" in tested


def meta_branch(world: Path) -> str:
    refs = git(repo(world), "for-each-ref", "--format=%(refname)", "refs/heads/gitrun").split()
    assert len(refs) == 1, refs
    return refs[0]


@pytest.mark.parametrize(
    ("path", "text"),
    [
        ("lib/cheat.pth", "import cheat\n"),
        ("sitecustomize.py", "import cheat\n"),
        ("stats/usercustomize/__init__.py", "import cheat\n"),
        ("src/cheat.egg-info/entry_points.txt", "[pytest11]\ncheat = cheat\n"),
        ("tests/__pycache__/notes.txt", "bytecode lives here\n"),
        ("_pytest/__init__.py", "raise SystemExit(0)\n"),
    ],
)
def test_every_other_runner_file_is_reset_too(
    gitrun: Gitrun, world: Path, path: str, text: str
) -> None:
    report, meta, _ = run(gitrun, world, prediction(world, {path: text}))
    assert report["unresolved_ids"] == [MEDIAN]
    assert reset_paths(meta) == [path]


# -- 2. the verdict channel --------------------------------------------------------------

# Code under test that finds the outcome channel (any socket it holds) and does ``what`` to
# it while the tests are collected, and rewrites the JUnit report at exit.
ON_SOCKETS = (
    "\n\nimport os as _os, stat as _stat\n\n\n"
    "def _sockets():\n"
    "    for name in _os.listdir('/proc/self/fd'):\n"
    "        try:\n"
    "            if _stat.S_ISSOCK(_os.fstat(int(name)).st_mode):\n"
    "                yield int(name)\n"
    "        except OSError:\n"
    "            pass\n\n\n"
    "for _fd in list(_sockets()):\n"
    "    {what}\n"
)
TAMPERING = {
    "atexit rewrites the report": "",
    "garbage written to the channel": ON_SOCKETS.format(what="_os.write(_fd, b'garbage\\n')"),
    "the channel closed": ON_SOCKETS.format(what="_os.close(_fd)"),
    "records forged without the token": ON_SOCKETS.format(what=(
        "_os.write(_fd, b''.join(b'{\"k\": \"test\", \"id\": \"tests/test_median.py::%s\", '\n"
        "        b'\"when\": \"call\", \"o\": \"passed\", \"x\": false}\\n' % n\n"
        "        for n in (b'test_even_length', b'test_even_length_two_values')))"
    )),
    "a forged end record at exit": ON_SOCKETS.format(what=(
        "_atexit.register(_os.write, _fd, b'{\"k\": \"end\", \"status\": 0, \"junit\": null}\\n')"
    )),
}  # fmt: skip
BREAKS = {
    "atexit rewrites the report": "verdict-tampered: the JUnit report was changed",
    "garbage written to the channel": "verdict-tampered: line ",
    "the channel closed": "verifier error: the outcome stream stopped before pytest's end",
    "records forged without the token": "verdict-tampered: line ",
    "a forged end record at exit": "verdict-tampered: line ",
}


def median_with(tail: str) -> str:
    source = (FIX.parent.parent / "repo" / "stats" / "median.py").read_text()
    return source + ATEXIT_REWRITE + tail


@pytest.mark.parametrize("case", list(TAMPERING))
def test_code_under_test_cannot_rewrite_the_verdict_after_pytest_reported_it(
    gitrun: Gitrun, world: Path, case: str
) -> None:
    patch = prediction(world, {"stats/median.py": median_with(TAMPERING[case])})
    report, meta, log = run(gitrun, world, patch)
    assert report["resolved_ids"] == [], log
    assert report["unresolved_ids"] == [MEDIAN]
    assert meta["summary"].startswith(BREAKS[case]), meta["summary"]
    assert "runner_reset" not in meta


def _forging_patch(task: Path, tmp_path: Path) -> None:
    """``tmp_path/cheat.diff``: a median that forges the verdict and leaves the bug."""
    work = tmp_path / "w"
    shutil.copytree(task / "repo", work)
    git(work, "init", "-q", "-b", "main")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "base")
    (work / "stats" / "median.py").write_text(median_with(""))
    (tmp_path / "cheat.diff").write_text(git(work, "diff"))


def test_a_task_verifier_gets_the_channel_too_and_a_rewritten_report_fails_the_run(
    gitrun: Gitrun, sandbox_copy: Any, tmp_path: Path
) -> None:
    task = sandbox_copy("fix-median")
    _forging_patch(task, tmp_path)

    res = gitrun(
        "run", str(task), "--run-id", "forge", "--agent", f"patch:{tmp_path / 'cheat.diff'}"
    )

    assert res.code == 1, (res.out, res.err)
    info = json.loads(gitrun("status", "forge", "--json").out)
    assert (info["phase"], info["stop_reason"]) == ("failed", "verifier_failed")
    assert info["verifier"]["summary"].startswith(
        "verdict-tampered: the JUnit report was changed after pytest wrote it"
    )


def test_the_gold_patch_still_resolves_through_the_channel(gitrun: Gitrun, world: Path) -> None:
    report, meta, log = run(gitrun, world, prediction(world, {}, fixed=True))
    assert report["resolved_ids"] == [MEDIAN], log
    assert meta["isolation"] == "bwrap"


# -- 6. instance ids name directories ------------------------------------------------------


@pytest.mark.parametrize(
    "iid",
    ["../../../../../../escaped", "a/../../../../../../escaped", "sub/dir", "..", ".", "",
     "tab\there", "back\\slash", "x" * 201],
)  # fmt: skip
def test_an_instance_id_that_is_not_one_safe_file_name_is_refused_before_anything_is_written(
    gitrun: Gitrun, world: Path, iid: str
) -> None:
    record = json.loads((BUNDLE / "instances.jsonl").read_text().splitlines()[0])
    dataset = world / "data" / "instances.jsonl"
    dataset.parent.mkdir()
    dataset.write_text(json.dumps(record | {"instance_id": iid}) + "\n")
    before = sorted(p.relative_to(world) for p in world.rglob("*"))

    res = gitrun.run((
        "swebench", "--dataset", str(dataset), "--predictions", "gold", "--repos",
        str(world / "repos"), "--run-id", "r1", "--report-dir", str(world / "data" / "out"),
    ), timeout=BATCH_SECONDS)  # fmt: skip

    assert res.code == 2, (res.out, res.err)
    assert res.err.startswith("gitrun: "), res.err
    assert len(res.err.strip().splitlines()) == 1, res.err
    assert "is not a safe file name" in res.err
    assert sorted(p.relative_to(world) for p in world.rglob("*")) == before
    assert git(repo(world), "for-each-ref", "refs/heads/gitrun") == ""


@pytest.mark.parametrize(("option", "value"), [("--run-id", "../../escaped"), ("model", "m\x00")])
def test_a_run_id_or_model_name_that_would_leave_the_report_dir_is_refused(
    gitrun: Gitrun, world: Path, option: str, value: str
) -> None:
    preds = world / "p.jsonl"
    model = value if option == "model" else "m"
    preds.write_text(json.dumps({"instance_id": MEDIAN, "model_name_or_path": model,
                                 "model_patch": "x"}) + "\n")  # fmt: skip
    run_id = value if option == "--run-id" else "r1"
    res = gitrun.run((
        "swebench", "--dataset", str(BUNDLE / "instances.jsonl"), "--predictions", str(preds),
        "--repos", str(world / "repos"), "--run-id", run_id, "--report-dir", str(world / "out"),
    ), timeout=BATCH_SECONDS)  # fmt: skip
    assert res.code == 2, (res.out, res.err)
    assert len(res.err.strip().splitlines()) == 1
    assert not (world / "out").exists()


def test_the_plugin_is_importable_in_the_sandbox_and_read_only_there(
    gitrun: Gitrun, world: Path
) -> None:
    # what the probe found becomes median()'s result, so a failing test's message shows it
    probe = (
        "\n\nimport errno as _e, sys as _s\n\n"
        "_plugin = _s.modules['gitrun_verdict'].__file__\n"
        "_found = []\n"
        "for _target in (_plugin, _plugin + '.new'):\n"
        "    try:\n"
        "        open(_target, 'a').close()\n"
        "        _found.append('WRITABLE')\n"
        "    except OSError as _exc:\n"
        "        _found.append(_e.errorcode[_exc.errno])\n\n\n"
        "def median(data):\n"
        "    return 'PLUGIN:' + ':'.join(_found)\n"
    )
    source = (FIX.parent.parent / "repo" / "stats" / "median.py").read_text()
    patch = prediction(world, {"stats/median.py": source + probe})
    report, meta, log = run(gitrun, world, patch)
    assert meta["isolation"] == "bwrap"
    assert "WRITABLE" not in log
    # the file is 0444 (EACCES: no capability overrides it in the sandbox); a new file in
    # its directory meets the read-only mount (EROFS)
    assert re.search(r"PLUGIN:(EACCES|EROFS):EROFS", log), log
    assert report["unresolved_ids"] == [MEDIAN]


def test_under_xdist_the_controller_streams_every_workers_outcomes(
    gitrun: Gitrun, sandbox_copy: Any, tmp_path: Path
) -> None:
    """xdist is named with -p (autoload is off); the workers' reports reach the channel
    through the controller. The code under test runs in the workers, which hold neither
    the channel nor the report: the forging median fails as any wrong fix does."""
    task = sandbox_copy("fix-median")
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace(
        '"-p", "no:cacheprovider"]', '"-p", "no:cacheprovider", "-p", "xdist.plugin", "-n", "2"]'
    ))  # fmt: skip
    assert "xdist.plugin" in toml.read_text()
    gold = gitrun("run", str(task), "--run-id", "gold", "--agent", f"patch:{FIX}")
    assert gold.code == 0, (gold.out, gold.err)

    _forging_patch(task, tmp_path)
    res = gitrun(
        "run", str(task), "--run-id", "forge", "--agent", f"patch:{tmp_path / 'cheat.diff'}"
    )
    assert res.code == 1, (res.out, res.err)
    info = json.loads(gitrun("status", "forge", "--json").out)
    assert "FAIL_TO_PASS still failing" in info["verifier"]["summary"]
