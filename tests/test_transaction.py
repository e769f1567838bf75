"""The store's one durable write API (issue #29, :class:`gitrun.store.refmove.Transaction`):
stores stage guards, ordered moves and best-effort index entries into a transaction the
caller holds; ``commit`` takes the sorted locks, compares, writes one journal record,
publishes and renames, in order (docs/design.md §5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pygit2
import pytest
from helpers import git
from test_journal import BOOT

from gitrun.core import faults
from gitrun.core.errors import CasFailed, GitrunError, LeaseLost
from gitrun.store import gitstore, journal_recovery

pytestmark = pytest.mark.timeout(120)

CHECKPOINT = "refs/gitrun/runs/r/checkpoints/t/i"
BRANCH = "refs/heads/gitrun/r"
INDEX = "refs/gitrun/runs/r/receipts/k-1"


@pytest.fixture
def repo(tmp_path: Path) -> pygit2.Repository:
    # This process's own boot id: it is read once per process, and the CLI processes of
    # later tests run under the real one (a test boot id here would look like a reboot).
    path = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(path))
    return gitstore.open_repo(path)


def _blob(repo: pygit2.Repository, text: str) -> pygit2.Oid:
    return gitstore.write_blob(repo, text.encode())


def _refuse(_: pygit2.Oid | None) -> None:
    raise LeaseLost(None, "the lease is someone else's")


def test_a_guard_that_refuses_moves_no_ref_of_the_transaction(repo: pygit2.Repository) -> None:
    first, second = _blob(repo, "intent\n"), _blob(repo, "write\n")
    txn = gitstore.transaction(repo).guard(gitstore.Guard("refs/gitrun/runs/r/lease", _refuse))
    txn.move(CHECKPOINT, None, first).move(BRANCH, None, second).index(INDEX, second)
    with pytest.raises(LeaseLost):
        txn.commit()
    assert [gitstore.read_ref(repo, n) for n in (CHECKPOINT, BRANCH, INDEX)] == [None] * 3
    assert not list(Path(repo.path).rglob("*.lock"))
    assert not txn.moved(CHECKPOINT)


def test_a_stale_expected_value_in_either_move_refuses_both_before_anything_is_written(
    repo: pygit2.Repository,
) -> None:
    first, second = _blob(repo, "intent\n"), _blob(repo, "write\n")
    txn = gitstore.transaction(repo).move(CHECKPOINT, None, first)
    txn.move(BRANCH, first, second)  # the branch does not exist: its compare fails
    with pytest.raises(CasFailed):
        txn.commit()
    assert gitstore.read_ref(repo, CHECKPOINT) is None
    assert gitstore.read_ref(repo, BRANCH) is None


def test_two_moves_and_an_index_entry_go_into_one_journal_record(
    repo: pygit2.Repository,
) -> None:
    first, second = _blob(repo, "intent\n"), _blob(repo, "write\n")
    gitstore.transaction(repo).move("refs/gitrun/warm", None, first).commit()  # the journal
    cdir = gitstore.common_dir(repo)
    before = journal_recovery.contents(cdir)
    txn = gitstore.transaction(repo).move(CHECKPOINT, None, first)
    txn.move(BRANCH, None, second).index(INDEX, second).commit()
    after = journal_recovery.contents(cdir)
    new = {name: entry.new for name, entry in after.refs.items() if name not in before.refs}
    assert new == {CHECKPOINT: first.raw, BRANCH: second.raw, INDEX: second.raw}
    assert second.raw in after.objects  # the objects the values reach, in the record
    assert [gitstore.read_ref(repo, n) for n in (CHECKPOINT, BRANCH, INDEX)] == [
        first,
        second,
        second,
    ]
    assert txn.moved(CHECKPOINT)
    assert txn.moved(BRANCH)


def test_a_kill_between_the_two_renames_leaves_the_first_moved_and_both_journaled(
    tmp_path: Path,
) -> None:
    """The first move's crash points run after its rename, with nothing locked: window 2."""
    path = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(path))
    script = f"""
import sys
from gitrun.store import gitstore
repo = gitstore.open_repo(sys.argv[1])
first, second = repo.create_blob(b"intent\\n"), repo.create_blob(b"write\\n")
gitstore.transaction(repo).move("refs/gitrun/warm", None, first).commit()
print(first, second, flush=True)
point = "after_intent_checkpoint"
txn = gitstore.transaction(repo).move({CHECKPOINT!r}, None, first, after=(point,))
txn.move({BRANCH!r}, None, second).commit()
"""
    env = {**os.environ, **BOOT, faults.ENV_VAR: "after_intent_checkpoint"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == -9, done.stderr
    first, second = done.stdout.split()
    assert git(path, "rev-parse", CHECKPOINT).strip() == first
    assert git(path, "show-ref", BRANCH, check=False).strip() == ""
    held = journal_recovery.contents(path / ".git").refs
    assert held[BRANCH].new == bytes.fromhex(second)  # a power cut now: recovery completes it
    assert not list((path / ".git").rglob("*.lock"))


def test_a_transaction_commits_once(repo: pygit2.Repository) -> None:
    txn = gitstore.transaction(repo).move(BRANCH, None, _blob(repo, "x\n"))
    txn.commit()
    with pytest.raises(GitrunError):
        txn.commit()
    with pytest.raises(GitrunError):
        txn.move(CHECKPOINT, None, _blob(repo, "y\n"))


def test_an_index_entry_alone_is_compared_afresh_and_set_again_when_moved_behind_its_back(
    repo: pygit2.Repository,
) -> None:
    mine, theirs = _blob(repo, "mine\n"), _blob(repo, "theirs\n")
    gitstore.transaction(repo).index(INDEX, mine).commit()
    assert gitstore.read_ref(repo, INDEX) == mine
    gitstore.transaction(repo).move("refs/gitrun/other", None, theirs).commit()  # published
    git(Path(repo.workdir), "update-ref", INDEX, str(theirs))  # moved behind its back
    gitstore.transaction(repo).index(INDEX, mine).commit()  # compares afresh: no error
    assert gitstore.read_ref(repo, INDEX) == mine


def test_a_forked_child_commits_through_its_own_journal_handle(tmp_path: Path) -> None:
    """No fork hook: the per-repository journal knows the process it is for, and a forked
    child (its parent mid-use, a thread of it holding the journal's thread lock) opens
    its own."""
    path = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(path))
    script = """
import os, sys, threading
from gitrun.store import gitstore, journal
repo = gitstore.open_repo(sys.argv[1])
gitstore.transaction(repo).move("refs/gitrun/parent", None, repo.create_blob(b"p")).commit()
held = journal.of(gitstore.common_dir(repo))
held.thread_lock.acquire()  # a parent thread's, at the moment of the fork
pid = os.fork()
if pid == 0:
    blob = repo.create_blob(b"child")
    gitstore.transaction(repo).move("refs/gitrun/child", None, blob).commit()
    os._exit(0 if journal.of(gitstore.common_dir(repo)) is not held else 3)
held.thread_lock.release()
_, status = os.waitpid(pid, 0)
gitstore.transaction(repo).move("refs/gitrun/after", None, repo.create_blob(b"a")).commit()
sys.exit(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], env={**os.environ, **BOOT},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    held = journal_recovery.contents(path / ".git").refs
    assert {"refs/gitrun/parent", "refs/gitrun/child", "refs/gitrun/after"} <= set(held)
