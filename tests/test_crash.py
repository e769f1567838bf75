"""Crash-safe resume, proven by killing real ``gitrun`` processes with SIGKILL.

Two families of tests drive the real CLI in subprocesses:

* the crash matrix: every named crash point (:data:`gitrun.core.faults.POINTS`) in every
  bundled sandbox (``GITRUN_CRASH_AT=<point>``), and every pass of every point
  (``<point>:<nth>``) in the sandbox that writes most, then ``gitrun resume``;
* random kills: ``gitrun run`` killed with SIGKILL after a random delay, then
  ``gitrun resume`` killed at random too until one finishes on its own (after a few
  kills the last resume is left alone, so every run ends).

After each, the run must end exactly like an uninterrupted run of the same sandbox
(``done``, or frozen at the same approval for a sandbox that needs a human): every
idempotency key once in the branch history (so the adapter wrote each key once); as many
write commits as the plan has steps the gate lets through; every intent key persisted
before the crash reused, never replaced; the same final tree; ``git fsck --strict``
clean; ``gitrun status`` and the worktree clean; no ``*.lock`` left behind.

Knobs (environment variables, read at collection):

* ``GITRUN_RANDOM_KILLS=N`` — how many random-kill runs the default test makes
  (default 50); the ``slow`` variant makes 500 (``pytest --run-slow -k soak``).
* one random-kill run in three sleeps ``WIDEN_MS`` between a worktree temp file's write
  and its rename (``GITRUN_DELAY_AT``), so that window — microseconds wide, hit about
  once in a few hundred kills otherwise — is hit often; the summary line counts the hits.
* ``GITRUN_RANDOM_SEED=S`` — the seed of the kill delays (default 4242), to replay a
  failing sequence.
* ``GITRUN_CRASH_WORKERS=K`` — how many runs go at once (default 2-4 by CPU count).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
import spawn
from conftest import SANDBOXES, Gitrun
from helpers import hermetic_env

from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core import faults
from gitrun.core.errors import GitrunError

SANDBOX_NAMES = sorted(p.name for p in SANDBOXES.iterdir() if (p / "task.toml").is_file())
POINTS = tuple(faults.POINTS)

RANDOM_KILLS = int(os.environ.get("GITRUN_RANDOM_KILLS", "50"))
RANDOM_SEED = int(os.environ.get("GITRUN_RANDOM_SEED", "4242"))
WORKERS = int(os.environ.get("GITRUN_CRASH_WORKERS", "0")) or max(2, min(4, os.cpu_count() or 2))
KILLS_PER_RUN = 4  # then one last resume runs unkilled, so every run ends
WIDEN_MS = 400  # one run in three sleeps this long between a temp file's write and rename
RUN_ID = "crash"
KEYRING = Path("keys/checkpoint.keyring")


# -- the CLI in a hermetic subprocess ---------------------------------------------------


@dataclass(frozen=True)
class Cli:
    """The real ``gitrun`` CLI against one private workspace (``GITRUN_HOME``)."""

    home: Path
    env: dict[str, str]

    @classmethod
    def at(cls, home: Path) -> Cli:
        home.mkdir(parents=True, exist_ok=True)
        user = home.parent / "user-home"
        env = hermetic_env(user, PYTHONDONTWRITEBYTECODE="1", GITRUN_HOME=str(home))
        return cls(home, env)

    def argv(self, *args: str) -> list[str]:
        # Under `python -O -m pytest` the CLI runs optimised too: no runtime check may be
        # an assert (the verifier's own pytest child is not affected).
        optimise = ["-O"] if sys.flags.optimize else []
        return [sys.executable, *optimise, "-m", "gitrun", *args]

    def __call__(
        self, *args: str, crash_at: str = "", timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        env = {**self.env, faults.ENV_VAR: crash_at} if crash_at else self.env
        return spawn.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
            cwd=self.home.parent,
        )

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return spawn.popen(
            self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=self.home.parent,
        )

    def git(self, repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
            timeout=60,
        )

    def repo(self, sandbox: str) -> Path:
        return self.home / "repos" / sandbox

    def record(self, run_id: str) -> dict[str, str]:
        data: dict[str, str] = json.loads((self.home / "runs" / f"{run_id}.json").read_text())
        return data


def killed(code: int) -> bool:
    return code == -signal.SIGKILL


# -- what an uninterrupted run looks like -----------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """An uninterrupted run of one sandbox: its outcome, and how often it passes each point.

    Most sandboxes end ``done``; one that needs a human (an approval) ends frozen, and a
    crashed-and-resumed run must then end frozen in the same place.
    """

    sandbox: str
    cli: Cli
    code: int
    phase: str
    base: str
    tree: str
    writes: int
    pending: bool
    proposals: int
    checkpoints: int
    verified: bool
    seconds: float  # wall time of the uninterrupted run, under this machine's load
    execs: int = 0  # how many of the writes are exec steps (no file sync; a command runs)

    def passes(self, point: str) -> int:  # noqa: PLR0911 - one return per kind of point
        """How often an uninterrupted run reaches ``point`` (docs/design.md §6)."""
        if point.startswith("setup_"):
            return 1  # once per run, before its first checkpoint
        if point == "before_propose":
            return self.proposals + self.verified  # each plan step, then the one that finishes
        if point.startswith(("checkpoint_ref_", "checkpoint_witness_")):
            return self.checkpoints
        if point in ("before_verify", "after_verify"):
            return int(self.verified)
        if point == "after_intent_checkpoint":
            return self.writes + self.pending
        if point in ("exec_running", "exec_done"):
            return self.execs  # exec_running: at least once per command (once per poll)
        if point in ("temp_file_written", "mid_file_sync"):
            return self.writes - self.execs  # an exec's files are on disk before its commit
        return self.writes  # the other write-window points: once per write


def plan_steps(sandbox: str, kind: str | None = None) -> int:
    task = tomllib.loads((SANDBOXES / sandbox / "task.toml").read_text())
    plan = tomllib.loads((SANDBOXES / sandbox / task["agent"]["plan"]).read_text())
    return len([s for s in plan["step"] if kind is None or s["kind"] == kind])


def make_baseline(sandbox: str, home: Path) -> Baseline:
    cli = Cli.at(home)
    started = time.monotonic()
    ran = cli("run", str(SANDBOXES / sandbox), "--run-id", "baseline", "-q")
    seconds = time.monotonic() - started
    assert ran.returncode in (0, 3), ran.stderr  # done, or frozen for a human
    status = cli("status", "baseline", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    base = cli.record("baseline")["base_commit"]
    writes = len(branch_keys(cli, sandbox, base, "baseline"))
    if info["phase"] == "done":
        chain = cli("checkpoints", "baseline").stdout
        assert writes == plan_steps(sandbox) - chain.count("gate_rejected"), chain
    baseline = Baseline(
        sandbox,
        cli,
        ran.returncode,
        info["phase"],
        base,
        tree_of(cli, sandbox, "baseline"),
        writes,
        info["pending"] is not None,
        info["budgets"]["proposals"],
        info["generation"],
        info["verifier"] is not None,
        seconds,
        plan_steps(sandbox, "exec"),
    )
    problems = run_invariants(baseline, "baseline", cli)
    assert not problems, problems
    return baseline


def tree_of(cli: Cli, sandbox: str, run_id: str) -> str:
    out = cli.git(cli.repo(sandbox), "rev-parse", f"refs/heads/gitrun/{run_id}^{{tree}}")
    return out.stdout.strip()


# -- the invariants every crashed-and-resumed run must meet -----------------------------


def branch_keys(cli: Cli, sandbox: str, base: str, run_id: str) -> list[str]:
    """The idempotency key of every commit between the base and the run's branch tip."""
    log = cli.git(
        cli.repo(sandbox),
        "log",
        "--format=%H %(trailers:key=Gitrun-Idempotency-Key,valueonly,separator=%x2C)",
        f"{base}..refs/heads/gitrun/{run_id}",
    )
    assert log.returncode == 0, log.stderr
    return [line.partition(" ")[2].strip() for line in log.stdout.splitlines()]


