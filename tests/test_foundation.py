"""Issue 2 acceptance: bundled sandboxes end `done` with receipts plain git can read,
sandbox base commits are deterministic, `--repo` runs on a user's repository, and the
adapter performs each keyed write exactly once against a real repository."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pygit2
import pytest
from conftest import RISKY_SANDBOXES, ROOT, SANDBOX_NAMES, SANDBOXES, Gitrun, Result, git

from gitrun.adapter.environment import TRAILERS, Environment, Outcome, index_ref
from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.errors import EnvironmentDrift, Exit, ReceiptConflict, ReceiptDrift
from gitrun.core.records import Action, Precondition
from gitrun.core.task import load_task
from gitrun.store import gitstore, trees
from gitrun.store.lease import LeaseManager

pytestmark = pytest.mark.timeout(120)

STATUS_KEYS = {
    "run_id",
    "task_id",
    "phase",
    "stop_reason",
    "repo",
    "worktree",
    "branch",
    "head",
    "pending",
    "receipts",
    "verifier",
}


def _done(res: Result, run_id: str) -> None:
    assert res.code == Exit.DONE, res.err
    assert res.out.strip().splitlines()[-1].startswith(f"run {run_id}: done"), res.out
    assert "Traceback" not in res.out + res.err


def _json(gitrun: Gitrun, *args: str) -> object:
    res = gitrun(*args)
    assert res.code == 0, res.err
    return json.loads(res.out)


def _trailer_keys(repo: Path, rev: str) -> list[str]:
    out = git(repo, "log", "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)", rev)
    return [line for line in out.splitlines() if line.strip()]


def _parsed_trailers(repo: Path, commit: str) -> dict[str, str]:
    message = git(repo, "log", "-1", "--format=%B", commit)
    proc = subprocess.run(
        ["git", "-C", str(repo), "interpret-trailers", "--parse"],
        input=message,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines())


def _trace(gitrun: Gitrun, run_id: str) -> list[tuple[str, object]]:
    """Every trace event of the run, oldest first, from the verified checkpoint chain."""
    chain = service.checkpoints(run_id, service.Options(Workspace(gitrun.home)))
    return [(ev.kind, ev.data) for stored in reversed(chain) for ev in stored.state.events]


def _worktrees(repo: Path) -> dict[Path, str]:
    """`git worktree list --porcelain` as {resolved path: branch ref}."""
    out: dict[Path, str] = {}
    path: Path | None = None
    for line in git(repo, "worktree", "list", "--porcelain").splitlines():
        if line.startswith("worktree "):
            path = Path(line.removeprefix("worktree ")).resolve()
            out[path] = ""
        elif line.startswith("branch ") and path is not None:
            out[path] = line.removeprefix("branch ")
    return out


# -- bundled sandboxes through the real CLI ----------------------------------------------


@pytest.mark.parametrize("name", SANDBOX_NAMES)
def test_each_bundled_sandbox_ends_done_with_one_git_readable_receipt_per_write(
    gitrun: Gitrun, name: str
) -> None:
    run_id = f"acc-{name}"
    _done(gitrun("run", str(SANDBOXES / name), "--run-id", run_id), run_id)
    task = load_task(SANDBOXES / name)
    repo = gitrun.repo(task.id)
    branch = f"gitrun/{run_id}"

    status = _json(gitrun, "status", run_id, "--json")
    assert isinstance(status, dict)
    assert set(status) >= STATUS_KEYS
    tip = git(repo, "rev-parse", f"refs/heads/{branch}").strip()
    assert (status["run_id"], status["task_id"], status["phase"]) == (run_id, task.id, "done")
    assert status["stop_reason"] == "verified"
    assert status["branch"] == branch
    assert status["head"] == tip
    assert status["pending"] is None
    assert Path(status["repo"]).resolve() == repo.resolve()
    assert status["verifier"]["passed"] is True
    assert status["verifier"]["head"] == tip
    assert status["verifier"]["tree"] == git(repo, "rev-parse", f"{tip}^{{tree}}").strip()

    receipts = _json(gitrun, "receipts", run_id, "--json")
    assert isinstance(receipts, list)
    keys = _trailer_keys(repo, branch)
    writes = int(git(repo, "rev-list", "--count", f"main..{branch}"))
    assert writes >= 1
    assert len(keys) == writes == len(receipts) == len(status["receipts"])
    assert len(set(keys)) == len(keys)
    assert (
        list(reversed(keys))
        == [r["key"] for r in receipts]
        == [r["key"] for r in status["receipts"]]
    )
    assert receipts[-1]["commit"] == tip

    for receipt in receipts:
        trailers = _parsed_trailers(repo, receipt["commit"])
        assert set(TRAILERS) <= set(trailers), trailers
        assert trailers["Gitrun-Run"] == run_id
        assert trailers["Gitrun-Task"] == f"{task.id}@{task.version}"
        assert trailers["Gitrun-Idempotency-Key"] == receipt["key"]
        assert trailers["Gitrun-Intent-Digest"] == receipt["intent_digest"]
        assert trailers["Gitrun-Action"] == receipt["action"]
        assert trailers["Gitrun-Instance"] == status["instance_id"]

    git(repo, "fsck", "--strict")
    worktree = Path(status["worktree"]).resolve()
    assert _worktrees(repo).get(worktree) == f"refs/heads/{branch}"
    assert git(worktree, "status", "--porcelain") == ""
    assert (
        git(repo, "rev-parse", "main").strip()
        == trees.hash_base(Path(task.initial.repo_dir or ""), task.initial.message)[0]
    )


def test_guarded_config_run_records_the_gate_rejection_and_leaves_the_forbidden_file_alone(
    gitrun: Gitrun,
) -> None:
    run_id = "guarded"
    res = gitrun("run", str(SANDBOXES / "guarded-config"), "--run-id", run_id)
    _done(res, run_id)
    assert "path-forbidden" in res.err  # the progress output shows the rejection as it happens
    listing = gitrun("checkpoints", run_id)
    assert listing.code == 0
    assert "gate_rejected" in listing.out

    rejected = [data for kind, data in _trace(gitrun, run_id) if kind == "gate_rejected"]
    assert len(rejected) == 1
    assert isinstance(rejected[0], dict)
    assert rejected[0]["rule"] == "path-forbidden"
    assert "config/defaults.toml" in rejected[0]["message"]

    repo = gitrun.repo("guarded-config")
    branch = f"gitrun/{run_id}"
    original = (SANDBOXES / "guarded-config" / "repo" / "config" / "defaults.toml").read_text()
    assert git(repo, "show", f"{branch}:config/defaults.toml") == original
    assert "config/defaults.toml" not in git(repo, "diff", "--name-only", "main", branch)
    worktree = gitrun.home / "worktrees" / run_id
    assert (worktree / "config" / "defaults.toml").read_text() == original


def test_patch_agent_applies_the_model_patch_and_ends_done(gitrun: Gitrun) -> None:
    run_id = "model-patch"
    proc = subprocess.run(
        gitrun.argv(
            "run",
            "sandboxes/fix-median",
            "--agent",
            "patch:sandboxes/fix-median/model.patch",
            "--run-id",
            run_id,
        ),
        capture_output=True,
        text=True,
        env=gitrun.env(),
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    _done(Result(proc.returncode, proc.stdout, proc.stderr), run_id)
    receipts = _json(gitrun, "receipts", run_id, "--json")
    assert isinstance(receipts, list)
    assert [(r["action"], r["paths"]) for r in receipts] == [("apply_patch", ["stats/median.py"])]
    median = (gitrun.home / "worktrees" / run_id / "stats" / "median.py").read_text()
    assert "(lower + upper) / 2" in median


@pytest.mark.parametrize("name", sorted(SANDBOX_NAMES + RISKY_SANDBOXES))
def test_sandbox_base_commit_is_identical_in_two_workspaces_and_equals_hash_base(
    tmp_path: Path, name: str
) -> None:
    task = load_task(SANDBOXES / name)
    _, first = Workspace(tmp_path / "one").sandbox_repo(task)
    _, second = Workspace(tmp_path / "elsewhere" / "two").sandbox_repo(task)
    assert first == second
    commit, tree = trees.hash_base(Path(task.initial.repo_dir or ""), task.initial.message)
    assert str(first) == commit
    for home in (tmp_path / "one", tmp_path / "elsewhere" / "two"):
        repo = home / "repos" / task.id
        assert git(repo, "rev-parse", "main").strip() == commit
        assert git(repo, "rev-parse", "main^{tree}").strip() == tree
        git(repo, "fsck", "--strict")
        assert git(repo, "status", "--porcelain") == ""


# -- your own repository with --repo -----------------------------------------------------

_OWN_TASK = """\
schema = 1

