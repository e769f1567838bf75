"""The verifier judges HEAD's tree only, confined, and dies with its runtime (issues 9, 10).

Every test drives the real CLI and real git the way a hostile agent or a hostile model
patch would: files planted in the worktree and hidden from git, a stale ``.pyc`` stamped
to look fresh, code under test that hunts for the checkpoint keyring, a test that leaves
a detached grandchild behind, a verifier command that does not exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import py_compile
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Gitrun, git, snapshot

from gitrun.adapter import sandbox

pytestmark = pytest.mark.timeout(120)


def _bwrap_usable() -> bool:
    """Whether gitrun's own probe (the flags its sandbox uses) passes on this machine."""
    found = shutil.which("bwrap")
    return found is not None and sandbox.bwrap_works(found)


BWRAP_USABLE = _bwrap_usable()
needs_bwrap = pytest.mark.skipif(
    not BWRAP_USABLE, reason="bubblewrap is not usable here (CI installs it; see .ci/run)"
)

NOOP_PATCH = """\
--- a/stats/median.py
+++ b/stats/median.py
@@ -1,1 +1,2 @@
+# touched, not fixed
 {first}
"""

ALWAYS_GREEN_CONFTEST = """\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""

FIXED_MEDIAN_TAIL = """\
    lower, upper = data[mid - 1], data[mid]
    return (lower + upper) / 2
