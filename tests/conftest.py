"""Shared fixtures: hermetic git, a private workspace per test, the CLI as a real process,
session-wide signing keys and template runs, process reaping. Their building blocks (and
the names tests import from here) live in helpers.py.

The suite runs in parallel (pytest-xdist): what a test must do to be parallel-safe, and
how tests that share a module-scoped fixture stay on one worker, is in parallel.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import parallel
import pytest
from helpers import (
    Gitrun,
    Keys,
    Result,
    Templates,
    compile_gitrun,
    git,
    make_keys,
    reap_all,
    relocate_workspace,
    scrub_env,
    snapshot,
)
from remote_helpers import git_daemon
from swebench_data import BUNDLE, make_repos

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
    parser.addoption(
        "--screenshots", default=None, help="write the HTML report tests' screenshots here"
    )


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, before any worker starts
        compile_gitrun()
    parallel.optimise_workers(config)
    parallel.check_worker(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    parallel.cleanup()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: twice the CPUs (at least 2, at most 8): most tests wait on their child
    processes, fsync and sleeps, so more workers than cores keep the cores busy.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it."""
    forced = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if forced:
        return int(forced)
    return max(2, min(8, 2 * len(os.sched_getaffinity(0))))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    parallel.configure_node(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N`` (xdist's ``--dist load``): our groups-aware scheduler (parallel.py)."""
    if config.getvalue("dist") in ("load", "loadgroup"):
        return parallel.GroupScheduling(config, log)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    parallel.mark_shared_fixture_groups(config, items)
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


@pytest.fixture(scope="module")
def envs() -> Iterator[Path]:
    """One SWE-bench environment cache per test module (each venv built once, as in real
    use), outside /tmp: the verifier's sandbox replaces /tmp by an empty tmpfs."""
    path = Path(tempfile.mkdtemp(prefix="gitrun-swebench-envs-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def world(tmp_path: Path, envs: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The bundled SWE-bench repositories under tmp/repos (base commits as bundled), the
    bundled spec file beside them, and the module's environment cache."""
    make_repos(tmp_path / "repos")
    shutil.copy(BUNDLE / "specs.json", tmp_path / "repos" / "gitrun-swebench.json")
    monkeypatch.setenv("GITRUN_SWEBENCH_ENVS", str(envs))
    return tmp_path
