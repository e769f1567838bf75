"""Headless rewind and `gitrun log` (issue #14): a rewind is one new gated step whose
receipt commit has an earlier tree; history keeps every step; budgets, approvals, the
freeze and the path rules hold for it as for any write."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pygit2
import pytest
from conftest import SANDBOXES, Gitrun, git
from session_client import Rpc

from gitrun.adapter.gate import Gate
from gitrun.core.errors import GateRejected
from gitrun.core.records import REWIND, Action
from gitrun.core.task import load_task
from gitrun.store import gitstore, trees

TASK = SANDBOXES / "fix-median"
FIX = (TASK / "patches" / "fix.diff").read_text()


@pytest.fixture(autouse=True)
def _reap_sessions() -> Iterator[None]:
    yield
    Rpc.reap_all()


def two_writes(gitrun: Gitrun, run_id: str, task: Path = TASK) -> list[dict[str, Any]]:
    """A session run left running after two writes of stats/notes.py (A = 1, then A = 2)."""
    rpc = Rpc(gitrun, str(task), "--run-id", run_id)
    out = [
        rpc.call("write_file", path="stats/notes.py", content=f"A = {n}\n",
                 idempotency_key=f"rw-step-000{n}")
        for n in (1, 2)
    ]  # fmt: skip
    assert rpc.close() == 8  # left before finish: resumable
    return out


def branch(gitrun: Gitrun, run_id: str) -> list[tuple[str, str]]:
    """(commit, tree) of every commit on the run's branch above the base, oldest first."""
    out = git(gitrun.repo("fix-median"), "log", "--reverse", "--format=%H %T", f"gitrun/{run_id}")
    rows = [tuple(line.split()) for line in out.splitlines()]
    return [(c, t) for c, t in rows][1:]  # the first is the base


def log_json(gitrun: Gitrun, run_id: str) -> dict[str, Any]:
    res = gitrun("log", run_id, "--json")
    assert res.code == 0, res.err
    info: dict[str, Any] = json.loads(res.out)
    return info


def test_rewind_to_the_first_receipt_is_a_third_commit_with_its_tree(gitrun: Gitrun) -> None:
    first, second = two_writes(gitrun, "rw1")
    res = gitrun("rewind", "rw1", "--to", first["commit"][:10], "--key", "rw-back-0001")
    assert res.code == 0, res.err
    assert "rewind committed" in res.out
    commits = branch(gitrun, "rw1")
    assert [c for c, _ in commits[:2]] == [first["commit"], second["commit"]]  # kept
    assert len(commits) == 3
    assert commits[2][1] == first["tree"]  # the third commit restores the first tree
    # Its receipt rode in no later checkpoint (the rewind is the process's one step): the
    # rewind's end wrote it, so the checkpoint, not only the branch, shows the step done.
    info = json.loads(gitrun("status", "rw1", "--json").out)
    assert (info["pending"], info["unrecorded_receipt"]) == (None, None)
    assert info["head"] == commits[2][0]
    assert info["budgets"]["steps"] == 3
    again = gitrun("rewind", "rw1", "--to", first["commit"], "--key", "rw-back-0001")
    assert again.code == 0, again.err
    assert "rewind replayed" in again.out
    assert len(branch(gitrun, "rw1")) == 3
    rpc = Rpc(gitrun, str(TASK), "--run-id", "rw1")
    seen = rpc.call("observe")
    assert seen["budgets"]["used"]["steps"] == 3  # the rewind counted as a step
    assert seen["receipts"][0]["action"] == "rewind"
    assert rpc.call("read_file", path="stats/notes.py")["content"] == "A = 1\n"
    rpc.call("apply_patch", patch=FIX)
    assert rpc.call("finish")["phase"] == "done"
    assert rpc.close() == 0
    worktree = Path(json.loads(gitrun("status", "rw1", "--json").out)["worktree"])
    assert (worktree / "stats" / "notes.py").read_text() == "A = 1\n"


def test_gitrun_log_lists_the_steps_and_rewind_takes_a_generation(gitrun: Gitrun) -> None:
    first, second = two_writes(gitrun, "rw2")
    info = log_json(gitrun, "rw2")
    assert info["run_id"] == "rw2"
    assert info["phase"] == "running"
    assert [s["key"] for s in info["steps"]] == ["rw-step-0001", "rw-step-0002"]
    step = info["steps"][0]
    assert set(step) == {"generation", "key", "action", "commit", "tree", "paths",
                         "diffstat", "verifier"}  # fmt: skip
    assert step["commit"] == first["commit"]
    assert step["action"] == "write_file"
    assert step["paths"] == ["stats/notes.py"]
    assert step["diffstat"] == {"files": 1, "insertions": 1, "deletions": 0}
    assert info["steps"][1]["diffstat"] == {"files": 1, "insertions": 1, "deletions": 1}
    assert isinstance(step["generation"], int)
    assert step["generation"] < info["steps"][1]["generation"]
    text = gitrun("log", "rw2")
    assert text.code == 0, text.err
    assert first["commit"][:12] in text.out
    assert "rw-step-0002" in text.out
    assert "(base)" in text.out
    # the first generation is the base: the rewind deletes what the two writes made
    assert info["base"]["generation"] == 1
    base = gitrun("rewind", "rw2", "--to", "1")
    assert base.code == 0, base.err
    base_tree = git(gitrun.repo("fix-median"), "rev-parse", f"{info['base']['commit']}^{{tree}}")
    assert branch(gitrun, "rw2")[-1][1] == base_tree.strip()
    by_gen = gitrun("rewind", "rw2", "--to", str(info["steps"][1]["generation"]))
    assert by_gen.code == 0, by_gen.err
    assert branch(gitrun, "rw2")[-1][1] == second["tree"]
    assert [s["action"] for s in log_json(gitrun, "rw2")["steps"]][2:] == ["rewind", "rewind"]


