"""git inside exec steps (issue #30): each command sees the run's worktree as an ordinary
checkout of the run's base through a private git dir made for the step; the real
repository's refs, config, hooks and objects stay untouched, and only the worktree change
becomes the receipt. Real git, the real CLI, bubblewrap when the machine has it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git
from test_exec import RUN, record, task_with, worktree

from gitrun.adapter import gitview, sandbox
from gitrun.core.errors import Exit
from gitrun.store import gitstore

pytestmark = pytest.mark.timeout(120)
RENAME = "sed -i 's/calc_area/circle_area/g' geometry/shapes.py"

BWRAP = shutil.which("bwrap") is not None and sandbox.bwrap_works("bwrap")


def repo_of(cli: Gitrun) -> Path:
    return Path(record(cli)["repo"])


def commits(cli: Gitrun) -> list[str]:
    """The run's receipts, newest first."""
    return git(repo_of(cli), "rev-list", f"{record(cli)['base_commit']}..gitrun/{RUN}").split()


def output(cli: Gitrun, rev: str, stream: str = "stdout") -> str:
    fmt = "--format=%(trailers:key=Gitrun-Output,valueonly)"
    oid = git(repo_of(cli), "log", "-1", fmt, rev).strip()
    return git(repo_of(cli), "show", f"{oid}:{stream}")


def refs(repo: Path) -> str:
    """Every ref but the run's own (which its receipts move) and gitrun's bookkeeping."""
    lines = git(repo, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
    own = ("refs/gitrun/", f"refs/heads/gitrun/{RUN} ")
    return "\n".join(line for line in lines if not line.startswith(own))


def own_repo(task: Path, where: Path) -> Path:
    """A repository of the task's files with a tag and a second branch (``--repo``)."""
    shutil.copytree(task / "repo", where)
    git(where, "init", "-q", "-b", "main")
    git(where, "add", "-A")
    git(where, "commit", "-qm", "base: geometry package still calling calc_area")
    git(where, "tag", "v1")
    git(where, "branch", "other")
    return where


def run(cli: Gitrun, task: Path, *args: str) -> None:
    """Run the plan to its end (the verifier's verdict does not matter here)."""
    res = cli("run", str(task), "--run-id", RUN, *args)
    assert res.code in (Exit.DONE, Exit.FAILED), res.err
    assert "verifier:" in res.err, res.err


@pytest.mark.parametrize("isolation", ["auto", "none"])
def test_git_in_a_step_reads_the_run_as_an_uncommitted_change_on_its_base(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], isolation: str
) -> None:
    if isolation == "auto" and not BWRAP:
        pytest.skip("bubblewrap cannot run here")
    look = (
        "git status --porcelain && git diff --stat && git diff --cached --stat && "
        "git log --format=%s && git show --stat --format=%s HEAD | head -1 && "
        "git blame -s -L1,1 geometry/shapes.py | sed 's/^[^ ]* //' && "
        "git grep -c circle_area -- geometry && cd geometry && git diff --name-only HEAD && "
        "git rev-parse --show-toplevel --abbrev-ref HEAD && git diff > fix.patch"
    )
    task = task_with(sandbox_copy, [{"command": RENAME}, {"command": look}])
    run(gitrun, task, "--isolation", isolation)
    first, second = reversed(commits(gitrun))
    seen = output(gitrun, second).splitlines()
    base = record(gitrun)["base_commit"]
    wt = worktree(gitrun)
    assert seen == [
        " M geometry/shapes.py",  # the first step's receipt: an uncommitted change here
        " geometry/shapes.py | 2 +-",
        " 1 file changed, 1 insertion(+), 1 deletion(-)",
        "base: geometry package still calling calc_area",  # only the base: no receipts
        "base: geometry package still calling calc_area",
        "1) import math",
        "geometry/shapes.py:1",
        "geometry/shapes.py",
        str(wt),
        f"gitrun/{RUN}",
    ], output(gitrun, second, "stderr")
    repo = repo_of(gitrun)
    patch = git(repo, "show", f"{second}:geometry/fix.patch")
    assert patch == git(repo, "diff", base, first, "--", "geometry")  # the real diff
    assert git(repo, "diff", "--name-only", first, second).split() == ["geometry/fix.patch"]


