"""gitrun's Claude Code hooks as Claude Code runs them — one ``gitrun hook EVENT`` process
per call, its JSON on stdin — without the CLI: the scan cache never hides a change, bad
input is one line and changes nothing, a pre-tool-use hook that cannot decide blocks."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import git

from gitrun.app.opening import cli_options
from gitrun.integrations.claude_code import hook_command

GITRUN = [sys.executable, "-m", "gitrun"]


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(workspace, repository, worktree) of a fresh Claude Code run ``c1``."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "a.txt").write_text("aaaa\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    ws = tmp_path / "ws"
    made = gitrun(ws, "claude", "--repo", str(repo), "--run-id", "c1", "--no-launch")
    assert made.returncode == 0, made.stderr
    return ws, repo, ws / "worktrees" / "c1"


def gitrun(ws: Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "GITRUN_HOME": str(ws)}
    return subprocess.run([*GITRUN, *args], input=stdin, capture_output=True, env=env,
                          timeout=120, check=False)  # fmt: skip


def hook(
    ws: Path, event: str, tool: str, key: str, tool_input: dict[str, object]
) -> subprocess.CompletedProcess[bytes]:
    name = {"pre-tool-use": "PreToolUse", "post-tool-use": "PostToolUse"}[event]
    data = {"session_id": "s-1", "hook_event_name": name, "tool_name": tool,
            "tool_input": tool_input, "tool_use_id": key,
            "tool_response": {"stdout": "", "stderr": "", "interrupted": False}}  # fmt: skip
    return gitrun(ws, "hook", event, "--run", "c1", "--workspace", str(ws),
                  stdin=json.dumps(data).encode())  # fmt: skip


def subjects(repo: Path) -> list[str]:
    return git(repo, "log", "--reverse", "--format=%s", "main..gitrun/c1").split()


def call(ws: Path, key: str, change: object = None) -> None:
    pre = hook(ws, "pre-tool-use", "Bash", key, {"command": "true"})
    assert pre.returncode == 0, pre.stderr
    if callable(change):
        change()
    post = hook(ws, "post-tool-use", "Bash", key, {"command": "true"})
    assert (post.returncode, post.stdout) == (0, b""), post.stderr


def test_a_same_size_rewrite_with_its_old_mtime_restored_is_still_recorded(
    run: tuple[Path, Path, Path],
) -> None:
    ws, repo, wt = run
    call(ws, "toolu_first_call")  # the scan cache now knows a.txt
    call(ws, "toolu_second_call")
    target = wt / "a.txt"
    st = os.stat(target)

    def sneak() -> None:
        target.write_text("bbbb\n")  # same size
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # old mtime back

    call(ws, "toolu_sneaky_call", sneak)
    assert git(repo, "show", "gitrun/c1:a.txt") == "bbbb\n"
    assert git(repo, "log", "-1", "--format=%s", "gitrun/c1").strip() == "gitrun: Bash a.txt"


def test_a_garbled_scan_cache_only_costs_a_full_scan(run: tuple[Path, Path, Path]) -> None:
    ws, repo, wt = run
    call(ws, "toolu_first_call")
    cache = repo / ".git" / "worktrees" / "gitrun-c1" / "gitrun-scan-cache.json"
    assert cache.is_file()
    cache.write_bytes(b"gitrun-scan-cache/1\n\x00\x00garbage")
    call(ws, "toolu_second_call", lambda: (wt / "a.txt").write_text("cccc\n"))
    assert git(repo, "show", "gitrun/c1:a.txt") == "cccc\n"


def test_bad_hook_input_is_one_line_and_a_pre_tool_use_hook_that_cannot_decide_blocks(
    run: tuple[Path, Path, Path],
) -> None:
    ws, repo, _ = run
    pre = gitrun(ws, "hook", "pre-tool-use", "--run", "c1", stdin=b"{not json")
    assert pre.returncode == 2
    assert pre.stderr.decode().startswith("gitrun: hook input is not JSON")
    assert pre.stderr.count(b"\n") == 1
    post = gitrun(ws, "hook", "post-tool-use", "--run", "c1", stdin=b"[1]")
    assert (post.returncode, post.stderr) == (2, b"gitrun: hook input is not a JSON object\n")
    unknown = gitrun(ws, "hook", "pre-tool-use", "--run", "nope", stdin=b"{}")
    assert unknown.returncode == 2
    assert b"unknown run id 'nope'" in unknown.stderr
    usage = gitrun(ws, "hook", "post-tool-use")
    assert usage.returncode == 2
    assert b"--run RUN is required" in usage.stderr
    assert subjects(repo) == []


def test_an_edit_outside_the_worktree_is_blocked_before_it_runs(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    ws, repo, wt = run
    outside = hook(ws, "pre-tool-use", "Write", "toolu_outside_1",
                   {"file_path": str(tmp_path / "elsewhere.txt"), "content": "x"})  # fmt: skip
    assert outside.returncode == 2
    assert b"(rule path-escape)" in outside.stderr
    edit: dict[str, object] = {"file_path": str(wt / ".git"), "old_string": "a", "new_string": "b"}
    dotgit = hook(ws, "pre-tool-use", "Edit", "toolu_dotgit_01", edit)
    assert dotgit.returncode == 2, dotgit.stderr
    assert subjects(repo) == []


@pytest.mark.parametrize(
    ("plant", "rule"),
    [
        (lambda wt: (wt / "sub" / ".git").mkdir(parents=True), "exec-dotgit"),
        (lambda wt: os.link(wt / "a.txt", wt / "b.txt"), "exec-hard-link"),
    ],
    ids=["nested-dotgit", "hard-link"],
)
def test_a_tool_calls_change_meets_the_exec_steps_output_checks(
    run: tuple[Path, Path, Path], plant: object, rule: str
) -> None:
    """A Bash call's change is checked exactly as an exec step's output: a planted .git,
    a hard link are undone, the rule named to the model, nothing committed."""
    ws, repo, wt = run
    before = subjects(repo)
    key = "toolu_hostile_call"
    pre = hook(ws, "pre-tool-use", "Bash", key, {"command": "true"})
    assert pre.returncode == 0, pre.stderr
    assert callable(plant)
    plant(wt)
    post = hook(ws, "post-tool-use", "Bash", key, {"command": "true"})
    assert f"rule {rule}" in post.stdout.decode(), (post.returncode, post.stdout, post.stderr)
    assert subjects(repo) == before
    assert sorted(p.name for p in wt.iterdir()) == [".git", "a.txt"]
    call(ws, "toolu_next_call", lambda: (wt / "a.txt").write_text("next\n"))  # not wedged
    assert git(repo, "show", "gitrun/c1:a.txt") == "next\n"


def test_resume_of_a_claude_run_records_what_a_session_left_and_points_to_gitrun_claude(
    run: tuple[Path, Path, Path],
) -> None:
    ws, repo, wt = run
    (wt / "left.txt").write_text("a killed session's change\n")
    resumed = gitrun(ws, "resume", "c1")
    assert resumed.returncode == 8, resumed.stderr  # the agent is gone: start it again
    said = resumed.stderr.decode().strip().splitlines()[-1]
    assert said.startswith("gitrun: run c1 is a Claude Code run (running; recorded what")
    assert "gitrun claude --run-id c1 -- --continue" in said
    assert subjects(repo) == ["gitrun:", "outside", "left.txt"]  # recorded once
    again = gitrun(ws, "resume", "c1")
    assert again.returncode == 8
    assert b"nothing left unrecorded" in again.stderr
    assert subjects(repo) == ["gitrun:", "outside", "left.txt"]


def test_gitrun_claude_with_another_task_for_an_existing_run_is_refused_and_changes_nothing(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    ws, repo, _ = run
    other = tmp_path / "other-task"
    other.mkdir()
    text = (ws / "claude" / "default-task" / "task.toml").read_text()
    (other / "task.toml").write_text(text.replace('id = "claude-code"', 'id = "other"'))
    settings = (ws / "claude" / "c1.settings.json").read_bytes()
    refused = gitrun(ws, "claude", "--run-id", "c1", "--task", str(other), "--no-launch")
    assert refused.returncode == 2
    line = refused.stderr.decode()
    assert line.count("\n") == 1
    assert line.startswith("gitrun: run c1 already exists with other inputs: task dir ")
    elsewhere = gitrun(ws, "claude", "--run-id", "c1", "--repo", str(tmp_path), "--no-launch")
    assert elsewhere.returncode == 2
    assert b"repo " in elsewhere.stderr
    assert (ws / "claude" / "c1.settings.json").read_bytes() == settings
    same = gitrun(ws, "claude", "--run-id", "c1", "--repo", str(repo), "--no-launch")
    assert same.returncode == 0, same.stderr  # its own inputs: it continues
    assert subjects(repo) == []


def test_rm_refuses_a_takeover_time_that_is_not_a_number_of_seconds(
    run: tuple[Path, Path, Path],
) -> None:
    ws, repo, _ = run
    refused = gitrun(ws, "rm", "c1", "--takeover-after", "inf")
    assert refused.returncode == 2
    assert b"inf is not a finite number of seconds" in refused.stderr
    assert git(repo, "rev-parse", "--verify", "-q", "gitrun/c1").strip()


def test_the_runs_worktree_is_locked_so_git_will_not_remove_it_and_gitrun_rm_does(
    run: tuple[Path, Path, Path],
) -> None:
    ws, repo, wt = run
    reason = "gitrun run c1; `gitrun rm c1` removes it"
    assert f"locked {reason}\n" in git(repo, "worktree", "list", "--porcelain")
    refused = subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(wt)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert refused.returncode != 0
    assert f"cannot remove a locked working tree, lock reason: {reason}" in refused.stderr
    assert (wt / "a.txt").is_file()
    locked = repo / ".git" / "worktrees" / "gitrun-c1" / "locked"
    locked.unlink()  # a run made before gitrun locked its worktrees: locked when next opened
    call(ws, "toolu_relocking_01")
    assert locked.read_text() == f"{reason}\n"
    removed = gitrun(ws, "rm", "c1")
    assert removed.returncode == 0, removed.stderr
    assert not wt.exists()
    assert str(wt) not in git(repo, "worktree", "list")
    assert not (repo / ".git" / "worktrees" / "gitrun-c1").exists()


@contextmanager
def helper(
    ws: Path, tmp_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """The run's resident helper (``gitrun hook serve``), as ``gitrun claude`` forks it."""
    where = tmp_path / "sock"
    where.mkdir(mode=0o700)
    sock = where / "hook.sock"
    argv = [*GITRUN, "hook", "serve", "--run", "c1", "--workspace", str(ws),
            "--socket", str(sock)]  # fmt: skip
    proc = subprocess.Popen(argv, env={**os.environ, "GITRUN_HOME": str(ws), **(env or {})},
                            stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, "the helper exited"
            assert time.monotonic() < deadline, "no helper socket"
            time.sleep(0.05)
        yield sock, proc
    finally:
        proc.kill()
        proc.wait(30)


def asked(
    ws: Path, sock: Path, event: str, tool: str, key: str, tool_input: dict[str, object],
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
    """One hook as Claude Code runs it in a ``gitrun claude`` session (a shell line): the
    small client."""
    name = {"pre-tool-use": "PreToolUse", "post-tool-use": "PostToolUse"}[event]
    data = {"session_id": "s-1", "hook_event_name": name, "tool_name": tool,
            "tool_input": tool_input, "tool_use_id": key,
            "tool_response": {"stdout": "", "stderr": "", "interrupted": False}}  # fmt: skip
    argv = ["sh", "-c", hook_command(event, "c1", cli_options(ws, None), socket=sock)]
    return subprocess.run(argv, input=json.dumps(data).encode(), capture_output=True,
                          env={**os.environ, **(env or {})}, timeout=120, check=False)  # fmt: skip


# The in-process hook dies at its first commit under this: a hook that still records
# was answered by the helper (started without it).
NO_IN_PROCESS = {"GITRUN_CRASH_AT": "after_write_commit_object"}


def asked_call(ws: Path, sock: Path, key: str, change: object = None) -> None:
    pre = asked(ws, sock, "pre-tool-use", "Bash", key, {"command": "true"}, NO_IN_PROCESS)
    assert pre.returncode == 0, pre.stderr
    if callable(change):
        change()
    post = asked(ws, sock, "post-tool-use", "Bash", key, {"command": "true"}, NO_IN_PROCESS)
    assert (post.returncode, post.stdout) == (0, b""), post.stderr


def test_the_resident_helper_answers_the_hooks_and_sees_every_change(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    ws, repo, wt = run
    with helper(ws, tmp_path) as (sock, _):
        asked_call(ws, sock, "toolu_first_call", lambda: (wt / "a.txt").write_text("bbbb\n"))
        asked_call(ws, sock, "toolu_quiet_call")
        st = os.stat(wt / "a.txt")

        def sneak() -> None:
            (wt / "a.txt").write_text("cccc\n")  # same size, old mtime put back
            os.utime(wt / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))

        asked_call(ws, sock, "toolu_sneaky_call", sneak)

        def nested() -> None:
            (wt / "d" / "e").mkdir(parents=True)
            (wt / "d" / "e" / "f.txt").write_text("one\n")

        asked_call(ws, sock, "toolu_nested_call", nested)
        asked_call(ws, sock, "toolu_inner_call", lambda: (wt / "d/e/f.txt").write_text("two\n"))

        def other_dir() -> None:
            (wt / "g").mkdir()
            (wt / "g" / "h.txt").write_text("h\n")

        asked_call(ws, sock, "toolu_other_dir", other_dir)
        # Only files change from here: the helper looks in the directories they are in.
        asked_call(ws, sock, "toolu_deep_edit", lambda: (wt / "d/e/f.txt").write_text("three\n"))
        asked_call(ws, sock, "toolu_deep_delete", (wt / "g" / "h.txt").unlink)
        asked_call(ws, sock, "toolu_deep_new", lambda: (wt / "d/e/n.txt").write_text("n\n"))
        (wt / "by-hand.txt").write_text("typed between calls\n")
        asked_call(ws, sock, "toolu_after_hand")
        refused = asked(ws, sock, "pre-tool-use", "Write", "toolu_outside_1",
                        {"file_path": str(tmp_path / "x"), "content": "x"})  # fmt: skip
        assert refused.returncode == 2
        assert b"(rule path-escape)" in refused.stderr
    log = git(repo, "log", "--reverse", "--format=%s", "main..gitrun/c1").splitlines()
    assert [line for line in log if "(no change)" not in line] == [
        "gitrun: Bash a.txt", "gitrun: Bash a.txt", "gitrun: Bash d/e/f.txt",
        "gitrun: Bash d/e/f.txt", "gitrun: Bash g/h.txt", "gitrun: Bash d/e/f.txt",
        "gitrun: Bash g/h.txt", "gitrun: Bash d/e/n.txt", "gitrun: outside by-hand.txt",
    ]  # fmt: skip
    assert git(repo, "show", "gitrun/c1:a.txt") == "cccc\n"
    assert git(repo, "ls-tree", "-r", "--name-only", "gitrun/c1").split() == [
        "a.txt", "by-hand.txt", "d/e/f.txt", "d/e/n.txt",
    ]  # fmt: skip
    assert git(repo, "show", "gitrun/c1:d/e/f.txt") == "three\n"


def test_a_helper_killed_mid_call_leaves_nothing_half_recorded_and_the_hook_records_it_once(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    ws, repo, wt = run
    with helper(ws, tmp_path, env=NO_IN_PROCESS) as (sock, proc):
        pre = asked(ws, sock, "pre-tool-use", "Bash", "toolu_killed_1", {"command": "true"})
        assert pre.returncode == 0, pre.stderr
        (wt / "new.txt").write_text("made by the call\n")
        post = asked(ws, sock, "post-tool-use", "Bash", "toolu_killed_1", {"command": "true"})
        assert (post.returncode, post.stdout) == (0, b""), post.stderr
        assert proc.wait(30) == -signal.SIGKILL  # the helper died at its commit
        again = asked(ws, sock, "post-tool-use", "Bash", "toolu_killed_1", {"command": "true"})
        assert again.returncode == 0, again.stderr  # no helper now: in-process, a replay
    keys = git(repo, "log", "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)",
               "main..gitrun/c1").split()  # fmt: skip
    assert keys == ["toolu_killed_1"]
    assert git(repo, "show", "gitrun/c1:new.txt") == "made by the call\n"
    assert git(repo, "for-each-ref", "refs/gitrun/runs/c1/calls").strip() == ""  # not twice


def test_a_socket_others_can_reach_is_never_spoken_to(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    ws, repo, wt = run
    with helper(ws, tmp_path) as (sock, _):
        sock.parent.chmod(0o755)
        pre = asked(ws, sock, "pre-tool-use", "Bash", "toolu_open_dir1", {"command": "true"})
        assert pre.returncode == 0, pre.stderr
        (wt / "new.txt").write_text("x\n")
        post = asked(ws, sock, "post-tool-use", "Bash", "toolu_open_dir1", {"command": "true"},
                     NO_IN_PROCESS)  # fmt: skip
        assert post.returncode != 0  # done in-process (and killed there), not by the helper
    assert git(repo, "log", "--format=%s", "main..gitrun/c1").strip() == ""


def test_the_helper_stops_and_removes_its_socket_when_its_parent_is_gone(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    ws, _, _ = run
    where = tmp_path / "sock"
    where.mkdir(mode=0o700)
    sock = where / "hook.sock"
    serve = shlex.join([*GITRUN, "hook", "serve", "--run", "c1", "--workspace", str(ws),
                        "--socket", str(sock)])  # fmt: skip
    wait = f"until [ -S {shlex.quote(str(sock))} ]; do sleep 0.1; done"
    parent = subprocess.Popen(["sh", "-c", f"{serve} & {wait}"], stdin=subprocess.DEVNULL)
    assert parent.wait(60) == 0
    deadline = time.monotonic() + 30
    while where.exists():
        assert time.monotonic() < deadline, "the helper outlived its parent"
        time.sleep(0.1)


def test_a_call_that_changed_nothing_is_one_record_on_the_call_log_and_no_commit(
    run: tuple[Path, Path, Path],
) -> None:
    ws, repo, _ = run
    call(ws, "toolu_quiet_call")
    again = hook(ws, "post-tool-use", "Bash", "toolu_quiet_call", {"command": "true"})
    assert again.returncode == 0, again.stderr  # the same call reported twice: once
    assert subjects(repo) == []  # nothing on the branch
    fields = "%(trailers:key={},valueonly,separator=)"
    shown = (
        "%s|" + fields.format("Gitrun-Idempotency-Key") + "|" + fields.format("Gitrun-Exit-Status")
    )
    log = git(repo, "log", f"--format={shown}", "refs/gitrun/runs/c1/calls")
    assert log.splitlines() == ["gitrun: Bash (no change)|toolu_quiet_call|0"]
    assert git(repo, "fsck", "--strict", "--no-dangling").strip() == ""


def test_a_session_set_up_without_launching_has_hooks_that_work_alone(
    run: tuple[Path, Path, Path],
) -> None:
    """``--no-launch`` starts no helper: its hooks are the in-process ones, every event
    Claude Code 2.1.332 sends for a call (PostToolUseFailure for a failed one) included."""
    ws, _, _ = run
    hooks = json.loads((ws / "claude" / "c1.settings.json").read_text())["hooks"]
    assert set(hooks) == {"SessionStart", "PreToolUse", "PostToolUse", "PostToolUseFailure",
                          "Stop"}  # fmt: skip
    for entries in hooks.values():
        argv = shlex.split(entries[0]["hooks"][0]["command"])
        assert argv[1:6] == ["-P", "-E", "-m", "gitrun", "hook"]


def test_a_hook_client_with_no_helper_never_imports_a_gitrun_package_in_the_worktree(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The small client falls back to the in-process hook when its helper is gone. Claude
    Code starts hooks in the worktree, where the model's Bash can plant a ``gitrun/``
    package: ``python -m gitrun`` there would run it (the planted hook says yes to every
    call and records nothing). The fallback runs gitrun's own package, with ``-P -E``."""
    ws, _, wt = run
    marker = tmp_path / "planted-hook-ran"
    (wt / "gitrun").mkdir()
    (wt / "gitrun" / "__init__.py").write_text("")
    (wt / "gitrun" / "__main__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    line = hook_command("pre-tool-use", "c1", cli_options(ws, None), socket=tmp_path / "gone.sock")
    data = {"session_id": "s-1", "hook_event_name": "PreToolUse", "tool_name": "Write",
            "tool_input": {"file_path": str(wt / ".git" / "config"), "content": "x"},
            "tool_use_id": "toolu_planted_1"}  # fmt: skip
    asked = subprocess.run(["sh", "-c", line], cwd=wt, input=json.dumps(data).encode(),
                           capture_output=True, timeout=120, check=False)  # fmt: skip
    assert not marker.exists()
    assert asked.returncode == 2, asked.stderr  # gitrun's own hook refused the .git write
    assert b"rule" in asked.stderr
