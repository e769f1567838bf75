"""Ref lock files: a ``<ref>.lock`` left by a writer killed with SIGKILL is cleaned by the
next gitrun process, and a lock some live process holds is never touched.

Every gitrun writer holds an OS-level lock (``filelock``, released by the kernel when
the process dies) on each ref while it holds that ref's git lock file, so whoever holds
the OS lock next knows a leftover ``*.lock`` is stale.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git

from gitrun.core.errors import GitrunError
from gitrun.store import gitstore, reflocks

pytestmark = pytest.mark.timeout(120)

RUN = "r"
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the verifier's pytest: no unrelated plugins

HOLDER = """
import sys, time
from pathlib import Path
from gitrun.store import gitstore
repo = gitstore.open_repo(sys.argv[1])
ref = sys.argv[2]
with gitstore.os_locks(repo, [ref]):
    lock = gitstore.common_dir(repo) / (ref + ".lock")
    lock.write_text("held by a live writer\\n")
    print("held", flush=True)
    sys.stdin.readline()
"""


def lock_files(repo: Path) -> list[str]:
    gitdir = repo / ".git"
    return sorted(str(p.relative_to(gitdir)) for p in gitdir.rglob("*.lock"))


def keys_on_branch(repo: Path, base: str, branch: str) -> list[str]:
    out = git(
        repo,
        "log",
        "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly,separator=%x2C)",
        f"{base}..{branch}",
    )
    return [line.strip() for line in out.splitlines()]


def fsck_clean(repo: Path) -> None:
    proc = subprocess.run(
        ["git", "-C", str(repo), "fsck", "--strict", "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
    )
    bad = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if not line.startswith("dangling ")
    ]
    assert proc.returncode == 0, proc.stderr
    assert not bad, bad


@pytest.fixture
def holder(reap: list[subprocess.Popen[str]]) -> list[subprocess.Popen[str]]:
    """Helper processes that hold a ref's OS lock and its ``.lock`` file; reaped after."""
    return reap


def hold(procs: list[subprocess.Popen[str]], repo: Path, ref: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(repo), ref],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held", proc.stderr.read() if proc.stderr else ""
    return proc


def lock_state(path: Path) -> tuple[bytes, int, int]:
    st = path.stat()
    return path.read_bytes(), st.st_ino, st.st_mtime_ns


@pytest.mark.parametrize(
    ("point", "locked_ref"),
    [
        ("write_ref_locked", "refs/heads/gitrun/r"),
        ("checkpoint_ref_locked:3", "refs/gitrun/runs/r/checkpoints/fix-median/"),
        ("checkpoint_ref_locked:1", "refs/gitrun/runs/r/checkpoints/fix-median/"),
    ],
)
def test_a_ref_lock_left_by_a_killed_writer_is_cleaned_by_the_next_resume(
    gitrun: Gitrun, point: str, locked_ref: str
) -> None:
    killed = gitrun(
        "run", str(SANDBOXES / "fix-median"), "--run-id", RUN, GITRUN_CRASH_AT=point, **FAST
    )
    assert killed.code == -signal.SIGKILL, killed.err
    repo = gitrun.repo("fix-median")
    left = lock_files(repo)
    assert any(name.startswith(locked_ref) and name.endswith(".lock") for name in left), left

    resumed = gitrun("resume", RUN, **FAST)
    assert resumed.code == 0, resumed.err
    assert ": done (" in resumed.out
    assert lock_files(repo) == []
    base = json.loads((gitrun.home / "runs" / f"{RUN}.json").read_text())["base_commit"]
    keys = keys_on_branch(repo, base, "refs/heads/gitrun/r")
    assert len(keys) == 1
    assert keys[0].startswith("k-")
    fsck_clean(repo)


