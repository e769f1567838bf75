"""Agent sessions (issue #12): the JSON-RPC protocol through a real `gitrun session`
process, external agents under `gitrun run --agent cmd:...`, client idempotency keys,
and SIGKILL of the agent and of gitrun at random points."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, SANDBOXES, Gitrun, git, snapshot
from session_client import Rpc, load_schemas, problems

from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.engine import session_rpc

FIX = (SANDBOXES / "fix-median" / "patches" / "fix.diff").read_text()
AGENTS = Path(__file__).resolve().parent / "session_agents"
LONG_LEASE = ("--lease-seconds", "600")  # no lease renewal may move a ref mid-test


@pytest.fixture(autouse=True)
def _reap_sessions() -> Iterator[None]:
    yield
    Rpc.reap_all()


def status(gitrun: Gitrun, run_id: str) -> dict[str, object]:
    res = gitrun("status", run_id, "--json")
    assert res.code == 0, res.err
    info: dict[str, object] = json.loads(res.out)
    return info


def branch_keys(repo: Path, run_id: str) -> list[str]:
    out = git(
        repo, "log", "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)", f"gitrun/{run_id}"
    )
    return [line for line in out.splitlines() if line.strip()]


def tree_of(repo: Path, run_id: str) -> str:
    return git(repo, "rev-parse", f"gitrun/{run_id}^{{tree}}").strip()


# -- the spec ---------------------------------------------------------------------------


def test_the_spec_has_a_params_and_a_result_schema_for_every_method() -> None:
    schemas, defs = load_schemas()
    for method in session_rpc.PARAMS:
        assert f"{method}.params" in schemas, method
        assert f"{method}.result" in schemas, method
    assert defs["key"]["pattern"] == f"^{session_rpc.KEY_PATTERN}$"


# -- every method through a real session ------------------------------------------------


def test_every_method_answers_over_a_real_session_as_its_schema_says(gitrun: Gitrun) -> None:
    rpc = Rpc(gitrun, str(SANDBOXES / "fix-median"), "--run-id", "s-all")
    hello = rpc.call("initialize", protocol="gitrun/1", client={"name": "test"})
    assert hello["run_id"] == "s-all"
    assert hello["task"]["id"] == "fix-median"
    assert "exec" not in hello["tools"]  # the sandbox's policy does not allow it
    seen = rpc.call("observe")
    assert seen["phase"] == "running"
    assert seen["receipts"] == []
    assert seen["pending"] is None
    files = rpc.call("list_files", glob="stats/*.py")["files"]
    assert [f["path"] for f in files] == ["stats/__init__.py", "stats/mean.py", "stats/median.py"]
    hits = rpc.call("search", pattern=r"return data\[mid\]$", regex=True)["matches"]
    assert [(h["path"], h["line"]) for h in hits] == [
        ("stats/median.py", 20),
        ("stats/median.py", 21),
    ]
    part = rpc.call("read_file", path="./stats/median.py", start_line=20, end_line=21)
    assert part["content"] == "        return data[mid]\n    return data[mid]\n"
    assert (part["path"], part["total_lines"], part["truncated"]) == ("stats/median.py", 21, False)

    note = rpc.call(
        "write_file", path="stats/NOTES.txt", content="temp\n", idempotency_key="notes-0001"
    )
    assert note["replayed"] is False
    assert note["paths"] == ["stats/NOTES.txt"]
    assert note["key"] == "notes-0001"
    assert note["parent"] == seen["head"]["commit"]
    gone = rpc.call("delete_file", path="stats/NOTES.txt")
    assert gone["key"].startswith("k-")
    assert gone["parent"] == note["commit"]
    fixed = rpc.call("apply_patch", patch=FIX)
    assert fixed["paths"] == ["stats/median.py"]
    err = rpc.fail("exec", command="true")  # the policy has no [policy.exec]
    assert err["data"]["rule"] == "action-not-allowed"
    assert err["data"]["exit_code"] == 5

    after = rpc.call("observe")
    assert after["head"] == {"commit": fixed["commit"], "tree": fixed["tree"]}
    assert [r["commit"] for r in after["receipts"]] == [
        fixed["commit"],
        gone["commit"],
        note["commit"],
    ]
    assert after["budgets"]["used"]["steps"] == 3
    assert after["budgets"]["left"]["steps"] == 7
    tests = rpc.call("run_tests")
    assert tests["passed"]
    assert set(tests["outcomes"].values()) == {"passed"}
    assert tests["tree"] == fixed["tree"]
    assert rpc.call("observe")["phase"] == "running"  # run_tests does not end the run
    end = rpc.call("finish")
    assert end["phase"] == "done"
    assert end["verifier"]["passed"]
    assert rpc.close() == 0
    assert status(gitrun, "s-all")["phase"] == "done"
    assert branch_keys(gitrun.repo("fix-median"), "s-all")[2] == "notes-0001"


def test_reads_see_heads_tree_in_git_not_files_or_symlinks_planted_on_disk(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path]
) -> None:
    task = sandbox_copy("fix-median")
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]", "allow_symlinks = true\n\n[verifier]"))
    rpc = Rpc(gitrun, str(task), "--run-id", "s-read")
    link = (
        "diff --git a/stats/link b/stats/link\nnew file mode 120000\n--- /dev/null\n"
        "+++ b/stats/link\n@@ -0,0 +1 @@\n+median.py\n\\ No newline at end of file\n"
    )
    rpc.call("apply_patch", patch=link)
    worktree = Path(str(status(gitrun, "s-read")["worktree"]))
    (worktree / "stats" / "planted.py").write_text("SECRET = 1\n")
    (worktree / "stats" / "etc").symlink_to("/etc")

    assert rpc.call("read_file", path="stats/link") | {"commit": ""} == {
        "commit": "", "path": "stats/link", "kind": "symlink", "size": 9, "content": "median.py",
        "start_line": 1, "end_line": 1, "total_lines": 1, "truncated": False,
    }  # fmt: skip
    rules = {
        "stats/link/x": "path-symlink",
        "stats/planted.py": "missing-path",
        "stats/etc/passwd": "missing-path",
        ".git/config": "path-git-dir",
        "stats/../../x": "path-dotdot",
        "/etc/passwd": "path-absolute",
        "stats": "path-is-directory",
    }
    for path, rule in rules.items():
        assert rpc.fail("read_file", path=path)["data"]["rule"] == rule, path
    listed = [f["path"] for f in rpc.call("list_files")["files"]]
    assert "stats/link" in listed
    assert "stats/planted.py" not in listed
    assert "stats/etc" not in listed
    assert rpc.call("search", pattern="SECRET")["matches"] == []
    assert rpc.close() == 8  # left before finish: resumable


def test_malformed_input_never_kills_the_session_nor_changes_the_run(gitrun: Gitrun) -> None:
    rpc = Rpc(gitrun, str(SANDBOXES / "fix-median"), "--run-id", "s-bad", *LONG_LEASE)
    before_obs = rpc.call("observe")
    before = snapshot(gitrun.repo("fix-median"))
    raw = [
        (b"not json\n", -32700),
        (b"\xff\xfe\n", -32700),
        (b"[1, 2]\n", -32600),
        (b'{"jsonrpc": "2.0", "id": 7}\n', -32600),
        (b'{"jsonrpc": "1.0", "id": 8, "method": "observe"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": true, "method": "observe"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": 9, "method": "observe", "params": 3}\n', -32602),
        (b'{"jsonrpc": "2.0", "id": 10, "method": "nope"}\n', -32601),
        (b"x" * (17 * 1024 * 1024) + b"\n", -32600),
    ]
    for line, code in raw:
        rpc.send_raw(b"\n" + line)  # blank lines are ignored
        reply = rpc.read()
        assert isinstance(reply, dict), line[:40]
        assert reply["error"]["code"] == code, (line[:40], reply)
    rpc.send_raw(
        b'{"jsonrpc": "2.0", "method": "write_file", "params": {"path": 1}}\n'
    )  # notification
    bad_params: list[tuple[str, dict[str, Any]]] = [
        ("write_file", {"path": "stats/a.py", "content": 3}),
        ("write_file", {"path": "stats/a.py", "content": "x", "mode": "755"}),
        ("write_file", {"path": "stats/a.py", "content": "x", "idempotency_key": "short"}),
        ("write_file", {"path": "stats/a.py", "content": "x", "idempotency_key": "a..bbbbbbbb"}),
        ("apply_patch", {"patch": FIX, "idempotency_key": "refs/heads/main"}),
        ("read_file", {"path": "stats/median.py", "start_line": 0}),
        ("search", {"pattern": "(", "regex": True}),
        ("search", {"pattern": "x", "regex": "yes"}),
        ("delete_file", {}),
    ]
    for method, params in bad_params:
        reply = rpc.request(method, params)
        assert reply.get("error", {}).get("code") == -32602, (method, params, reply)
    refused = [
        ("write_file", {"path": "tests/test_median.py", "content": "x"}, "path-forbidden"),
        ("write_file", {"path": "README.md", "content": "x"}, "path-not-allowlisted"),
        ("write_file", {"path": ".git/hooks/pre-commit", "content": "x"}, "path-git-dir"),
        ("delete_file", {"path": "stats/nothing.py"}, "missing-path"),
        ("apply_patch", {"patch": "not a diff\n"}, "patch-does-not-apply"),
        ("apply_patch", {"patch": FIX.replace("return data[mid]\n+", "return data[0]\n+")},
         "patch-does-not-apply"),
    ]  # fmt: skip
    for method, params, rule in refused:
        assert rpc.fail(method, **params)["data"]["rule"] == rule, (method, params)
    assert rpc.call("observe") == before_obs
    assert snapshot(gitrun.repo("fix-median")) == before
    assert rpc.call("apply_patch", patch=FIX)["replayed"] is False  # and it still works
    assert rpc.close() == 8


def test_exec_over_the_session_commits_the_commands_change_as_one_receipt(
    gitrun: Gitrun,
) -> None:
    rpc = Rpc(gitrun, str(SANDBOXES / "rename-api"), "--run-id", "s-exec")
    assert "exec" in rpc.call("initialize")["tools"]
    repo = gitrun.repo("rename-api")
    denied = rpc.fail("exec", command="sed -i 's/a/b/' tests/test_rename.py")
    assert denied["data"]["rule"] == "exec-denied"
    outside = rpc.fail("exec", command="sed -i 's/geometry/geo/' pyproject.toml")
    assert outside["data"]["rule"] == "path-not-allowlisted"
    assert "put back" in outside["message"]
    assert branch_keys(repo, "s-exec") == []
    worktree = Path(str(status(gitrun, "s-exec")["worktree"]))
    assert git(worktree, "status", "--porcelain") == ""  # the worktree was restored
    sed = "sed -i 's/calc_area/circle_area/g' geometry/*.py"
    done = rpc.call("exec", command=sed, idempotency_key="rename-sed-0001")
    assert done["exit_code"] == 0
    assert done["replayed"] is False
    assert len(done["paths"]) == 4
    assert (done["stdout"], done["stderr"]) == ("", "")
    assert git(repo, "show", done["output_blob"] + ":stdout") == done["stdout"]
    again = rpc.call("exec", command=sed, idempotency_key="rename-sed-0001")
    assert again == {**done, "replayed": True}
    assert rpc.call("search", pattern="calc_area", glob="geometry/**")["matches"] == []
    assert rpc.call("finish")["phase"] == "done"
    assert rpc.close() == 0
    assert branch_keys(repo, "s-exec") == ["rename-sed-0001"]


def test_exec_over_the_session_returns_stdout_and_stderr_apart_each_bounded(
    gitrun: Gitrun,
) -> None:
    rpc = Rpc(gitrun, str(SANDBOXES / "rename-api"), "--run-id", "s-stdio")
    rpc.call("initialize")
    repo = gitrun.repo("rename-api")
    split = "sed -i 's/calc_area/circle_area/g' geometry/*.py; echo to-out; echo to-err >&2"
    done = rpc.call("exec", command=split)
    assert (done["stdout"], done["stderr"]) == ("to-out\n", "to-err\n")
    assert (done["stdout_truncated"], done["stderr_truncated"]) == (False, False)
    tree = done["output_blob"]
    assert git(repo, "show", f"{tree}:stdout") == "to-out\n"
    assert git(repo, "show", f"{tree}:stderr") == "to-err\n"
    assert git(repo, "log", "-1", "--format=%(trailers:key=Gitrun-Output,valueonly)",
               done["commit"]).strip() == tree  # fmt: skip
    noisy = "sed -i 's/x/x/' geometry/shapes.py; seq 1 20000 >&2; seq 1 3"
    cut = rpc.call("exec", command=noisy, idempotency_key="noisy-stderr-1")
    assert cut["stdout"] == "1\n2\n3\n"
    assert (cut["stdout_truncated"], cut["stderr_truncated"]) == (False, True)
    assert cut["stderr"].startswith("1\n2\n3\n")
    assert cut["stderr"].endswith("19999\n20000\n")
    assert (
        "\n[gitrun: output truncated: 108894 bytes, first and last 32768 kept]\n" in cut["stderr"]
    )
    assert git(repo, "show", cut["output_blob"] + ":stderr") == cut["stderr"]
    again = rpc.call("exec", command=noisy, idempotency_key="noisy-stderr-1")
    assert again == {**cut, "replayed": True}  # read back from the receipt's tree
    assert rpc.close() == 8


def test_a_risky_request_waits_for_approval_and_resume_serves_it_executed(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    rpc = Rpc(gitrun, str(SANDBOXES / "retire-legacy"), "--run-id", "s-risk")
    err = rpc.fail("delete_file", path="units/legacy.py", idempotency_key="retire-legacy-1")
    assert err["data"]["rule"] == "awaiting-approval"
    assert "gitrun approve s-risk" in err["message"]
    seen = rpc.call("observe")  # the session goes on serving reads
    assert seen["pending"]["key"] == "retire-legacy-1"
    assert seen["pending"]["risk"] == "deleting a module"
    assert rpc.close() == 3
    roots = tmp_path / "roots.json"
    made = gitrun("keys", "new", "alice", "--role", "approver", "--dir", str(tmp_path),
                  "--trust-roots", str(roots))  # fmt: skip
    assert made.code == 0, made.err
    approved = gitrun("approve", "s-risk", "--key", str(tmp_path / "alice.key"),
                      "--trust-roots", str(roots))  # fmt: skip
    assert approved.code == 0, approved.err
    again = Rpc(gitrun, "s-risk", "--trust-roots", str(roots), command="resume")
    after = again.call("observe")  # the approved intent ran before the first request
    assert after["receipts"][0]["key"] == "retire-legacy-1"
    assert after["pending"] is None
    retry = again.call("delete_file", path="units/legacy.py", idempotency_key="retire-legacy-1")
    assert retry["replayed"] is True  # the file is gone, the key still answers
    assert retry["commit"] == after["head"]["commit"]
    assert again.close() == 8
    assert branch_keys(gitrun.repo("retire-legacy"), "s-risk") == ["retire-legacy-1"]


# -- idempotency keys -------------------------------------------------------------------


def test_a_client_that_lost_the_answer_gets_the_original_receipt_after_a_restart(
    gitrun: Gitrun,
) -> None:
    args = (str(SANDBOXES / "fix-median"), "--run-id", "s-lost")
    rpc = Rpc(gitrun, *args)
    request = {"jsonrpc": "2.0", "id": 1, "method": "apply_patch",
               "params": {"patch": FIX, "idempotency_key": "client-fix-0001"}}  # fmt: skip
    rpc.send_raw((json.dumps(request) + "\n").encode())
    assert rpc.close() == 8  # the client left without reading the answer
    repo = gitrun.repo("fix-median")
    assert branch_keys(repo, "s-lost") == ["client-fix-0001"]
    again = Rpc(gitrun, *args)  # the same run id continues the run
    first = again.call("apply_patch", patch=FIX, idempotency_key="client-fix-0001")
    assert first["replayed"] is True
    assert first["commit"] == git(repo, "rev-parse", "gitrun/s-lost").strip()
    assert again.call("finish")["phase"] == "done"
    assert again.close() == 0
    assert branch_keys(repo, "s-lost") == ["client-fix-0001"]


def test_an_agent_that_leaves_after_a_write_leaves_its_receipt_checkpointed(
    gitrun: Gitrun,
) -> None:
    # A step's receipt rides in the run's next checkpoint; when the agent leaves first,
    # the session's end writes it, so the stopped run's checkpoint is its whole state.
    rpc = Rpc(gitrun, str(SANDBOXES / "fix-median"), "--run-id", "s-left")
    one = rpc.call("apply_patch", patch=FIX, idempotency_key="client-left-0001")
    seen = rpc.call("observe")
    assert (seen["pending"], seen["receipt_count"]) == (None, 1)
    assert rpc.close() == 8
    info = status(gitrun, "s-left")
    assert (info["phase"], info["pending"], info["unrecorded_receipt"]) == ("running", None, None)
    assert info["head"] == one["commit"] == git(gitrun.repo("fix-median"), "rev-parse",
                                                 "gitrun/s-left").strip()  # fmt: skip
    newest = service.checkpoints("s-left", service.Options(Workspace(gitrun.home)))[0].state
    assert [e.kind for e in newest.events] == ["receipt"]
    assert newest.pending is None
    assert newest.receipts.last is not None
    assert newest.receipts.last.commit == one["commit"]


def test_an_agent_killed_after_sending_a_write_retries_it_and_gets_the_same_receipt(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    out = tmp_path / "answer.json"
    agent = f"cmd:{sys.executable} {AGENTS / 'retry_agent.py'} {tmp_path / 'marker'} {out}"
    # The agent keeps its marker and the answer in tmp_path: only unconfined can it write there.
    bare = ("--isolation", "none")
    first = gitrun(
        "run", str(SANDBOXES / "fix-median"), "--agent", agent, "--run-id", "s-retry", *bare
    )
    assert first.code == 8, first.err
    assert "gitrun resume s-retry" in first.err
    assert "was killed" in first.err
    repo = gitrun.repo("fix-median")
    assert branch_keys(repo, "s-retry") == ["retry-agent-write-1"]
    second = gitrun("resume", "s-retry", *bare)
    assert second.code == 1, second.err  # finish ran the tests: the bug is still there
    answer = json.loads(out.read_text())["result"]
    assert answer["replayed"] is True
    assert answer["key"] == "retry-agent-write-1"
    assert answer["commit"] == git(repo, "rev-parse", "gitrun/s-retry").strip()
    assert branch_keys(repo, "s-retry") == ["retry-agent-write-1"]


def test_reusing_a_key_for_another_intent_freezes_the_run_for_review(gitrun: Gitrun) -> None:
    rpc = Rpc(gitrun, str(SANDBOXES / "fix-median"), "--run-id", "s-conflict")
    one = rpc.call("write_file", path="stats/a.py", content="A\n", idempotency_key="same-key-0001")
    err = rpc.fail("write_file", path="stats/a.py", content="B\n", idempotency_key="same-key-0001")
    assert err["code"] == -32002
    assert err["data"]["rule"] == "needs-review"
    assert "same-key-0001" in err["message"]
    assert "gitrun review show s-conflict" in err["message"]
    assert rpc.call("observe")["phase"] == "needs_review"
    assert (
        rpc.fail("write_file", path="stats/b.py", content="C\n")["data"]["rule"] == "needs-review"
    )
    assert rpc.close() == 3
    info = status(gitrun, "s-conflict")
    assert info["phase"] == "needs_review"
    assert info["head"] == one["commit"]
    assert branch_keys(gitrun.repo("fix-median"), "s-conflict") == ["same-key-0001"]


# -- external agents ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sandbox", "command"),
    [
        ("fix-median", f"{sys.executable} {ROOT / 'examples/agents/median_agent.py'}"),
        (
            "guarded-config",
            f"sh {ROOT / 'examples/agents/config_agent.sh'} "
            f"{SANDBOXES / 'guarded-config' / 'patches'}",
        ),
        ("rename-api", f"sh {ROOT / 'examples/agents/rename_agent.sh'}"),
    ],
    ids=["python", "posix-sh", "posix-sh-exec"],
)
def test_the_example_agents_solve_their_sandboxes(
    gitrun: Gitrun, sandbox: str, command: str
) -> None:
    res = gitrun("run", str(SANDBOXES / sandbox), "--agent", f"cmd:{command}", "--run-id", "ex")
    assert res.code == 0, res.err
    assert "required tests passed" in res.out
    assert status(gitrun, "ex")["phase"] == "done"
    assert len(branch_keys(gitrun.repo(sandbox), "ex")) == 1


def test_an_agent_process_sees_no_gitrun_variables(gitrun: Gitrun) -> None:
    code = "import json,os,sys;print('ENV',json.dumps(dict(os.environ)),file=sys.stderr)"
    res = gitrun(
        "run", str(SANDBOXES / "fix-median"), "--agent", f'cmd:{sys.executable} -c "{code}"'
    )
    assert res.code == 8, res.err
    line = next(ln for ln in res.err.splitlines() if ln.startswith("ENV "))
    seen = json.loads(line.removeprefix("ENV "))
    assert not [k for k in seen if k.startswith("GITRUN_")]


# -- crashes -------------------------------------------------------------------------------

STEPS = 6


def _steps_agent(pidfile: Path) -> str:
    return f"cmd:{sys.executable} {AGENTS / 'steps_agent.py'} {pidfile} {STEPS} 0.15"


def _reference_tree(gitrun: Gitrun, pidfile: Path) -> str:
    res = gitrun("run", str(SANDBOXES / "fix-median"), "--agent", _steps_agent(pidfile),
                 "--run-id", "ref")  # fmt: skip
    assert res.code == 1, res.err  # the writes do not fix the bug: finish fails the run
    return tree_of(gitrun.repo("fix-median"), "ref")


def _agent_pid(pidfile: Path, seen: set[int]) -> int:
    """The host pid of the steps agent named by ``pidfile`` not in ``seen`` (inside bwrap's
    pid namespace the agent cannot tell its host pid, nor write ``pidfile``)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in seen:
                continue
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if argv[1:3] == [str(AGENTS / "steps_agent.py").encode(), str(pidfile).encode()]:
                    seen.add(int(entry.name))
                    return int(entry.name)
        time.sleep(0.01)
    raise AssertionError("the agent never started")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("victim", ["agent", "gitrun"])