def fsck_problems(cli: Cli, repo: Path) -> list[str]:
    fsck = cli.git(repo, "fsck", "--strict", "--no-progress")
    lines = (fsck.stdout + fsck.stderr).splitlines()
    bad = [line for line in lines if not line.startswith(("dangling ", "Checking "))]
    if fsck.returncode != 0 or bad:
        return [f"git fsck --strict exit {fsck.returncode}: {bad[:5]}"]
    return []


def lock_files(cli: Cli, sandbox: str) -> list[str]:
    gitdir = cli.repo(sandbox) / ".git"
    return sorted(str(p.relative_to(gitdir)) for p in gitdir.rglob("*.lock"))


def run_invariants(
    baseline: Baseline, run_id: str, cli: Cli, *, fsck: bool = True, announced: tuple[str, ...] = ()
) -> list[str]:
    """Every broken invariant of a finished run, as readable lines (empty: all hold)."""
    problems: list[str] = []
    sandbox = baseline.sandbox
    keys = branch_keys(cli, sandbox, baseline.base, run_id)
    if "" in keys:
        problems.append(f"a commit without an idempotency key is on the branch: {keys}")
    twice = sorted(k for k, n in Counter(keys).items() if n > 1)
    if twice:
        problems.append(f"keys written more than once: {twice}")
    if len(keys) != baseline.writes:
        problems.append(
            f"{len(keys)} write commits, the plan lets {baseline.writes} through: {keys}"
        )
    try:  # in-process: the same call `gitrun status --json` makes, without a new Python
        info = service.status(run_id, service.Options(Workspace(cli.home, cli.home / KEYRING)))
    except GitrunError as exc:
        return [*problems, f"gitrun status: {exc}"]
    pending = info.pending.key if info.pending else None
    if info.phase != baseline.phase or (pending is not None) != baseline.pending:
        problems.append(
            f"status is {info.phase} with pending {pending}, the uninterrupted "
            f"run ended {baseline.phase}"
        )
    receipt_keys = [r.key for r in info.receipts]
    if receipt_keys != list(reversed(keys)):
        problems.append(f"gitrun receipts {receipt_keys} differ from the history {keys}")
    lost = sorted(set(announced) - {*keys, pending})
    if lost:
        problems.append(f"intent keys persisted before the crash but missing after resume: {lost}")
    tree = tree_of(cli, sandbox, run_id)
    if tree != baseline.tree:
        problems.append(f"final tree {tree} is not the uninterrupted run's {baseline.tree}")
    worktree = Path(cli.record(run_id)["worktree"])
    dirty = cli.git(worktree, "status", "--porcelain", "--untracked-files=all").stdout
    if dirty:
        problems.append(f"the worktree is not clean: {dirty.splitlines()[:5]}")
    if fsck:
        problems.extend(fsck_problems(cli, cli.repo(sandbox)))
        locks = lock_files(cli, sandbox)
        if locks:
            problems.append(f"lock files left behind: {locks}")
    return problems


