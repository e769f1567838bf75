"""Hostile exec steps through the real CLI, bubblewrap in force, real git: a planted
``.git``, output over the policy's limits, names git cannot hold, special files, hard
links, setuid bits and odd directory modes, descriptors reopened through ``/proc``. Each
is a refused step with the worktree put back (modes: cleared), never a crash, and
nothing of it reaches the user's git."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git
from session_client import Rpc
from test_exec import RUN, assert_clean_at, branch, commits, task_with, worktree

from gitrun.core.errors import Exit

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
]
RENAME = "sed -i 's/calc_area/circle_area/g' geometry/*.py"


def run_steps(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], *commands: str, table: str = "",
    isolation: str = "required",
) -> tuple[int, str]:  # fmt: skip
    """Run the rename task with ``commands`` as its exec steps (bwrap required)."""
    exec_table = 'allow = ["*"]\nmax_timeout_seconds = 60' + ("\n" + table if table else "")
    task = task_with(sandbox_copy, [{"command": c} for c in commands], exec_table=exec_table)
    res = gitrun("run", str(task), "--run-id", RUN, "--isolation", isolation)
    return res.code, res.err


def assert_refused_and_put_back(gitrun: Gitrun, code: int, err: str, rule: str) -> None:
    """The step was refused by ``rule``: nothing committed, the worktree exactly HEAD,
    its .git gitrun's, and the run still readable (no crash, nothing wedged)."""
    assert code == Exit.FAILED, err  # refused; the rename with it: the tests fail
    assert f"{rule}:" in err, err  # (rule "": any; then "gate rejected" names it)
    assert "gate rejected pending exec" in err, err
    assert "put back" in err, err
    assert commits(gitrun) == []
    assert_user_git_is_gitruns(gitrun)
    assert_clean_at(gitrun, branch(gitrun))
    status = gitrun("status", RUN)
    assert status.code == 0, status.err


def assert_user_git_is_gitruns(gitrun: Gitrun) -> None:
    """``git`` in the worktree opens gitrun's repository, through gitrun's .git file."""
    wt = worktree(gitrun)
    assert stat.S_ISREG(os.lstat(wt / ".git").st_mode)
    common = git(wt, "rev-parse", "--git-common-dir").strip()
    assert Path(wt, common).resolve() == (gitrun.repo("rename-api") / ".git").resolve()
    assert git(wt, "symbolic-ref", "HEAD").strip() == branch(gitrun)


# -- a planted .git ----------------------------------------------------------------------

FSMONITOR = "git config core.fsmonitor 'touch {flag}'"
# An unconfined command gets the step's git view through GIT_DIR; a hostile one drops it first.
NEW_REPO = "unset GIT_DIR GIT_WORK_TREE; rm .git && git init -q . && "


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(
            NEW_REPO + FSMONITOR,
            id="repository-directory",
        ),
        pytest.param("printf 'gitdir: /tmp\\n' > .git", id="file-naming-another-git-dir"),
        pytest.param("rm .git && ln -s geometry .git", id="symlink"),
        pytest.param("printf ' ' >> .git", id="one-byte-more"),
        pytest.param("rm .git", id="removed"),
        pytest.param("mkfifo g && mv g .git", id="fifo"),
    ],
)
def test_an_exec_that_replaces_the_worktrees_git_is_refused_and_gitruns_put_back(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path, plant: str
) -> None:
    """Unconfined (in bubblewrap the file is read-only: the next test), the check after
    the command is what stands between a planted repository and the user's git."""
    flag = tmp_path / "fsmonitor-ran"
    command = f"{plant.format(flag=flag)}; {RENAME}"
    code, err = run_steps(gitrun, sandbox_copy, command, isolation="none")
    assert_refused_and_put_back(gitrun, code, err, "exec-dotgit")
    assert "the worktree's .git" in err
    git(worktree(gitrun), "status")  # the user's next git command
    assert not flag.exists()  # no planted hook ran outside the sandbox


