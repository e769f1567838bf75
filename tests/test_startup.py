"""The fast entry (``gitrun --help``, ``gitrun status RUN``) answers exactly as the Typer
app does, without loading Typer, rich or cryptography: hooks start gitrun once per agent
tool call. Timing lives in benchmarks/bench_startup.py, not here."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator

import pytest
from conftest import ROOT, SANDBOXES, scrub_env

TYPER_PATH = "import sys; from gitrun.cli import main; main(sys.argv[1:])"
HEAVY = ("typer", "rich", "click", "cryptography", "filelock")
LOADED = """
import runpy, sys
sys.argv = ["gitrun", *sys.argv[1:]]
try:
    runpy.run_module("gitrun", run_name="__main__")
except SystemExit:
    pass
print(sorted({m.split(".")[0] for m in sys.modules} & set(%r)), file=sys.stderr)
"""


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=60, check=False, cwd=ROOT
    )


def both(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    """The same command line through ``python -m gitrun`` and through the Typer app."""
    entry = _run([sys.executable, "-m", "gitrun", *args], env)
    typer = _run([sys.executable, "-c", TYPER_PATH, *args], env)
    return entry, typer


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of a workspace holding one real run driven to done."""
    tmp = tmp_path_factory.mktemp("startup")
    with pytest.MonkeyPatch.context() as mp:
        scrub_env(mp, tmp / "home")
        env = {**os.environ, "GITRUN_HOME": str(tmp / "ws"), "COLUMNS": "80"}
        task = str(SANDBOXES / "fix-median")
        done = _run([sys.executable, "-m", "gitrun", "run", task, "--run-id", "r1", "-q"], env)
        assert done.returncode == 0, done.stderr
        yield env


@pytest.mark.parametrize("columns", ["80", "59", "58", "57", "132"])
def test_help_is_the_typer_apps_help_byte_for_byte(finished: dict[str, str], columns: str) -> None:
    entry, typer = both({**finished, "COLUMNS": columns}, "--help")
    assert (entry.returncode, typer.returncode) == (0, 0)
    assert entry.stdout == typer.stdout
    assert entry.stderr == typer.stderr == ""


def test_help_lists_every_command_of_the_typer_app_with_its_summary() -> None:
    from gitrun import entry
    from gitrun.cli import app

    command = __import__("typer").main.get_command(app)
    listed = {name: " ".join((cmd.help or "").split()) for name, cmd in command.commands.items()}
    assert dict(entry.COMMANDS) == listed
    assert command.help == entry.DESCRIPTION


@pytest.mark.parametrize(
    "args",
    [
        ["status", "r1"],
        ["status", "r1", "--json"],
        ["status", "--json", "r1"],
        ["status", "r1", "--workspace", "{ws}"],
        ["status", "--workspace={ws}", "r1", "--json"],
    ],
)
def test_status_of_a_finished_run_is_the_typer_apps_output(
    finished: dict[str, str], args: list[str]
) -> None:
    args = [a.format(ws=finished["GITRUN_HOME"]) for a in args]
    entry, typer = both(finished, *args)
    assert (entry.returncode, typer.returncode) == (0, 0)
    assert entry.stdout == typer.stdout
    assert "phase      done" in entry.stdout or '"phase": "done"' in entry.stdout
    assert entry.stderr == typer.stderr == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["status", "nope"], "unknown run id 'nope'"),
        (["status", "../x", "--json"], "run id '../x' is not valid"),
        (["status", "r1", "--workspace"], "--workspace"),
        (["status", "r1", "r2"], "r2"),
        (["status", "r1", "--bogus"], "--bogus"),
    ],
)
def test_status_errors_are_the_typer_apps_one_line_and_exit_2(
    finished: dict[str, str], args: list[str], needle: str
) -> None:
    entry, typer = both(finished, *args)
    assert (entry.returncode, typer.returncode) == (2, 2)
    assert entry.stderr == typer.stderr
    assert entry.stderr.startswith("gitrun: ")
    assert len(entry.stderr.splitlines()) == 1
    assert needle in entry.stderr
    assert entry.stdout == typer.stdout == ""


@pytest.mark.parametrize(
    "args", [["--help"], ["--version"], ["status", "r1"], ["status", "r1", "--json"]]
)
def test_help_and_status_load_no_typer_rich_or_cryptography(
    finished: dict[str, str], args: list[str]
) -> None:
    proc = _run([sys.executable, "-c", LOADED % (HEAVY,), *args], finished)
    assert proc.stderr.splitlines()[-1] == "[]"


def test_help_loads_no_pygit2(finished: dict[str, str]) -> None:
    proc = _run([sys.executable, "-c", LOADED % (("pygit2",),), "--help"], finished)
    assert proc.stderr.splitlines()[-1] == "[]"


def test_the_installed_gitrun_command_and_python_m_gitrun_start_at_the_fast_entry() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gitrun"] == "gitrun.entry:main"
    assert "from gitrun.entry import main" in (ROOT / "gitrun" / "__main__.py").read_text()


def test_every_other_command_still_goes_through_the_typer_app(finished: dict[str, str]) -> None:
    entry, typer = both(finished, "receipts", "r1")
    assert (entry.returncode, entry.stdout) == (typer.returncode, typer.stdout)
    assert entry.returncode == 0
    assert "apply_patch" in entry.stdout
    entry, typer = both(finished, "status", "--help")
    assert (entry.returncode, entry.stdout) == (0, typer.stdout)
