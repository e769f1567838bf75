"""Every git command docs/reading-with-git.md shows works as printed on a real run: it
exits 0 and prints what the doc says it shows (the README copies its lines from there)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, SANDBOXES, scrub_env

DOC = ROOT / "docs" / "reading-with-git.md"
RUNS = {"fix-1": "fix-median", "ren-1": "rename-api"}
# What each command must print, matched against the command's text (the first key found).
EXPECT = {
    "key=Gitrun-Tool": "Gitrun-Idempotency-Key: k-",  # a tool step's adds Gitrun-Tool
    "%(trailers)": "Gitrun-Idempotency-Key: k-",
    "Gitrun-Idempotency-Key,valueonly": "k-",
    "interpret-trailers": "Gitrun-Intent-Digest: sha256:",
    "for-each-ref --format": "refs/gitrun/runs/fix-1/checkpoints/fix-median/",
    "for-each-ref": "refs/gitrun/runs/fix-1/receipts/",
    "ls-tree": "\tstdout",
    ":stdout": "",
    ":stderr": "",
    "log --oneline --glob": "gitrun checkpoint g=",
    "log -1 --format=%B --glob": "gitrun checkpoint g=",
    "verify-commit": 'Good "git" signature for gitrun-checkpoint with ED25519 key SHA256:',
    "--show-signature": 'Good "git" signature',
    "export-allowed-signers": "wrote 1 checkpoint key to allowed_signers",
}


def doc_commands(doc: Path = DOC) -> list[str]:
    """The lines of a document's ``sh`` blocks, in order."""
    blocks = re.findall(r"^```sh\n(.*?)^```", doc.read_text(), re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def readme_git_commands() -> list[str]:
    """The ``git`` lines of the README's section on reading receipts with plain git."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Reading receipts with plain git", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("git ")]


def readme_every_git_command() -> list[str]:
    """Every ``git`` line of every code block in the README, whatever its section."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("git ")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Path]]:
    """Real runs named as in the doc, driven to done; the environment and the repos' root."""
    tmp = tmp_path_factory.mktemp("reading")
    with pytest.MonkeyPatch.context() as mp:
        scrub_env(mp, tmp / "home")
        bindir = tmp / "bin"
        bindir.mkdir()
        gitrun = bindir / "gitrun"
        gitrun.write_text(f'#!/bin/sh\nexec {sys.executable} -m gitrun "$@"\n')
        gitrun.chmod(0o755)
        env = {
            **os.environ,
            "GITRUN_HOME": str(tmp / "ws"),
            "PATH": f"{bindir}:{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT),
        }
        for run_id, task in RUNS.items():
            done = subprocess.run(
                ["gitrun", "run", str(SANDBOXES / task), "--run-id", run_id, "-q"],
                env=env, capture_output=True, text=True, timeout=180, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            # as the doc's export step (itself a test below) writes it, so the commands
            # after it pass on their own
            subprocess.run(["gitrun", "keys", "export-allowed-signers", "allowed_signers"],
                           cwd=tmp / "ws" / "repos" / task, env=env, check=True, timeout=60,
                           capture_output=True)  # fmt: skip
        yield env, tmp / "ws" / "repos"


def test_the_doc_shows_commands_for_receipts_outputs_and_checkpoints() -> None:
    commands = doc_commands()
    assert len(commands) >= 6
    for needle in ("%(trailers)", ":stdout", "--glob="):
        assert any(needle in c for c in commands), needle


def test_the_readme_shows_only_git_commands_the_doc_runs() -> None:
    shown = readme_git_commands()
    assert len(shown) >= 4
    assert [c for c in shown if c not in doc_commands()] == []


@pytest.mark.parametrize("command", doc_commands())
def test_each_git_command_in_the_doc_works_as_printed(
    runs: tuple[dict[str, str], Path], command: str
) -> None:
    env, repos = runs
    run_id = next((r for r in RUNS if r in command), "fix-1")
    repo = repos / RUNS[run_id]
    proc = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, f"{command}\n{proc.stderr}"
    shown = proc.stdout + proc.stderr
    assert shown.strip() or ":std" in command, f"{command} printed nothing"
    expected = next(v for k, v in EXPECT.items() if k in command)
    assert expected in shown, f"{command}\n{shown}"


def test_the_readme_shows_git_commands_for_receipts_and_checkpoints() -> None:
    shown = readme_every_git_command()
    for needle in ("%(trailers)", "--glob=", "verify-commit", "for-each-ref"):
        assert any(needle in c for c in shown), needle


@pytest.mark.parametrize("command", readme_every_git_command())
def test_each_git_command_in_the_readme_works_as_printed(
    runs: tuple[dict[str, str], Path], command: str
) -> None:
    """As printed, a placeholder (``<run>``) filled in with a real run's id."""
    env, repos = runs
    filled = command.replace("<run>", "fix-1").replace("<run_id>", "fix-1")
    run_id = next((r for r in RUNS if r in filled), "fix-1")
    proc = subprocess.run(["bash", "-c", filled], cwd=repos / RUNS[run_id], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, f"{filled}\n{proc.stderr}"
    expected = next(v for k, v in EXPECT.items() if k in filled)
    assert expected in proc.stdout + proc.stderr, f"{filled}\n{proc.stdout}{proc.stderr}"


def test_a_bare_star_in_a_ref_name_prints_nothing_which_is_why_the_doc_uses_glob(
    runs: tuple[dict[str, str], Path],
) -> None:
    env, repos = runs
    cmd = "git log --oneline refs/gitrun/runs/fix-1/checkpoints/*/*"
    proc = subprocess.run(["bash", "-c", cmd], cwd=repos / "fix-median", env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.stdout == ""
