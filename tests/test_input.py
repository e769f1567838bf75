"""Input taken byte-exactly, and bad input refused in one line with nothing left behind.

Every test drives the real CLI in a subprocess on a real git repository: patches for
CRLF and non-UTF-8 files, ``git format-patch`` mail and ``diff -ruN`` output land exactly
as ``git apply`` would make them; a refused write never ends a run ``done``; and each bad
input (a float that is not finite, a run id git refuses, a garbage lease ref, a repo dir
that swallows the task or the workspace, a bogus ``--ttl``, plan files from outside the
task) exits with its documented code and changes nothing.
"""

from __future__ import annotations

import base64
import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, Result, git, snapshot

from gitrun.app.workspace import RUN_ID_RE, check_run_id
from gitrun.core import errors
from gitrun.core.errors import Exit
from gitrun.core.records import Action

pytestmark = pytest.mark.timeout(90)

QUICK_VERIFIER = '["{python}", "-c", "pass"]'


def make_task(
    root: Path,
    files: dict[str, bytes],
    *,
    plan: str | None = None,
    verifier: str = QUICK_VERIFIER,
    budgets: str = "max_proposals = 10\nmax_steps = 10\nmax_wall_seconds = 600",
    initial: str = 'repo = "repo"',
    forbidden: str = '["locked/**"]',
) -> Path:
    """A small task: base files, a policy allowing everything but ``locked/``, a verifier
    that passes at once (these tests are about what lands, not about tests passing)."""
    task = root / "task"
    for rel, data in files.items():
        (task / "repo" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / "repo" / rel).write_bytes(data)
    (task / "repo").mkdir(parents=True, exist_ok=True)
    agent = ""
    if plan is not None:
        (task / "plan.toml").write_text(plan)
        agent = '[agent]\nplan = "plan.toml"\n'
    (task / "task.toml").write_text(
        f"""schema = 1

[task]
id = "input-task"
version = "1"

[initial]
{initial}

[policy]
id = "p"
version = "1"
allowed_actions = ["write_file", "delete_file", "apply_patch"]
write_allowlist = ["**"]
forbidden_paths = {forbidden}

[verifier]
command = {verifier}
junit = false
fail_to_pass = []
pass_to_pass = []
timeout_seconds = 60

[budgets]
{budgets}

{agent}"""
    )
    return task


def branch_files(repo: Path, run_id: str) -> dict[str, bytes]:
    """Every file of the run branch's tree, with its exact bytes, read by real git."""
    ref = f"gitrun/{run_id}"
    names = git(repo, "ls-tree", "-r", "-z", "--name-only", ref).split("\0")
    out = {}
    for name in filter(None, names):
        blob = subprocess.run(
            ["git", "-C", str(repo), "cat-file", "blob", f"{ref}:{name}"],
            capture_output=True,
            check=True,
        )
        out[name] = blob.stdout
    return out


def checkpoint_payloads(repo: Path, run_id: str) -> list[dict[str, object]]:
    """The JSON payload of every checkpoint of the run (the paragraph after the subject)."""
    (ref,) = git(
        repo, "for-each-ref", "--format=%(refname)", f"refs/gitrun/runs/{run_id}/checkpoints/"
    ).split()
    bodies = git(repo, "log", "--format=%B%x00", ref).split("\0")
    return [json.loads(body.strip().split("\n\n")[1]) for body in bodies if body.strip()]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def assert_one_line(res: Result, code: int, *fragments: str) -> None:
    assert res.code == code, (res.code, res.out, res.err)
    lines = res.err.splitlines()
    assert len(lines) == 1, res.err
    assert lines[0].startswith("gitrun: ")
    assert "Traceback" not in res.out + res.err
    assert "internal error" not in res.err
    for fragment in fragments:
        assert fragment in res.err, (fragment, res.err)


def refused_untouched(gitrun: Gitrun, code: int, *args: str, expect: tuple[str, ...] = ()) -> str:
    """Run the CLI: it must refuse in one line with ``code`` and leave the workspace as
    it was (no registry entry, no repository, no worktree, no key)."""
    before = _tree(gitrun.home)
    res = gitrun(*args)
    assert_one_line(res, code, *expect)
    assert _tree(gitrun.home) == before
    return res.err


