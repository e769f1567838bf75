"""Bad input through the real CLI: exit code 2, one line on stderr starting `gitrun:`,
never a traceback, and nothing created — no run registry, no key, no refs."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, Result, git, snapshot

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(60)

MEDIAN = SANDBOXES / "fix-median"


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (to prove nothing was created or changed)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _bad_input(gitrun: Gitrun, *args: str, expect: tuple[str, ...] = ()) -> str:
    """Run the CLI; it must refuse as bad input and leave the workspace as it was."""
    before = _tree(gitrun.home)
    res = gitrun(*args)
    _assert_one_line(res, Exit.BAD_INPUT)
    for fragment in expect:
        assert fragment in res.err, (fragment, res.err)
    assert _tree(gitrun.home) == before
    return res.err


def _assert_one_line(res: Result, code: int) -> None:
    assert res.code == code, (res.code, res.out, res.err)
    lines = res.err.splitlines()
    assert len(lines) == 1, res.err
    assert lines[0].startswith("gitrun: ")
    assert len(lines[0]) > len("gitrun: ") + 10
    assert "Traceback" not in res.out + res.err
    assert "internal error" not in res.err


@pytest.fixture
def task_copy(sandbox_copy: Callable[[str], Path]) -> Path:
    return sandbox_copy("fix-median")


def _edit(task_dir: Path, old: str, new: str) -> Path:
    path = task_dir / "task.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


# -- the task directory and task.toml ----------------------------------------------------


def test_missing_task_directory_is_bad_input(gitrun: Gitrun, tmp_path: Path) -> None:
    _bad_input(gitrun, "run", str(tmp_path / "no-such-task"), expect=("no-such-task", "task.toml"))


def test_directory_without_task_toml_is_bad_input(gitrun: Gitrun, tmp_path: Path) -> None:
    empty = tmp_path / "empty-task"
    empty.mkdir()
    _bad_input(gitrun, "run", str(empty), expect=(str(empty / "task.toml"), "missing"))


def test_task_toml_that_is_not_toml_names_the_file(gitrun: Gitrun, task_copy: Path) -> None:
    path = task_copy / "task.toml"
    path.write_text(path.read_text() + "\n[budgets\nbroken = \n")
    _bad_input(gitrun, "run", str(task_copy), expect=(str(path), "not valid TOML", "line"))


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('version = "1"\ntitle', 'version = "1"\ncolour = "red"\ntitle', "task.colour"),
        ("max_steps = 10", "max_steps = 10\nmax_cost = 3", "budgets.max_cost"),
        ("[budgets]", "[surprise]\nx = 1\n\n[budgets]", "surprise"),
    ],
    ids=["task-field", "budgets-field", "table"],
)
def test_task_toml_unknown_field_names_the_file_and_field(
    gitrun: Gitrun, task_copy: Path, old: str, new: str, field: str
) -> None:
    path = _edit(task_copy, old, new)
    err = _bad_input(gitrun, "run", str(task_copy), expect=(str(path), field))
    assert "unknown" in err


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("max_steps = 10\n", "", "budgets.max_steps"),
        (
            '[policy]\nid = "default"\nversion = "1"\n',
            '[policy]\nid = "default"\n',
            "policy.version",
        ),
        ("max_steps = 10", 'max_steps = "ten"', "budgets.max_steps"),
        ("schema = 1\n", "", "schema"),
    ],
    ids=["missing-budget", "missing-policy-version", "wrong-type", "missing-schema"],
)
def test_task_toml_missing_or_wrong_field_names_the_file_and_field(
    gitrun: Gitrun, task_copy: Path, old: str, new: str, field: str
) -> None:
    path = _edit(task_copy, old, new)
    _bad_input(gitrun, "run", str(task_copy), expect=(str(path), field))


def test_plan_file_with_an_unknown_step_field_is_bad_input(gitrun: Gitrun, task_copy: Path) -> None:
    plan = task_copy / "plan.toml"
    plan.write_text(plan.read_text() + 'shell = "rm -rf /"\n')
    _bad_input(gitrun, "run", str(task_copy), expect=(str(plan), "shell"))


# -- agents ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["robot", "shell:make fix", "patch:", "plan:"])
def test_unknown_agent_spec_is_bad_input(gitrun: Gitrun, spec: str) -> None:
    _bad_input(gitrun, "run", str(MEDIAN), "--agent", spec, expect=("agent",))


def test_patch_agent_with_a_missing_file_is_bad_input(gitrun: Gitrun, tmp_path: Path) -> None:
    missing = tmp_path / "model.patch"
    _bad_input(
        gitrun,
        "run",
        str(MEDIAN),
        "--agent",
        f"patch:{missing}",
        expect=(str(missing), "no such file"),
    )


def test_patch_agent_with_an_empty_file_is_bad_input(gitrun: Gitrun, tmp_path: Path) -> None:
    empty = tmp_path / "empty.patch"
    empty.write_text("\n")
    _bad_input(gitrun, "run", str(MEDIAN), "--agent", f"patch:{empty}", expect=("empty",))


# -- --repo ------------------------------------------------------------------------------


def _user_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "user-repo"
    repo.mkdir()
    (repo / "calc.py").write_text("x = 1\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    return repo


def test_repo_with_uncommitted_changes_is_refused_untouched(gitrun: Gitrun, tmp_path: Path) -> None:
    repo = _user_repo(tmp_path)
    (repo / "calc.py").write_text("x = 2  # work in progress\n")
    before = snapshot(repo)
    _bad_input(
        gitrun,
        "run",
        str(MEDIAN),
        "--repo",
        str(repo),
        "--run-id",
        "dirty",
        expect=("uncommitted", "calc.py"),
    )
    assert snapshot(repo) == before
    assert (repo / "calc.py").read_text() == "x = 2  # work in progress\n"
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


def test_repo_that_is_not_a_git_repository_is_bad_input(gitrun: Gitrun, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    _bad_input(gitrun, "run", str(MEDIAN), "--repo", str(plain), expect=("not a git repository",))
    assert list(plain.iterdir()) == []
    _bad_input(gitrun, "run", str(MEDIAN), "--repo", str(tmp_path / "absent"), expect=("absent",))


def test_repo_with_no_commits_is_bad_input(gitrun: Gitrun, tmp_path: Path) -> None:
    repo = tmp_path / "unborn"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    _bad_input(gitrun, "run", str(MEDIAN), "--repo", str(repo), expect=("no commits",))


def test_repo_that_already_has_the_runs_branch_is_bad_input(gitrun: Gitrun, tmp_path: Path) -> None:
    repo = _user_repo(tmp_path)
    git(repo, "branch", "gitrun/taken")
    before = snapshot(repo)
    _bad_input(
        gitrun,
        "run",
        str(MEDIAN),
        "--repo",
        str(repo),
        "--run-id",
        "taken",
        expect=("gitrun/taken", "already exists"),
    )
    assert snapshot(repo) == before


# -- run ids -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "resume", "receipts", "checkpoints"])
def test_unknown_run_id_is_bad_input(gitrun: Gitrun, command: str) -> None:
    _bad_input(gitrun, command, "no-such-run", expect=("unknown run id", "no-such-run"))


def test_unknown_run_id_in_checkpoint_verify_is_bad_input(gitrun: Gitrun) -> None:
    _bad_input(gitrun, "checkpoint", "verify", "no-such-run", expect=("unknown run id",))


@pytest.mark.parametrize(
    "run_id", ["../escape", "a/b", "has space", "x.lock", "-dash", "a" * 65, "ü"]
)
def test_invalid_run_id_characters_are_bad_input(gitrun: Gitrun, run_id: str) -> None:
    _bad_input(gitrun, "run", str(MEDIAN), f"--run-id={run_id}", expect=("run id", "not valid"))


@pytest.mark.parametrize("command", ["status", "resume", "receipts"])
def test_run_id_that_could_escape_the_registry_is_bad_input(gitrun: Gitrun, command: str) -> None:
    (gitrun.home / "secret.json").write_text("{}")  # what ../secret would reach
    _bad_input(gitrun, command, "../secret", expect=("run id", "not valid"))


def test_run_id_that_already_exists_with_other_inputs_is_refused_without_touching_the_run(
    gitrun: Gitrun,
) -> None:
    first = gitrun("run", str(MEDIAN), "--run-id", "once", "-q")
    assert first.code == Exit.DONE, first.err
    repo = gitrun.repo("fix-median")
    refs_before = snapshot(repo)
    patch = gitrun.home.parent / "model.patch"
    patch.write_bytes((MEDIAN / "model.patch").read_bytes())
    err = _bad_input(
        gitrun,
        "run",
        str(MEDIAN),
        "--run-id",
        "once",
        "--agent",
        f"patch:{patch}",
        expect=("once", "already exists", "agent"),
    )
    assert "gitrun resume once" in err
    assert snapshot(repo) == refs_before
    again = gitrun("status", "once", "--json")
    assert again.code == 0
    assert '"phase": "done"' in again.out


# -- the command line itself -------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("frobnicate",), "frobnicate"),
        (("run", str(MEDIAN), "--bogus"), "--bogus"),
        (("status", "x", "--verbose"), "--verbose"),
        (("run",), "task_dir"),
        (("status",), "run_id"),
        (("run", str(MEDIAN), "--lease-seconds", "0"), "lease-seconds"),
        (("run", str(MEDIAN), "--lease-seconds", "soon"), "lease-seconds"),
        (("resume", "x", "--takeover-after", "-1"), "takeover-after"),
    ],
    ids=[
        "command",
        "run-option",
        "status-option",
        "run-no-task",
        "status-no-id",
        "lease-zero",
        "lease-text",
        "takeover-negative",
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    gitrun: Gitrun, args: tuple[str, ...], fragment: str
) -> None:
    err = _bad_input(gitrun, *args)
    assert re.search(re.escape(fragment), err, re.IGNORECASE), err
