"""The contract gate: every rule rejects with a message naming it, and a rejected action
changes nothing — not the refs, not the objects, not the files."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pygit2
import pytest
from conftest import Gitrun, git, snapshot

from gitrun.adapter.gate import Gate
from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.errors import Exit, GateRejected
from gitrun.core.records import Action, Budgets
from gitrun.core.task import load_task
from gitrun.store import gitstore, trees

pytestmark = pytest.mark.timeout(120)

TASK = """\
schema = 1

[task]
id = "gate-check"
version = "1"

[policy]
id = "strict"
version = "1"
allowed_actions = ["write_file", "delete_file", "apply_patch"]
write_allowlist = ["src/**", "config/*.toml"]
forbidden_paths = ["src/secret.py", "config/prod.toml"]

[verifier]
command = ["true"]
fail_to_pass = ["tests/test_x.py::test_x"]
pass_to_pass = []

[budgets]
max_proposals = 5
max_steps = 3
max_wall_seconds = 60
"""

APP = "line 1\nline 2\nline 3\nline 4\nline 5\n"


@dataclasses.dataclass
class Scene:
    """A repository with a committed symlink, its task, and a gate over both."""

    dir: Path
    repo: pygit2.Repository
    gate: Gate
    outside: Path

    @property
    def tree(self) -> pygit2.Tree:
        return self.repo.head.peel(pygit2.Commit).tree

    def files(self) -> dict[str, str]:
        """Every path in the working tree (outside .git) with its content digest or link."""
        out: dict[str, str] = {}
        for base in (self.dir, self.outside):
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if d != ".git"]
                for name in dirnames + filenames:
                    p = Path(dirpath) / name
                    if p.is_symlink():
                        out[str(p)] = "link:" + os.readlink(p)
                    elif p.is_file():
                        out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out

    def reject(
        self,
        action: Action,
        used: Budgets | None = None,
        started_at: float | None = None,
        gate: Gate | None = None,
    ) -> GateRejected:
        """Check ``action``; it must be rejected, and nothing may change."""
        before = (snapshot(self.dir), self.files())
        with pytest.raises(GateRejected) as caught:
            (gate or self.gate).check(
                action, self.tree, used or Budgets(), started_at or time.time()
            )
        assert (snapshot(self.dir), self.files()) == before
        assert caught.value.exit_code == Exit.REFUSED
        return caught.value


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    repo_dir = tmp_path / "repo"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target.py").write_text("outside\n")
    for rel, text in {
        "src/app.py": APP,
        "src/secret.py": "KEY = 1\n",
        "config/dev.toml": "a = 1\n",
        "config/prod.toml": "a = 2\n",
        "README.md": "readme\n",
    }.items():
        (repo_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / rel).write_text(text)
    (repo_dir / "src" / "conf").symlink_to("../config")  # committed in the tree
    git(tmp_path, "init", "-q", "-b", "main", str(repo_dir))
    git(repo_dir, "add", ".")
    git(repo_dir, "commit", "-q", "-m", "base")
    (repo_dir / "src" / "ext").symlink_to(outside)  # only on disk, untracked
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    (task_dir / "task.toml").write_text(TASK)
    repo = gitstore.open_repo(repo_dir)
    return Scene(repo_dir, repo, Gate(load_task(task_dir), repo_dir, repo), outside)


def _write(path: str, content: str | None = "x = 1\n") -> Action:
    return Action("write_file", path=path, content=content)


def _patch(path: str, old: str, new: str, *, create: bool = False) -> str:
    if create:
        return (
            f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1 @@\n+{new}\n"
        )
    return (
        f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-{old}\n+{new}\n"
    )


CASES: list[tuple[str, Action, str]] = [
    # (rule, action, a fragment the message must show)
    ("path-absolute", _write("/etc/passwd"), "/etc/passwd"),
    ("path-absolute", _write("C:/Windows/evil.py"), "C:/Windows"),
    ("path-dotdot", _write("../outside/target.py"), "'..'"),
    ("path-dotdot", _write("src/../../outside/target.py"), "'..'"),
    ("path-dotdot", Action("delete_file", path="../outside/target.py"), "'..'"),
    ("path-git-dir", _write(".git/config"), ".git"),
    ("path-git-dir", _write("src/.git/hooks/pre-commit"), ".git"),
    ("path-git-dir", _write(".GIT/config"), ".git"),
    ("path-symlink", _write("src/conf/dev.toml"), "symlink src/conf"),
    ("path-symlink", _write("src/conf"), "symlink src/conf"),
    ("path-symlink", _write("src/ext/target.py"), "on disk"),
    ("path-symlink", Action("delete_file", path="src/conf"), "symlink"),
    ("path-forbidden", _write("src/secret.py"), "src/secret.py"),
    ("path-forbidden", Action("delete_file", path="config/prod.toml"), "config/prod.toml"),
    ("path-not-allowlisted", _write("README.md"), "allowlist"),
    ("path-not-allowlisted", _write("config/nested/x.toml"), "allowlist"),
    ("path-empty", _write(""), "no path"),
    ("path-empty", _write("."), "root"),
    ("path-characters", _write("src\\app.py"), "backslash"),
    ("path-characters", _write("src/a\x00.py"), "NUL"),
    ("missing-path", Action("delete_file", path="src/nope.py"), "src/nope.py"),
    ("malformed-action", _write("src/app.py", content=None), "content"),
    ("malformed-action", Action("apply_patch", patch=""), "patch"),
    (
        "patch-does-not-apply",
        Action("apply_patch", patch=_patch("src/app.py", "not line 1", "x")),
        "src/app.py",
    ),
    (
        "patch-does-not-apply",
        Action("apply_patch", patch=_patch("src/app.py", "", "new", create=True)),
        "already exists",
    ),
    (
        "patch-does-not-apply",
        Action("apply_patch", patch=_patch("src/nope.py", "a", "b")),
        "src/nope.py",
    ),
    (
        "patch-does-not-apply",
        Action("apply_patch", patch="this is not a diff\n"),
        "outside a file patch",
    ),
    (
        "patch-does-not-apply",
        Action("apply_patch", patch=_patch("../outside/target.py", "outside", "x")),
        "../outside/target.py",
    ),
    (
        "patch-does-not-apply",
        Action("apply_patch", patch=_patch(".git/config", "a", "b")),
        ".git/config",
    ),
    (
        "path-forbidden",
        Action("apply_patch", patch=_patch("src/secret.py", "KEY = 1", "KEY = 2")),
        "src/secret.py",
    ),
    (
        "path-not-allowlisted",
        Action("apply_patch", patch=_patch("README.md", "readme", "x")),
        "README.md",
    ),
    (
        "path-symlink",
        Action("apply_patch", patch=_patch("src/conf/dev.toml", "a = 1", "a = 3")),
        "symlink",
    ),
]


@pytest.mark.parametrize(
    ("rule", "action", "fragment"), CASES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(CASES)]
)
def test_gate_rule_rejects_with_its_name_and_changes_nothing(
    scene: Scene, rule: str, action: Action, fragment: str
) -> None:
    exc = scene.reject(action)
    assert exc.rule == rule
    assert str(exc).startswith(f"{rule}: ")
    assert fragment in str(exc)
    assert "\n" not in str(exc)


def test_action_kind_outside_the_policy_is_rejected_as_action_not_allowed(scene: Scene) -> None:
    task = scene.gate.task
    narrow = dataclasses.replace(
        task, policy=dataclasses.replace(task.policy, allowed_actions=("apply_patch",))
    )
    gate = Gate(narrow, scene.dir, scene.repo)
    for action in (_write("src/app.py"), Action("delete_file", path="src/app.py")):
        exc = scene.reject(action, gate=gate)
        assert exc.rule == "action-not-allowed"
        assert action.kind in str(exc)
        assert "strict@1" in str(exc)  # names the policy and its version


BUDGETS: list[tuple[str, Budgets, float]] = [
    ("budget-proposals", Budgets(proposals=5), 0.0),
    ("budget-steps", Budgets(steps=3), 0.0),
    ("budget-wall-time", Budgets(wall_seconds=60.0), 0.0),
    ("budget-wall-time", Budgets(wall_seconds=30.0), 31.0),  # this segment's time counts too
]


@pytest.mark.parametrize(
    ("rule", "used", "ago"), BUDGETS, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BUDGETS)]
)
def test_exhausted_budget_rejects_even_a_valid_action(
    scene: Scene, rule: str, used: Budgets, ago: float
) -> None:
    exc = scene.reject(_write("src/app.py"), used=used, started_at=time.time() - ago)
    assert exc.rule == rule
    assert str(exc).startswith(f"{rule}: ")


def test_symlink_in_the_tree_is_refused_even_when_the_disk_shows_a_plain_directory(
    scene: Scene,
) -> None:
    link = scene.dir / "src" / "conf"
    link.unlink()
    link.mkdir()
    (link / "dev.toml").write_text("a = 1\n")
    exc = scene.reject(_write("src/conf/dev.toml"))
    assert exc.rule == "path-symlink"
    assert "on disk" not in str(exc)


def test_a_valid_action_passes_with_its_path_normalised_and_nothing_written(scene: Scene) -> None:
    before = (snapshot(scene.dir), scene.files())
    used = Budgets(proposals=4, steps=2, wall_seconds=10.0)
    for raw in ("src/app.py", "./src/app.py", "src//app.py", "src/./app.py"):
        checked = scene.gate.check(_write(raw), scene.tree, used, time.time())
        assert checked.path == "src/app.py"
    patch = Action("apply_patch", patch=_patch("src/app.py", "line 1", "LINE 1"))
    assert scene.gate.check(patch, scene.tree, used, time.time()) == patch
    assert (snapshot(scene.dir), scene.files()) == before


def test_the_execute_time_recheck_is_skipped_only_for_the_same_action_on_the_same_tree(
    scene: Scene,
) -> None:
    """The re-check a pending action passes when it executes (no disk) is not run twice
    for an action that passed unchanged on that tree; any other action or tree is checked."""
    action = _write("src/app.py")
    assert scene.gate.check(action, scene.tree, Budgets(), time.time()) == action
    assert scene.gate.check_action(action, scene.tree, on_disk=False) == action
    # The same action on a tree where its path is now a symlink: checked, and refused.
    link = scene.repo.create_blob(b"../config/dev.toml")
    linked = scene.repo[
        trees.tree_with_changes(scene.repo, scene.tree, {"src/app.py": (link, trees.LINK)})
    ]
    assert isinstance(linked, pygit2.Tree)
    with pytest.raises(GateRejected) as caught:
        scene.gate.check_action(action, linked, on_disk=False)
    assert caught.value.rule == "path-symlink"
    # Another action on the tree that passed: checked, and refused.
    with pytest.raises(GateRejected) as caught:
        scene.gate.check_action(_write("src/secret.py"), scene.tree, on_disk=False)
    assert caught.value.rule == "path-forbidden"
    # A path the check normalises is no pass for the raw action: it is checked again.
    raw = _write("./src/secret.py")
    with pytest.raises(GateRejected):
        scene.gate.check_action(raw, scene.tree, on_disk=False)


# -- end to end through the CLI ----------------------------------------------------------

MARKER = "gitrun-gate-escape-marker-7f3a"


def _plan(steps: list[str], fix: bool = True) -> str:
    body = "schema = 1\n"
    for path in steps:
        body += f'\n[[step]]\nkind = "write_file"\npath = "{path}"\ncontent = "# {MARKER}\\n"\n'
    if fix:
        body += '\n[[step]]\nkind = "apply_patch"\npatch_file = "patches/fix.diff"\n'
    return body


def _rejections(gitrun: Gitrun, run_id: str) -> list[dict[str, str]]:
    chain = service.checkpoints(run_id, service.Options(Workspace(gitrun.home)))
    return [
        ev.data
        for stored in reversed(chain)
        for ev in stored.state.events
        if ev.kind == "gate_rejected"
    ]


def _files_with_marker(root: Path, skip: set[Path]) -> list[Path]:
    hits = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            if path not in skip and not path.is_symlink() and MARKER.encode() in path.read_bytes():
                hits.append(path)
    return hits


def test_plan_writing_outside_the_worktree_or_into_git_is_rejected_recorded_and_writes_nothing(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    task_dir = sandbox_copy("fix-median")
    escapes = [
        "../outside.py",
        "../../../escaped.py",
        ".git/config",
        "stats/../../up.py",
        str(tmp_path / "absolute.py"),
    ]
    (task_dir / "plan.toml").write_text(_plan(escapes))
    res = gitrun("run", str(task_dir), "--run-id", "escape")
    assert res.code == Exit.DONE, res.err
    assert res.out.strip().endswith("done (8/8 required tests passed)")
    assert "Traceback" not in res.out + res.err

    rules = [(r["rule"], r["action"]) for r in _rejections(gitrun, "escape")]
    assert rules == [
        ("path-dotdot", "write_file ../outside.py"),
        ("path-dotdot", "write_file ../../../escaped.py"),
        ("path-git-dir", "write_file .git/config"),
        ("path-dotdot", "write_file stats/../../up.py"),
        ("path-absolute", f"write_file {tmp_path / 'absolute.py'}"),
    ]
    assert _files_with_marker(tmp_path, skip={task_dir / "plan.toml"}) == []
    worktree = gitrun.home / "worktrees" / "escape"
    assert sorted(p.name for p in worktree.parent.iterdir()) == ["escape"]
    repo = gitrun.repo("fix-median")
    receipts = service.receipts("escape", service.Options(Workspace(gitrun.home)))
    assert [r["paths"] for r in receipts] == [["stats/median.py"]]
    assert git(repo, "rev-list", "--count", "main..gitrun/escape").strip() == "1"
    git(repo, "fsck", "--strict")


def test_run_that_spends_its_proposals_on_rejections_ends_failed_cleanly(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task_dir = sandbox_copy("fix-median")
    toml = (task_dir / "task.toml").read_text().replace("max_proposals = 20", "max_proposals = 2")
    (task_dir / "task.toml").write_text(toml)
    (task_dir / "plan.toml").write_text(_plan(["tests/test_median.py", "setup.py"]))
    res = gitrun("run", str(task_dir), "--run-id", "spent")
    assert res.code == Exit.FAILED, res.err
    assert res.out.strip() == "run spent: failed (budget_exhausted)"
    assert "Traceback" not in res.out + res.err
    assert [r["rule"] for r in _rejections(gitrun, "spent")] == [
        "path-forbidden",
        "path-not-allowlisted",
        "budget-proposals",
    ]
    repo = gitrun.repo("fix-median")
    assert git(repo, "rev-parse", "gitrun/spent").strip() == git(repo, "rev-parse", "main").strip()
    worktree = gitrun.home / "worktrees" / "spent"
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""
    status = gitrun("status", "spent", "--json")
    assert '"phase": "failed"' in status.out