# -- the crash matrix -------------------------------------------------------------------


@dataclass
class CrashCase:
    sandbox: str
    point: str
    nth: int
    reached: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return f"{self.point}:{self.nth}"


INTENT_RE = re.compile(r"intent (k-[0-9a-f]+):")


def crash_and_resume(baseline: Baseline, case: CrashCase, root: Path) -> CrashCase:
    """Run with ``GITRUN_CRASH_AT``, check it died by SIGKILL, resume, check the invariants."""
    cli = Cli.at(root / f"{case.sandbox}-{case.point}-{case.nth}")
    crash = cli("run", str(SANDBOXES / case.sandbox), "--run-id", RUN_ID, crash_at=case.spec)
    case.reached = killed(crash.returncode)
    if not case.reached and case.nth <= baseline.passes(case.point):
        case.problems.append(
            f"not killed (exit {crash.returncode}), yet an uninterrupted run passes the "
            f"point {baseline.passes(case.point)} times"
        )
    if not case.reached and crash.returncode != baseline.code:
        case.problems.append(
            f"run exit {crash.returncode}, neither SIGKILL nor the uninterrupted "
            f"run's {baseline.code}: {crash.stderr[-800:]}"
        )
    if case.problems:
        return case
    if case.reached:
        # Killed before it was registered: nothing to resume, and nothing that blocks
        # running it again.
        registered = (cli.home / "runs" / f"{RUN_ID}.json").exists()
        again = ["resume", RUN_ID] if registered else ["run", str(SANDBOXES / case.sandbox)]
        resumed = cli(*again, *([] if registered else ["--run-id", RUN_ID]), "-q")
        if resumed.returncode != baseline.code:
            case.problems.append(
                f"resume exit {resumed.returncode}, not {baseline.code}: "
                f"{resumed.stdout} {resumed.stderr[-800:]}"
            )
            return case
    announced = tuple(INTENT_RE.findall(crash.stderr))
    case.problems.extend(run_invariants(baseline, RUN_ID, cli, announced=announced))
    return case


