"""What people expect of a command line: ``--version``, ``-`` for standard input, a closed
output pipe that is no error, and shell completion they can install."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, SANDBOXES, scrub_env
from helpers import Gitrun, Keys
from swebench_data import BUNDLE, make_repos

import gitrun as package

TYPER_PATH = "import sys; from gitrun.cli import main; main(sys.argv[1:])"


def _cli(
    env: dict[str, str], *args: str, typer_path: bool = False, stdout: int = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    """``gitrun ARGS`` through the fast entry (or the Typer app), output captured as text."""
    head = ["-c", TYPER_PATH] if typer_path else ["-m", "gitrun"]
    return subprocess.run([sys.executable, *head, *args], env=env, timeout=120, check=False,
                          cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of a workspace holding one run of fix-median driven to done."""
    tmp = tmp_path_factory.mktemp("habits")
    with pytest.MonkeyPatch.context() as mp:
        scrub_env(mp, tmp / "home")
        env = {**os.environ, "GITRUN_HOME": str(tmp / "ws"), "COLUMNS": "80"}
        done = _cli(env, "run", str(SANDBOXES / "fix-median"), "--run-id", "r1", "-q")
        assert done.returncode == 0, done.stderr
        yield env


@pytest.mark.parametrize("typer_path", [False, True], ids=["entry", "typer"])
def test_version_prints_the_packages_version(finished: dict[str, str], typer_path: bool) -> None:
    proc = _cli(finished, "--version", typer_path=typer_path)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert proc.returncode == 0
    assert proc.stdout == f"gitrun {package.__version__}\n"
    assert package.__version__ == project["version"]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["status", "r1"],
        ["status", "r1", "--json"],
        ["log", "r1"],
        ["log", "r1", "--json"],
        ["receipts", "r1"],
        ["checkpoints", "r1"],
        ["debug", "crash-points"],
        ["log", "--help"],
        ["list"],
        ["checkpoint", "verify", "r1"],
        ["report", "r1", "--html", "-"],
        ["keys", "export-allowed-signers", "-"],
        ["run", "--help"],
        ["swebench", "--help"],
    ],
)
@pytest.mark.parametrize("typer_path", [False, True], ids=["entry", "typer"])
def test_a_closed_output_pipe_ends_quietly_with_status_0(
    finished: dict[str, str], args: list[str], typer_path: bool
) -> None:
    """``gitrun status RUN | true``: the reader is gone before gitrun writes a byte."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = _cli(finished, *args, typer_path=typer_path, stdout=write)
    finally:
        os.close(write)
    assert proc.stderr == ""
    assert proc.returncode == 0


def _closed_stdout(gitrun: Gitrun, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(gitrun.argv(*args), env=gitrun.env(**extra), stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=240, check=False,
                              cwd=gitrun.home.parent)  # fmt: skip
    finally:
        os.close(write)


def test_a_closed_output_pipe_keeps_a_failed_runs_status_and_a_refused_chains(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    """Quiet, but never a success that was not one: the run's own exit status stays."""
    plan = tmp_path / "plan.toml"
    plan.write_text('schema = 1\n[[step]]\nkind = "write_file"\npath = "x.txt"\ncontent = "x"\n')
    task = str(SANDBOXES / "fix-median")
    failed = _closed_stdout(gitrun, "run", task, "--run-id", "f1", "-q", "--agent", f"plan:{plan}")
    assert (failed.returncode, failed.stderr) == (1, "")
    again = _closed_stdout(gitrun, "resume", "f1", "-q")
    assert (again.returncode, again.stderr) == (1, "")
    repo = gitrun.home / "repos" / "fix-median"
    ref = subprocess.run(["git", "for-each-ref", "--format=%(refname)",
                          "refs/gitrun/runs/f1/checkpoints/"], cwd=repo, check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    subprocess.run(["git", "update-ref", ref, f"{ref}~1"], cwd=repo, check=True)  # a rollback
    refused = _closed_stdout(gitrun, "report", "f1", "--html", "-")
    assert refused.returncode == 5, refused.stderr
    assert "the page at standard output shows what git holds" in refused.stderr


def test_a_reader_that_stops_early_is_no_error_in_a_real_shell_pipeline(
    finished: dict[str, str],
) -> None:
    script = (
        f"{sys.executable} -m gitrun debug crash-points | head -n 1 >/dev/null; "
        'echo "status ${PIPESTATUS[0]}"'
    )
    proc = subprocess.run(["bash", "-c", script], env=finished, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert proc.stdout == "status 0\n"
    assert proc.stderr == ""


def test_a_patch_on_standard_input_runs_and_resumes_from_the_kept_copy(
    gitrun: Gitrun,
) -> None:
    patch = (SANDBOXES / "fix-median" / "model.patch").read_bytes()
    argv = gitrun.argv("run", str(SANDBOXES / "fix-median"), "--agent", "patch:-", "--run-id",
                       "p1", "-q")  # fmt: skip
    proc = subprocess.run(argv, input=patch, env=gitrun.env(), capture_output=True, timeout=120,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert b"run p1: done" in proc.stdout
    record = json.loads((gitrun.home / "runs" / "p1.json").read_text())
    kept = Path(record["agent"].removeprefix("patch:"))
    assert kept.parent == gitrun.home / "inputs"
    assert kept.read_bytes() == patch
    assert kept.stat().st_mode & 0o777 == 0o600
    again = gitrun("resume", "p1", "-q")
    assert again.code == 0, again.err
    assert "run p1: done" in again.out


@pytest.mark.parametrize(
    ("stdin", "words"),
    [(b"", "the patch on standard input is empty"), (b"  \n", "is empty")],
)
def test_an_empty_patch_on_standard_input_is_one_line_and_exit_2(
    gitrun: Gitrun, stdin: bytes, words: str
) -> None:
    argv = gitrun.argv("run", str(SANDBOXES / "fix-median"), "--agent", "patch:-", "-q")
    proc = subprocess.run(argv, input=stdin, env=gitrun.env(), capture_output=True, timeout=120,
                          check=False)  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert err.startswith("gitrun: ")
    assert len(err.splitlines()) == 1
    assert words in err
    assert not (gitrun.home / "runs").exists() or not list((gitrun.home / "runs").iterdir())


INLINE_PLAN = b"""schema = 1

[[step]]
kind = "write_file"
path = "stats/median.py"
content_file = "patches/x"
"""


def _piped(gitrun: Gitrun, stdin: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(gitrun.argv(*args), input=stdin, env=gitrun.env(), cwd=gitrun.home.parent,
                          capture_output=True, timeout=180, check=False)  # fmt: skip


def test_a_plan_on_standard_input_runs_and_resumes_from_the_kept_copy(gitrun: Gitrun) -> None:
    fixed = (
        (SANDBOXES / "fix-median" / "repo" / "stats" / "median.py")
        .read_text()
        .replace("\n    return data[mid]\n", "\n    return (data[mid - 1] + data[mid]) / 2\n")
    )
    plan = (
        'schema = 1\n\n[[step]]\nkind = "write_file"\npath = "stats/median.py"\n'
        f"content = {json.dumps(fixed)}\n"
    ).encode()
    proc = _piped(gitrun, plan, "run", str(SANDBOXES / "fix-median"), "--agent", "plan:-",
                  "--run-id", "pl", "-q")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert b"run pl: done" in proc.stdout
    record = json.loads((gitrun.home / "runs" / "pl.json").read_text())
    kept = Path(record["agent"].removeprefix("plan:"))
    assert kept.parent.parent == gitrun.home / "inputs"
    assert kept.read_bytes() == plan
    assert kept.stat().st_mode & 0o777 == 0o600
    again = gitrun("resume", "pl", "-q")
    assert again.code == 0, again.err


def test_a_plan_on_standard_input_that_names_a_file_is_one_line_and_exit_2(gitrun: Gitrun) -> None:
    proc = _piped(gitrun, INLINE_PLAN, "run", str(SANDBOXES / "fix-median"), "--agent", "plan:-")
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert len(err.splitlines()) == 1
    assert "--agent plan:-: step[0] names content_file" in err
    assert not (gitrun.home / "runs").exists() or not list((gitrun.home / "runs").iterdir())


def test_trust_roots_on_standard_input_serve_run_approve_and_resume(
    gitrun: Gitrun, keys: Keys
) -> None:
    roots = keys.roots.read_bytes()
    task = str(SANDBOXES / "retire-legacy")
    frozen = _piped(gitrun, roots, "run", task, "--run-id", "ap", "-q", "--trust-roots", "-")
    assert frozen.returncode == 3, frozen.stderr
    approved = _piped(gitrun, roots, "approve", "ap", "--key", str(keys["alice"]),
                      "--trust-roots", "-")  # fmt: skip
    assert approved.returncode == 0, approved.stderr
    done = _piped(gitrun, roots, "resume", "ap", "-q", "--trust-roots", "-")
    assert done.returncode == 0, done.stderr
    assert b"run ap: done" in done.stdout
    empty = _piped(gitrun, b"", "resume", "ap", "--trust-roots", "-")
    assert empty.returncode == 2
    assert "--trust-roots -: the trust roots on standard input are empty" in empty.stderr.decode()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", str(SANDBOXES / "fix-median"), "--key-file", "-"], "--key-file -: the checkpoint"),
        (["status", "r", "--key-file", "-"], "--key-file -: the checkpoint keyring"),
        (["keys", "new", "bob", "--role", "approver", "--trust-roots", "-"], "keys new adds"),
        (
            ["session", str(SANDBOXES / "fix-median"), "--trust-roots", "-"],
            "the session's requests",
        ),
    ],
)
def test_a_dash_for_a_file_gitrun_writes_or_while_stdin_is_taken_is_refused_by_name(
    gitrun: Gitrun, args: list[str], words: str
) -> None:
    proc = _piped(gitrun, b"{}", *args)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.startswith("gitrun: ")
    assert len(err.splitlines()) == 1
    assert words in err
    assert not (gitrun.home.parent / "-").exists()  # no file named "-" made


@pytest.fixture
def world(tmp_path: Path) -> Path:
    make_repos(tmp_path / "repos")
    shutil.copy(BUNDLE / "specs.json", tmp_path / "repos" / "gitrun-swebench.json")
    return tmp_path


@pytest.mark.parametrize("which", ["--dataset", "--predictions"])
def test_swebench_reads_its_dataset_or_predictions_from_standard_input(
    gitrun: Gitrun, world: Path, which: str
) -> None:
    """Empty-patch predictions: the batch reads both files and runs nothing (fast)."""
    files = {"--dataset": BUNDLE / "instances.jsonl", "--predictions": BUNDLE / "preds-empty.jsonl"}
    args = [x for k, v in files.items() for x in (k, "-" if k == which else str(v))]
    argv = gitrun.argv("swebench", *args, "--repos", str(world / "repos"), "--run-id", "b",
                       "--report-dir", str(world / "out"), "--json")  # fmt: skip
    # the environment cache may not lie under /tmp (the sandbox replaces it): /var/tmp
    with tempfile.TemporaryDirectory(prefix="gitrun-habits-envs-", dir="/var/tmp") as envs:
        env = {**gitrun.env(), "GITRUN_SWEBENCH_ENVS": envs}
        proc = subprocess.run(argv, input=files[which].read_bytes(), env=env,
                              capture_output=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["empty_patch_instances"] == 2
    assert report["submitted_instances"] == 2


def test_swebench_writes_its_page_even_when_its_output_reader_is_gone(
    gitrun: Gitrun, world: Path
) -> None:
    page = world / "b.html"
    with tempfile.TemporaryDirectory(prefix="gitrun-habits-envs-", dir="/var/tmp") as envs:
        proc = _closed_stdout(gitrun, "swebench", "--dataset", str(BUNDLE / "instances.jsonl"),
                              "--predictions", str(BUNDLE / "preds-empty.jsonl"), "--repos",
                              str(world / "repos"), "--run-id", "b", "--report-dir",
                              str(world / "out"), "--html", str(page),
                              GITRUN_SWEBENCH_ENVS=envs)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "gitrun: " not in proc.stderr  # the progress lines only: no error line
    assert "empty <b>2</b>" in page.read_text()


def test_standard_input_named_twice_is_refused_by_name(gitrun: Gitrun, world: Path) -> None:
    argv = gitrun.argv("swebench", "--dataset", "-", "--predictions", "-", "--repos",
                       str(world / "repos"), "--run-id", "b")  # fmt: skip
    data = (BUNDLE / "instances.jsonl").read_bytes()
    proc = subprocess.run(argv, input=data, env=gitrun.env(), capture_output=True, timeout=120,
                          check=False)  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert len(err.splitlines()) == 1
    assert "--predictions -: standard input is already read for --dataset" in err


# Typer's own switch that makes --install-completion/--show-completion take the shell's
# name instead of detecting it from the process tree (which differs under CI).
NAMED_SHELL = {"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}


def test_show_completion_prints_a_bash_script_that_completes_commands(gitrun: Gitrun) -> None:
    shown = gitrun.run(["--show-completion", "bash"], NAMED_SHELL)
    assert shown.code == 0, shown.err
    assert "_GITRUN_COMPLETE=complete_bash" in shown.out
    complete = {"_GITRUN_COMPLETE": "complete_bash", "COMP_WORDS": "gitrun sta", "COMP_CWORD": "1"}
    asked = gitrun.run([], complete)
    assert asked.code == 0, asked.err
    assert asked.out.split() == ["status"]
    options = gitrun.run([], {**complete, "COMP_WORDS": "gitrun log --js", "COMP_CWORD": "2"})
    assert options.out.split() == ["--json"]


def test_install_completion_adds_the_script_to_the_users_bash_setup(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    home = Path(os.environ["HOME"])
    home.mkdir(parents=True, exist_ok=True)
    res = gitrun.run(["--install-completion", "bash"], NAMED_SHELL)
    assert res.code == 0, res.err
    bashrc = (home / ".bashrc").read_text()
    script = home / ".bash_completions" / "gitrun.sh"
    assert str(script) in bashrc or ".bash_completions/gitrun.sh" in bashrc
    assert "_GITRUN_COMPLETE" in script.read_text()


def test_show_completion_for_zsh_is_zshs_script(gitrun: Gitrun) -> None:
    shown = gitrun.run(["--show-completion", "zsh"], NAMED_SHELL)
    assert shown.code == 0, shown.err
    assert "#compdef gitrun" in shown.out
