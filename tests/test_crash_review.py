"""A step that crashes gitrun (exit 70) at the same point twice is not tried a third time:
the run goes to needs_review with the error recorded, so no input wedges a run for good
(issue #27 §4). Real CLI processes, real git; the recurring crash is a real exception
raised inside gitrun at a named point (GITRUN_FAIL_AT), not an edit of .git."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git
from helpers import Keys
from session_client import Rpc
from test_input import make_task

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(240)

RUN = "crashy"
PLAN = 'schema = 1\n[[step]]\nkind = "write_file"\npath = "f.txt"\ncontent = "new\\n"\n'


def status(gitrun: Gitrun) -> dict[str, object]:
    res = gitrun("status", RUN, "--json")
    assert res.code == 0, res.err
    info: dict[str, object] = json.loads(res.out)
    return info


def branch_commits(gitrun: Gitrun) -> list[str]:
    repo = gitrun.repo("input-task")
    return git(repo, "rev-list", f"main..gitrun/{RUN}").split()


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path, {"f.txt": b"old\n"}, plan=PLAN)


def test_a_step_crashing_twice_at_one_point_goes_to_review_with_the_error(
    gitrun: Gitrun, task: Path
) -> None:
    fail = {"GITRUN_FAIL_AT": "after_write_commit_object"}
    first = gitrun("run", str(task), "--run-id", RUN, "-q", **fail)
    assert first.code == Exit.INTERNAL, first.err
    assert "injected failure" in first.err
    second = gitrun("resume", RUN, **fail)
    assert second.code == Exit.INTERNAL, second.err  # resume tries once more
    third = gitrun("resume", RUN, **fail)  # the same input would crash again: not tried
    assert third.code == Exit.FROZEN, third.err
    assert "needs review" in third.err
    assert "crashed gitrun 2 times" in third.err
    assert "InjectedFailure" in third.err
    assert "internal error" not in third.err
    info = status(gitrun)
    assert info["phase"] == "needs_review"
    assert info["stop_reason"] == "step_crashed"
    shown = gitrun("review", "show", RUN)
    assert shown.code == 0, shown.err
    assert "injected failure at after_write_commit_object" in shown.out
    assert branch_commits(gitrun) == []  # nothing of the crashed step landed
    git(gitrun.repo("input-task"), "fsck", "--strict")


def test_crashes_at_two_different_points_are_retried_and_the_run_finishes(
    gitrun: Gitrun, task: Path
) -> None:
    """Only the same point twice counts: a crash elsewhere is another failure, retried."""
    first = gitrun("run", str(task), "--run-id", RUN, "-q",
                   GITRUN_FAIL_AT="after_write_commit_object")  # fmt: skip
    assert first.code == Exit.INTERNAL, first.err
    second = gitrun("resume", RUN, GITRUN_FAIL_AT="write_ref_locked")
    assert second.code == Exit.INTERNAL, second.err
    done = gitrun("resume", RUN)
    assert done.code == Exit.DONE, done.err
    assert len(branch_commits(gitrun)) == 1


def test_a_sigkill_at_the_same_point_twice_is_still_retried(gitrun: Gitrun, task: Path) -> None:
    """Kills and power cuts are what resume is for: they leave no crash record."""
    first = gitrun("run", str(task), "--run-id", RUN, "-q",
                   GITRUN_CRASH_AT="after_write_commit_object")  # fmt: skip
    assert first.code == -9, first.err
    second = gitrun("resume", RUN, GITRUN_CRASH_AT="after_write_commit_object")
    assert second.code == -9, second.err
    done = gitrun("resume", RUN)
    assert done.code == Exit.DONE, done.err
    assert len(branch_commits(gitrun)) == 1


@pytest.mark.parametrize(
    ("decision", "phase", "code"), [("abort", "failed", Exit.FAILED), ("replan", "done", Exit.DONE)]
)
def test_a_reviewer_decides_the_crash_case_and_one_resume_ends_the_run(
    gitrun: Gitrun, task: Path, keys: Keys, decision: str, phase: str, code: int
) -> None:
    fail = {"GITRUN_FAIL_AT": "after_write_commit_object"}
    assert gitrun("run", str(task), "--run-id", RUN, "-q", **fail).code == Exit.INTERNAL
    assert gitrun("resume", RUN, **fail).code == Exit.INTERNAL
    assert gitrun("resume", RUN, **fail).code == Exit.FROZEN
    decided = gitrun("review", "decide", RUN, decision, "--key", str(keys["bob"]))
    assert decided.code == 0, decided.err
    # The crash's cause is gone (a fixed gitrun): replan proposes the step again.
    ended = gitrun("resume", RUN, "--trust-roots", str(keys.roots))
    assert ended.code == code, ended.err
    assert status(gitrun)["phase"] == phase


def test_a_session_step_crashing_twice_leaves_the_session_answering_needs_review(
    gitrun: Gitrun,
) -> None:
    point = "after_write_commit_object"
    task = str(SANDBOXES / "fix-median")
    rpc = Rpc(gitrun, task, "--run-id", "s1", "--lease-seconds", "600", GITRUN_FAIL_AT=point)
    rpc.call("initialize", protocol="gitrun/1")
    err = rpc.fail("write_file", path="stats/x.py", content="x\n")
    assert err["data"]["exit_code"] == Exit.INTERNAL
    assert rpc.close() == Exit.INTERNAL
    again = Rpc(
        gitrun, "s1", command="resume", GITRUN_FAIL_AT=point
    )  # the intent runs first: crash 2
    assert again.close() == Exit.INTERNAL
    third = Rpc(gitrun, "s1", command="resume", GITRUN_FAIL_AT=point)
    seen = third.call("observe")
    assert seen["phase"] == "needs_review"
    assert seen["stop_reason"] == "step_crashed"
    refused = third.fail("write_file", path="stats/y.py", content="y\n")
    assert refused["data"]["rule"] == "needs-review"
    assert third.close() == Exit.FROZEN
    assert "crashed gitrun 2 times" in third.stderr()


def test_a_verifier_step_crashing_twice_fails_the_run_with_the_error(
    gitrun: Gitrun, task: Path
) -> None:
    """No pending step to review: the run ends failed, the crash as the verdict's reason."""
    fail = {"GITRUN_FAIL_AT": "before_verify"}
    assert gitrun("run", str(task), "--run-id", RUN, "-q", **fail).code == Exit.INTERNAL
    assert gitrun("resume", RUN, **fail).code == Exit.INTERNAL
    ended = gitrun("resume", RUN, **fail)
    assert ended.code == Exit.FAILED, ended.err
    info = status(gitrun)
    assert info["phase"] == "failed"
    assert info["stop_reason"] == "verifier_cannot_start"
    shown = gitrun("log", RUN)
    assert "crashed gitrun 2 times" in shown.out + shown.err
    assert len(branch_commits(gitrun)) == 1  # the write stands; only the verdict failed