@pytest.mark.parametrize(
    "plant",
    [
        "rm -rf .git",
        "mv .git geometry/moved",
        "printf 'gitdir: /tmp\\n' > .git",
        "printf ' ' >> .git",
        "mkdir g && mv -T g .git",
        "ln -sfn geometry .git",
        "chmod 000 .git",
    ],
)
def test_in_bubblewrap_the_worktrees_git_file_cannot_be_changed_while_the_command_runs(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], plant: str
) -> None:
    """The user's shell prompt may run git status in the worktree while a long command
    runs: a repository swapped in then would run its hooks before any check."""
    probe = (
        f"cp .git /tmp/orig; ({plant}) 2>/dev/null; "
        "if cmp -s .git /tmp/orig && [ -f .git ] && [ ! -L .git ]; then "
        "echo intact > geometry/intact.txt; fi; rm -rf g geometry/moved"
    )
    code, err = run_steps(gitrun, sandbox_copy, f"{probe}; {RENAME}")
    assert code == Exit.DONE, err
    (tip,) = commits(gitrun)
    assert git(gitrun.repo("rename-api"), "show", f"{tip}:geometry/intact.txt").strip() == "intact"
    assert_user_git_is_gitruns(gitrun)


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param("mkdir -p geometry/sub/.git && echo x > geometry/sub/.git/config", id="deep"),
        pytest.param("printf 'gitdir: /tmp\\n' > geometry/.git", id="file-in-subdir"),
        pytest.param("mkdir .GIT && echo x > .GIT/config", id="upper-case-at-root"),
        pytest.param("ln -s shapes.py geometry/.Git", id="symlink-in-subdir"),
        pytest.param("mkdir -p geometry/a/b/.git", id="empty-deep-dir"),
    ],
)
def test_a_git_dir_or_file_anywhere_else_in_an_execs_output_is_refused(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], plant: str
) -> None:
    code, err = run_steps(gitrun, sandbox_copy, f"{plant}; {RENAME}")
    assert_refused_and_put_back(gitrun, code, err, "exec-dotgit")
    assert "below the worktree root" in err


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(
            "unset GIT_DIR GIT_WORK_TREE; "
            "mv .git /tmp/keep && git init -q . && rm -rf .git && mv /tmp/keep .git",
            id="planted-then-removed",
        ),
        pytest.param(
            "cp .git /tmp/g && rm .git && cp /tmp/g .git && chmod 600 .git",
            id="same-bytes-another-inode",
        ),
    ],
)
def test_an_exec_that_leaves_gitruns_git_file_as_it_was_commits(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], plant: str
) -> None:
    code, err = run_steps(gitrun, sandbox_copy, f"{plant} && {RENAME}", isolation="none")
    assert code == Exit.DONE, err
    assert len(commits(gitrun)) == 1
    assert_user_git_is_gitruns(gitrun)
    assert_clean_at(gitrun, branch(gitrun))


