"""``exec`` steps through the real CLI and real git: a shell command as one receipt.

Each test writes a task (the rename-api sandbox with its own plan and policy), runs
``gitrun run``, and reads what landed with the git CLI: the receipt's trailers with
``git log --format=%(trailers)``, its output with ``git show``, the worktree with
``git status``. Crash tests kill gitrun with SIGKILL at ``exec_running`` / ``exec_done``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Gitrun, git
from helpers import one_line

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(120)
RUN = "x"
POLICY = re.compile(r"\[policy\.exec\].*?(?=\n\[verifier\])", re.DOTALL)


def task_with(
    sandbox_copy: Callable[[str], Path],
    steps: list[dict[str, object]],
    *,
    exec_table: str = 'allow = ["*"]\nmax_timeout_seconds = 30',
    symlinks: bool = False,
) -> Path:
    """The rename-api task with ``steps`` as its plan and ``exec_table`` as [policy.exec]."""
    task = sandbox_copy("rename-api")
    text = POLICY.sub("[policy.exec]\n" + exec_table + "\n", (task / "task.toml").read_text())
    if symlinks:
        text = text.replace(
            'forbidden_paths = ["tests/**"]',
            'forbidden_paths = ["tests/**"]\nallow_symlinks = true',
        )
    (task / "task.toml").write_text(text)
    plan = ["schema = 1"]
    for step in steps:
        plan.append("\n[[step]]")
        plan += [f"{k} = {json.dumps(v)}" for k, v in {"kind": "exec", **step}.items()]
    (task / "plan.toml").write_text("\n".join(plan) + "\n")
    return task


def branch(cli: Gitrun) -> str:
    return f"refs/heads/gitrun/{RUN}"


def record(cli: Gitrun) -> dict[str, str]:
    data: dict[str, str] = json.loads((cli.home / "runs" / f"{RUN}.json").read_text())
    return data


def commits(cli: Gitrun) -> list[str]:
    rec = record(cli)
    out = git(cli.repo("rename-api"), "rev-list", f"{rec['base_commit']}..{branch(cli)}")
    return out.split()


def trailer(cli: Gitrun, rev: str, key: str) -> str:
    fmt = f"--format=%(trailers:key={key},valueonly)"
    return git(cli.repo("rename-api"), "log", "-1", fmt, rev).strip()


def worktree(cli: Gitrun) -> Path:
    return Path(record(cli)["worktree"])


def assert_clean_at(cli: Gitrun, rev: str) -> None:
    """The worktree holds exactly ``rev``'s tree: files, modes, nothing untracked or ignored."""
    wt = worktree(cli)
    git(wt, "update-index", "-q", "--refresh", check=False)
    assert git(wt, "status", "--porcelain", "--untracked-files=all", "--ignored") == ""
    assert git(wt, "rev-parse", "HEAD") == git(wt, "rev-parse", rev)
    assert git(wt, "diff", "--raw", rev) == ""