def run_done(gitrun: Gitrun, *args: str) -> Result:
    res = gitrun(*args, "-q")
    assert res.code == Exit.DONE, (res.out, res.err)
    return res


# -- byte-exact writes ----------------------------------------------------------------


CRLF_OLD = b"one\r\ntwo\r\nthree\r\n"
CRLF_NEW = b"one\r\n2\r\nthree\r\n"
CRLF_PATCH = (
    b"diff --git a/win.txt b/win.txt\n--- a/win.txt\n+++ b/win.txt\n"
    b"@@ -1,3 +1,3 @@\n one\r\n-two\r\n+2\r\n three\r\n"
    b"diff --git a/new.txt b/new.txt\nnew file mode 100644\n--- /dev/null\n+++ b/new.txt\n"
    b"@@ -0,0 +1,2 @@\n+made\r\n+here\r\n"
)


def test_a_patch_for_crlf_files_lands_byte_exactly_through_the_patch_agent(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    task = make_task(tmp_path, {"win.txt": CRLF_OLD})
    (tmp_path / "crlf.diff").write_bytes(CRLF_PATCH)
    run_done(
        gitrun, "run", str(task), "--agent", f"patch:{tmp_path / 'crlf.diff'}", "--run-id", "crlf"
    )
    files = branch_files(gitrun.repo("input-task"), "crlf")
    assert files["win.txt"] == CRLF_NEW
    assert files["new.txt"] == b"made\r\nhere\r\n"


def test_plan_patch_and_content_files_land_byte_exactly(gitrun: Gitrun, tmp_path: Path) -> None:
    plan = (
        'schema = 1\n[[step]]\nkind = "apply_patch"\npatch_file = "crlf.diff"\n'
        '[[step]]\nkind = "write_file"\npath = "bin.dat"\ncontent_file = "bin.dat"\n'
    )
    task = make_task(tmp_path, {"win.txt": CRLF_OLD}, plan=plan)
    (task / "crlf.diff").write_bytes(CRLF_PATCH)
    blob = b"\xff\xfe\r\n\x00latin \xe9\r\n"
    (task / "bin.dat").write_bytes(blob)
    run_done(gitrun, "run", str(task), "--run-id", "plan-bytes")
    files = branch_files(gitrun.repo("input-task"), "plan-bytes")
    assert (files["win.txt"], files["new.txt"], files["bin.dat"]) == (
        CRLF_NEW,
        b"made\r\nhere\r\n",
        blob,
    )


def test_a_patch_that_is_not_utf8_lands_byte_exactly_and_its_intent_carries_the_bytes(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    old = b"caf\xe9\nna\xefve\n"
    patch = b"--- a/l1.txt\n+++ b/l1.txt\n@@ -1,2 +1,2 @@\n-caf\xe9\n+caf\xe9 cr\xe8me\n na\xefve\n"
    task = make_task(tmp_path, {"l1.txt": old})
    (tmp_path / "latin1.diff").write_bytes(patch)
    run_done(
        gitrun, "run", str(task), "--agent", f"patch:{tmp_path / 'latin1.diff'}", "--run-id", "l1"
    )
    repo = gitrun.repo("input-task")
    assert branch_files(repo, "l1")["l1.txt"] == b"caf\xe9 cr\xe8me\nna\xefve\n"
    intents = [p["pending"] for p in checkpoint_payloads(repo, "l1") if p["pending"]]
    assert intents, "the intent checkpoint holds the pending action"
    action = intents[0]["action"]  # type: ignore[index]
    assert action["patch"] is None
    assert base64.b64decode(action["patch_b64"]) == patch


def test_the_intent_digest_depends_on_the_bytes_only_and_stays_what_it_was_for_utf8() -> None:
    text = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"
    from gitrun.core.codec import digest

    legacy = digest({"kind": "apply_patch", "path": None, "content": None, "patch": text})
    assert Action.of_bytes("apply_patch", patch=text.encode()).intent_digest() == legacy
    assert Action("apply_patch", patch=text).intent_digest() == legacy
    raw = b"\xff\n"
    b64 = base64.b64encode(raw).decode()
    assert (
        Action("apply_patch", patch_b64=b64).intent_digest()
        == Action.of_bytes("apply_patch", patch=raw).intent_digest()
    )
    assert (
        Action.of_bytes("apply_patch", patch=b"x\r\n").intent_digest()
        != Action.of_bytes("apply_patch", patch=b"x\n").intent_digest()
    )


def test_a_utf8_action_keeps_the_record_bytes_and_agent_identity_it_had_before() -> None:
    from gitrun.core.codec import decode, digest, encode
    from gitrun.engine.agents import ScriptAgent

    legacy = {
        "kind": "apply_patch",
        "path": None,
        "content": None,
        "patch": "p\n",
        "description": "",
    }
    action = Action.of_bytes("apply_patch", patch=b"p\n")
    assert encode(action) == legacy  # no base64 keys unless the bytes need them
    assert decode(Action, legacy) == action  # records written before the field existed
    assert ScriptAgent("plan", (action,)).identity == f"plan:{digest([legacy])}"
    binary = Action.of_bytes("write_file", path="b", content=b"\x80")
    assert decode(Action, encode(binary)).content_bytes() == b"\x80"


def _user_git(repo: Path, *args: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "core.autocrlf=false", *args],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout


def test_git_format_patch_mail_is_accepted_by_the_patch_agent(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    base = {"a.txt": b"one\ntwo\n", "gone.txt": b"bye\n"}
    task = make_task(tmp_path, base)
    work = tmp_path / "work"
    work.mkdir()
    for rel, data in base.items():
        (work / rel).write_bytes(data)
    _user_git(work, "init", "-q", "-b", "main")
    _user_git(work, "add", "-A")
    _user_git(work, "commit", "-q", "-m", "base")
    (work / "a.txt").write_bytes(b"one\nTWO\n")
    (work / "gone.txt").unlink()
    (work / "new.txt").write_bytes(b"hello\n")
    _user_git(work, "add", "-A")
    _user_git(work, "commit", "-q", "-m", "fix it\n\n--- not a header\n+++ nor this\n")
    mail = _user_git(work, "format-patch", "--stdout", "-1")
    assert mail.startswith(b"From ")
    assert b"\n-- \n" in mail
    (tmp_path / "fix.patch").write_bytes(mail)
    run_done(
        gitrun, "run", str(task), "--agent", f"patch:{tmp_path / 'fix.patch'}", "--run-id", "mail"
    )
    assert branch_files(gitrun.repo("input-task"), "mail") == {
        "a.txt": b"one\nTWO\n",
        "new.txt": b"hello\n",
    }


def test_gnu_diff_ruN_output_deletes_and_creates_files_as_git_apply_does(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    base = {"keep.txt": b"1\n2\n", "old/gone.txt": b"x\n"}
    task = make_task(tmp_path, base)
    for side, files in (("before", base), ("after", {"keep.txt": b"1\nII\n", "fresh.txt": b"f\n"})):
        for rel, data in files.items():
            (tmp_path / side / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / side / rel).write_bytes(data)
    done = subprocess.run(
        ["diff", "-ruN", "before", "after"],
        cwd=tmp_path,
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert done.returncode == 1
    assert b"1970-01-01" in done.stdout
    (tmp_path / "gnu.diff").write_bytes(done.stdout)
    run_done(
        gitrun, "run", str(task), "--agent", f"patch:{tmp_path / 'gnu.diff'}", "--run-id", "gnu"
    )
    assert branch_files(gitrun.repo("input-task"), "gnu") == {
        "keep.txt": b"1\nII\n",
        "fresh.txt": b"f\n",
    }


# -- a refused write never ends done ------------------------------------------------------


def test_a_patch_agent_whose_patch_the_gate_refuses_ends_failed_with_the_reason(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    task = make_task(tmp_path, {"locked/conf.txt": b"a\n", "ok.txt": b"o\n"})
    (tmp_path / "bad.diff").write_bytes(
        b"--- a/locked/conf.txt\n+++ b/locked/conf.txt\n@@ -1 +1 @@\n-a\n+b\n"
    )
    res = gitrun(
        "run", str(task), "--agent", f"patch:{tmp_path / 'bad.diff'}", "--run-id", "refused"
    )
    assert res.code == Exit.FAILED, (res.out, res.err)
    assert "agent_write_refused" in res.out
    status = json.loads(gitrun("status", "refused", "--json").out)
    assert (status["phase"], status["stop_reason"], status["receipts"]) == (
        "failed",
        "agent_write_refused",
        [],
    )
    assert status["verifier"] is None  # never verified: a refused change is not the run's result
    again = gitrun("resume", "refused")
    assert again.code == Exit.FAILED


def test_a_plan_whose_last_step_is_refused_ends_failed_even_after_good_steps(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    plan = (
        'schema = 1\n[[step]]\nkind = "write_file"\npath = "ok.txt"\ncontent = "fixed\\n"\n'
        '[[step]]\nkind = "write_file"\npath = "locked/x"\ncontent = "no\\n"\n'
    )
    task = make_task(tmp_path, {"ok.txt": b"o\n"}, plan=plan)
    res = gitrun("run", str(task), "--run-id", "last-refused", "-q")
    assert res.code == Exit.FAILED, (res.out, res.err)
    status = json.loads(gitrun("status", "last-refused", "--json").out)
    assert (status["phase"], status["stop_reason"], len(status["receipts"])) == (
        "failed",
        "agent_write_refused",
        1,
    )


def test_a_plan_that_recovers_from_a_refused_step_still_ends_done(gitrun: Gitrun) -> None:
    res = gitrun("run", str(SANDBOXES / "guarded-config"), "--run-id", "guarded", "-q")
    assert res.code == Exit.DONE, (res.out, res.err)
    status = json.loads(gitrun("status", "guarded", "--json").out)
    assert (status["phase"], status["stop_reason"]) == ("done", "verified")


# -- bad input: one line, a documented code, nothing left behind ---------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("max_wall_seconds = 600", "max_wall_seconds = inf"),
        ("max_wall_seconds = 600", "max_wall_seconds = nan"),
        ("max_wall_seconds = 600", "max_wall_seconds = -inf"),
        ("timeout_seconds = 60", "timeout_seconds = inf"),
        ("timeout_seconds = 60", "timeout_seconds = nan"),
    ],
)
def test_a_task_float_that_is_not_finite_is_bad_input(
    gitrun: Gitrun, tmp_path: Path, old: str, new: str
) -> None:
    task = make_task(
        tmp_path,
        {"f.txt": b"x\n"},
        plan='schema = 1\n[[step]]\nkind = "delete_file"\npath = "f.txt"\n',
    )
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace(old, new))
    field = new.split(" =", maxsplit=1)[0]
    refused_untouched(
        gitrun, Exit.BAD_INPUT, "run", str(task), "--run-id", "f", expect=(field, "finite")
    )
    assert not gitrun.repo("input-task").exists()


def test_a_task_version_that_could_forge_a_trailer_is_bad_input(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    task = make_task(tmp_path, {"f.txt": b"x\n"})
    toml = task / "task.toml"
    toml.write_text(
        toml.read_text().replace('version = "1"', 'version = "1\\nGitrun-Lease: 99"', 1)
    )
    refused_untouched(gitrun, Exit.BAD_INPUT, "run", str(task), expect=("task.version", "one line"))


BAD_RUN_IDS = [
    "a.",
    "a.lock",
    "a..b",
    ".a",
    "a@{b",
    "a b",
    "a\x01b",
    "a/b",
    "a~1",
    "a^",
    "a:b",
    "a?",
    "a*",
    "a[b",
    "a\\b",
    "@",
    "",
]


@pytest.mark.parametrize("run_id", ["a.", "a.lock", "x..y", "r@{1}", "a~1"])
def test_a_run_id_git_refuses_as_a_ref_name_is_bad_input_and_burns_nothing(
    gitrun: Gitrun, tmp_path: Path, run_id: str
) -> None:
    task = make_task(
        tmp_path,
        {"f.txt": b"x\n"},
        plan='schema = 1\n[[step]]\nkind = "delete_file"\npath = "f.txt"\n',
    )
    refused_untouched(
        gitrun, Exit.BAD_INPUT, "run", str(task), "--run-id", run_id, expect=("run id", "not valid")
    )
    assert not (gitrun.home / "runs").exists()


def _git_accepts(name: str) -> bool:
    refs = (f"refs/heads/gitrun/{name}", f"refs/gitrun/runs/{name}/lease")
    return all(
        subprocess.run(
            ["git", "check-ref-format", ref], capture_output=True, check=False
        ).returncode
        == 0
        for ref in refs
    )


def _gitrun_accepts(name: str) -> bool:
    try:
        check_run_id(name)
    except errors.BadInput:
        return False
    return True


def test_run_ids_agree_with_git_check_ref_format() -> None:
    """Every id gitrun accepts git accepts; within gitrun's alphabet, exactly those."""
    rng = random.Random(7)
    alphabet = "aZ09._-@{}~^:?*[\\ /\x01\x7f"
    candidates = set(BAD_RUN_IDS) | {"ok", "a.b", "a_b-c", "A9", "x" * 64, "1.lock.x", "a.lock.b"}
    candidates |= {
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(300)
    }
    for name in sorted(candidates):
        if _gitrun_accepts(name):
            assert _git_accepts(name), name
        elif RUN_ID_RE.match(name):
            assert not _git_accepts(name), name


def _crashed_run(gitrun: Gitrun, tmp_path: Path, run_id: str) -> Path:
    """A run killed before its verifier: registered, running, with a lease ref."""
    task = make_task(
        tmp_path,
        {"f.txt": b"x\n"},
        plan='schema = 1\n[[step]]\nkind = "delete_file"\npath = "f.txt"\n',
    )
    res = gitrun("run", str(task), "--run-id", run_id, "-q", GITRUN_CRASH_AT="before_verify")
    assert res.code == -signal.SIGKILL, (res.code, res.err)
    return gitrun.repo("input-task")


@pytest.mark.parametrize("target", ["commit", "blob"])
def test_a_garbage_lease_ref_leaves_status_answering_and_resume_refusing(
    gitrun: Gitrun, tmp_path: Path, target: str
) -> None:
    repo = _crashed_run(gitrun, tmp_path, "leased")
    ref = "refs/gitrun/runs/leased/lease"
    if target == "commit":
        garbage = git(repo, "rev-parse", "main").strip()
    else:
        garbage = (
            subprocess.run(
                ["git", "-C", str(repo), "hash-object", "-w", "--stdin"],
                input=b'{"not": "a lease"}',
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .strip()
        )
    git(repo, "update-ref", ref, garbage)
    shown = gitrun("status", "leased")
    assert shown.code == Exit.DONE, shown.err
    assert "lease      unreadable" in shown.out
    assert garbage in shown.out
    info = json.loads(gitrun("status", "leased", "--json").out)
    assert info["lease"]["oid"] == garbage
    assert info["phase"] == "running"
    before = snapshot(repo)
    res = gitrun("resume", "leased")
    assert_one_line(res, Exit.REFUSED, "lease", garbage, "not a gitrun lease")
    assert snapshot(repo) == before


@pytest.mark.parametrize(
    ("initial", "problem"),
    [
        ('repo = "/"', "holds the task directory"),
        ('repo = "."', "holds the task directory"),
        ('repo = ".."', "holds the task directory"),
    ],
)
def test_a_repo_dir_that_holds_the_task_is_bad_input(
    gitrun: Gitrun, tmp_path: Path, initial: str, problem: str
) -> None:
    task = make_task(tmp_path, {"f.txt": b"x\n"}, initial=initial)
    refused_untouched(gitrun, Exit.BAD_INPUT, "run", str(task), expect=("initial.repo", problem))


def test_a_repo_dir_that_holds_the_workspace_is_bad_input(tmp_path: Path) -> None:
    task = make_task(
        tmp_path,
        {"f.txt": b"x\n"},
        plan='schema = 1\n[[step]]\nkind = "delete_file"\npath = "f.txt"\n',
    )
    inside = Gitrun(task / "repo" / "ws")
    inside.home.mkdir()
    refused_untouched(
        inside,
        Exit.BAD_INPUT,
        "run",
        str(task),
        expect=("initial.repo", "contains the gitrun workspace"),
    )


@pytest.mark.parametrize("ttl", ["bogus", "inf", "nan", "0", "-5m", "1e400", "400d"])
def test_approve_with_a_bogus_ttl_is_bad_input(gitrun: Gitrun, tmp_path: Path, ttl: str) -> None:
    refused_untouched(
        gitrun,
        Exit.BAD_INPUT,
        "approve",
        "r",
        "--key",
        str(tmp_path / "k"),
        "--ttl",
        ttl,
        expect=("--ttl",),
    )


@pytest.mark.parametrize("option", ["--lease-seconds", "--takeover-after"])
def test_lease_options_that_are_not_finite_are_bad_input(gitrun: Gitrun, option: str) -> None:
    command = "resume" if option == "--takeover-after" else "run"
    target = "some-run" if command == "resume" else str(SANDBOXES / "fix-median")
    refused_untouched(gitrun, Exit.BAD_INPUT, command, target, option, "inf", expect=(option,))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "content-symlink", "agent-plan"])
def test_plan_files_from_outside_the_task_directory_are_bad_input(
    gitrun: Gitrun, tmp_path: Path, how: str
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not for the repo\n")
    patch_file = {"dotdot": "../secret.txt", "absolute": str(secret)}.get(how, "patches/evil.diff")
    step = (
        f'kind = "write_file"\npath = "stolen"\ncontent_file = "{patch_file}"\n'
        if how == "content-symlink"
        else f'kind = "apply_patch"\npatch_file = "{patch_file}"\n'
    )
    task = make_task(tmp_path, {"f.txt": b"x\n"}, plan=f"schema = 1\n[[step]]\n{step}")
    (task / "patches").mkdir()
    (task / "patches" / "evil.diff").symlink_to(secret)
    if how == "agent-plan":
        outside = tmp_path / "outside-plan.toml"
        outside.write_text('schema = 1\n[[step]]\nkind = "delete_file"\npath = "f.txt"\n')
        toml = task / "task.toml"
        toml.write_text(
            toml.read_text().replace('plan = "plan.toml"', 'plan = "../outside-plan.toml"')
        )
    expect = ("agent.plan", "outside") if how == "agent-plan" else ("outside", str(task))
    refused_untouched(gitrun, Exit.BAD_INPUT, "run", str(task), "--run-id", "steal", expect=expect)


# -- the error families ------------------------------------------------------------------


def test_the_exit_table_holds_internal_errors_and_interrupts() -> None:
    assert (Exit.INTERNAL, Exit.INTERRUPTED) == (70, 130)
    assert errors.GitrunError("broken invariant").exit_code == Exit.INTERNAL
    assert errors.BadInput("x").exit_code == Exit.BAD_INPUT


@pytest.mark.parametrize(
    ("family_name", "builtin"),
    [
        ("BadInput", ValueError),
        ("TaskError", ValueError),
        ("UnknownRun", LookupError),
        ("KeyFileError", ValueError),
        ("GateRejected", PermissionError),
        ("ApprovalRefused", PermissionError),
        ("Refused", ValueError),
        ("CheckpointRejected", ValueError),
        ("InvalidState", ValueError),
        ("EnvironmentDrift", ValueError),
        ("ReceiptDrift", ValueError),
        ("LeaseUnreadable", ValueError),
        ("RefLocked", TimeoutError),
        ("CasFailed", RuntimeError),
        ("LeaseHeld", RuntimeError),
        ("LeaseLost", RuntimeError),
        ("ReceiptConflict", RuntimeError),
        ("Frozen", RuntimeError),
    ],
)
def test_each_error_family_is_the_builtin_a_caller_would_catch(
    family_name: str, builtin: type
) -> None:
    family = getattr(errors, family_name)
    assert issubclass(family, errors.GitrunError)
    assert issubclass(family, builtin)
    assert family.exit_code != Exit.INTERNAL


def test_an_invalid_state_carries_its_rule_as_an_attribute() -> None:
    exc = errors.InvalidState("phase", "unknown phase 'x'")
    assert (exc.rule, str(exc)) == ("phase", "invalid state (phase): unknown phase 'x'")


def test_an_interrupted_run_exits_130_in_one_line(gitrun: Gitrun, tmp_path: Path) -> None:
    slow = '["{python}", "-c", "import time; time.sleep(20)"]'
    task = make_task(
        tmp_path,
        {"f.txt": b"x\n"},
        verifier=slow,
        plan='schema = 1\n[[step]]\nkind = "delete_file"\npath = "f.txt"\n',
    )
    proc = gitrun.popen("run", str(task), "--run-id", "ctrl-c")
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    seen = ""
    while "verifier:" not in seen and time.monotonic() < deadline:
        seen += proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == Exit.INTERRUPTED, err
    assert err.strip().splitlines()[-1].startswith("gitrun: interrupted")
    assert "Traceback" not in err