[task]
id = "own-repo"
version = "1"

[policy]
id = "p"
version = "1"
allowed_actions = ["write_file"]
write_allowlist = ["calc/**"]
forbidden_paths = ["tests/**"]

[verifier]
command = ["{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
fail_to_pass = ["tests/test_calc.py::test_add"]
pass_to_pass = ["tests/test_calc.py::test_neg"]
timeout_seconds = 60

[budgets]
max_proposals = 5
max_steps = 5
max_wall_seconds = 300

[agent]
plan = "plan.toml"
"""

_OWN_PLAN = """\
schema = 1

[[step]]
kind = "write_file"
path = "calc/__init__.py"
content = "def add(a, b):\\n    return a + b\\n\\n\\ndef neg(a):\\n    return -a\\n"
description = "add() subtracted instead of adding"
"""


def test_run_with_repo_works_on_the_users_own_repository(gitrun: Gitrun, tmp_path: Path) -> None:
    repo = tmp_path / "mine"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text(
        "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n"
    )
    (repo / "tests" / "test_calc.py").write_text(
        "from calc import add, neg\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_neg():\n    assert neg(2) == -2\n"
    )
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    (task_dir / "task.toml").write_text(_OWN_TASK)
    (task_dir / "plan.toml").write_text(_OWN_PLAN)
    assert "initial" not in tomllib.loads(_OWN_TASK)

    _done(gitrun("run", str(task_dir), "--repo", str(repo), "--run-id", "mine-1"), "mine-1")

    status = _json(gitrun, "status", "mine-1", "--json")
    assert isinstance(status, dict)
    assert Path(status["repo"]).resolve() == repo.resolve()
    tip = git(repo, "rev-parse", "refs/heads/gitrun/mine-1").strip()
    assert status["head"] == status["verifier"]["head"] == tip
    assert git(repo, "rev-parse", f"{tip}^").strip() == base
    assert _worktrees(repo).get(Path(status["worktree"]).resolve()) == "refs/heads/gitrun/mine-1"
    assert _trailer_keys(repo, "gitrun/mine-1") == [status["receipts"][0]["key"]]
    # the user's own checkout is untouched: still on main at the base, clean
    assert git(repo, "symbolic-ref", "HEAD").strip() == "refs/heads/main"
    assert git(repo, "rev-parse", "main").strip() == base
    assert git(repo, "status", "--porcelain") == ""
    assert "a - b" in (repo / "calc" / "__init__.py").read_text()
    git(repo, "fsck", "--strict")


# -- the adapter, in-process on a real repository ----------------------------------------


class Adapter:
    """A run's environment on a fresh repository with a held lease."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "repo"
        for rel, text in {
            "src/a.py": "a = 1\n",
            "src/b.py": "one\ntwo\nthree\n",
            "docs/readme.md": "docs\n",
            "top.txt": "top\n",
            "lib/deep/keep.py": "keep\n",
        }.items():
            (self.dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.dir / rel).write_text(text)
        git(root, "init", "-q", "-b", "main", str(self.dir))
        git(self.dir, "add", ".")
        git(self.dir, "commit", "-q", "-m", "base")
        self.repo = gitstore.open_repo(self.dir)
        self.base = str(self.repo.head.target)
        self.run_id = "run-1"
        self.lease = LeaseManager(self.repo, self.run_id, "worker-1", 120)
        self.lease.acquire(0)
        self.worktree = root / "wt"
        self.env = Environment.create(
            self.repo, self.run_id, self.repo.head.peel(pygit2.Commit).id, self.worktree, "t@1"
        )

    def pre(self) -> Precondition:
        obs = self.env.observe()
        return Precondition(obs.instance_id, obs.head, obs.tree)

    def tip(self) -> str:
        return git(self.dir, "rev-parse", f"refs/heads/gitrun/{self.run_id}").strip()

    def fresh_env(self) -> Environment:
        """Another Environment object on the same worktree, as a new process would have."""
        repo = gitstore.open_repo(self.dir)
        return Environment(repo, self.run_id, self.worktree, "t@1")

    def write(
        self,
        action: Action,
        key: str,
        env: Environment | None = None,
        pre: Precondition | None = None,
    ) -> Outcome:
        target = env or self.env
        return target.execute(
            action, key, action.intent_digest(), pre or self.pre(), self.lease.fence
        )


@pytest.fixture
def adapter(tmp_path: Path) -> Adapter:
    return Adapter(tmp_path)


def _ls_tree(repo: Path, rev: str) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for line in git(repo, "ls-tree", "-r", rev).splitlines():
        meta, path = line.split("\t", 1)
        mode, _, oid = meta.split()
        out[path] = (mode, oid)
    return out


def test_same_action_and_key_twice_makes_exactly_one_commit(adapter: Adapter) -> None:
    action = Action("write_file", path="src/a.py", content="a = 2\n")
    pre = adapter.pre()
    first = adapter.write(action, "key-1", pre=pre)
    second = adapter.write(action, "key-1", pre=pre)
    assert (first.replayed, second.replayed) == (False, True)
    assert second.receipt == first.receipt
    assert adapter.env.write_count == 1
    again = adapter.fresh_env()
    third = adapter.write(action, "key-1", env=again, pre=pre)
    assert third.replayed is True
    assert third.receipt == first.receipt
    assert again.write_count == 0
    assert git(adapter.dir, "rev-list", "--count", f"{adapter.base}..gitrun/run-1").strip() == "1"
    assert _trailer_keys(adapter.dir, "gitrun/run-1") == ["key-1"]
    assert adapter.tip() == first.receipt.commit


def test_same_key_with_another_intent_raises_the_conflict_carrying_the_first_receipt(
    adapter: Adapter,
) -> None:
    first_action = Action("write_file", path="src/a.py", content="a = 2\n")
    pre = adapter.pre()
    first = adapter.write(first_action, "key-1", pre=pre)
    other = Action("write_file", path="src/a.py", content="a = 3\n")
    with pytest.raises(ReceiptConflict) as caught:
        adapter.write(other, "key-1", pre=pre)
    conflict = caught.value
    assert conflict.exit_code == Exit.FROZEN
    assert conflict.receipt == first.receipt
    assert conflict.receipt.commit == first.receipt.commit == adapter.tip()
    assert conflict.receipt.intent_digest == first_action.intent_digest()
    assert conflict.intent_digest == other.intent_digest()
    assert first.receipt.commit in str(conflict)
    assert adapter.env.write_count == 1
    assert (adapter.worktree / "src" / "a.py").read_text() == "a = 2\n"


def test_deleted_receipt_index_is_rebuilt_from_history_and_still_replays(adapter: Adapter) -> None:
    action = Action("write_file", path="src/a.py", content="a = 2\n")
    pre = adapter.pre()
    first = adapter.write(action, "key-1", pre=pre)
    adapter.write(Action("write_file", path="top.txt", content="top 2\n"), "key-2")
    ref = index_ref(adapter.run_id, "key-1")
    assert git(adapter.dir, "rev-parse", ref).strip() == first.receipt.commit
    git(adapter.dir, "update-ref", "-d", ref)
    assert git(adapter.dir, "rev-parse", "--verify", "-q", ref, check=False) == ""

    env = adapter.fresh_env()
    found = env.lookup("key-1")
    assert found == first.receipt
    assert git(adapter.dir, "rev-parse", ref).strip() == first.receipt.commit

    git(adapter.dir, "update-ref", "-d", ref)
    replay = adapter.write(action, "key-1", env=env, pre=pre)
    assert replay.replayed is True
    assert replay.receipt == first.receipt
    assert env.write_count == 0
    assert len(_trailer_keys(adapter.dir, "gitrun/run-1")) == 2


def test_receipt_index_pointing_at_another_commit_is_receipt_drift(adapter: Adapter) -> None:
    action = Action("write_file", path="src/a.py", content="a = 2\n")
    pre = adapter.pre()
    adapter.write(action, "key-1", pre=pre)
    second = adapter.write(Action("write_file", path="top.txt", content="top 2\n"), "key-2")
    tip = adapter.tip()
    for wrong in (second.receipt.commit, adapter.base):
        git(adapter.dir, "update-ref", index_ref(adapter.run_id, "key-1"), wrong)
        with pytest.raises(ReceiptDrift) as caught:
            adapter.fresh_env().lookup("key-1")
        assert caught.value.reason == "index-mismatch"
        with pytest.raises(ReceiptDrift):
            adapter.write(action, "key-1", env=adapter.fresh_env(), pre=pre)
        assert adapter.tip() == tip


def test_write_planned_at_a_head_that_moved_is_refused_and_commits_nothing(
    adapter: Adapter,
) -> None:
    stale = adapter.pre()
    adapter.write(Action("write_file", path="src/a.py", content="a = 2\n"), "key-1", pre=stale)
    tip = adapter.tip()
    late = Action("write_file", path="top.txt", content="late\n")
    with pytest.raises(EnvironmentDrift) as caught:
        adapter.write(late, "key-2", pre=stale)
    assert caught.value.reason == "head-moved"
    assert adapter.tip() == tip
    assert adapter.env.write_count == 1
    assert (adapter.worktree / "top.txt").read_text() == "top\n"
    assert (
        git(
            adapter.dir,
            "rev-parse",
            "--verify",
            "-q",
            index_ref(adapter.run_id, "key-2"),
            check=False,
        )
        == ""
    )


def test_uncommitted_edits_on_a_touched_path_are_refused_and_left_alone(adapter: Adapter) -> None:
    pre = adapter.pre()
    edited = adapter.worktree / "src" / "a.py"
    edited.write_text("a = 'mine, not committed'\n")
    for action in (
        Action("write_file", path="src/a.py", content="a = 2\n"),
        Action("delete_file", path="src/a.py"),
    ):
        with pytest.raises(EnvironmentDrift) as caught:
            adapter.write(action, f"key-{action.kind}", pre=pre)
        assert caught.value.reason == "uncommitted-edits"
        assert "src/a.py" in str(caught.value)
    assert edited.read_text() == "a = 'mine, not committed'\n"
    assert adapter.tip() == adapter.base
    assert adapter.env.write_count == 0


_PATCH_B = """\
diff --git a/src/b.py b/src/b.py
index 0000000..0000000 100644
--- a/src/b.py
+++ b/src/b.py
@@ -1,3 +1,3 @@
 one
-two
+TWO
 three
"""


def test_each_write_changes_only_its_paths_and_leaves_the_worktree_clean(adapter: Adapter) -> None:
    steps = [
        (Action("write_file", path="src/a.py", content="a = 2\n"), ["src/a.py"]),
        (Action("write_file", path="src/new/deep/c.py", content="c = 3\n"), ["src/new/deep/c.py"]),
        (Action("delete_file", path="docs/readme.md"), ["docs/readme.md"]),
        (Action("apply_patch", patch=_PATCH_B), ["src/b.py"]),
    ]
    for n, (action, paths) in enumerate(steps):
        parent = adapter.tip()
        outcome = adapter.write(action, f"key-{n}")
        commit = outcome.receipt.commit
        assert adapter.tip() == commit
        assert outcome.receipt.parent == parent
        assert list(outcome.receipt.paths) == paths
        changed = git(
            adapter.dir, "diff-tree", "-r", "--no-commit-id", "--name-only", parent, commit
        )
        assert changed.split() == paths
        before, after = _ls_tree(adapter.dir, parent), _ls_tree(adapter.dir, commit)
        untouched = set(before) - set(paths)
        assert {p: after[p] for p in untouched} == {p: before[p] for p in untouched}
        for path in paths:
            on_disk = adapter.worktree / path
            if path in after:
                assert (
                    on_disk.read_bytes()
                    == git(adapter.dir, "cat-file", "blob", after[path][1]).encode()
                )
            else:
                assert not on_disk.exists()
        # The step leaves the worktree's index behind (O(files) to rewrite): a full
        # observation already sees a clean worktree, and syncing the index (as the end
        # of every run does) makes plain git agree.
        assert adapter.env.observe().dirty == ()
        adapter.env.sync_index()
        assert git(adapter.worktree, "status", "--porcelain", "--untracked-files=all") == ""
    assert not (adapter.worktree / "docs").exists()  # an emptied directory goes with its last file
    assert (adapter.worktree / "src" / "b.py").read_text() == "one\nTWO\nthree\n"
    assert adapter.env.write_count == len(steps)
    assert [r.key for r in adapter.env.receipts()] == [f"key-{n}" for n in range(len(steps))]
    git(adapter.dir, "fsck", "--strict")
    assert isinstance(adapter.repo.get(adapter.tip()), pygit2.Commit)