"""


# -- helpers ---------------------------------------------------------------------------


def noop_patch(task: Path) -> Path:
    """An agent patch that touches stats/median.py without fixing the bug."""
    first = (task / "repo" / "stats" / "median.py").read_text().splitlines()[0]
    path = task.parent / "noop.diff"
    path.write_text(NOOP_PATCH.format(first=first))
    return path


def common_dir(repo: Path) -> Path:
    found = Path(git(repo, "rev-parse", "--git-common-dir").strip())
    return found if found.is_absolute() else (repo / found).resolve()


def hide_in_exclude(worktree: Path, pattern: str) -> None:
    """What an agent with a shell does: ignore its planted file through info/exclude."""
    exclude = common_dir(worktree) / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as handle:
        handle.write(f"\n{pattern}\n")
    assert pattern not in git(worktree, "status", "--porcelain")


def status_json(gitrun: Gitrun, run_id: str, **env: str) -> dict[str, object]:
    result = gitrun("status", run_id, "--json", **env)
    assert result.code == 0, result.err
    info: dict[str, object] = json.loads(result.out)
    return info


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def crash_before_verify(gitrun: Gitrun, task: Path, run_id: str, *extra: str, **env: str) -> Path:
    """Run until just before the verifier, then die with SIGKILL; return the worktree."""
    result = gitrun(
        "run", str(task), "--run-id", run_id, "--agent", f"patch:{noop_patch(task)}",
        *extra, GITRUN_CRASH_AT="before_verify", **env,
    )  # fmt: skip
    assert result.code == -signal.SIGKILL, (result.code, result.err)
    return gitrun.home / "worktrees" / run_id


@pytest.fixture
def scratch_tmp(tmp_path: Path) -> Path:
    """The TMPDIR handed to gitrun: its verifier scratch dirs land (and must go) here."""
    path = tmp_path / "gitrun-tmp"
    path.mkdir()
    return path


def scratch_left(tmp: Path) -> list[Path]:
    """What gitrun left in ``tmp`` but its (empty) scratch root, kept between runs."""
    root = tmp / f"gitrun-scratch-{os.geteuid()}"
    return sorted(p for p in tmp.rglob("*") if p != root)


# -- issue 9.1: files git does not show cannot change the verdict -----------------------


def test_a_conftest_hidden_through_info_exclude_cannot_make_a_wrong_patch_pass(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], scratch_tmp: Path
) -> None:
    task = sandbox_copy("fix-median")
    worktree = crash_before_verify(gitrun, task, "planted", TMPDIR=str(scratch_tmp))
    (worktree / "conftest.py").write_text(ALWAYS_GREEN_CONFTEST)
    (worktree / "tests" / "conftest.py").write_text(ALWAYS_GREEN_CONFTEST)
    hide_in_exclude(worktree, "conftest.py")
    task_files = files_under(task)

    resumed = gitrun("resume", "planted", TMPDIR=str(scratch_tmp))

    assert resumed.code == 1, (resumed.out, resumed.err)
    assert "done" not in resumed.out
    assert "FAIL_TO_PASS still failing" in resumed.out
    info = status_json(gitrun, "planted")
    assert (info["phase"], info["stop_reason"]) == ("failed", "verifier_failed")
    verifier = info["verifier"]
    assert isinstance(verifier, dict)
    assert verifier["tree"] == git(worktree, "rev-parse", "HEAD^{tree}").strip()
    assert files_under(task) == task_files
    assert scratch_left(scratch_tmp) == []  # the scratch tree was removed


def _user_repo_ignoring_pycache(tmp_path: Path, task: Path) -> Path:
    repo = tmp_path / "user-repo"
    shutil.copytree(task / "repo", repo)
    (repo / ".gitignore").write_text("__pycache__/\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    return repo


def _plant_fixed_pyc(module: Path) -> Path:
    """Compile a fixed copy of ``module`` to the pyc the import system will trust for it."""
    source = module.read_text()
    fixed = source[: source.rindex("    return data[mid]\n")] + FIXED_MEDIAN_TAIL
    assert fixed != source
    tag = sys.implementation.cache_tag
    pyc = module.parent / "__pycache__" / f"{module.stem}.{tag}.pyc"
    with tempfile.TemporaryDirectory() as tmp:
        fixed_file = Path(tmp) / module.name
        fixed_file.write_text(fixed)
        py_compile.compile(
            str(fixed_file),
            cfile=str(pyc),
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP,
        )
    stat = module.stat()
    data = bytearray(pyc.read_bytes())
    data[8:16] = struct.pack("<II", int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF)
    pyc.write_bytes(bytes(data))
    return pyc


def test_a_stale_pyc_stamped_like_the_buggy_source_cannot_make_a_wrong_patch_pass(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path, scratch_tmp: Path
) -> None:
    task = sandbox_copy("fix-median")
    repo = _user_repo_ignoring_pycache(tmp_path, task)
    worktree = crash_before_verify(
        gitrun, task, "pyc", "--repo", str(repo), TMPDIR=str(scratch_tmp)
    )
    pyc = _plant_fixed_pyc(worktree / "stats" / "median.py")
    assert "__pycache__" not in git(worktree, "status", "--porcelain", "--untracked=all")
    repo_files, repo_refs = files_under(repo / "stats"), snapshot(repo)[0]

    resumed = gitrun("resume", "pyc", TMPDIR=str(scratch_tmp))

    assert resumed.code == 1, (resumed.out, resumed.err)
    assert "done" not in resumed.out
    assert status_json(gitrun, "pyc")["phase"] == "failed"
    assert pyc.exists()  # the planted file is not gitrun's to delete; it was never used
    assert files_under(repo / "stats") == repo_files
    assert {line for line in snapshot(repo)[0].splitlines() if "refs/heads/main" in line} == {
        line for line in repo_refs.splitlines() if "refs/heads/main" in line
    }
    assert scratch_left(scratch_tmp) == []


# -- issue 9.3: the code under test cannot read the keyring or gitrun's variables -------

THIEF_INIT = """\
import json, os, pathlib

_LOOT = pathlib.Path({loot!r})
_TARGETS = {targets!r}


def _try(path):
    p = pathlib.Path(path)
    try:
        if p.is_dir():
            return sorted(os.listdir(p))
        return p.read_text()
    except OSError as exc:
        return None


_found = {{
    "env": sorted(k for k in os.environ if k.startswith("GITRUN") or {key!r} in os.environ[k]),
    "targets": {{t: _try(t) for t in _TARGETS}},
}}
_found["stolen"] = bool(_found["env"]) or any(v for v in _found["targets"].values())
for _dest in (_LOOT, pathlib.Path("/tmp/gitrun-loot.json"), pathlib.Path("loot.json")):
    try:
        _dest.write_text(json.dumps(_found))
    except OSError:
        pass
if _found["stolen"]:
    raise ImportError("stolen: " + json.dumps(_found)[:200])
