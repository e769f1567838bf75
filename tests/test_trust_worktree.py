"""The worktree write path holds against a hostile agent and against stale workers.

Each test drives the real CLI (``gitrun run`` / ``resume`` as subprocesses), tampers the
way an agent with a shell in its worktree would (symlinks hidden via ``info/exclude``,
``chmod``), or pauses and wakes real processes, and asserts the refusal and that nothing
outside the worktree changed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Gitrun, git, snapshot

from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.errors import EnvironmentDrift, Exit

pytestmark = pytest.mark.timeout(120)

RUN = "r"
FIX = '\n[[step]]\nkind = "apply_patch"\npatch_file = "patches/fix.diff"\n'


def _write_step(path: str, content: str) -> str:
    return f'\n[[step]]\nkind = "write_file"\npath = "{path}"\ncontent = {json.dumps(content)}\n'


def _task(sandbox_copy: Callable[[str], Path], plan: str, policy_extra: str = "") -> Path:
    task_dir = sandbox_copy("fix-median")
    (task_dir / "plan.toml").write_text("schema = 1\n" + plan)
    if policy_extra:
        toml = (task_dir / "task.toml").read_text()
        toml = toml.replace(
            'forbidden_paths = ["tests/**"]\n', f'forbidden_paths = ["tests/**"]\n{policy_extra}'
        )
        (task_dir / "task.toml").write_text(toml)
    return task_dir


def _record(gitrun: Gitrun, run_id: str = RUN) -> dict[str, str]:
    data: dict[str, str] = json.loads((gitrun.home / "runs" / f"{run_id}.json").read_text())
    return data


def _tree_files(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links as their target, files as bytes, dirs marked)."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = f"{oct(p.stat().st_mode)}:{p.read_bytes()!r}"
    return out


def _events(gitrun: Gitrun, run_id: str, kind: str) -> list[dict[str, object]]:
    chain = service.checkpoints(run_id, service.Options(Workspace(gitrun.home)))
    return [
        dict(ev.data) for stored in reversed(chain) for ev in stored.state.events if ev.kind == kind
    ]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"not one line: {err!r}"
    assert lines[0].startswith("gitrun:"), lines[0]
    return lines[0]


def _hide(repo: Path, pattern: str) -> None:
    exclude = repo / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as fh:
        fh.write(f"\n{pattern}\n")


# -- 9.2: a pending write is gated again when it executes; no symlink is followed -----------


def test_resumed_pending_write_into_a_planted_hidden_symlink_is_refused_and_lands_nowhere(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    task = _task(sandbox_copy, _write_step("stats/extra/helpers.py", "HELPER = 1\n") + FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="after_intent_checkpoint")
    assert res.code == -9, res.err
    rec = _record(gitrun)
    repo, worktree = Path(rec["repo"]), Path(rec["worktree"])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious\n")
    (worktree / "stats" / "extra").symlink_to(outside, target_is_directory=True)
    _hide(repo, "stats/extra")
    assert git(worktree, "status", "--porcelain") == ""  # git does not show the link
    before = (snapshot(repo), _tree_files(outside), _tree_files(worktree))

    for _ in range(2):  # refused again, the same way: nothing was half-done
        res = gitrun("resume", RUN)
        assert res.code == Exit.REFUSED, res.out + res.err
        line = _one_line(res.err)
        assert "(symlink-in-path)" in line, line
        assert "stats/extra" in line, line
        assert (snapshot(repo), _tree_files(outside), _tree_files(worktree)) == before
    assert sorted(os.listdir(outside)) == ["keep.txt"]

    # The human removes the link: the same pending write then runs, inside the worktree.
    (worktree / "stats" / "extra").unlink()
    res = gitrun("resume", RUN)
    assert res.code == Exit.DONE, res.out + res.err
    assert (worktree / "stats" / "extra" / "helpers.py").read_text() == "HELPER = 1\n"
    assert sorted(os.listdir(outside)) == ["keep.txt"]
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""


def test_a_link_planted_after_the_write_committed_stops_the_file_sync_and_lands_nowhere(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    """Window 3: the branch already moved; the repair of the file sync on resume walks
    the path without following the planted link, refuses, and can finish once it is gone."""
    task = _task(sandbox_copy, _write_step("stats/extra/helpers.py", "HELPER = 1\n") + FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="after_receipt_index")
    assert res.code == -9, res.err
    rec = _record(gitrun)
    repo, worktree = Path(rec["repo"]), Path(rec["worktree"])
    outside = tmp_path / "outside"
    outside.mkdir()
    (worktree / "stats" / "extra").symlink_to(outside, target_is_directory=True)
    _hide(repo, "stats/extra")
    before = (snapshot(repo), _tree_files(worktree))
    res = gitrun("resume", RUN)
    assert res.code == Exit.REFUSED, res.out + res.err
    assert "(symlink-in-path)" in _one_line(res.err)
    assert (snapshot(repo), _tree_files(worktree)) == before
    assert list(outside.iterdir()) == []
    (worktree / "stats" / "extra").unlink()
    res = gitrun("resume", RUN)
    assert res.code == Exit.DONE, res.out + res.err
    assert (worktree / "stats" / "extra" / "helpers.py").read_text() == "HELPER = 1\n"
    assert list(outside.iterdir()) == []


def test_the_file_writer_follows_no_symlink_even_one_planted_after_every_check(
    tmp_path: Path,
) -> None:
    from gitrun.adapter import safefs

    root, outside = tmp_path / "wt", tmp_path / "outside"
    (root / "stats").mkdir(parents=True)
    outside.mkdir()
    (root / "stats" / "extra").symlink_to(outside)
    (root / "stats" / "f.py").symlink_to(outside / "f.py")
    for path in ("stats/extra/helpers.py", "stats/extra/deeper/x.py"):
        with pytest.raises(EnvironmentDrift, match="symlink-in-path"):
            safefs.write_file(root, path, b"x", executable=False)
    with pytest.raises(EnvironmentDrift, match="symlink-in-path"):
        safefs.remove(root, "stats/extra/keep.txt")
    # The last component is replaced, never written through.
    safefs.write_file(root, "stats/f.py", b"inside", executable=False)
    assert not (root / "stats" / "f.py").is_symlink()
    assert (root / "stats" / "f.py").read_bytes() == b"inside"
    assert list(outside.iterdir()) == []


def test_a_pending_action_the_gate_rejects_at_execute_time_is_abandoned_and_the_run_goes_on(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    """A policy rejection of a pending action (here: one proposed by a gitrun that did not
    know the rule yet) abandons it with a gate_rejected event; the run is never stuck."""
    task = _task(sandbox_copy, _write_step("stats/notes.txt", "n\n") + FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="after_intent_checkpoint")
    assert res.code == -9, res.err
    _rewrite_pending_as_old_gitrun(gitrun, path="tests")  # `delete_file tests` was pending
    repo = Path(_record(gitrun)["repo"])
    base = git(repo, "rev-parse", "main").strip()

    res = gitrun("resume", RUN)
    assert res.code == Exit.DONE, res.out + res.err
    rejected = _events(gitrun, RUN, "gate_rejected")
    assert [(e["rule"], e["action"], e.get("at")) for e in rejected] == [
        ("path-forbidden", "delete_file tests", "execute")
    ]
    log = git(repo, "log", "--format=%s", f"{base}..gitrun/{RUN}").splitlines()
    assert log == ["gitrun: apply_patch stats/median.py"]
    assert (Path(_record(gitrun)["worktree"]) / "tests").is_dir()


def _rewrite_pending_as_old_gitrun(gitrun: Gitrun, path: str) -> None:
    """Advance the run's checkpoint, under its lease, with the pending action replaced by
    ``delete_file <path>``: what a gitrun without today's gate rules would have stored."""
    from dataclasses import replace

    from gitrun.core.records import Action
    from gitrun.store.lease import LeaseManager

    opts = service.Options(Workspace(gitrun.home), worker="old-gitrun")
    opened = service.open_run(RUN, opts)
    ref, stored = service.load_verified(opened)
    pending = stored.state.pending
    assert pending is not None
    action = Action("delete_file", path=path)
    new_pending = replace(pending, action=action, intent_digest=action.intent_digest())
    lease = LeaseManager(opened.repo, RUN, "old-gitrun", 30)
    lease.acquire(stored.state.generation, takeover_after=0)
    try:
        nxt = replace(
            stored.state,
            pending=new_pending,
            generation=stored.state.generation + 1,
            lease_version=lease.fence.version,
            identity="old-gitrun",
            events=(),
        )
        opened.store.advance(ref, nxt, stored.oid, lease.fence)
    finally:
        lease.release()


