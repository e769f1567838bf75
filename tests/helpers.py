"""The suite's building blocks, once: the hermetic environment, the CLI as a process,
template runs and their relocated copies, signing keys, and reaping child processes.

conftest.py turns these into fixtures (and re-exports the names tests import from it);
test modules build their module-specific templates from them.
"""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pygit2
import pytest
import spawn

from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.codec import decode
from gitrun.core.records import RunState
from gitrun.engine.approvals import inbox_ref, submit
from gitrun.store import gitstore
from gitrun.store.evidence import Signed, new_keypair

# Every CLI child runs optimised too when the suite does, so `if … raise` is what holds.
CLI_ENV = {"PYTHONOPTIMIZE": "1"} if sys.flags.optimize else {}
_OUTSIDE = ("GIT_", "GITRUN_")  # variables from outside that would reach git or gitrun
# The caller's terminal shape: xdist workers get COLUMNS=80 and LINES=24, and `review show`
# lays its diffs out to COLUMNS, so a test would see another layout under -n than without.
_TERMINAL = ("COLUMNS", "LINES")

# -- the hermetic environment ------------------------------------------------------------


def hermetic_vars(home: Path) -> dict[str, str]:
    """A private HOME (made), no system git config, a fixed identity for the git CLI."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "Test",
        "GIT_AUTHOR_EMAIL": "test@example.invalid",
        "GIT_COMMITTER_NAME": "Test",
        "GIT_COMMITTER_EMAIL": "test@example.invalid",
        # The sandboxes' verifier runs pytest: plugins installed beside gitrun for other
        # purposes (benchmark peers bring some) must not slow every verifier run down.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


def scrub_env(mp: pytest.MonkeyPatch, home: Path) -> None:
    """This process: no user or system git config leaks in; the hermetic variables set."""
    for name in list(os.environ):
        if name.startswith(_OUTSIDE) or name in _TERMINAL:
            mp.delenv(name)
    for name, value in hermetic_vars(home).items():
        mp.setenv(name, value)


def hermetic_env(home: Path, **extra: str) -> dict[str, str]:
    """The same hermetic environment as a dict, for children of shared (threaded) fixtures."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTSIDE) and k not in _TERMINAL}
    return {**env, **hermetic_vars(home), **extra}


@contextlib.contextmanager
def hermetic(home: Path) -> Iterator[None]:
    """The hermetic environment (HOME at ``home``) for a module- or session-scoped fixture."""
    with pytest.MonkeyPatch.context() as mp:
        scrub_env(mp, home)
        yield


def compile_gitrun() -> None:
    """Byte-compile gitrun once (every -O level the suite runs its CLI at), so the thousands
    of CLI processes the suite starts read it compiled even where PYTHONDONTWRITEBYTECODE
    forbids them to write it: about a fifth of a CLI call's CPU time."""
    root = Path(__file__).resolve().parent.parent / "gitrun"
    for level in sorted({0, sys.flags.optimize}):
        compileall.compile_dir(root, quiet=1, optimize=level)


# -- git and the CLI as real processes ---------------------------------------------------


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
    # gitrun's stage holds the objects it wrote that no ref names yet: they count too.
    stores = [common / "objects", common / "gitrun" / "stage"]
    objects = frozenset(
        str(p.relative_to(common)) for d in stores for p in d.rglob("*") if p.is_file()
    )
    return refs, objects


@dataclass
class Result:
    code: int
    out: str
    err: str


@dataclass
class Gitrun:
    """Runs the real CLI in a subprocess against one private workspace (forked from the
    worker's fork server where that gives the same process: tests/spawn.py)."""

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

    def __call__(self, *args: str, **extra: str) -> Result:
        """``gitrun ARGS`` with the environment variables ``extra``; two minutes at most."""
        return self.run(args, extra)

    def run(
        self, args: Sequence[str], extra: Mapping[str, str] | None = None, *, timeout: float = 120
    ) -> Result:
        """``gitrun ARGS`` with the environment variables ``extra``, within ``timeout``."""
        proc = spawn.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            env=self.env(**(extra or {})),
            timeout=timeout,
            check=False,
            cwd=self.home.parent,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def popen(self, *args: str, **extra: str) -> subprocess.Popen[str]:
        return spawn.popen(
            self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(**extra),
            cwd=self.home.parent,
        )

    def repo(self, task_id: str) -> Path:
        return self.home / "repos" / task_id


def one_line(err: str) -> str:
    """A refusal is one line on stderr, never a traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gitrun: "), err
    return lines[0]


def reap_all(procs: Iterable[subprocess.Popen[str]]) -> None:
    """Wake (a test may have SIGSTOPped it), kill and reap every process still running."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        proc.communicate(timeout=30)


# The real CLI, stopped at one named fault point: it writes its pid to a marker file
# there and waits for a "go" file, so a test can SIGSTOP it at a known place in the step
# protocol and let it carry on later. argv: pause_at marker go <gitrun args...>
PAUSING_WORKER = """
import os, sys, time
from gitrun import cli
from gitrun.core import faults

pause_at, marker, go = sys.argv[1:4]
real_point = faults.point

def point(name):
    if name == pause_at and not os.path.exists(marker):
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
        while not os.path.exists(go):
            time.sleep(0.02)
    real_point(name)

faults.point = point
cli.main(sys.argv[4:])
"""

