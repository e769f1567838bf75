"""Claude Code on gitrun, with the REAL Claude Code CLI (installed from npm, pinned) driven
by a scripted stand-in for the Messages API on loopback: every tool call that changes
files is one receipt commit (Bash included), a refused call is blocked or undone, a kill
mid-call is reconciled once, rewind restores a Bash edit, parallel sessions stay apart,
and the README's MCP configuration works as printed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from claude_standin import Script, claude_env, install_claude, standin
from conftest import SANDBOXES, git

pytestmark = pytest.mark.timeout(600)

GITRUN = [sys.executable, "-m", "gitrun"]
ALLOWED = "Bash,Write,Edit,Read"


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return install_claude()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "app.py").write_text("print(1)\n")
    (path / "README").write_text("a project\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "base")
    return path


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return tmp_path / "gitrun-home"


def gitrun(ws: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GITRUN_HOME": str(ws)}
    return subprocess.run([*GITRUN, *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)  # fmt: skip


def claude_argv(claude_bin: Path, run_args: list[str], *extra: str) -> list[str]:
    return [*GITRUN, "claude", *run_args, "--claude", str(claude_bin), "--",
            "-p", "work on it", "--allowedTools", ALLOWED, "--permission-mode", "acceptEdits",
            *extra]  # fmt: skip


def session(
    claude_bin: Path, ws: Path, tmp_path: Path, run_args: list[str], script: Script,
    *extra: str, env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """One ``gitrun claude … -- -p …`` session against ``script``, to its end."""
    with standin(script) as url:
        full = claude_env(url, tmp_path / "claude-home", {"GITRUN_HOME": str(ws), **(env or {})})
        return subprocess.run(claude_argv(claude_bin, run_args, *extra), env=full,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=300, check=False)  # fmt: skip


def receipts(repo: Path, run: str) -> list[dict[str, str]]:
    """The run's receipt commits, oldest first: subject and trailers, read by git."""
    out = git(repo, "log", "--reverse", "--format=%H%x00%s%x00%(trailers:unfold)%x01",
              "main..gitrun/" + run)  # fmt: skip
    found = []
    for record in out.split("\x01"):
        if not record.strip():
            continue
        oid, subject, trailers = record.strip("\n").split("\x00")
        fields = dict(line.split(": ", 1) for line in trailers.splitlines() if ": " in line)
        found.append({"commit": oid, "subject": subject, **fields})
    return found


def calls(repo: Path, run: str) -> list[dict[str, str]]:
    """The run's call log (calls that changed nothing), oldest first."""
    out = git(repo, "log", "--reverse", "--format=%H%x00%s%x00%(trailers:unfold)%x01",
              f"refs/gitrun/runs/{run}/calls", "--")  # fmt: skip
    found = []
    for record in out.split("\x01"):
        if record.strip():
            oid, subject, trailers = record.strip("\n").split("\x00")
            fields = dict(line.split(": ", 1) for line in trailers.splitlines() if ": " in line)
            found.append({"commit": oid, "subject": subject, **fields})
    return found


def worktree(ws: Path, run: str) -> Path:
    return ws / "worktrees" / run