# -- 9.5: writes under a file, onto a directory, and forbidden directories -----------------


PATCH_UNDER_FILE = """\
diff --git a/stats/median.py/helper.py b/stats/median.py/helper.py
new file mode 100644
--- /dev/null
+++ b/stats/median.py/helper.py
@@ -0,0 +1 @@
+X = 1
"""


def test_writes_under_a_file_and_onto_a_directory_are_refused_by_their_own_rules(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(
        sandbox_copy,
        _write_step("stats/median.py/helper.py", "X = 1\n")
        + '\n[[step]]\nkind = "delete_file"\npath = "stats/median.py/helper.py"\n'
        + '\n[[step]]\nkind = "apply_patch"\npatch_file = "under.diff"\n'
        + _write_step("stats", "not a dir\n")
        + '\n[[step]]\nkind = "delete_file"\npath = "stats"\n'
        + '\n[[step]]\nkind = "delete_file"\npath = "tests"\n',
    )
    (task / "under.diff").write_text(PATCH_UNDER_FILE)
    res = gitrun("run", str(task), "--run-id", RUN)
    assert "Traceback" not in res.out + res.err
    rec = _record(gitrun)
    repo, worktree = Path(rec["repo"]), Path(rec["worktree"])
    rules = [(e["rule"], e["action"]) for e in _events(gitrun, RUN, "gate_rejected")]
    assert rules == [
        ("path-under-file", "write_file stats/median.py/helper.py"),
        ("path-under-file", "delete_file stats/median.py/helper.py"),
        ("path-under-file", "apply_patch (6 diff lines)"),
        ("path-is-directory", "write_file stats"),
        ("path-is-directory", "delete_file stats"),
        ("path-forbidden", "delete_file tests"),
    ]
    assert git(repo, "rev-parse", f"gitrun/{RUN}") == git(repo, "rev-parse", "main")
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""
    assert (worktree / "stats" / "median.py").is_file()
    # Nothing of the refused actions reached the repository: no branch moved, no blob.
    heads = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads")
    main = git(repo, "rev-parse", "main").strip()
    assert heads.splitlines() == [f"refs/heads/gitrun/{RUN} {main}", f"refs/heads/main {main}"]
    for content in ("X = 1\n", "not a dir\n"):
        blob = subprocess.run(
            ["git", "-C", str(repo), "hash-object", "--stdin"],
            input=content, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert _objects_have(repo, blob) is False


def _objects_have(repo: Path, oid: str) -> bool:
    """In the object store or gitrun's stage (objects written, not yet named by a ref)."""
    stage = {"GIT_ALTERNATE_OBJECT_DIRECTORIES": str(repo / ".git" / "gitrun" / "stage")}
    cmd = ["git", "-C", str(repo), "cat-file", "-e", oid]
    return subprocess.run(cmd, check=False, env={**os.environ, **stage}).returncode == 0


def test_a_forbidden_glob_covers_the_directory_itself(tmp_path: Path) -> None:
    from gitrun.adapter.gate import forbidden_match

    assert forbidden_match("tests", "tests/**")
    assert forbidden_match("tests/x.py", "tests/**")
    assert not forbidden_match("testsuite", "tests/**")
    assert not forbidden_match("stats", "tests/**")


# -- 9.6: modes and symlinks are part of the state fingerprint -----------------------------


def test_a_chmod_on_a_file_a_step_just_wrote_is_an_uncommitted_change(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(sandbox_copy, FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="before_verify")
    assert res.code == -9, res.err
    worktree = Path(_record(gitrun)["worktree"])
    target = worktree / "stats" / "median.py"
    target.chmod(0o755)
    res = gitrun("resume", RUN)
    assert res.code == Exit.REFUSED, res.out + res.err
    line = _one_line(res.err)
    assert "(uncommitted-edits)" in line, line
    assert "stats/median.py" in line, line
    target.chmod(0o644)
    res = gitrun("resume", RUN)
    assert res.code == Exit.DONE, res.out + res.err


def test_a_chmod_in_a_repository_without_file_modes_is_no_change_as_for_git(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(sandbox_copy, FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="before_verify")
    assert res.code == -9, res.err
    rec = _record(gitrun)
    git(Path(rec["repo"]), "config", "core.filemode", "false")
    (Path(rec["worktree"]) / "stats" / "median.py").chmod(0o755)
    res = gitrun("resume", RUN)
    assert res.code == Exit.DONE, res.out + res.err
    assert git(Path(rec["worktree"]), "status", "--porcelain") == ""


def test_a_chmod_after_the_run_ended_shows_in_status_as_plain_git_does(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(sandbox_copy, FIX)
    assert gitrun("run", str(task), "--run-id", RUN).code == Exit.DONE
    worktree = Path(_record(gitrun)["worktree"])
    (worktree / "stats" / "median.py").chmod(0o755)
    assert git(worktree, "status", "--porcelain").strip() == "M stats/median.py"
    from gitrun.adapter.environment import Environment
    from gitrun.store import gitstore

    repo = gitstore.open_repo(_record(gitrun)["repo"])
    env = Environment(repo, RUN, worktree, "fix-median@1")
    assert [p for p, _ in env.status()] == ["stats/median.py"]


def _link_patch(path: str, target: str) -> str:
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 120000\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1 @@\n+{target}\n\\ No newline at end of file\n"
    )


def test_a_patch_creating_a_symlink_is_refused_unless_the_policy_allows_symlinks(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(sandbox_copy, '\n[[step]]\nkind = "apply_patch"\npatch_file = "link.diff"\n' + FIX)
    (task / "link.diff").write_text(_link_patch("stats/passwd", "/etc/passwd"))
    res = gitrun("run", str(task), "--run-id", RUN)
    assert "Traceback" not in res.out + res.err
    rules = [e["rule"] for e in _events(gitrun, RUN, "gate_rejected")]
    assert rules == ["symlink-not-allowed"]
    worktree = Path(_record(gitrun)["worktree"])
    assert not os.path.lexists(worktree / "stats" / "passwd")


@pytest.mark.parametrize(
    ("target", "rule"),
    [("/etc/passwd", "symlink-escape"), ("../../etc/passwd", "symlink-escape")],
)
def test_an_allowed_symlink_must_stay_inside_the_worktree(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], target: str, rule: str
) -> None:
    task = _task(
        sandbox_copy,
        '\n[[step]]\nkind = "apply_patch"\npatch_file = "link.diff"\n' + FIX,
        policy_extra="allow_symlinks = true\n",
    )
    (task / "link.diff").write_text(_link_patch("stats/passwd", target))
    gitrun("run", str(task), "--run-id", RUN)
    assert [e["rule"] for e in _events(gitrun, RUN, "gate_rejected")] == [rule]
    assert not os.path.lexists(Path(_record(gitrun)["worktree"]) / "stats" / "passwd")


def test_an_allowed_symlink_inside_the_worktree_is_written_as_a_real_symlink(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(
        sandbox_copy,
        '\n[[step]]\nkind = "apply_patch"\npatch_file = "link.diff"\n' + FIX,
        policy_extra="allow_symlinks = true\n",
    )
    (task / "link.diff").write_text(_link_patch("stats/alias.py", "median.py"))
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.DONE, res.out + res.err
    worktree = Path(_record(gitrun)["worktree"])
    link = worktree / "stats" / "alias.py"
    assert link.is_symlink()
    assert os.readlink(link) == "median.py"
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(worktree, "ls-files", "-s", "stats/alias.py").startswith("120000 ")


def test_the_symlink_policy_is_part_of_the_scenario(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(sandbox_copy, FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="before_verify")
    assert res.code == -9
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(
        toml.replace(
            'forbidden_paths = ["tests/**"]\n',
            'forbidden_paths = ["tests/**"]\nallow_symlinks = true\n',
        )
    )
    res = gitrun("resume", RUN)
    assert res.code == Exit.REFUSED, res.out + res.err
    assert "allowlist" in _one_line(res.err)


# -- 10.2: a stale worker's file sync lands nothing -------------------------------------------


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()[0]


def _wait_stopped(proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.communicate()}")
        if _state(proc.pid) == "T":
            return
        time.sleep(0.02)
    raise AssertionError("the worker never reached its pause point")


def test_a_stale_worker_woken_after_a_takeover_writes_no_worktree_file(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    plan = _write_step("stats/notes.py", "N = 1\n") + _write_step("stats/notes.py", "N = 2\n")
    task = _task(sandbox_copy, plan + FIX)
    stale = gitrun.popen(
        "run", str(task), "--run-id", RUN, "--lease-seconds", "2",
        GITRUN_PAUSE_AT="after_receipt_index",
    )  # fmt: skip
    try:
        _wait_stopped(stale)
        res = gitrun("resume", RUN, "--takeover-after", "0")
        assert res.code == Exit.DONE, res.out + res.err
        worktree = Path(_record(gitrun)["worktree"])
        assert (worktree / "stats" / "notes.py").read_text() == "N = 2\n"
        os.kill(stale.pid, signal.SIGCONT)
        _, err = stale.communicate(timeout=60)
    finally:
        if stale.poll() is None:
            stale.kill()
            stale.communicate()
    assert stale.returncode == Exit.LEASE_LOST, err
    assert (worktree / "stats" / "notes.py").read_text() == "N = 2\n"
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""
    status = json.loads(gitrun("status", RUN, "--json").out)
    assert status["phase"] == "done"
    again = gitrun("resume", RUN)
    assert again.code == Exit.DONE, again.out + again.err


# -- 10.5: gitrun's own temp-file leftovers are cleaned by the next owner -------------------


def test_a_run_killed_between_a_temp_write_and_its_rename_resumes_without_a_human(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(sandbox_copy, _write_step("stats/notes.py", "N = 1\n") + FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="temp_file_written")
    assert res.code == -9, res.err
    worktree = Path(_record(gitrun)["worktree"])
    leftovers = [p.name for p in (worktree / "stats").iterdir() if "gitrun-tmp" in p.name]
    assert len(leftovers) == 1, leftovers
    assert leftovers[0].startswith(".notes.py.gitrun-tmp-"), leftovers
    res = gitrun("resume", RUN)
    assert res.code == Exit.DONE, res.out + res.err
    assert not [p for p in (worktree / "stats").iterdir() if "gitrun-tmp" in p.name]
    assert (worktree / "stats" / "notes.py").read_text() == "N = 1\n"
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""


def test_a_user_file_that_looks_like_a_temp_file_elsewhere_is_not_removed(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = _task(sandbox_copy, _write_step("stats/notes.py", "N = 1\n") + FIX)
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="temp_file_written")
    assert res.code == -9, res.err
    worktree = Path(_record(gitrun)["worktree"])
    mine = worktree / "tests" / ".test_mean.py.gitrun-tmp-0123abcd"
    mine.write_text("mine\n")
    res = gitrun("resume", RUN)
    assert res.code == Exit.REFUSED, res.out + res.err
    assert "uncommitted-edits" in _one_line(res.err)
    assert mine.read_text() == "mine\n"


def test_safefs_realpath_answers_what_os_path_realpath_answers(tmp_path: Path) -> None:
    """The kernel's name for a path (the gate's escape check and the instance check use
    it) is realpath's, through links, for absent paths, loops and relative paths alike."""
    from gitrun.adapter import safefs

    real = tmp_path / "real" / "dir"
    real.mkdir(parents=True)
    (real / "file.py").write_text("x\n")
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cases = [
        real, tmp_path / "link", tmp_path / "link" / "file.py", tmp_path / "link" / "new.py",
        tmp_path / "absent" / "deeper", tmp_path / "loop", tmp_path / "dangling",
        tmp_path / "link" / ".." / "dir", Path("."), Path("relative/absent"),
    ]  # fmt: skip
    for case in cases:
        assert safefs.realpath(case) == os.path.realpath(case), case
        assert safefs.realpath(str(case)) == os.path.realpath(case), case
    assert safefs.realpath(tmp_path / "link" / "file.py") == str(real / "file.py")