def test_rewind_to_head_unknown_or_ambiguous_targets_are_refused(gitrun: Gitrun) -> None:
    _, second = two_writes(gitrun, "rw3")
    same = gitrun("rewind", "rw3", "--to", second["commit"])
    assert same.code == 5, same.err
    assert "rewind-no-change" in same.err
    unknown = gitrun("rewind", "rw3", "--to", "deadbeefdead")
    assert unknown.code == 2, unknown.err
    assert unknown.err.startswith("gitrun: rewind: no receipt commit deadbeefdead")
    assert len(branch(gitrun, "rw3")) == 2


def _task_with_rule(tmp_path: Path, rule: str) -> Path:
    task = tmp_path / "fix-median"
    shutil.copytree(TASK, task)
    toml = (task / "task.toml").read_text()
    risk = f'[[policy.risk]]\nname = "rewinds"\n{rule}\n\n[verifier]'
    (task / "task.toml").write_text(toml.replace("[verifier]", risk, 1))
    return task


@pytest.mark.parametrize(
    "rule",
    ['actions = ["rewind"]', 'actions = ["rewind"]\npaths = ["stats/notes.py"]'],
)
def test_the_policy_can_require_approval_and_a_frozen_run_refuses_rewind(
    gitrun: Gitrun, tmp_path: Path, rule: str
) -> None:
    first, _ = two_writes(gitrun, "rw4", _task_with_rule(tmp_path, rule))
    asked = gitrun("rewind", "rw4", "--to", first["commit"])
    assert asked.code == 3, asked.err  # waits for a human
    assert json.loads(gitrun("status", "rw4", "--json").out)["phase"] == "awaiting_approval"
    assert len(branch(gitrun, "rw4")) == 2
    frozen = gitrun("rewind", "rw4", "--to", first["commit"], "--key", "rw-other-0001")
    assert frozen.code == 3, frozen.err
    assert frozen.err.startswith("gitrun: ")
    assert len(branch(gitrun, "rw4")) == 2


def test_a_risk_rule_on_other_paths_lets_a_rewind_through(gitrun: Gitrun, tmp_path: Path) -> None:
    rule = 'actions = ["rewind"]\npaths = ["stats/median.py"]'
    first, _ = two_writes(gitrun, "rw7", _task_with_rule(tmp_path, rule))
    res = gitrun("rewind", "rw7", "--to", first["commit"])
    assert res.code == 0, res.err
    assert len(branch(gitrun, "rw7")) == 3


def test_a_rewind_that_would_change_a_forbidden_path_is_refused(gitrun: Gitrun) -> None:
    """Every path a rewind changes meets the write rules: a target tree differing in
    tests/ (forbidden) or outside the allowlist is refused, with real git objects."""
    two_writes(gitrun, "rw5")
    repo = gitstore.open_repo(gitrun.repo("fix-median"))
    head = repo.revparse_single("gitrun/rw5").peel(pygit2.Commit)
    gate = Gate(load_task(TASK), Path(str(repo.workdir)), repo)
    for path, rule in (("tests/test_median.py", "path-forbidden"),
                       ("README.md", "path-not-allowlisted")):  # fmt: skip
        blob = repo.create_blob(b"changed\n")
        target = trees.tree_with_changes(repo, head.tree, {path: (blob, trees.BLOB)})
        with pytest.raises(GateRejected) as caught:
            gate.check_action(Action(REWIND, tree=str(target)), head.tree, on_disk=False)
        assert caught.value.rule == rule
        assert path in str(caught.value)


@pytest.mark.parametrize(
    "point", ["after_intent_checkpoint", "after_write_commit_object", "write_ref_moved",
              "mid_file_sync", "after_file_sync"]
)  # fmt: skip
def test_a_rewind_killed_mid_step_is_finished_once_by_the_same_command(
    gitrun: Gitrun, point: str
) -> None:
    first, _ = two_writes(gitrun, "rw6")
    args = ("rewind", "rw6", "--to", first["commit"], "--key", "rw-back-0006")
    crashed = gitrun(*args, GITRUN_CRASH_AT=point)
    assert crashed.code == -signal.SIGKILL, crashed.err
    again = gitrun(*args, "--takeover-after", "0")
    assert again.code == 0, again.err
    assert "rewind replayed" in again.out or "rewind committed" in again.out
    commits = branch(gitrun, "rw6")
    assert len(commits) == 3
    assert commits[2][1] == first["tree"]
    keys = [s["key"] for s in log_json(gitrun, "rw6")["steps"]]
    assert keys == ["rw-step-0001", "rw-step-0002", "rw-back-0006"]
    worktree = Path(json.loads(gitrun("status", "rw6", "--json").out)["worktree"])
    assert (worktree / "stats" / "notes.py").read_text() == "A = 1\n"
    assert git(worktree, "status", "--porcelain") == ""