def test_an_exec_step_commits_the_commands_whole_change_as_one_receipt(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = "sed -i 's/calc_area/circle_area/g' geometry/*.py && echo renamed && echo warn >&2"
    task = task_with(sandbox_copy, [{"command": command}])
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.DONE, res.err
    (tip,) = commits(gitrun)
    repo = gitrun.repo("rename-api")
    assert trailer(gitrun, tip, "Gitrun-Action") == "exec"
    assert trailer(gitrun, tip, "Gitrun-Exit-Code") == "0"
    changed = git(repo, "diff", "--name-only", f"{tip}~1", tip).split()
    assert changed == [f"geometry/{n}.py" for n in ("__init__", "report", "shapes", "totals")]
    assert git(repo, "grep", "-l", "-e", "calc_area", tip, "--", "geometry", check=False) == ""
    output = trailer(gitrun, tip, "Gitrun-Output")
    git(repo, "gc", "--prune=now", "-q")  # the output tree is kept by its ref
    assert git(repo, "show", f"{output}:stdout") == "renamed\n"
    assert git(repo, "show", f"{output}:stderr") == "warn\n"
    assert git(repo, "ls-tree", "--name-only", output).split() == ["stderr", "stdout"]
    assert trailer(gitrun, tip, "Gitrun-Output-Digest") == documented_digest(repo, output)
    assert_clean_at(gitrun, tip)
    status = json.loads(gitrun("status", RUN, "--json").out)
    assert status["receipts"][0]["exit_code"] == 0
    assert status["receipts"][0]["output"] == output


def documented_digest(repo: Path, output: str) -> str:
    """``Gitrun-Output-Digest`` as the README says to recompute it from the output tree."""
    h = hashlib.sha256()
    for name in ("stdout", "stderr"):
        data = git_bytes(repo, "cat-file", "blob", f"{output}:{name}")
        h.update(f"{name} {len(data)}\n".encode() + data)
    return "sha256:" + h.hexdigest()


def git_bytes(repo: Path, *args: str, stdin: bytes = b"") -> bytes:
    """The real git CLI, bytes in and out."""
    argv = ["git", "-C", str(repo), *args]
    return subprocess.run(argv, input=stdin, capture_output=True, check=True).stdout


def test_a_command_that_changes_nothing_still_leaves_a_receipt_with_its_exit_code(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = task_with(
        sandbox_copy,
        [{"command": "true"}, {"argv": ["bash", "-c", "echo no; exit 3"]},
         {"command": "sed -i 's/calc_area/circle_area/g' geometry/*.py"}],
    )  # fmt: skip
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.DONE, res.err
    first, second, _ = reversed(commits(gitrun))
    repo = gitrun.repo("rename-api")
    base = record(gitrun)["base_commit"]
    for rev in (first, second):
        assert git(repo, "rev-parse", f"{rev}^{{tree}}") == git(
            repo, "rev-parse", f"{base}^{{tree}}"
        )
    assert trailer(gitrun, first, "Gitrun-Exit-Code") == "0"
    assert trailer(gitrun, second, "Gitrun-Exit-Code") == "3"
    assert git(repo, "show", trailer(gitrun, second, "Gitrun-Output") + ":stdout") == "no\n"
    keys = [trailer(gitrun, c, "Gitrun-Idempotency-Key") for c in commits(gitrun)]
    assert len(set(keys)) == 3


def test_an_exec_touching_a_forbidden_path_is_refused_and_the_worktree_put_back(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = (
        "sed -i 's/calc_area/circle_area/g' geometry/shapes.py; chmod +x geometry/report.py; "
        "rm geometry/totals.py; mkdir -p geometry/new/deep; echo x > geometry/new/deep/n.py; "
        "echo hacked > tests/test_extra.py; mkdir empty"
    )
    task = task_with(sandbox_copy, [{"command": command}])
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.FAILED, res.err  # the step was refused; the tests still fail
    assert commits(gitrun) == []
    assert "tests/test_extra.py matches forbidden path" in res.err
    assert "put back" in res.err
    assert_clean_at(gitrun, branch(gitrun))
    assert not (worktree(gitrun) / "empty").exists()
    chain = gitrun("checkpoints", RUN).out
    assert "gate_rejected" in chain


def test_a_timeout_kills_the_whole_process_tree(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = (
        "(sleep 1.5; echo late > geometry/late.py) & "
        "setsid bash -c 'sleep 1.5; echo late > geometry/late2.py' & "
        "echo started; sleep 30"
    )
    task = task_with(sandbox_copy, [{"command": command, "timeout_seconds": 0.5}])
    started = time.monotonic()
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.FAILED, res.err
    assert time.monotonic() - started < 20
    (tip,) = commits(gitrun)
    assert trailer(gitrun, tip, "Gitrun-Exit-Code") == "timeout"
    output = trailer(gitrun, tip, "Gitrun-Output")
    assert git(gitrun.repo("rename-api"), "show", f"{output}:stdout") == "started\n"
    shown = git(gitrun.repo("rename-api"), "show", f"{output}:stderr")
    assert "killed after the 0.5s timeout" in shown
    time.sleep(2.0)  # past the moment the grandchildren would have written
    assert not (worktree(gitrun) / "geometry" / "late.py").exists()
    assert not (worktree(gitrun) / "geometry" / "late2.py").exists()


def test_the_command_cannot_read_the_keyring_or_see_gitrun_variables(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    keyring = gitrun.home / "keys" / "checkpoint.keyring"
    command = (
        f"cat {keyring} > geometry/leak.txt 2>&1; ls -a {gitrun.home} > geometry/home.txt 2>&1; "
        "env > geometry/env.txt; git status > geometry/git.txt 2>&1; "
        f"ls -a {gitrun.repo('rename-api')}/.git > geometry/common.txt 2>&1; true"
    )
    table = 'allow = ["*"]\nenv = ["PASSED_THROUGH"]'
    task = task_with(sandbox_copy, [{"command": command}], exec_table=table)
    extra = {"PASSED_THROUGH": "yes", "NOT_PASSED": "no", "GITRUN_SECRET_PROBE": "s3cret"}
    res = gitrun("run", str(task), "--run-id", RUN, **extra)
    assert res.code == Exit.FAILED, res.err
    assert keyring.is_file()
    wt = worktree(gitrun) / "geometry"
    assert keyring.read_bytes()[:16] not in (wt / "leak.txt").read_bytes()
    env = dict(
        line.split("=", 1) for line in (wt / "env.txt").read_text().splitlines() if "=" in line
    )
    assert env.get("PASSED_THROUGH") == "yes"
    assert "NOT_PASSED" not in env
    assert not [name for name in env if name.startswith("GITRUN_")]
    assert "s3cret" not in (wt / "env.txt").read_text()
    assert "runs" not in (wt / "home.txt").read_text()  # the workspace is hidden
    # the common git dir is hidden too: git works on the step's own view (test_gitview.py),
    # which shows the object store read-only and nothing else of it (no refs, config, hooks)
    assert (wt / "git.txt").read_text().startswith(f"On branch gitrun/{RUN}\n")
    assert (wt / "common.txt").read_text().split() == [".", "..", "objects", "worktrees"]


def test_chmod_and_symlinks_made_by_the_command_are_captured(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = "chmod +x geometry/report.py && ln -s shapes.py geometry/alias.py"
    task = task_with(sandbox_copy, [{"command": command}], symlinks=True)
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.FAILED, res.err  # the rename was not made: the tests fail
    (tip,) = commits(gitrun)
    tree = git(gitrun.repo("rename-api"), "ls-tree", "-r", tip, "geometry/")
    assert re.search(r"^100755 blob \w+\tgeometry/report.py$", tree, re.M)
    assert re.search(r"^120000 blob \w+\tgeometry/alias.py$", tree, re.M)
    assert git(gitrun.repo("rename-api"), "show", f"{tip}:geometry/alias.py") == "shapes.py"
    assert_clean_at(gitrun, tip)


COUNTING = (
    "for i in $(seq 150); do echo $i >> geometry/count.txt; sleep 0.02; done; "
    "sed -i 's/calc_area/circle_area/g' geometry/*.py"
)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(name))
    return kids


def test_a_resume_puts_the_worktree_back_only_once_the_killed_runs_command_is_dead(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], reap: list[subprocess.Popen[str]]
) -> None:
    """gitrun SIGKILLed mid-command, its supervisor held up (SIGSTOP) before it can end
    the command: the command goes on appending. A resume must not put the worktree back
    and re-run while it lives (the old command's writes would land on the put-back tree);
    it waits, and once the supervisor ends the command, re-runs it exactly once."""
    task = task_with(sandbox_copy, [{"command": COUNTING}])
    run = gitrun.popen("run", str(task), "--run-id", RUN, "--isolation", "none")
    reap.append(run)
    deadline = time.monotonic() + 60
    while (
        not (gitrun.home / "runs" / f"{RUN}.json").exists()
        or not (worktree(gitrun) / "geometry" / "count.txt").exists()
    ):
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    supervisors = children_of(run.pid)
    assert len(supervisors) == 1, supervisors
    os.kill(supervisors[0], signal.SIGSTOP)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    count = worktree(gitrun) / "geometry" / "count.txt"
    seen = len(count.read_text().split())
    resume = gitrun.popen("resume", RUN)
    reap.append(resume)
    time.sleep(2.0)
    assert resume.poll() is None, resume.communicate()  # waiting for the old command's end
    assert len(count.read_text().split()) > seen  # which is still running, unswept
    os.kill(supervisors[0], signal.SIGCONT)
    _, err = resume.communicate(timeout=90)
    assert resume.returncode == Exit.DONE, err
    assert "discarded its unproven effects on geometry/count.txt" in err
    assert len(commits(gitrun)) == 1
    tip = git(gitrun.repo("rename-api"), "show", f"{branch(gitrun)}:geometry/count.txt")
    assert tip.split() == [str(i) for i in range(1, 151)]  # one whole run, nothing of the old
    assert_clean_at(gitrun, branch(gitrun))


@pytest.mark.parametrize(
    ("command", "rule"),
    [
        ("chmod +x geometry/report.py && ln -s shapes.py geometry/alias.py", "symlinks"),
        ("ln -s /etc/passwd geometry/pw", "absolute path"),
    ],
)
def test_a_symlink_the_policy_does_not_allow_is_refused_and_undone(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], command: str, rule: str
) -> None:
    task = task_with(sandbox_copy, [{"command": command}], symlinks=rule != "symlinks")
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.FAILED, res.err
    assert rule in res.err
    assert commits(gitrun) == []
    assert_clean_at(gitrun, branch(gitrun))


SLOW_EDIT = (
    "echo partial > geometry/partial.py; sleep 2; sed -i 's/calc_area/circle_area/g' geometry/*.py"
)


def crash_mid_command(gitrun: Gitrun, task: Path) -> str:
    """SIGKILL gitrun ~1 s into the command: its first effect made, the rest not."""
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="exec_running:50")
    assert res.code == -9, res.err
    wt = worktree(gitrun) / "geometry"
    assert (wt / "partial.py").read_text() == "partial\n"  # an unproven partial effect
    time.sleep(2.5)  # the command would have renamed by now, had gitrun's death not killed it
    assert "calc_area" in (wt / "shapes.py").read_text()
    assert commits(gitrun) == []
    found = re.search(r"intent (k-[0-9a-f]+):", res.err)
    assert found is not None, res.err
    return found.group(1)


def test_a_crash_while_the_command_runs_discards_its_partial_effects_and_runs_it_once_more(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    task = task_with(sandbox_copy, [{"command": SLOW_EDIT}])
    clean = Gitrun(tmp_path / "uninterrupted")
    clean.home.mkdir()
    assert clean("run", str(task), "--run-id", RUN).code == Exit.DONE
    intent = crash_mid_command(gitrun, task)
    res = gitrun("resume", RUN)
    assert res.code == Exit.DONE, res.err
    assert "discarded its unproven effects on geometry/partial.py" in res.err
    keys = [trailer(gitrun, c, "Gitrun-Idempotency-Key") for c in commits(gitrun)]
    assert len(keys) == 1
    assert keys == [intent]  # the key persisted before the crash, not a new one
    tree = git(gitrun.repo("rename-api"), "rev-parse", f"{branch(gitrun)}^{{tree}}")
    assert tree == git(clean.repo("rename-api"), "rev-parse", f"{branch(clean)}^{{tree}}")
    assert_clean_at(gitrun, branch(gitrun))


def test_with_retry_review_a_crash_while_the_command_runs_freezes_the_run_for_review(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    table = 'allow = ["*"]\nretry = "review"'
    task = task_with(sandbox_copy, [{"command": SLOW_EDIT}], exec_table=table)
    crash_mid_command(gitrun, task)
    res = gitrun("resume", RUN)
    assert res.code == Exit.FROZEN, res.err
    assert "needs review" in res.err
    assert "exec interrupted" in res.err
    status = json.loads(gitrun("status", RUN, "--json").out)
    assert status["phase"] == "needs_review"
    assert commits(gitrun) == []
    assert_clean_at(gitrun, branch(gitrun))  # restored, so a replan starts from HEAD
    shown = gitrun("review", "show", RUN)
    assert shown.code == 0, shown.err
    assert "none (the command was interrupted" in shown.out


@pytest.mark.parametrize("point", ["exec_done", "after_write_commit_object", "write_ref_moved"])
def test_a_crash_around_the_exec_commit_resumes_to_one_receipt(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], point: str
) -> None:
    task = task_with(
        sandbox_copy, [{"command": "sed -i 's/calc_area/circle_area/g' geometry/*.py"}]
    )
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT=point)
    assert res.code == -9, res.err
    resumed = gitrun("resume", RUN)
    assert resumed.code == Exit.DONE, resumed.err
    assert len(commits(gitrun)) == 1
    assert_clean_at(gitrun, branch(gitrun))


def test_a_plan_exec_step_outside_the_exec_policy_is_refused_before_it_runs(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = task_with(
        sandbox_copy,
        [{"command": "touch geometry/ran.py"}],
        exec_table='allow = ["sed -i *"]\ndeny = ["*tests/*"]',
    )
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.FAILED, res.err
    assert "matches no allowed pattern" in res.err
    assert not (worktree(gitrun) / "geometry" / "ran.py").exists()
    assert commits(gitrun) == []


def test_a_task_allowing_exec_without_an_exec_table_is_refused(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("rename-api")
    text = POLICY.sub("", (task / "task.toml").read_text())
    (task / "task.toml").write_text(text)
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.BAD_INPUT, res.err
    assert res.err.startswith("gitrun:")
    assert "[policy.exec]" in res.err
    assert len(res.err.strip().splitlines()) == 1
    assert not (gitrun.home / "runs" / f"{RUN}.json").exists()


def test_an_exec_step_runs_in_its_cwd_inside_the_worktree_and_nowhere_else(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    rename = "sed -i 's/calc_area/circle_area/g' *.py"
    task = task_with(
        sandbox_copy, [{"command": "true", "cwd": "../.."}, {"command": rename, "cwd": "geometry"}]
    )
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.DONE, res.err
    assert "path-dotdot" in res.err  # the first step: refused before anything ran
    (tip,) = commits(gitrun)
    assert len(git(gitrun.repo("rename-api"), "diff", "--name-only", f"{tip}~1", tip).split()) == 4


def test_a_long_stderr_is_cut_with_a_note_while_stdout_is_kept_whole(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = "head -c 200000 /dev/zero | tr '\\0' e >&2; seq 1 5000"
    task = task_with(sandbox_copy, [{"command": command}])
    res = gitrun("run", str(task), "--run-id", RUN)
    assert res.code == Exit.FAILED, res.err  # nothing renamed: the tests fail
    (tip,) = commits(gitrun)
    repo = gitrun.repo("rename-api")
    output = trailer(gitrun, tip, "Gitrun-Output")
    stdout = git(repo, "show", f"{output}:stdout")
    assert stdout == "".join(f"{n}\n" for n in range(1, 5001))  # 23893 bytes: not cut
    stderr = git(repo, "show", f"{output}:stderr")
    note = "\n[gitrun: output truncated: 200000 bytes, first and last 32768 kept]\n"
    assert stderr == "e" * 32768 + note + "e" * 32768
    assert trailer(gitrun, tip, "Gitrun-Output-Digest") == documented_digest(repo, output)


def test_resume_refuses_an_exec_commit_whose_output_was_swapped_for_another(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = "sed -i 's/calc_area/circle_area/g' geometry/*.py; echo ok; echo fine >&2"
    task = task_with(sandbox_copy, [{"command": command}])
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="write_ref_moved")
    assert res.code == -9, res.err
    repo = gitrun.repo("rename-api")
    (tip,) = commits(gitrun)
    output = trailer(gitrun, tip, "Gitrun-Output")
    # A hostile agent rewrites the commit: same trailers, the stderr of its output changed.
    forged_err = git_bytes(repo, "hash-object", "-w", "--stdin", stdin=b"all good\n").strip()
    stderr_blob = git(repo, "rev-parse", f"{output}:stderr").strip().encode()
    listing = git_bytes(repo, "ls-tree", output).replace(stderr_blob, forged_err)
    forged = git_bytes(repo, "mktree", stdin=listing).strip()
    body = git_bytes(repo, "cat-file", "commit", tip).replace(output.encode(), forged)
    made = git_bytes(repo, "hash-object", "-t", "commit", "-w", "--stdin", stdin=body)
    git(repo, "update-ref", branch(gitrun), made.decode().strip(), tip)
    before = git(repo, "for-each-ref")
    resumed = gitrun("resume", RUN)
    assert resumed.code == Exit.REFUSED, resumed.err
    assert "names no output matching its digest" in resumed.err
    assert git(repo, "for-each-ref") == before
    git(repo, "update-ref", branch(gitrun), tip)  # the true commit back: resume accepts it
    assert gitrun("resume", RUN).code == Exit.DONE


def test_a_link_planted_at_the_exec_lock_is_refused_and_its_target_left_alone(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    """The lock file's holder record is written into it: through a planted link it would
    overwrite whatever the link names (an unconfined command can plant one)."""
    task = task_with(
        sandbox_copy, [{"command": "echo one > geometry/one.txt"}, {"command": COUNTING}]
    )
    assert gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="exec_done:2").code == -9
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    gitdir = Path(git(worktree(gitrun), "rev-parse", "--absolute-git-dir").strip())
    (gitdir / "gitrun-exec.flock").unlink()
    (gitdir / "gitrun-exec.flock").symlink_to(victim)
    res = gitrun("resume", RUN)
    line = one_line(res.err)
    assert res.code == Exit.REFUSED, res.err
    assert "gitrun-exec.flock is a symbolic link" in line
    assert "remove it" in line
    assert victim.read_text() == "the user's file\n"
    assert len(commits(gitrun)) == 1