def test_a_crash_after_a_command_planted_a_git_resumes_with_gitruns_put_back(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    flag = tmp_path / "fsmonitor-ran"
    plant = NEW_REPO + FSMONITOR.format(flag=flag)
    task = task_with(sandbox_copy, [{"command": plant}, {"command": RENAME}],
                     exec_table='allow = ["*"]')  # fmt: skip
    unconfined = ("--isolation", "none")
    res = gitrun("run", str(task), "--run-id", RUN, *unconfined, GITRUN_CRASH_AT="exec_done")
    assert res.code == -9, res.err
    assert os.path.isdir(worktree(gitrun) / ".git")  # the planted repository, for now
    resumed = gitrun("resume", RUN)
    assert resumed.code == Exit.DONE, resumed.err  # the rename done
    assert "discarded its unproven effects on .git" in resumed.err
    assert len(commits(gitrun)) == 2  # re-run in bubblewrap: the plant fails, changes nothing
    assert_user_git_is_gitruns(gitrun)
    assert_clean_at(gitrun, branch(gitrun))
    assert not flag.exists()


# -- output over the policy's limits, or not representable -------------------------------


@pytest.mark.parametrize(
    ("command", "table", "rule"),
    [
        pytest.param("truncate -s 1001 geometry/big.bin", "max_file_bytes = 1000",
                     "exec-file-too-large", id="sparse-file-just-over"),
        pytest.param("truncate -s 200G geometry/huge.bin", "", "exec-file-too-large",
                     id="200-GiB-sparse-file-default-limit"),
        pytest.param("head -c 600 /dev/zero > geometry/a.bin; head -c 600 /dev/zero > "
                     "geometry/b.bin", "max_written_bytes = 1000", "exec-too-much-output",
                     id="written-bytes-just-over"),
        pytest.param("mkdir -p geometry/" + "/".join("d" * 10) + " && touch geometry/"
                     + "/".join("d" * 10) + "/f.py", "max_depth = 10", "exec-too-deep",
                     id="nesting-just-over"),
        pytest.param("mkdir -p geometry/" + "/".join(["d"] * 1500), "", "exec-too-deep",
                     id="1500-nested-directories"),
        pytest.param("for i in $(seq 40); do touch geometry/f$i.py; done", "max_files = 30",
                     "exec-too-many-files", id="files-just-over"),
        pytest.param("touch geometry/$'\\xff\\xfe'.py", "", "exec-path-encoding",
                     id="non-utf8-name"),
        pytest.param("mkdir geometry/$'\\xe9t\\xe9' && touch geometry/$'\\xe9t\\xe9'/x.py", "",
                     "exec-path-encoding", id="non-utf8-directory"),
        pytest.param("mkfifo geometry/pipe", "", "exec-special-file", id="fifo"),
        pytest.param("python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind("
                     "\"geometry/sock\")'", "", "exec-special-file", id="socket"),
    ],
)  # fmt: skip
def test_exec_output_over_a_limit_or_not_representable_is_refused_never_a_crash(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], command: str, table: str, rule: str
) -> None:
    try:
        code, err = run_steps(gitrun, sandbox_copy, f"{command}; {RENAME}", table=table)
        assert_refused_and_put_back(gitrun, code, err, rule)
    finally:  # a deep tree left behind would break pytest's own clean-up (recursive)
        subprocess.run(["rm", "-rf", str(worktree(gitrun) / "geometry" / "d")], check=False)


@pytest.mark.parametrize(
    "name", [".git./x", ".git /x", "GIT~1/x", "git~1/x", ".git::$INDEX_ALLOCATION/x"]
)
def test_names_git_refuses_under_core_protectntfs_are_refused_never_a_crash(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], name: str
) -> None:
    path = f"geometry/{name}"
    command = f"mkdir -p '{path.rsplit('/', 1)[0]}' && echo x > '{path}'; {RENAME}"
    code, err = run_steps(gitrun, sandbox_copy, command)
    assert_refused_and_put_back(gitrun, code, err, "")


def test_output_at_the_limits_is_committed(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    nested = "geometry/" + "/".join("d" * 9)
    command = f"head -c 1000 /dev/zero > geometry/big.bin && mkdir -p {nested} && touch {nested}/f"
    table = "max_file_bytes = 1000\nmax_depth = 10\nmax_written_bytes = 100000"
    code, err = run_steps(gitrun, sandbox_copy, f"{command} && {RENAME}", table=table)
    assert code == Exit.DONE, err
    (tip,) = commits(gitrun)
    files = git(gitrun.repo("rename-api"), "ls-tree", "-r", "--name-only", tip).split()
    assert "geometry/big.bin" in files
    assert f"{nested}/f" in files


@pytest.mark.parametrize(
    "table", ["max_depth = 0", "max_depth = 501", 'max_files = "10"', "max_file_bytes = true"]
)
def test_a_bad_output_limit_in_the_policy_is_refused_before_anything_runs(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], table: str
) -> None:
    code, err = run_steps(gitrun, sandbox_copy, "touch geometry/ran.py", table=table)
    assert code == Exit.BAD_INPUT, err
    assert "policy.exec.max_" in err
    assert len(err.strip().splitlines()) == 1
    assert not (gitrun.home / "runs" / f"{RUN}.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (unconfined)")
