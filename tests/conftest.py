"""Shared fixtures: hermetic git, a private workspace per test, the CLI as a real process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

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


def scrub_env(mp: pytest.MonkeyPatch, home: Path) -> None:
    """No user or system git config leaks in; a fixed identity for the git CLI."""
    for name in list(os.environ):
        if name.startswith(("GIT_", "GITRUN_")):
            mp.delenv(name)
    home.mkdir(parents=True, exist_ok=True)
    mp.setenv("HOME", str(home))
    mp.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    mp.setenv("GIT_CONFIG_NOSYSTEM", "1")
    mp.setenv("GIT_AUTHOR_NAME", "Test")
    mp.setenv("GIT_AUTHOR_EMAIL", "test@example.invalid")
    mp.setenv("GIT_COMMITTER_NAME", "Test")
    mp.setenv("GIT_COMMITTER_EMAIL", "test@example.invalid")
    # The sandboxes' verifier runs pytest: plugins installed beside gitrun for other
    # purposes (benchmark peers bring some) must not slow every verifier run down.
    mp.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(autouse=True)
def hermetic_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test: a private HOME and no git configuration from outside."""
    scrub_env(monkeypatch, tmp_path / "home")


def relocate_workspace(src: Path, dest: Path) -> None:
    """Copy a workspace; rewrite the absolute paths git and the registry keep of it."""
    shutil.copytree(src, dest, symlinks=True)
    old, new = str(src).encode(), str(dest).encode()
    for path in dest.rglob("*"):
        if not path.is_file() or path.is_symlink() or "objects" in path.parts:
            continue
        data = path.read_bytes()
        if old in data:
            path.write_bytes(data.replace(old, new))


@dataclass
class Result:
    code: int
    out: str
    err: str


@dataclass
class Gitrun:
    """Runs the real CLI in a subprocess against one private workspace."""

    home: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["GITRUN_HOME"] = str(self.home)
        env.update(extra)
        return env

    def argv(self, *args: str) -> list[str]:
        # Under `python -O -m pytest` the CLI runs optimised too: no assert may guard it.
        optimise = ["-O"] if sys.flags.optimize else []
        return [sys.executable, *optimise, "-m", "gitrun", *args]

    def __call__(self, *args: str, timeout: float = 120, **extra: str) -> Result:
        proc = subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            env=self.env(**extra),
            timeout=timeout,
            check=False,
            cwd=self.home.parent,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def popen(self, *args: str, **extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(**extra),
            cwd=self.home.parent,
        )

    def repo(self, task_id: str) -> Path:
        return self.home / "repos" / task_id


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


def git(repo: Path, *args: str, check: bool = True) -> str:
    """The real git CLI."""
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout


def snapshot(repo: Path) -> tuple[str, frozenset[str]]:
    """Every ref with its value, and every object file: to prove nothing changed."""
    refs = git(repo, "for-each-ref", "--format=%(refname) %(objectname)")
    common = Path(git(repo, "rev-parse", "--git-common-dir").strip())
    if not common.is_absolute():
        common = repo / common
    objects = frozenset(
        str(p.relative_to(common)) for p in (common / "objects").rglob("*") if p.is_file()
    )
    return refs, objects