def test_index_commands_work_inside_one_step_and_only_the_worktree_change_is_kept(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    shuffle = (
        "sed -i 's/calc_area/circle_area/g' geometry/report.py && git add -A && "
        "git diff --cached --name-only && git stash -q && git status --porcelain && "
        "echo stashed && git stash pop -q && git diff --name-only && "
        "git checkout -- geometry/shapes.py && git diff HEAD > /tmp/d && "
        "git apply -R /tmp/d && git apply /tmp/d && git apply --cached /tmp/d && "
        "git diff --cached --name-only"
    )
    task = task_with(sandbox_copy, [{"command": RENAME}, {"command": shuffle}])
    run(gitrun, task)
    first, second = reversed(commits(gitrun))
    assert output(gitrun, second).splitlines() == [
        "geometry/report.py",
        "geometry/shapes.py",
        "stashed",  # git stash took both changes away: the porcelain status was empty
        "geometry/report.py",
        "geometry/shapes.py",
        "geometry/report.py",
    ], output(gitrun, second, "stderr")
    repo = repo_of(gitrun)
    base = record(gitrun)["base_commit"]
    # shapes.py checked out from the index (the base): the receipt undoes the first step
    assert git(repo, "diff", "--name-only", base, second).split() == ["geometry/report.py"]
    assert git(repo, "diff", "--name-only", first, second).split() == [
        "geometry/report.py", "geometry/shapes.py",
    ]  # fmt: skip


def test_git_commit_in_a_step_is_refused_with_a_line_and_nothing_outside_moves(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    steps: list[dict[str, object]] = [
        {"command": RENAME + " && git add -A && git commit -qm mine; echo commit=$?"},
        {"command": "git -c core.hooksPath=/dev/null commit -qam forced; echo forced=$?; "
         "git log --format=%s -1; git stash list | wc -l; git tag t; git branch b; echo ok"},
        {"command": "git log --format=%s; git branch --format='%(refname)'; git tag; "
         "git stash list; git config user.name"},
    ]  # fmt: skip
    task = task_with(sandbox_copy, steps)
    repo = own_repo(task, tmp_path / "repo")
    before = refs(repo)
    run(gitrun, task, "--repo", str(repo))
    first, second, third = reversed(commits(gitrun))
    said = output(gitrun, first, "stderr")
    assert "gitrun: refused: git commit" in said
    assert "gitrun commits the command's whole worktree change itself" in said
    assert output(gitrun, first) == "commit=128\n"  # git's own code for the aborted update
    assert git(repo, "diff", "--name-only", f"{first}~1", first).split() == ["geometry/shapes.py"]
    # forced past the hook, the commit only lands in the step's own git dir: thrown away
    assert output(gitrun, second).splitlines() == ["forced=0", "forced", "0", "ok"]
    base_subject = "base: geometry package still calling calc_area"
    assert output(gitrun, third).splitlines() == [
        base_subject, f"refs/heads/gitrun/{RUN}", "gitrun agent",
    ], output(gitrun, third, "stderr")  # fmt: skip
    assert refs(repo) == before  # no branch, tag or stash of the real repository moved
    first_parent = git(repo, "log", "--format=%s", f"refs/heads/gitrun/{RUN}~3", "-1")
    assert first_parent == base_subject + "\n"
    assert git(repo, "diff", "--name-only", second, third) == ""


def test_the_repositorys_config_hooks_and_filters_never_run_inside_the_view(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    """A config that runs commands (fsmonitor, hooks, filters, diff.external, aliases)
    in the repository is not the view's: git in the step runs none of it."""
    task = task_with(
        sandbox_copy,
        [{"command": RENAME + " && git status -s && git diff --stat && git add -A && "
          "git stash -q && git stash pop -q && git st; echo alias=$?"}],
    )  # fmt: skip
    (task / "repo" / ".gitattributes").write_text("*.py filter=x\n")
    repo = own_repo(task, tmp_path / "repo")
    mark = "touch geometry/PWNED-$(basename $0)"
    evil = tmp_path / "evil"
    evil.mkdir()
    for name in ("fsmonitor", "external", "clean", "pre-commit", "post-checkout", "alias"):
        script = evil / name
        script.write_text(f'#!/bin/sh\ncd "$(git rev-parse --show-toplevel)"; {mark}\ncat\n')
        script.chmod(0o755)
    for key, value in {
        "core.fsmonitor": str(evil / "fsmonitor"),
        "core.hooksPath": str(evil),
        "diff.external": str(evil / "external"),
        "filter.x.clean": str(evil / "clean"),
        "filter.x.required": "true",
        "alias.st": f"!{evil / 'alias'}",
    }.items():
        git(repo, "config", key, value)
    run(gitrun, task, "--isolation", "none", "--repo", str(repo))
    (tip,) = commits(gitrun)
    said = output(gitrun, tip) + output(gitrun, tip, "stderr")
    assert "alias=1" in said  # the repository's alias is not the view's
    assert git(repo, "diff", "--name-only", f"{tip}~1", tip).split() == ["geometry/shapes.py"]
    assert not list(worktree(gitrun).rglob("PWNED-*")), said


def test_the_worktrees_git_file_and_git_dir_are_left_as_gitrun_made_them(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    if not BWRAP:
        pytest.skip("bubblewrap cannot run here")
    task = task_with(sandbox_copy, [{"command": "git status -s; git add -A; git gc -q; true"}])
    run(gitrun, task)
    wt = worktree(gitrun)
    gitfile = (wt / ".git").read_text()
    gitdir = Path(gitfile.removeprefix("gitdir: ").strip())
    assert gitdir.is_dir()
    kept = sorted(p.name for p in gitdir.iterdir())
    assert not {"config", "hooks", "objects", "refs"} & set(kept), kept  # no view landed here
    assert json.loads(gitrun("status", RUN, "--json").out)["phase"] in ("done", "failed")
    assert git(wt, "rev-parse", "HEAD") == git(repo_of(gitrun), "rev-parse", f"gitrun/{RUN}")


def test_a_lost_index_cache_is_made_again_and_git_still_reads_the_base(tmp_path: Path) -> None:
    repo_dir = own_repo(SANDBOXES / "rename-api", tmp_path / "repo")
    git(repo_dir, "worktree", "add", "-q", "--detach", str(tmp_path / "wt"), "main")
    wt = tmp_path / "wt"
    gitdir = Path((wt / ".git").read_text().removeprefix("gitdir: ").strip())
    base = git(repo_dir, "rev-parse", "main").strip()
    view = gitview.GitView(base, "gitrun/x", repo_dir / ".git" / "objects", gitdir)
    repo = gitstore.open_repo(repo_dir)
    (wt / "geometry" / "shapes.py").write_text("changed\n")
    for attempt in ("first", "cache lost"):
        if attempt == "cache lost":
            (gitdir / gitview.INDEX_CACHE).unlink()
        made = gitview.make(view, repo, tmp_path / attempt, wt, confined=False)
        env = gitview.child_env({"PATH": os.environ["PATH"], "HOME": str(tmp_path)}, made)
        seen = subprocess.run(
            ["git", "status", "--porcelain"], cwd=wt, env=env, capture_output=True, text=True,
            check=True,
        ).stdout  # fmt: skip
        assert seen == " M geometry/shapes.py\n", attempt