# -- templates: a run made once, copied per test -----------------------------------------


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


@dataclass(frozen=True)
class Template:
    """A workspace (``home``) holding one run, made once; tests work on relocated copies."""

    home: Path
    run_id: str
    task_dir: Path  # the task the run was started from
    run: Result  # what `gitrun run` said

    def copy(self, dest: Path) -> Path:
        relocate_workspace(self.home, dest)
        return dest


def make_run(base: Path, task: Path, run_id: str, expect: int, **env: str) -> Template:
    """`gitrun run TASK --run-id RUN_ID` in a new workspace ``base/home`` (a hermetic user
    at ``base/user``); it must exit ``expect``."""
    home = base / "home"
    home.mkdir(parents=True)
    with hermetic(base / "user"):
        res = Gitrun(home)("run", str(task), "--run-id", run_id, **CLI_ENV, **env)
    assert res.code == expect, (res.code, res.err)
    return Template(home, run_id, task, res)


@dataclass
class Templates:
    """Session-wide template runs, each made once on first use (tests copy, never edit)."""

    root: Path
    made: dict[tuple[str, str, int], Template] = field(default_factory=dict)

    def run(self, task: Path, run_id: str, expect: int) -> Template:
        key = (str(task), run_id, expect)
        if key not in self.made:
            self.made[key] = make_run(self.root / f"{task.name}-{run_id}", task, run_id, expect)
        return self.made[key]


# -- signing keys ------------------------------------------------------------------------

# (name, role, trusted): the trusted are in Keys.roots; the others in Keys.other_roots.
PEOPLE = (
    ("alice", "approver", True),
    ("bob", "reviewer", True),
    ("mallory", "approver", False),
    ("eve", "reviewer", False),
)


@dataclass(frozen=True)
class Keys:
    """alice approves and bob reviews (both trusted); mallory approves and eve reviews in
    another trust root. ``keys["alice"]`` is alice's private key file."""

    dir: Path
    roots: Path
    other_roots: Path

    def __getitem__(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def make_keys(base: Path) -> Keys:
    """Every key of PEOPLE under ``base``, as `gitrun keys new` makes them (same call)."""
    made = Keys(base / "keys", base / "roots.json", base / "other-roots.json")
    for name, role, trusted in PEOPLE:
        new_keypair(role, name, made.dir, made.roots if trusted else made.other_roots)
    return made


# -- a relocated copy of a run awaiting a human ------------------------------------------


@dataclass
class RunCopy:
    """A private, relocated copy of a template workspace holding run ``RUN`` of ``TASK``;
    ``INBOX`` names the evidence inbox its tests use ("approval" or "review")."""

    home: Path
    keys: Keys

    RUN: ClassVar[str]
    TASK: ClassVar[str]
    INBOX: ClassVar[str]

    @property
    def repo(self) -> Path:
        return self.home / "repos" / self.TASK

    @property
    def worktree(self) -> Path:
        return self.home / "worktrees" / self.RUN

    def cli(self, *args: str, **extra: str) -> Result:
        return Gitrun(self.home)(*args, **CLI_ENV, **extra)

    def resume(self, *extra_args: str, **env: str) -> Result:
        roots = str(self.keys.roots)
        return self.cli("resume", self.RUN, "--trust-roots", roots, *extra_args, **env)

    def opened(self) -> service.Opened:
        return service.open_run(self.RUN, service.Options(Workspace(self.home)))

    def state(self) -> RunState:
        _, stored = service.load_verified(self.opened())
        return stored.state

    def chain(self) -> list[RunState]:
        """Every checkpoint, oldest first."""
        stored = service.checkpoints(self.RUN, service.Options(Workspace(self.home)))
        return [s.state for s in reversed(stored)]

    def checkpoint_tip(self) -> str:
        ref, _ = service.load_verified(self.opened())
        return git(self.repo, "rev-parse", ref).strip()

    def branch_tip(self) -> str:
        return git(self.repo, "rev-parse", f"refs/heads/gitrun/{self.RUN}").strip()

    def tips(self) -> tuple[str, str]:
        return self.checkpoint_tip(), self.branch_tip()

    def keys_in_history(self) -> list[str]:
        fmt = "%(trailers:key=Gitrun-Idempotency-Key,valueonly)"
        out = git(self.repo, "log", f"--format={fmt}", f"gitrun/{self.RUN}")
        return [line for line in out.splitlines() if line.strip()]

    def inbox(self) -> Signed | None:
        repo = gitstore.open_repo(self.repo)
        oid = gitstore.read_ref(repo, inbox_ref(self.RUN, self.INBOX))
        if oid is None:
            return None
        blob = repo[oid]
        assert isinstance(blob, pygit2.Blob)
        return decode(Signed, json.loads(blob.data))

    def submit(self, evidence: Signed) -> None:
        submit(gitstore.open_repo(self.repo), self.RUN, self.INBOX, evidence)


def stopped(pid: int) -> bool:
    """The process ``pid`` is stopped (SIGSTOP: state T in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["T"]