def test_sigkill_of_the_agent_or_of_gitrun_at_random_resumes_to_the_uninterrupted_tree(
    gitrun: Gitrun, tmp_path: Path, victim: str
) -> None:
    pidfile = tmp_path / "pids"
    expected = _reference_tree(gitrun, pidfile)
    rng = random.Random(f"session-{victim}")
    repo = gitrun.repo("fix-median")
    first = ("run", str(SANDBOXES / "fix-median"), "--agent", _steps_agent(pidfile),
             "--run-id", "crashy", "--lease-seconds", "2")  # fmt: skip
    args: tuple[str, ...] = first
    codes: list[int] = []
    seen: set[int] = set()
    for _ in range(4):
        if (tmp_path / "started").exists() and status(gitrun, "crashy")["phase"] != "running":
            break  # a kill landed after the run had ended
        (tmp_path / "started").touch()
        proc = gitrun.popen(*args)
        try:
            agent = _agent_pid(pidfile, seen)
            time.sleep(rng.uniform(0.05, 0.7))
            with contextlib.suppress(ProcessLookupError):  # it may have ended by itself
                os.kill(agent if victim == "agent" else proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
            codes.append(proc.returncode)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if victim == "gitrun":
            deadline = time.monotonic() + 5
            while _alive(agent) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not _alive(agent), "the agent outlived gitrun"
        args = ("resume", "crashy", "--takeover-after", "0")
    interrupted = 8 if victim == "agent" else -signal.SIGKILL
    assert codes.count(interrupted) >= 2, codes  # most kills landed while the run ran
    final = gitrun.run(list(args), timeout=120)
    assert final.code == 1, final.err  # ended (verifier failed, as in the reference run)
    assert status(gitrun, "crashy")["stop_reason"] == "verifier_failed"
    keys = branch_keys(repo, "crashy")
    assert sorted(keys) == sorted(f"gen-step-{i:04d}" for i in range(STEPS))
    assert tree_of(repo, "crashy") == expected
    assert git(Path(str(status(gitrun, "crashy")["worktree"])), "status", "--porcelain") == ""


def test_problems_finds_what_breaks_a_schema() -> None:
    _, defs = load_schemas()
    assert problems({"commit": "x"}, defs["head"], defs) == [
        "$: missing tree",
        "$.commit: 'x' does not match ^[0-9a-f]{40}$",
    ]
    error = {"code": 1, "message": "m", "data": {"rule": "r", "message": "m", "exit_code": -1}}
    assert problems(error, defs["error"], defs) == ["$.data.exit_code: -1 < 0"]


def _processes_running(needle: str) -> list[int]:
    """Live processes whose command line mentions ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if needle in cmdline and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize(
    "point", ["exec_running", "exec_done", "write_ref_moved", "after_file_sync"]
)
def test_gitrun_killed_during_an_agents_exec_resumes_to_the_uninterrupted_tree(
    gitrun: Gitrun, tmp_path: Path, point: str
) -> None:
    script = tmp_path / "rename_agent.sh"  # a private copy: its path names this test's agent
    script.write_bytes((ROOT / "examples/agents/rename_agent.sh").read_bytes())
    agent = f"cmd:sh {script}"
    task = str(SANDBOXES / "rename-api")
    assert gitrun("run", task, "--agent", agent, "--run-id", "ref").code == 0
    repo = gitrun.repo("rename-api")
    crashed = gitrun("run", task, "--agent", agent, "--run-id", "cut", GITRUN_CRASH_AT=point)
    assert crashed.code == -signal.SIGKILL, crashed.err
    deadline = time.monotonic() + 5
    while _processes_running(str(script)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_running(str(script)) == [], "the agent outlived gitrun"
    resumed = gitrun("resume", "cut", "--takeover-after", "0")
    assert resumed.code == 0, resumed.err
    assert branch_keys(repo, "cut") == ["rename-agent-sed-1"]
    assert tree_of(repo, "cut") == tree_of(repo, "ref")


def test_the_session_keeps_its_lease_alive_while_the_agent_thinks(gitrun: Gitrun) -> None:
    # A 2 s lease (renewed every third of it): a loaded machine may delay one renewal by
    # a second without the test's claim changing.
    rpc = Rpc(gitrun, str(SANDBOXES / "fix-median"), "--run-id", "s-idle", "--lease-seconds", "2")
    rpc.call("observe")
    time.sleep(5.0)  # idle: two and a half leases
    other = gitrun("resume", "s-idle", "--worker-id", "intruder")
    assert other.code == 4, other.err  # the lease is still live: nobody takes the run over
    assert rpc.call("apply_patch", patch=FIX)["replayed"] is False
    assert rpc.call("finish")["phase"] == "done"
    assert rpc.close() == 0