def test_an_index_lock_left_in_the_run_worktree_is_cleaned_by_the_next_resume(
    gitrun: Gitrun,
) -> None:
    """A gitrun killed while writing the worktree's index leaves ``index.lock`` in the
    worktree's git dir (there is no crash point inside libgit2's write, so it is placed
    by hand after a real SIGKILL); libgit2 then refuses every index write until it goes."""
    killed = gitrun(
        "run",
        str(SANDBOXES / "slugify-unicode"),
        "--run-id",
        RUN,
        GITRUN_CRASH_AT="after_file_sync",
        **FAST,
    )
    assert killed.code == -signal.SIGKILL, killed.err
    repo = gitrun.repo("slugify-unicode")
    stale = repo / ".git" / "worktrees" / f"gitrun-{RUN}" / "index.lock"
    stale.write_bytes(b"DIRC half-written")
    old = time.time() - 10
    os.utime(stale, (old, old))

    resumed = gitrun("resume", RUN, **FAST)
    assert resumed.code == 0, resumed.err
    assert ": done (" in resumed.out
    assert lock_files(repo) == []
    worktree = gitrun.home / "worktrees" / RUN
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""


@pytest.fixture
def two_commits(tmp_path: Path) -> tuple[Path, str, str]:
    repo = tmp_path / "plain"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "a.txt").write_text("one\n")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-q", "-m", "one")
    first = git(repo, "rev-parse", "HEAD").strip()
    (repo / "a.txt").write_text("two\n")
    git(repo, "commit", "-q", "-am", "two")
    second = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "update-ref", "refs/heads/topic", first)
    return repo, first, second


def test_a_lock_held_by_a_live_process_is_not_touched_and_the_update_waits_for_it(
    two_commits: tuple[Path, str, str],
    holder: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo_path, first, second = two_commits
    ref = "refs/heads/topic"
    helper = hold(holder, repo_path, ref)
    lockfile = repo_path / ".git" / (ref + ".lock")
    before = lock_state(lockfile)
    time.sleep(reflocks.STALE_LOCK_GRACE_SECONDS + 0.2)  # old enough to pass for stale by age

    monkeypatch.setattr(reflocks, "LOCK_TIMEOUT_SECONDS", 1.0)
    repo = gitstore.open_repo(repo_path)
    import pygit2

    with pytest.raises(GitrunError, match="held by a live gitrun process") as refused:
        gitstore.transaction(repo).move(ref, pygit2.Oid(hex=first), pygit2.Oid(hex=second)).commit()
    assert ref in str(refused.value)
    assert lock_state(lockfile) == before
    assert git(repo_path, "rev-parse", ref).strip() == first

    os.kill(helper.pid, signal.SIGKILL)  # dies holding the ref lock: the kernel drops its OS lock
    helper.communicate(timeout=30)
    assert lockfile.exists()
    gitstore.transaction(repo).move(ref, pygit2.Oid(hex=first), pygit2.Oid(hex=second)).commit()
    assert git(repo_path, "rev-parse", ref).strip() == second
    assert not lockfile.exists()


def test_a_resume_waits_for_a_live_lock_holder_and_finishes_once_it_is_gone(
    gitrun: Gitrun, holder: list[subprocess.Popen[str]]
) -> None:
    killed = gitrun(
        "run",
        str(SANDBOXES / "fix-median"),
        "--run-id",
        RUN,
        GITRUN_CRASH_AT="after_intent_checkpoint",
        **FAST,
    )
    assert killed.code == -signal.SIGKILL, killed.err
    repo = gitrun.repo("fix-median")
    branch = "refs/heads/gitrun/r"
    tip = git(repo, "rev-parse", branch).strip()
    helper = hold(holder, repo, branch)
    lockfile = repo / ".git" / (branch + ".lock")
    before = lock_state(lockfile)

    resume = gitrun.popen("resume", RUN, **FAST)
    try:
        time.sleep(reflocks.STALE_LOCK_GRACE_SECONDS * 2 + 1)
        assert resume.poll() is None, resume.communicate()
        assert lock_state(lockfile) == before, "a lock a live process holds was touched"
        assert git(repo, "rev-parse", branch).strip() == tip

        os.kill(helper.pid, signal.SIGKILL)
        helper.communicate(timeout=30)
        out, err = resume.communicate(timeout=60)
    finally:
        if resume.poll() is None:
            resume.kill()
            resume.communicate()
    assert resume.returncode == 0, err
    assert ": done (" in out
    assert lock_files(repo) == []
    base = json.loads((gitrun.home / "runs" / f"{RUN}.json").read_text())["base_commit"]
    assert len(keys_on_branch(repo, base, branch)) == 1
    fsck_clean(repo)