"""


def _thief_patch(task: Path, init: str) -> str:
    """A model patch: the real fix, plus a stats/__init__.py that hunts for secrets."""
    old_init = (task / "repo" / "stats" / "__init__.py").read_text()
    fix = (task / "patches" / "fix.diff").read_text()
    old_lines, new_lines = old_init.splitlines(), (old_init + "\n" + init).splitlines()
    hunk = [f"@@ -1,{len(old_lines)} +1,{len(new_lines)} @@"]
    hunk += [" " + line for line in old_lines]
    hunk += ["+" + line for line in new_lines[len(old_lines) :]]
    return (
        fix.rstrip("\n")
        + "\n--- a/stats/__init__.py\n+++ b/stats/__init__.py\n"
        + "\n".join(hunk)
        + "\n"
    )


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A directory outside /tmp (which the sandbox replaces): the workspace lives there."""
    base = Path("/var/tmp")
    if not base.is_dir() or not os.access(base, os.W_OK):
        pytest.skip("needs a writable /var/tmp")
    path = Path(tempfile.mkdtemp(prefix="gitrun-theft-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _theft_scenario(
    outside: Path, sandbox_copy: Callable[[str], Path]
) -> tuple[Gitrun, Path, Path, dict[str, str], Path]:
    home, keydir = outside / "home", outside / "elsewhere"
    home.mkdir()
    keydir.mkdir()
    key = keydir / "checkpoint.keyring"
    task = sandbox_copy("fix-median")
    repo = _user_repo_ignoring_pycache(outside, task)
    loot = outside / "loot.json"
    targets = [str(key), str(keydir), str(home / "keys"), str(home), str(common_dir(repo) / "refs")]
    init = THIEF_INIT.format(loot=str(loot), targets=targets, key=str(key))
    patch = outside / "thief.diff"
    patch.write_text(_thief_patch(task, init))
    env = {"GITRUN_KEY_FILE": str(key), "GITRUN_SOMETHING": "secret-ish"}
    return Gitrun(home), task, repo, env, loot


@needs_bwrap
def test_code_under_test_in_the_sandbox_sees_no_keyring_no_refs_and_no_gitrun_variables(
    outside_tmp: Path, sandbox_copy: Callable[[str], Path]
) -> None:
    gitrun, task, repo, env, loot = _theft_scenario(outside_tmp, sandbox_copy)
    patch = f"patch:{outside_tmp / 'thief.diff'}"

    result = gitrun("run", str(task), "--repo", str(repo), "--agent", patch, "--run-id", "t", **env)

    # The thief's import raises when it found anything: a done run proves it found nothing.
    assert result.code == 0, (result.out, result.err)
    assert "run t: done" in result.out
    assert not loot.exists()  # it could not write outside its scratch dir either
    info = status_json(gitrun, "t", **env)
    assert info["isolation"] == "bwrap"
    assert gitrun("checkpoint", "verify", "t", **env).code == 0
    assert gitrun("resume", "t", **env).code == 0


def test_unconfined_code_under_test_still_gets_no_gitrun_variables(
    outside_tmp: Path, sandbox_copy: Callable[[str], Path]
) -> None:
    gitrun, task, repo, env, loot = _theft_scenario(outside_tmp, sandbox_copy)
    patch = f"patch:{outside_tmp / 'thief.diff'}"

    result = gitrun(
        "run", str(task), "--repo", str(repo), "--agent", patch, "--run-id", "t",
        "--isolation", "none", **env,
    )  # fmt: skip

    # Unconfined, the thief reads the keyring (that is what `none` means) and fails the run;
    # the variables are scrubbed all the same.
    assert result.code == 1, (result.out, result.err)
    found = json.loads(loot.read_text())
    assert found["env"] == []
    assert found["targets"][env["GITRUN_KEY_FILE"]]  # the positive control: really unconfined
    assert status_json(gitrun, "t", **env)["isolation"] == "none"


# -- the isolation setting ---------------------------------------------------------------


def _set_isolation(task: Path, value: str) -> None:
    toml = task / "task.toml"
    text = toml.read_text()
    toml.write_text(text.replace("[verifier]\n", f'[verifier]\nisolation = "{value}"\n', 1))


def test_required_isolation_without_bubblewrap_refuses_and_the_run_can_resume_later(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("fix-median")
    _set_isolation(task, "required")

    refused = gitrun("run", str(task), "--run-id", "req", GITRUN_BWRAP="/nonexistent")

    assert refused.code == 5, (refused.out, refused.err)
    assert "done" not in refused.out
    last = refused.err.strip().splitlines()[-1]
    assert last.startswith("gitrun: ")
    assert "bubblewrap" in last
    assert "gitrun resume req" in last
    info = status_json(gitrun, "req")
    assert (info["phase"], info["verifier"], info["isolation"]) == ("running", None, None)
    again = gitrun("resume", "req", GITRUN_BWRAP="/nonexistent")
    assert again.code == 5
    assert status_json(gitrun, "req")["phase"] == "running"
    if BWRAP_USABLE:
        finished = gitrun("resume", "req")
        assert finished.code == 0, finished.err
        assert status_json(gitrun, "req")["isolation"] == "bwrap"
        assert "isolation  bwrap" in gitrun("status", "req").out


def test_the_command_line_isolation_overrides_the_task_file(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("fix-median")

    refused = gitrun(
        "run", str(task), "--run-id", "cli", "--isolation", "required",
        GITRUN_BWRAP="/nonexistent",
    )  # fmt: skip
    unconfined = gitrun("resume", "cli", "--isolation", "none", GITRUN_BWRAP="/nonexistent")

    assert refused.code == 5
    assert "bubblewrap" in refused.err
    assert unconfined.code == 0, unconfined.err
    assert "warning" not in unconfined.err  # `none` was asked for: no warning
    assert status_json(gitrun, "cli")["isolation"] == "none"
    assert gitrun("run", str(task), "--isolation", "sometimes").code == 2


def test_auto_isolation_without_bubblewrap_warns_once_and_records_none(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("fix-median")

    result = gitrun("run", str(task), "--run-id", "auto", GITRUN_BWRAP="/nonexistent")

    assert result.code == 0, result.err
    warnings = [line for line in result.err.splitlines() if "UNCONFINED" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("gitrun: warning: ")
    assert status_json(gitrun, "auto")["isolation"] == "none"
    assert "isolation  none" in gitrun("status", "auto").out


def test_a_task_file_change_of_isolation_is_a_scenario_change(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("fix-median")
    assert gitrun("run", str(task), "--run-id", "scn", "--isolation", "none").code == 0
    _set_isolation(task, "none")

    result = gitrun("checkpoint", "verify", "scn", "--task", str(task))

    assert result.code == 5
    assert "verifier" in result.err


# -- issue 10: a verifier that cannot start; a verifier that outlives gitrun ---------------


def test_a_verifier_command_that_cannot_start_ends_the_run_failed_with_a_reason(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("fix-median")
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace('command = ["{python}"', 'command = ["/nonexistent"'))
    assert '"/nonexistent"' in toml.read_text()

    for isolation in ("auto", "none"):
        rid = f"nostart-{isolation}"
        result = gitrun.run(
            ("run", str(task), "--run-id", rid, "--isolation", isolation), timeout=60
        )

        assert result.code == 1, (result.out, result.err)
        assert "/nonexistent" in result.out
        assert "cannot start" in result.out
        info = status_json(gitrun, rid)
        assert (info["phase"], info["stop_reason"]) == ("failed", "verifier_cannot_start")
        again = gitrun("resume", rid)
        assert again.code == 1
        assert "cannot start" in again.out


SPAWNING_TEST = """\
import os, subprocess, sys, time

BEAT = "beat-{token}"


def test_leaves_a_grandchild_behind():
    loop = (
        "import os, sys, time\\n"
        "while True:\\n"
        "    with open(sys.argv[1], 'a') as f: f.write('.')\\n"
        "    time.sleep(0.05)\\n"
    )
    subprocess.Popen(
        [sys.executable, "-c", loop, os.path.abspath(BEAT), "{token}"], start_new_session=True
    )
    time.sleep(60)
"""

SPAWN_TASK = """\
schema = 1

[task]
id = "spawn"
version = "1"

[initial]
repo = "repo"

[policy]
id = "p"
version = "1"
allowed_actions = ["write_file"]
write_allowlist = ["src/**"]

[verifier]
command = ["{{python}}", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
fail_to_pass = ["tests/test_spawn.py::test_leaves_a_grandchild_behind"]
pass_to_pass = []
timeout_seconds = 90

[budgets]
max_proposals = 3
max_steps = 3
max_wall_seconds = 120

[agent]
plan = "plan.toml"
"""

SPAWN_PLAN = """\
schema = 1

[[step]]
kind = "write_file"
path = "src/x.txt"
content = "x"
"""


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if token.encode() in (entry / "cmdline").read_bytes():
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
    return found


def _wait_for(path_glob: Callable[[], list[Path]], within: float) -> Path:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = path_glob()
        if found and found[0].stat().st_size > 3:
            return found[0]
        time.sleep(0.05)
    raise AssertionError("the grandchild never started writing")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    "isolation", [pytest.param("required", marks=needs_bwrap, id="bwrap"), "none"]
)
def test_the_verifiers_whole_process_tree_dies_when_gitrun_is_killed(
    gitrun: Gitrun, tmp_path: Path, scratch_tmp: Path, isolation: str
) -> None:
    token = f"gitrun-orphan-{os.getpid()}-{isolation}"
    task = tmp_path / "tasks" / "spawn"
    (task / "repo" / "tests").mkdir(parents=True)
    (task / "repo" / "src").mkdir()
    (task / "repo" / "src" / "x.txt").write_text("")
    (task / "repo" / "tests" / "test_spawn.py").write_text(SPAWNING_TEST.format(token=token))
    (task / "task.toml").write_text(SPAWN_TASK.format())
    (task / "plan.toml").write_text(SPAWN_PLAN)
    proc = gitrun.popen("run", str(task), "--isolation", isolation, TMPDIR=str(scratch_tmp))
    try:
        beat = _wait_for(lambda: sorted(scratch_tmp.rglob(f"beat-{token}")), within=60)
        assert _processes_with(token)

        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
        deadline = time.monotonic() + 2.0
        while _processes_with(token) and time.monotonic() < deadline:
            time.sleep(0.05)

        assert _processes_with(token) == []
        with contextlib.suppress(FileNotFoundError):
            size = beat.stat().st_size
            time.sleep(0.3)
            assert beat.stat().st_size == size
    finally:
        for pid in _processes_with(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# -- the materialisation itself ------------------------------------------------------------


def test_the_scratch_tree_comes_from_git_objects_with_modes_and_links_and_no_repo_filters(
    tmp_path: Path,
) -> None:
    import pygit2

    from gitrun.adapter.materialise import materialise

    repo_dir = tmp_path / "r"
    (repo_dir / "sub").mkdir(parents=True)
    (repo_dir / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (repo_dir / "run.sh").chmod(0o755)
    (repo_dir / "crlf.txt").write_bytes(b"a\r\nb\r\n")
    (repo_dir / "sub" / "deep.txt").write_text("deep\n")
    os.symlink("run.sh", repo_dir / "link")
    os.symlink("/etc/passwd", repo_dir / "outside")
    git(repo_dir, "init", "-q")
    git(repo_dir, "add", "-A")
    git(repo_dir, "update-index", "--add", "--cacheinfo", f"160000,{'1' * 40},mod")
    tree_id = git(repo_dir, "write-tree").strip()
    # What an agent could add to the shared config and info/attributes: never applied.
    info = common_dir(repo_dir) / "info"
    info.mkdir(exist_ok=True)
    (info / "attributes").write_text("* filter=evil eol=crlf\n")
    git(repo_dir, "config", "filter.evil.smudge", "echo HACKED")
    dest = tmp_path / "scratch" / "tree"
    dest.parent.mkdir()

    made = materialise(pygit2.Repository(str(repo_dir)), pygit2.Oid(hex=tree_id), dest)

    assert made == tree_id
    assert (dest / "crlf.txt").read_bytes() == b"a\r\nb\r\n"
    assert (dest / "sub" / "deep.txt").read_text() == "deep\n"
    assert os.stat(dest / "run.sh").st_mode & 0o111
    assert not os.stat(dest / "crlf.txt").st_mode & 0o111
    assert os.readlink(dest / "link") == "run.sh"
    assert os.readlink(dest / "outside") == "/etc/passwd"
    assert (dest / "mod").is_dir()
    assert list((dest / "mod").iterdir()) == []
    assert sorted(p.name for p in dest.iterdir()) == [
        "crlf.txt", "link", "mod", "outside", "run.sh", "sub",
    ]  # fmt: skip


@pytest.mark.parametrize("name", [".GIT", ".."])
def test_a_tree_entry_git_would_not_check_out_is_refused(tmp_path: Path, name: str) -> None:
    import pygit2

    from gitrun.adapter.materialise import UnsafeTree, materialise

    repo_dir = tmp_path / "r"
    git(tmp_path, "init", "-q", str(repo_dir))
    blob = subprocess.run(
        ["git", "-C", str(repo_dir), "hash-object", "-w", "--stdin"],
        input="[core]\n", capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    tree = subprocess.run(
        ["git", "-C", str(repo_dir), "mktree"],
        input=f"100644 blob {blob}\t{name}\n", capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    dest = tmp_path / "scratch" / "tree"
    dest.parent.mkdir()

    with pytest.raises(UnsafeTree, match="would not check out"):
        materialise(pygit2.Repository(str(repo_dir)), pygit2.Oid(hex=tree), dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "r", "scratch"]
    assert list(dest.iterdir()) == []


LOOKS_FOR_SECRETS = """\
import os, sys
key, workspace = sys.argv[1], sys.argv[2]
assert open(key).read() == "", "key readable"
assert os.listdir(workspace) == [], "workspace visible"
assert not [k for k in os.environ if k.startswith("GITRUN_")], "variables leaked"
assert open("tracked.txt").read() == "ok\\n"
open("written-by-tests", "w").write("scratch is writable")
try:
    open(key + ".new", "w")
except OSError:
    pass
else:
    sys.exit("wrote beside the key")
"""


@needs_bwrap
def test_a_key_file_whose_directory_cannot_be_hidden_is_covered_by_dev_null(
    outside_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gitrun.engine.verifier import Secrets, VerifierSpec, run_verifier

    workdir = outside_tmp / "tree"  # the key's directory holds the tree: it cannot be hidden
    workdir.mkdir()
    (workdir / "tracked.txt").write_text("ok\n")
    key = outside_tmp / "checkpoint.keyring"
    key.write_text("secret")
    workspace = outside_tmp / "workspace"
    (workspace / "keys").mkdir(parents=True)
    monkeypatch.setenv("GITRUN_ANYTHING", "x")
    command = ("{python}", "-c", LOOKS_FOR_SECRETS, str(key), str(workspace))
    spec = VerifierSpec(command, False, ("t",), (), 30.0)
    confinement = sandbox.resolve("required")

    result = run_verifier(
        spec, workdir, confinement=confinement, secrets=Secrets((workspace,), (key,))
    )

    assert result.passed, result.output_tail
    assert key.read_text() == "secret"
    assert (workdir / "written-by-tests").exists()
    assert sorted(p.name for p in outside_tmp.iterdir()) == [
        "checkpoint.keyring", "tree", "workspace",
    ]  # fmt: skip


KILLS_ITS_SUPERVISOR = """\
import os, signal, subprocess, sys, time
loop = "import time\\nwhile True: time.sleep(0.05)"
subprocess.Popen([sys.executable, "-c", loop, sys.argv[1]], start_new_session=True)
os.kill(os.getppid(), signal.SIGKILL)
time.sleep(30)
"""


@needs_bwrap
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_in_the_sandbox_a_test_that_kills_its_supervisor_still_leaves_no_process_behind(
    tmp_path: Path,
) -> None:
    from gitrun.engine.verifier import VerifierSpec, run_verifier

    token = f"gitrun-escapee-{os.getpid()}"
    spec = VerifierSpec(("{python}", "-c", KILLS_ITS_SUPERVISOR, token), False, ("t",), (), 30.0)
    try:
        started = time.monotonic()
        result = run_verifier(spec, tmp_path, confinement=sandbox.resolve("required"))

        assert time.monotonic() - started < 10
        assert not result.passed
        assert _processes_with(token) == []
    finally:
        for pid in _processes_with(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
