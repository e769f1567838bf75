"""A step parses its patch once and applies it once (issue #15): the gate at intake, the
risk rules, the gate again at execute time and the adapter's write share one parse and one
application to the precondition tree, while every rule still runs each time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import SANDBOXES, git

from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core import patch as patch_module
from gitrun.core import patch_plan
from gitrun.core.patch import FilePatch
from gitrun.core.records import DONE

pytestmark = pytest.mark.timeout(120)


def test_a_run_s_patch_step_parses_the_patch_once_and_applies_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"parse": 0, "apply": 0}
    real_parse, real_apply = patch_module.parse_patch, patch_module.apply_file_patch

    def parse(text: str | bytes) -> tuple[FilePatch, ...]:
        calls["parse"] += 1
        return real_parse(text)

    def apply(old: bytes | None, fp: FilePatch) -> bytes | None:
        calls["apply"] += 1
        return real_apply(old, fp)

    monkeypatch.setattr(patch_plan, "parse_patch", parse)
    monkeypatch.setattr(patch_plan, "apply_file_patch", apply)
    patch_plan.forget()
    task = tmp_path / "fix-median"
    shutil.copytree(SANDBOXES / "fix-median", task)
    home = tmp_path / "ws"
    home.mkdir()
    state = service.start(
        task, service.Options(Workspace(home)), repo_path=None, agent_spec="plan", run_id="once"
    )
    assert (state.phase, state.budgets.steps) == (DONE, 1)
    assert calls == {"parse": 1, "apply": 1}  # main: parsed 5 times, applied 3 times
    worktree = home / "worktrees" / "once"
    assert "(data[mid - 1] + data[mid]) / 2" in (worktree / "stats" / "median.py").read_text()
    assert git(worktree, "status", "--porcelain") == ""