@dataclass
class Matrix:
    baselines: dict[str, Baseline]
    widest: Baseline  # the sandbox every pass of every point is crashed in
    cases: list[CrashCase]

    def of(self, sandbox: str, point: str) -> list[CrashCase]:
        return [c for c in self.cases if c.sandbox == sandbox and c.point == point]


T = TypeVar("T")
R = TypeVar("R")


def parallel(work: Callable[[T], R], items: list[T]) -> Iterator[R]:
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        yield from pool.map(work, items)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Baseline]:
    root = tmp_path_factory.mktemp("baselines")
    made = parallel(lambda s: make_baseline(s, root / s), list(SANDBOX_NAMES))
    return {b.sandbox: b for b in made}


@pytest.fixture(scope="module")
def matrix(baselines: dict[str, Baseline], tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    """Every crash point in every sandbox (first pass), and every pass of every point in
    the sandbox that writes most; run once for the module, several at a time."""
    root = tmp_path_factory.mktemp("crashes")
    widest = max(baselines.values(), key=lambda b: (b.writes, b.checkpoints))
    cases = [
        CrashCase(sandbox, point, nth)
        for sandbox, baseline in baselines.items()
        for point in POINTS
        for nth in range(1, (max(1, baseline.passes(point)) if baseline is widest else 1) + 1)
    ]
    done = list(parallel(lambda c: crash_and_resume(baselines[c.sandbox], c, root), cases))
    return Matrix(baselines, widest, done)


def test_the_debug_command_lists_every_crash_point(gitrun: Gitrun) -> None:
    proc = gitrun("debug", "crash-points")
    assert proc.code == 0, proc.err
    listed = [line.split()[0] for line in proc.out.splitlines() if line.strip()]
    assert listed == list(POINTS)
    for line in proc.out.splitlines():
        assert len(line.split(maxsplit=1)) == 2, f"{line!r} does not say which window it is in"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("sandbox", SANDBOX_NAMES)
def test_a_run_killed_at_a_crash_point_resumes_to_the_uninterrupted_result(
    matrix: Matrix, sandbox: str, point: str
) -> None:
    cases = matrix.of(sandbox, point)
    assert cases, f"no case for {point} in {sandbox}"
    failures = [f"{c.spec}: {p}" for c in cases for p in c.problems]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(600)
def test_every_crash_point_is_reached_in_some_sandbox(matrix: Matrix) -> None:
    reached = {c.point for c in matrix.cases if c.reached}
    never = [p for p in POINTS if p not in reached]
    assert not never, f"crash points no sandbox reaches (the test proves nothing for them): {never}"


@pytest.mark.timeout(600)
def test_every_pass_of_every_write_window_point_is_crashed_in_a_multi_write_sandbox(
    matrix: Matrix,
) -> None:
    widest = matrix.widest
    assert widest.writes > 1, "no bundled sandbox makes more than one write"
    last = {
        c.point
        for c in matrix.cases
        if c.sandbox == widest.sandbox and c.nth == widest.writes and c.reached
    }
    assert last >= {
        "after_intent_checkpoint",
        "after_write_commit_object",
        "write_ref_locked",
        "write_ref_synced",
        "write_ref_moved",
        "receipt_index_locked",
        "after_receipt_index",
        "mid_file_sync",
        "after_file_sync",
        "receipt_riding",
    }


@pytest.mark.parametrize("point", ["receipt_riding", "before_verify", "after_intent_checkpoint"])
def test_status_of_a_run_killed_before_its_receipt_was_checkpointed_shows_the_truth(
    tmp_path: Path, point: str
) -> None:
    # A step's receipt rides in the next checkpoint: killed before that one, the
    # checkpoint still holds the intent, but status reads the branch and shows the write
    # done (its commit the head, nothing pending); resume records it once. Killed before
    # the write, the intent is shown pending, as it is.
    cli = Cli.at(tmp_path / "home")
    crash = cli("run", str(SANDBOXES / "fix-median"), "--run-id", "riding", crash_at=point)
    assert killed(crash.returncode), crash.stderr
    tip = cli.git(cli.repo("fix-median"), "rev-parse", "refs/heads/gitrun/riding").stdout.strip()
    info = json.loads(cli("status", "riding", "--json").stdout)
    text = cli("status", "riding").stdout
    assert info["phase"] == "running"
    if point == "after_intent_checkpoint":
        assert info["pending"] is not None
        assert (info["unrecorded_receipt"], info["receipts"]) == (None, [])
        assert "pending    apply_patch" in text
    else:
        assert info["pending"] is None
        assert info["head"] == info["unrecorded_receipt"] == tip
        assert [r["commit"] for r in info["receipts"]] == [tip]
        assert f"head       {tip}  (last write, not checkpointed yet)" in text
        assert "pending    -" in text
    resumed = cli("resume", "riding", "-q")
    assert resumed.returncode == 0, resumed.stderr
    done = json.loads(cli("status", "riding", "--json").stdout)
    assert (done["phase"], done["pending"], done["unrecorded_receipt"]) == ("done", None, None)
    assert len(done["receipts"]) == 1
    assert done["verifier"]["head"] == done["head"] == done["receipts"][0]["commit"]


# -- random kills -----------------------------------------------------------------------


@dataclass
class KillRun:
    index: int
    sandbox: str
    fresh: Path | None  # a new workspace: the kills may hit its very first setup
    kills_in_run: int = 0  # the run was registered: resume had something to recover
    kills_before_registration: int = 0  # nothing to resume: `gitrun run` again
    kills_in_resume: int = 0
    temp_file_hits: int = 0  # kills that left a `.NAME.gitrun-tmp-<hex>` for the next owner
    widen_ms: int = 0  # GITRUN_DELAY_AT at temp_file_written: the window made this wide
    problems: list[str] = field(default_factory=list)


def _run_until(
    cli: Cli, args: list[str], delay: float | None
) -> tuple[bool, subprocess.CompletedProcess[str]]:
    """Run the CLI; SIGKILL it after ``delay`` seconds unless it ended by then."""
    proc = cli.popen(*args)
    try:
        out, err = proc.communicate(timeout=delay if delay is not None else 180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    code = proc.returncode
    return killed(code), subprocess.CompletedProcess(args, code, out, err)


def kill_at_random(baseline: Baseline, run: KillRun) -> KillRun:
    """Kill ``gitrun run`` at a random moment, then resume (killed at random too) to the end.

    Delays are uniform over the time an uninterrupted run of the sandbox took here (about
    a second on an idle machine), so kills land all along the run whatever the load.
    """
    rng = random.Random(RANDOM_SEED * 100_003 + run.index)
    cli, rid = Cli.at(run.fresh) if run.fresh else baseline.cli, f"rand-{run.index}"
    span = baseline.seconds
    if run.widen_ms:  # the temp-file window, microseconds wide, made wide enough to hit
        cli = Cli(cli.home, {**cli.env, faults.DELAY_VAR: f"temp_file_written:{run.widen_ms}"})
        span += baseline.writes * run.widen_ms / 1000
    args = ["run", str(SANDBOXES / run.sandbox), "--run-id", rid, "-q"]
    for attempt in range(KILLS_PER_RUN + 1):
        delay = rng.uniform(0.0, span) if attempt < KILLS_PER_RUN else None
        was_killed, proc = _run_until(cli, args, delay)
        if not was_killed:
            if proc.returncode != baseline.code:
                run.problems.append(
                    f"{' '.join(args[:2])} exit {proc.returncode}: {proc.stderr[-800:]}"
                )
                return run
            break
        # Killed before the run was even registered: there is nothing to resume, start again.
        registered = (cli.home / "runs" / f"{rid}.json").exists()
        worktree = cli.home / "worktrees" / rid
        if worktree.is_dir() and any(worktree.rglob("*.gitrun-tmp-*")):
            run.temp_file_hits += 1
        if args[0] == "resume":
            run.kills_in_resume += 1
        elif registered:
            run.kills_in_run += 1
        else:
            run.kills_before_registration += 1
        args = ["resume", rid, "-q"] if registered else args
    run.problems.extend(run_invariants(baseline, rid, cli, fsck=run.fresh is not None))
    return run


def random_kills(baselines: dict[str, Baseline], count: int, root: Path) -> None:
    """``count`` random-kill runs, several at a time; one in five in a fresh workspace,
    the others sharing one repository per sandbox (checked with fsck once all ended)."""
    runs = [
        KillRun(
            i,
            SANDBOX_NAMES[i % len(SANDBOX_NAMES)],
            root / f"fresh-{i}" if i % 5 == 4 else None,
            widen_ms=WIDEN_MS if i % 3 == 1 else 0,
        )
        for i in range(count)
    ]
    started = time.monotonic()
    done = list(parallel(lambda r: kill_at_random(baselines[r.sandbox], r), runs))
    wall = time.monotonic() - started
    failures = [f"run {r.index} ({r.sandbox}): {p}" for r in done for p in r.problems]
    for baseline in baselines.values():  # shared repositories: checked once all runs ended
        failures += [
            f"{baseline.sandbox}: {p}"
            for p in fsck_problems(baseline.cli, baseline.cli.repo(baseline.sandbox))
        ]
        locks = lock_files(baseline.cli, baseline.sandbox)
        failures += [f"{baseline.sandbox}: lock files left behind: {locks}"] if locks else []
    assert not failures, "\n".join(failures)
    in_run = sum(r.kills_in_run for r in done)
    in_resume = sum(r.kills_in_resume for r in done)
    early = sum(r.kills_before_registration for r in done)
    temp = sum(r.temp_file_hits for r in done)
    print(
        f"{count} random-kill runs in {wall:.1f}s: {in_run} kills inside `gitrun run`, "
        f"{in_resume} inside `gitrun resume`, {early} before the run was registered, "
        f"{temp} between a temp file's write and its rename"
    )
    if count >= 20:
        assert temp >= 1, "no kill landed in a (widened) temp-file window"
        assert in_run >= count // 5, "too few kills landed inside `gitrun run`"
        assert in_resume >= count // 10, "too few kills landed inside `gitrun resume`"


@pytest.mark.xdist_group("crash-random-kills")  # beside the matrix, with baselines of its own
@pytest.mark.timeout(600)
def test_runs_killed_at_random_moments_and_resumed_until_done_end_like_uninterrupted_runs(
    baselines: dict[str, Baseline], tmp_path: Path
) -> None:
    """``GITRUN_RANDOM_KILLS`` runs (default 50), seeded by ``GITRUN_RANDOM_SEED``."""
    random_kills(baselines, RANDOM_KILLS, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_500_runs_killed_at_random_moments_all_end_like_uninterrupted_runs(
    baselines: dict[str, Baseline], tmp_path: Path
) -> None:
    """The long version: ``pytest --run-slow -k soak tests/test_crash.py``."""
    random_kills(baselines, 500, tmp_path)
