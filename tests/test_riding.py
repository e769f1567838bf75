"""A step's intent riding with its write (issue #15, :mod:`gitrun.engine.riding`): one
journal record holds the intent's checkpoint and the write, the checkpoint ref is renamed
first, the locks are let go, then the branch is taken and renamed. Between the two the
run is in window 2 exactly as before: nothing locked, so an agent (or a human) with git
can move the run's branch there. Its move must win: the write fails, changing nothing,
and the record's value for the branch is pinned back, so no power-cut recovery puts the
dead write over the agent's commit."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from conftest import SANDBOXES
from helpers import stopped
from test_crash import Cli
from test_journal import BOOT, REBOOT, booted

from gitrun.core import faults
from gitrun.core.errors import Exit
from gitrun.store import journal_recovery

SANDBOX = "fix-median"
BRANCH = "refs/heads/gitrun/r"


def _git(cli: Cli, repo: Path, *args: str) -> str:
    done = cli.git(repo, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_branch_moved_between_the_intent_and_the_write_wins_and_no_recovery_undoes_it(
    tmp_path: Path,
) -> None:
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    paused = booted(cli, {faults.PAUSE_VAR: "after_intent_checkpoint"})
    run = paused.popen("run", str(SANDBOXES / SANDBOX), "--run-id", "r", "-q")
    try:
        deadline = time.monotonic() + 60
        while not stopped(run.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped(run.pid)
        repo = cli.repo(SANDBOX)
        gitdir = (repo / ".git").resolve()
        assert not list(gitdir.rglob("*.lock"))  # window 2: nothing is locked
        tip = _git(cli, repo, "rev-parse", BRANCH)
        tree = _git(cli, repo, "rev-parse", f"{tip}^{{tree}}")
        extra = _git(cli, repo, "commit-tree", tree, "-p", tip, "-m", "the agent's own commit")
        _git(cli, repo, "update-ref", BRANCH, extra, tip)  # plain git: no lock in its way
    finally:
        os.kill(run.pid, signal.SIGCONT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == Exit.CONFLICT, err
    assert len(err.strip().splitlines()) == 1, err
    assert BRANCH in err, err
    assert _git(cli, repo, "rev-parse", BRANCH) == extra
    assert not list(gitdir.rglob("*.lock"))
    # The record that named the dead write is superseded by the branch's real value...
    held = journal_recovery.contents(gitdir).refs[BRANCH]
    assert held.new is not None
    assert held.new.hex() == extra
    # ... so a reboot's recovery keeps the agent's commit, and resume refuses it, loudly.
    after = booted(cli, REBOOT)
    resumed = after("resume", "r", "-q")
    assert resumed.returncode == Exit.REFUSED, resumed.stderr
    assert _git(after, repo, "rev-parse", BRANCH) == extra


def test_a_kill_between_the_two_then_a_plain_git_move_is_never_undone_by_a_recovery(
    tmp_path: Path,
) -> None:
    """Killed between the transactions, the record still names the write never made and
    nothing is locked. The agent moves the branch with plain git, resume refuses that,
    and a reboot's recovery must keep the agent's commit: it completes only moves whose
    ref holds a journaled value (or an older one a cut can leave), never a foreign one."""
    cli = booted(Cli.at(tmp_path / "home"), BOOT)
    crashed = cli(
        "run", str(SANDBOXES / SANDBOX), "--run-id", "r", "-q", crash_at="after_intent_checkpoint"
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    repo = cli.repo(SANDBOX)
    gitdir = (repo / ".git").resolve()
    assert not list(gitdir.rglob("*.lock"))
    tip = _git(cli, repo, "rev-parse", BRANCH)
    dead = journal_recovery.contents(gitdir).refs[BRANCH].new
    assert dead is not None
    assert dead.hex() != tip  # the record names a write never made
    tree = _git(cli, repo, "rev-parse", f"{tip}^{{tree}}")
    extra = _git(cli, repo, "commit-tree", tree, "-p", tip, "-m", "the agent's own commit")
    _git(cli, repo, "update-ref", BRANCH, extra, tip)
    refused = cli("resume", "r", "-q")
    assert refused.returncode == Exit.REFUSED, refused.stderr
    after = booted(cli, REBOOT)
    assert after("status", "r").returncode == 0  # the new boot's first process recovers
    assert _git(after, repo, "rev-parse", BRANCH) == extra
