"""Shared fixtures: hermetic git, a private workspace per test, the CLI as a real process,
session-wide signing keys and template runs, process reaping. Their building blocks (and
the names tests import from here) live in helpers.py."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import (
    Gitrun,
    Keys,
    Result,
    Templates,
    git,
    make_keys,
    reap_all,
    relocate_workspace,
    scrub_env,
    snapshot,
)
from remote_helpers import git_daemon

# What test modules import from here (most of it made in helpers.py).
__all__ = [
    "RISKY_SANDBOXES",
    "ROOT",
    "SANDBOXES",
    "SANDBOX_NAMES",
    "Gitrun",
    "Result",
    "git",
    "git_daemon",
    "relocate_workspace",
    "scrub_env",
    "snapshot",
]

ROOT = Path(__file__).resolve().parent.parent
SANDBOXES = ROOT / "sandboxes"
_ALL = sorted(p.name for p in SANDBOXES.iterdir() if (p / "task.toml").is_file())
# Sandboxes whose policy has risk rules stop for a human's approval; the rest run unattended.
RISKY_SANDBOXES = [
    n for n in _ALL if "[[policy.risk]]" in (SANDBOXES / n / "task.toml").read_text()
]
SANDBOX_NAMES = [n for n in _ALL if n not in RISKY_SANDBOXES]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long soak variants")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow soak variant: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def hermetic_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test: a private HOME and no git configuration from outside."""
    scrub_env(monkeypatch, tmp_path / "home")


@pytest.fixture
def gitrun(tmp_path: Path) -> Gitrun:
    home = tmp_path / "gitrun-home"
    home.mkdir()
    return Gitrun(home)


@pytest.fixture
def sandbox_copy(tmp_path: Path) -> Callable[[str], Path]:
    """Copy a bundled sandbox somewhere a test may edit it."""

    def copy(name: str) -> Path:
        dest = tmp_path / "tasks" / name
        shutil.copytree(SANDBOXES / name, dest)
        return dest

    return copy


@pytest.fixture
def reap() -> Iterator[list[subprocess.Popen[str]]]:
    """Every process a test starts; teardown wakes, kills and reaps the leftovers."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    reap_all(procs)


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    """alice (approver) and bob (reviewer) trusted; mallory and eve in other roots. Read only."""
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Templates:
    """Template runs made once a session; a test works on ``template.copy(tmp_path / ...)``."""
    return Templates(tmp_path_factory.mktemp("templates"))