def test_a_device_node_left_by_an_unconfined_exec_is_refused(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = f"mknod geometry/null c 1 3; {RENAME}"
    code, err = run_steps(gitrun, sandbox_copy, command, isolation="none")
    assert_refused_and_put_back(gitrun, code, err, "exec-special-file")


def test_a_hard_link_to_a_file_outside_the_worktree_is_refused_and_the_file_left_alone(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    """Confined, the link cannot even be made (another mount); unconfined it can."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's own file\n")
    command = f"ln {secret} geometry/secret.txt; {RENAME}"
    code, err = run_steps(gitrun, sandbox_copy, command, isolation="none")
    assert_refused_and_put_back(gitrun, code, err, "exec-hard-link")
    assert secret.read_text() == "the user's own file\n"
    assert secret.stat().st_nlink == 1


# -- modes -------------------------------------------------------------------------------


def test_setuid_bits_and_odd_directory_modes_are_cleared_and_the_step_commits(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = (
        "cp /bin/true geometry/tool && chmod 6755 geometry/tool && "
        "echo x > geometry/notes.txt && chmod 2644 geometry/notes.txt && "
        "mkdir geometry/locked && echo y > geometry/locked/a.txt && chmod 000 geometry/locked && "
        "chmod 1777 geometry && " + RENAME
    )
    code, err = run_steps(gitrun, sandbox_copy, command)
    assert code == Exit.DONE, err
    (tip,) = commits(gitrun)
    tree = git(gitrun.repo("rename-api"), "ls-tree", "-r", tip, "geometry/")
    assert "100755 blob" in next(line for line in tree.splitlines() if "geometry/tool" in line)
    assert "geometry/locked/a.txt" in tree
    wt = worktree(gitrun) / "geometry"
    assert stat.S_IMODE(os.lstat(wt / "tool").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(wt / "notes.txt").st_mode) == 0o644
    assert stat.S_IMODE(os.lstat(wt / "locked").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(wt).st_mode) == 0o755
    assert_clean_at(gitrun, tip)


def test_a_mode_0000_directory_of_a_refused_step_is_removed(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    command = (
        "mkdir -p geometry/locked/in && echo y > geometry/locked/in/a.txt && "
        "chmod 000 geometry/locked/in geometry/locked && mkfifo geometry/pipe"
    )
    code, err = run_steps(gitrun, sandbox_copy, command)
    assert_refused_and_put_back(gitrun, code, err, "exec-special-file")
    assert not (worktree(gitrun) / "geometry" / "locked").exists()


# -- descriptors ---------------------------------------------------------------------------

REOPEN = (
    "for f in /proc/[0-9]*/fd/*; do case $f in /proc/$$/*|/proc/self/*) continue;; esac; "
    't=$(readlink $f 2>/dev/null) && echo "$f $t" >> geometry/seen.txt; '
    "(printf PWNED >> $f) 2>/dev/null; done; true"
)


def test_a_command_cannot_reopen_any_descriptor_of_the_sandboxs_other_processes(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    """The exec lock in the hidden git dir, gitrun's pipes: the supervisor holds them
    inside the sandbox; through /proc/<pid>/fd the command could reopen them read-write."""
    code, err = run_steps(gitrun, sandbox_copy, REOPEN, RENAME)
    assert code == Exit.DONE, err
    gitdir = Path(git(worktree(gitrun), "rev-parse", "--absolute-git-dir").strip())
    lock = gitdir / "gitrun-exec.flock"
    assert b"PWNED" not in lock.read_bytes()
    first = commits(gitrun)[-1]
    seen = git(gitrun.repo("rename-api"), "show", f"{first}:geometry/seen.txt", check=False)
    assert "flock" not in seen
    assert str(gitdir) not in seen  # nothing of the hidden git dir, nor of the workspace
    assert str(gitrun.home) not in seen


# -- over the session protocol ---------------------------------------------------------------


def test_over_the_session_a_planted_git_and_a_huge_file_are_refused_and_the_session_goes_on(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    flag = tmp_path / "fsmonitor-ran"
    rpc = Rpc(gitrun, str(SANDBOXES / "rename-api"), "--run-id", "s", "--isolation", "required")
    rpc.call("initialize")
    sed = "sed -i 's/calc_area/circle_area/g' geometry/*.py"
    # the policy allows "sed -i *" only: a pattern is no boundary, the output check is
    plant = f"{sed}; {NEW_REPO}{FSMONITOR.format(flag=flag)}"
    tried = rpc.call("exec", command=plant)  # in bubblewrap .git is read-only: rm fails
    assert tried["exit_code"] != 0
    refusals = [
        (f"{sed}; truncate -s 200G geometry/huge.bin", "exec-file-too-large"),
        (f"{sed}; touch geometry/$'\\xff'.py", "exec-path-encoding"),
        (f"{sed}; mkdir -p geometry/x/.git", "exec-dotgit"),
    ]
    for command, rule in refusals:
        refused = rpc.fail("exec", command=command)
        assert refused["data"]["rule"] == rule, (command, refused)
        assert "put back" in refused["message"]
    done = rpc.call("exec", command=f"{sed}; echo ok > geometry/ok.txt")  # the session goes on
    assert done["exit_code"] == 0
    assert done["paths"] == ["geometry/ok.txt"]
    assert rpc.call("finish")["phase"] == "done"
    assert rpc.close() == 0
    record = json.loads((gitrun.home / "runs" / "s.json").read_text())
    worktree_path = Path(record["worktree"])
    git(worktree_path, "status")
    assert not flag.exists()
    assert git(worktree_path, "status", "--porcelain", "--untracked-files=all", "--ignored") == ""


def test_a_worktree_made_before_its_git_file_was_recorded_is_judged_by_the_admin_dir_it_names(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    """Runs started by an older gitrun have no recorded .git bytes: their .git must name
    the worktree's own admin dir (as libgit2 wrote it); a plant is refused all the same."""
    task = task_with(sandbox_copy, [{"command": "true"}, {"command": RENAME}],
                     exec_table='allow = ["*"]')  # fmt: skip
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="exec_done:2")
    assert res.code == -9, res.err
    gitdir = Path(git(worktree(gitrun), "rev-parse", "--absolute-git-dir").strip())
    (gitdir / "gitrun-dotgit").unlink()
    resumed = gitrun("resume", RUN)
    assert resumed.code == Exit.DONE, resumed.err
    assert len(commits(gitrun)) == 2
    assert_clean_at(gitrun, branch(gitrun))


def test_a_git_planted_between_steps_is_named_as_such_and_never_opened(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    """An unconfined process plants a repository while the run is stopped: resume
    names the real cause (not "another instance") and runs none of its hooks."""
    flag = tmp_path / "fsmonitor-ran"
    task = task_with(sandbox_copy, [{"command": RENAME}], exec_table='allow = ["*"]')
    res = gitrun("run", str(task), "--run-id", RUN, GITRUN_CRASH_AT="before_verify")
    assert res.code == -9, res.err
    wt = worktree(gitrun)
    kept = (wt / ".git").read_bytes()
    (wt / ".git").unlink()
    git(wt.parent, "init", "-q", str(wt))
    git(wt, "config", "core.fsmonitor", f"touch {flag}")
    resumed = gitrun("resume", RUN)
    assert resumed.code == Exit.REFUSED, resumed.err
    assert "dotgit-replaced" in resumed.err
    assert ".git is a directory" in resumed.err
    assert "another instance" not in resumed.err
    assert not flag.exists()
    fix = resumed.err.split("Put gitrun's back (", 1)[1].rsplit(") and resume", 1)[0]
    subprocess.run(["bash", "-c", fix], check=True)  # what the message says to do
    assert (wt / ".git").read_bytes() == kept
    again = gitrun("resume", RUN)
    assert again.code == Exit.DONE, again.err