def test_scripted_bash_write_and_edit_calls_end_as_receipts_in_order(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    wt = worktree(ws, "s1")
    script = Script([
        ("Bash", {"command": "echo hello > notes.txt && echo said-out", "description": "d"}),
        ("Write", {"file_path": f"{wt}/new.py", "content": "x = 1\n"}),
        ("Read", {"file_path": f"{wt}/app.py"}),
        ("Edit", {"file_path": f"{wt}/app.py", "old_string": "print(1)", "new_string": "print(2)"}),
        ("Bash", {"command": "ls", "description": "look"}),
    ])  # fmt: skip
    done = session(claude_bin, ws, tmp_path, ["--repo", str(repo), "--run-id", "s1"], script)
    assert done.returncode == 0, done.stderr
    steps = receipts(repo, "s1")
    assert [(s["Gitrun-Tool"], s["Gitrun-Idempotency-Key"]) for s in steps] == [
        ("Bash", "toolu_gitrun_0000"),
        ("Write", "toolu_gitrun_0001"),
        ("Edit", "toolu_gitrun_0003"),
    ]
    assert [s["subject"] for s in steps] == [
        "gitrun: Bash notes.txt", "gitrun: Write new.py", "gitrun: Edit app.py",
    ]  # fmt: skip
    assert all(s["Gitrun-Action"] == "tool" and s["Gitrun-Session"] for s in steps)
    # The Bash call's output and exit status are kept with its receipt.
    assert git(repo, "show", steps[0]["Gitrun-Output"] + ":stdout") == "said-out"
    assert steps[0]["Gitrun-Exit-Status"] == "0"
    # The call that changed nothing made no commit on the branch: a record on the call log.
    [quiet] = calls(repo, "s1")
    assert (quiet["subject"], quiet["Gitrun-Idempotency-Key"]) == (
        "gitrun: Bash (no change)", "toolu_gitrun_0004",
    )  # fmt: skip
    assert quiet["Gitrun-Head"] == steps[2]["commit"]
    assert quiet["Gitrun-Session"] == steps[0]["Gitrun-Session"]
    assert git(repo, "show", "gitrun/s1:app.py") == "print(2)\n"
    # The worktree is the last receipt; the user's checkout was never touched.
    assert git(wt, "status", "--porcelain") == ""
    assert git(repo, "status", "--porcelain") == ""
    assert not (repo / "notes.txt").exists()
    verify = gitrun(ws, "checkpoint", "verify", "s1")
    assert verify.returncode == 0, verify.stderr
    # The hooks were answered by the session's resident helper (only it leaves the stamp).
    assert (repo / ".git" / "worktrees" / "gitrun-s1" / "gitrun-scan-cache.json.stamp").exists()


def test_a_change_made_outside_any_call_is_its_own_step(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    made = gitrun(ws, "claude", "--repo", str(repo), "--run-id", "s2", "--no-launch")
    assert made.returncode == 0, made.stderr
    wt = worktree(ws, "s2")
    (wt / "by-hand.txt").write_text("typed by the user\n")
    script = Script([("Write", {"file_path": f"{wt}/tool.txt", "content": "by the tool\n"})])
    done = session(claude_bin, ws, tmp_path, ["--run-id", "s2"], script)
    assert done.returncode == 0, done.stderr
    steps = receipts(repo, "s2")
    assert [(s["Gitrun-Tool"], s["subject"]) for s in steps] == [
        ("outside", "gitrun: outside by-hand.txt"),
        ("Write", "gitrun: Write tool.txt"),
    ]


def forbidding_task(tmp_path: Path) -> Path:
    task = tmp_path / "task"
    task.mkdir()
    (task / "task.toml").write_text(
        """schema = 1
[task]
id = "guarded"
version = "1"
[policy]
id = "guarded"
version = "1"
allowed_actions = ["write_file", "exec"]
write_allowlist = ["**"]
forbidden_paths = ["secrets/**"]
[policy.exec]
allow = ["*"]
deny = ["rm *", "*git push*"]
[verifier]
command = ["true"]
junit = false
fail_to_pass = []
pass_to_pass = []
[budgets]
max_proposals = 1000
max_steps = 1000
max_wall_seconds = 3600
"""
    )
    return task


def test_a_bash_call_writing_a_forbidden_path_is_undone_and_the_model_told_why(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    wt = worktree(ws, "g1")
    script = Script([
        ("Bash", {"command": "mkdir -p secrets && echo k > secrets/key && echo ok > fine.txt",
                  "description": "d"}),
        ("Bash", {"command": "rm app.py", "description": "d"}),
        ("Write", {"file_path": f"{wt}/secrets/other", "content": "x"}),
        ("Write", {"file_path": f"{wt}/fine.txt", "content": "fine\n"}),
    ])  # fmt: skip
    task = forbidding_task(tmp_path)
    args = ["--task", str(task), "--repo", str(repo), "--run-id", "g1"]
    done = session(claude_bin, ws, tmp_path, args, script)
    assert done.returncode == 0, done.stderr
    said = script.results()
    shown = script.conversation()  # a PostToolUse block reaches the model as a system text
    assert "gitrun undid this Bash call's change (rule path-forbidden)" in shown
    # a directory the tree lacks is removed whole, unread, and named as one (shell.restore)
    assert "discarded: fine.txt, secrets/)" in shown
    assert "gitrun refused this call (rule exec-denied)" in said[1]
    assert "gitrun refused this call (rule path-forbidden)" in said[2]
    # Only the allowed write is a receipt; the refused change is gone from the worktree.
    steps = receipts(repo, "g1")
    assert [s["Gitrun-Tool"] for s in steps] == ["Write"]
    assert not (wt / "secrets").exists()
    assert (wt / "app.py").exists()
    assert (wt / "fine.txt").read_text() == "fine\n"
    assert git(wt, "status", "--porcelain") == ""


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.05)


def descendants(root: int) -> list[int]:
    """Every process below ``root`` now (read from /proc's parent links), by id."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _session_id(repo: Path, run: str) -> str:
    return receipts(repo, run)[-1]["Gitrun-Session"]


def test_claude_killed_mid_bash_has_its_change_recorded_once_and_resume_goes_on_in_the_run(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    wt = worktree(ws, "k1")
    first = Script([
        ("Write", {"file_path": f"{wt}/before.txt", "content": "b\n"}),
        ("Bash", {"command": "echo partial > half.txt; sleep 120", "description": "d"}),
    ])  # fmt: skip
    with standin(first) as url:
        env = claude_env(url, tmp_path / "claude-home", {"GITRUN_HOME": str(ws)})
        proc = subprocess.Popen(
            claude_argv(claude_bin, ["--repo", str(repo), "--run-id", "k1"]), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            _wait_for(wt / "half.txt", 120)
            time.sleep(0.3)
            below = descendants(proc.pid)  # Claude Code runs Bash in a session of its own
            os.killpg(proc.pid, signal.SIGKILL)  # Claude Code's process group
            for pid in below:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            proc.wait(30)
    session_id = _session_id(repo, "k1")
    assert [s["Gitrun-Tool"] for s in receipts(repo, "k1")] == ["Write"]
    # Resumed: the session start records the killed call's change under its own key, once.
    second = Script([("Write", {"file_path": f"{wt}/after.txt", "content": "a\n"})],
                    prefix="toolu_resumed_")  # fmt: skip
    done = session(claude_bin, ws, tmp_path, ["--run-id", "k1"], second, "--resume", session_id)
    assert done.returncode == 0, done.stderr
    steps = receipts(repo, "k1")
    assert [(s["Gitrun-Tool"], s["Gitrun-Idempotency-Key"]) for s in steps] == [
        ("Write", "toolu_gitrun_0000"),
        ("Bash", "toolu_gitrun_0001"),
        ("Write", "toolu_resumed_0000"),
    ]
    assert steps[1]["subject"] == "gitrun: Bash half.txt"
    assert steps[2]["Gitrun-Session"] == session_id
    assert git(wt, "status", "--porcelain") == ""


def test_a_killed_hook_leaves_nothing_half_recorded_and_the_next_hook_records_it_once(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    wt = worktree(ws, "h1")
    first = Script([("Bash", {"command": "echo one > one.txt", "description": "d"})])
    crash = {"GITRUN_CRASH_AT": "after_write_commit_object"}
    session(claude_bin, ws, tmp_path, ["--repo", str(repo), "--run-id", "h1"], first, env=crash)
    assert receipts(repo, "h1") == []  # killed before its branch moved: nothing recorded
    assert (wt / "one.txt").exists()
    second = Script([("Write", {"file_path": f"{wt}/two.txt", "content": "2\n"})],
                    prefix="toolu_second_")  # fmt: skip
    done = session(claude_bin, ws, tmp_path, ["--run-id", "h1"], second)
    assert done.returncode == 0, done.stderr
    steps = receipts(repo, "h1")
    assert [(s["Gitrun-Idempotency-Key"], s["subject"]) for s in steps] == [
        ("toolu_gitrun_0000", "gitrun: Bash one.txt"),
        ("toolu_second_0000", "gitrun: Write two.txt"),
    ]


def test_rewind_restores_what_a_bash_call_changed_in_the_branch_and_the_worktree(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    script = Script([
        ("Bash", {"command": "sed -i s/1/9/ app.py && echo new > extra.txt", "description": "d"}),
    ])  # fmt: skip
    done = session(claude_bin, ws, tmp_path, ["--repo", str(repo), "--run-id", "r1"], script)
    assert done.returncode == 0, done.stderr
    wt = worktree(ws, "r1")
    assert (wt / "app.py").read_text() == "print(9)\n"
    base = git(repo, "rev-parse", "main")
    back = gitrun(ws, "rewind", "r1", "--to", base[:10])
    assert back.returncode == 0, back.stderr
    assert (wt / "app.py").read_text() == "print(1)\n"
    assert not (wt / "extra.txt").exists()
    steps = receipts(repo, "r1")
    assert [s["Gitrun-Action"] for s in steps] == ["tool", "rewind"]  # the Bash step stays
    assert git(repo, "rev-parse", "gitrun/r1^{tree}") == git(repo, "rev-parse", "main^{tree}")
    assert git(wt, "status", "--porcelain") == ""


def test_the_model_can_rewind_through_its_shell_and_the_rewind_is_one_more_step(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    base = git(repo, "rev-parse", "main").strip()
    script = Script([
        ("Bash", {"command": "sed -i s/1/9/ app.py", "description": "d"}),
        ("Bash", {"command": f"gitrun rewind r2 --to {base[:12]}", "description": "d"}),
    ])  # fmt: skip
    path = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = session(claude_bin, ws, tmp_path, ["--repo", str(repo), "--run-id", "r2"], script,
                   env=path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rewind committed as" in script.results()[1]
    steps = receipts(repo, "r2")
    assert [s["subject"] for s in steps] == ["gitrun: Bash app.py", "gitrun: rewind app.py"]
    assert [c["subject"] for c in calls(repo, "r2")] == ["gitrun: Bash (no change)"]
    assert (worktree(ws, "r2") / "app.py").read_text() == "print(1)\n"


def test_two_parallel_sessions_on_one_repository_stay_in_their_own_worktrees(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    with contextlib.ExitStack() as stack:
        for name in ("p1", "p2"):
            wt = worktree(ws, name)
            script = Script([
                ("Bash", {"command": f"echo {name} > same.txt; sleep 1", "description": "d"}),
                ("Write", {"file_path": f"{wt}/own-{name}.txt", "content": name}),
            ])  # fmt: skip
            url = stack.enter_context(standin(script))
            env = claude_env(url, tmp_path / f"home-{name}", {"GITRUN_HOME": str(ws)})
            argv = claude_argv(claude_bin, ["--repo", str(repo), "--run-id", name])
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
            procs.append((name, proc))
        for name, proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, (name, err)
    for name in ("p1", "p2"):
        wt = worktree(ws, name)
        assert (wt / "same.txt").read_text() == f"{name}\n"
        assert sorted(p.name for p in wt.glob("own-*")) == [f"own-{name}.txt"]
        assert [s["subject"] for s in receipts(repo, name)] == [
            "gitrun: Bash same.txt", f"gitrun: Write own-{name}.txt",
        ]  # fmt: skip
    assert git(repo, "status", "--porcelain") == ""
    assert not (repo / "same.txt").exists()


def _mcp_tools(script: Script) -> set[str]:
    """The gitrun tools Claude Code offered the model: in its tool list, or (deferred, as
    2.1.332 does with MCP tools) named in the list of tools it can load."""
    text = json.dumps(script.requests)
    return set(re.findall(r"mcp__gitrun__[a-z_]+", text))


def test_the_readmes_mcp_configuration_for_claude_code_works_as_printed(
    claude_bin: Path, ws: Path, tmp_path: Path
) -> None:
    task = tmp_path / "fix-median"
    shutil.copytree(SANDBOXES / "fix-median", task)
    patch = (task / "model.patch").read_text()
    project = tmp_path / "project"
    project.mkdir()
    bindir = Path(sys.executable).parent
    script = Script(
        [("mcp__gitrun__apply_patch", {"patch": patch, "idempotency_key": "fix-1-patch"})]
    )
    with standin(script) as url:
        path = f"{bindir}:{os.environ['PATH']}"
        env = claude_env(url, tmp_path / "claude-home", {"GITRUN_HOME": str(ws), "PATH": path})
        # The README's line, as printed (task directory and run id are the user's).
        add = subprocess.run([str(claude_bin), "mcp", "add", "gitrun", "--", "gitrun", "mcp",
                              str(task), "--run-id", "fix-1"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert add.returncode == 0, add.stderr
        done = subprocess.run([str(claude_bin), "-p", "fix it", "--allowedTools",
                               "mcp__gitrun__apply_patch"], cwd=project, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert {"mcp__gitrun__observe", "mcp__gitrun__apply_patch", "mcp__gitrun__read_file",
            "mcp__gitrun__rewind", "mcp__gitrun__finish"} <= _mcp_tools(script)  # fmt: skip
    assert '"paths":["stats/median.py"],"replayed":false' in script.conversation().replace(
        '\\"', '"'
    )
    listed = gitrun(ws, "receipts", "fix-1", "--json")
    assert listed.returncode == 0, listed.stderr
    found: list[dict[str, Any]] = json.loads(listed.stdout)
    found = found if isinstance(found, list) else found["receipts"]
    assert [(r["key"], r["action"]) for r in found] == [("fix-1-patch", "apply_patch")]


def test_the_verifier_runs_when_claude_code_stops_and_the_run_ends_done(
    claude_bin: Path, ws: Path, tmp_path: Path
) -> None:
    task = tmp_path / "fix-median"
    shutil.copytree(SANDBOXES / "fix-median", task)
    wt = worktree(ws, "v1")
    old = "        return data[mid]\n    return data[mid]\n"
    new = "        return data[mid]\n    return (data[mid - 1] + data[mid]) / 2\n"
    script = Script([
        ("Bash", {"command": "echo hi > stats/x.txt", "description": "d"}),
        ("Read", {"file_path": f"{wt}/stats/median.py"}),
        ("Edit", {"file_path": f"{wt}/stats/median.py", "old_string": old, "new_string": new}),
    ])  # fmt: skip
    args = ["--task", str(task), "--run-id", "v1", "--finish-on-stop"]
    done = session(claude_bin, ws, tmp_path, args, script)
    assert done.returncode == 0, done.stderr
    assert "(rule action-not-allowed)" in script.results()[0]  # this task allows no exec
    status = gitrun(ws, "status", "v1", "--json")
    found = json.loads(status.stdout)
    assert (found["phase"], found["stop_reason"]) == ("done", "verified")
    repo = ws / "repos" / "fix-median"
    assert [s["Gitrun-Tool"] for s in receipts(repo, "v1")] == ["Edit"]


def test_rm_removes_the_run_whole_and_git_gc_collects_its_receipts(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    script = Script([("Bash", {"command": "echo a > a.txt && echo out", "description": "d"})])
    done = session(claude_bin, ws, tmp_path, ["--repo", str(repo), "--run-id", "m1"], script)
    assert done.returncode == 0, done.stderr
    step = receipts(repo, "m1")[0]
    wt = worktree(ws, "m1")
    (wt / "unsaved.txt").write_text("work no receipt has\n")
    refused = gitrun(ws, "rm", "m1")
    assert refused.returncode == 5, refused.stderr
    assert "unsaved.txt" in refused.stderr
    assert git(repo, "rev-parse", "gitrun/m1").strip() == step["commit"]  # nothing removed
    removed = gitrun(ws, "rm", "m1", "--force")
    assert removed.returncode == 0, removed.stderr
    assert git(repo, "for-each-ref", "refs/gitrun/runs/m1", "refs/heads/gitrun").strip() == ""
    assert not wt.exists()
    assert gitrun(ws, "status", "m1").returncode == 2
    git(repo, "reflog", "expire", "--expire=now", "--all")
    git(repo, "gc", "-q", "--prune=now")
    for oid in (step["commit"], step["Gitrun-Output"]):
        assert subprocess.run(["git", "-C", str(repo), "cat-file", "-e", oid],
                              check=False).returncode != 0  # fmt: skip
    assert git(repo, "fsck", "--strict").strip() == ""
    again = gitrun(ws, "claude", "--repo", str(repo), "--run-id", "m1", "--no-launch")
    assert again.returncode == 0, again.stderr  # the name is free again


def test_a_failing_bash_calls_change_is_recorded_under_its_own_key(
    claude_bin: Path, repo: Path, ws: Path, tmp_path: Path
) -> None:
    wt = worktree(ws, "f1")
    script = Script([
        ("Bash", {"command": "echo half > f.txt; echo said; exit 3", "description": "d"}),
        ("Write", {"file_path": f"{wt}/g.txt", "content": "g\n"}),
    ])  # fmt: skip
    done = session(claude_bin, ws, tmp_path, ["--repo", str(repo), "--run-id", "f1"], script)
    assert done.returncode == 0, done.stderr
    steps = receipts(repo, "f1")
    assert [(s["Gitrun-Idempotency-Key"], s["subject"]) for s in steps] == [
        ("toolu_gitrun_0000", "gitrun: Bash f.txt"),
        ("toolu_gitrun_0001", "gitrun: Write g.txt"),
    ]
    # Claude Code reports a failed Bash call by PostToolUseFailure: exit status and output.
    assert steps[0]["Gitrun-Exit-Status"] == "3"
    assert git(repo, "show", steps[0]["Gitrun-Output"] + ":stdout") == "said"
