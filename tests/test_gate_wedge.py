"""Inputs that used to wedge a run (issue #27 §4-§6), through a real `gitrun session`
(and `gitrun mcp`) process and real git: names git refuses, idempotency keys that are
no ref names, malformed JSON. Each is refused with its own rule, nothing is
checkpointed, and the session goes on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git
from hypothesis import given, settings
from hypothesis import strategies as st
from session_client import Rpc

from gitrun.engine import jsonrpc

pytestmark = pytest.mark.timeout(180)

TASK = str(SANDBOXES / "fix-median")
LONG_LEASE = ("--lease-seconds", "600")
# Every name git refuses under core.protectNTFS / core.protectHFS (issue #27 §4).
DOTGIT_NAMES = [
    "stats/.git /x.py",
    "stats/.git./x.py",
    "stats/GIT~1/x.py",
    "stats/git~1/x.py",
    "stats/.git::$INDEX_ALLOCATION/x.py",
    "stats/.gi\u200ct/x.py",
    "stats/\ufeff.git/x.py",
    "stats/.GIT. . /x.py",
]


@pytest.fixture(autouse=True)
def _reap_sessions() -> Iterator[None]:
    yield
    Rpc.reap_all()


def new_file_patch(path: str) -> str:
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        "@@ -0,0 +1 @@\n+x = 1\n"
    )


@pytest.mark.parametrize("path", DOTGIT_NAMES)
def test_a_name_git_reads_as_dotgit_is_refused_before_any_intent(gitrun: Gitrun, path: str) -> None:
    rpc = Rpc(gitrun, TASK, "--run-id", "w1", *LONG_LEASE)
    rpc.call("initialize", protocol="gitrun/1")
    before = rpc.call("observe")["generation"]
    for method, params in (
        ("write_file", {"path": path, "content": "x = 1\n"}),
        ("apply_patch", {"patch": new_file_patch(path)}),
    ):
        err = rpc.fail(method, **params)
        assert err["data"]["rule"] == "path-git-dir", err
        assert err["data"]["exit_code"] == 5
        assert ".git" in err["message"]
    seen = rpc.call("observe")
    assert seen["generation"] == before  # no intent was checkpointed
    assert seen["pending"] is None
    done = rpc.call("write_file", path="stats/ok.py", content="ok = 1\n")  # the session goes on
    assert done["paths"] == ["stats/ok.py"]
    assert rpc.close() == 8  # the agent left a running run: resumable, not a crash (70)
    repo = gitrun.repo("fix-median")
    git(repo, "fsck", "--strict")


@pytest.mark.parametrize("key", ["abcdefgh.", "abcdefg.lock", "abcdefgh..x", "abcdefgh/x"])
def test_an_idempotency_key_that_is_no_ref_name_is_refused_and_gc_keeps_working(
    gitrun: Gitrun, key: str
) -> None:
    rpc = Rpc(gitrun, TASK, "--run-id", "k1", *LONG_LEASE)
    rpc.call("initialize", protocol="gitrun/1")
    err = rpc.fail("write_file", path="stats/a.py", content="a\n", idempotency_key=key)
    assert err["code"] == -32602, err
    assert "idempotency_key" in err["message"]
    assert rpc.call("observe")["pending"] is None
    rpc.call("write_file", path="stats/a.py", content="a\n", idempotency_key="good-key-0001")
    rpc.close()
    repo = gitrun.repo("fix-median")
    git(repo, "gc", "--quiet")  # one run's refs never break the repository
    for line in git(repo, "for-each-ref", "--format=%(refname)").splitlines():
        git(repo, "check-ref-format", line)


def _nested(depth: int) -> bytes:
    inner = "[" * depth + "]" * depth
    return ('{"jsonrpc":"2.0","id":7,"method":"observe","params":{"x":' + inner + "}}\n").encode()


@pytest.mark.parametrize(
    "line",
    [
        _nested(100_000),
        _nested(2_000),
        b'{"jsonrpc":"2.0","id":8,"method":"observe","params":{"a":"\\ud800"}}\n',
        b'{"jsonrpc":"2.0","id":9,"method":"write_file","params":'
        b'{"path":"stats/\\udc00.py","content":"x"}}\n',
        b'{"jsonrpc":"2.0","id":10,"method":"ob\\udfffserve"}\n',
        b'{"jsonrpc":"2.0","id":"\\ud834","method":"observe"}\n',
        b'{"jsonrpc":"2.0","id":11,"method":"observe","params":{"\\ud800":1}}\n',
    ],
    ids=[
        "deep-100k",
        "deep-2k",
        "surrogate-value",
        "surrogate-path",
        "surrogate-method",
        "surrogate-id",
        "surrogate-key",
    ],
)
def test_malformed_json_gets_an_error_and_the_session_goes_on(gitrun: Gitrun, line: bytes) -> None:
    rpc = Rpc(gitrun, TASK, "--run-id", "j1", *LONG_LEASE)
    rpc.call("initialize", protocol="gitrun/1")
    rpc.send_raw(line)
    reply = rpc.read()
    assert isinstance(reply, dict), rpc.stderr()
    assert reply["error"]["code"] in (-32700, -32600, -32602), reply
    assert reply["error"]["data"]["exit_code"] == 2
    seen = rpc.call("observe")  # still serving
    assert seen["phase"] == "running"
    assert seen["pending"] is None
    assert rpc.close() == 8
    assert "internal error" not in rpc.stderr()


def test_the_mcp_server_refuses_a_dotgit_name_and_goes_on(gitrun: Gitrun, tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from test_mcp import body, call, client, run, text_of

    async def go() -> None:
        async with client(gitrun, TASK, "--run-id", "m-dotgit") as s:
            for path in DOTGIT_NAMES[:6]:
                refused = await call(s, "write_file", path=path, content="x\n")
                assert refused.is_error
                assert "path-git-dir" in text_of(refused), text_of(refused)
            bad_key = await call(
                s, "write_file", path="stats/a.py", content="a\n", idempotency_key="abcdefgh."
            )
            assert bad_key.is_error
            assert "idempotency_key" in text_of(bad_key)
            seen = body(await call(s, "observe"))
            assert seen["pending"] is None
            assert seen["phase"] == "running"

    run(go)
    del tmp_path
    assert json.loads(gitrun("status", "m-dotgit", "--json").out)["phase"] == "running"


def test_the_mcp_server_answers_an_unreadable_line_and_goes_on(gitrun: Gitrun) -> None:
    """The SDK only logs a line it cannot read; gitrun answers it with -32700."""
    pytest.importorskip("mcp")
    rpc = Rpc(gitrun, TASK, "--run-id", "m-json", command="mcp")
    hello = {"protocolVersion": "2025-06-18", "capabilities": {},
             "clientInfo": {"name": "t", "version": "1"}}  # fmt: skip
    rpc.send_raw(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                             "params": hello}).encode() + b"\n")  # fmt: skip
    hello_reply = rpc.read()
    assert isinstance(hello_reply, dict)
    assert "result" in hello_reply
    rpc.send_raw(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
    for line in (_nested(100_000), b'{"jsonrpc":"2.0","id":5,"method":"ping","x":"\\ud800"\n'):
        rpc.send_raw(line)
        reply = rpc.read()
        assert isinstance(reply, dict), rpc.stderr()
        assert reply["id"] is None
        assert reply["error"]["code"] == -32700
    rpc.send_raw(b'{"jsonrpc":"2.0","id":2,"method":"tools/call",'
                 b'"params":{"name":"observe","arguments":{}}}\n')  # fmt: skip
    observed = rpc.read()
    assert isinstance(observed, dict)
    assert json.loads(observed["result"]["content"][0]["text"])["phase"] == "running"
    assert rpc.close() == 8


HIDDEN = [
    "stats/a\nb.py",
    "stats/a\rb.py",
    "stats/a\tb.py",
    "stats/\x1b[31m.py",
    "stats/\u202eyp.txt",
    "stats/a\u200bb.py",
    "stats/\u2066x.py",
    "stats/a\x85b.py",
]


def test_paths_with_hidden_characters_are_refused_by_their_own_rule(gitrun: Gitrun) -> None:
    """Not `path-not-allowlisted ... ['**']` (issue #27 §6): the rule names the character."""
    rpc = Rpc(gitrun, TASK, "--run-id", "h1", *LONG_LEASE)
    rpc.call("initialize", protocol="gitrun/1")
    for path in HIDDEN:
        err = rpc.fail("write_file", path=path, content="x\n")
        assert err["data"]["rule"] == "path-hidden-character", (path, err)
        assert "U+" in err["message"]
        assert "allow_hidden_characters" in err["message"]
        if all(ord(c) >= 0x20 for c in path):  # the patch parser refuses C0 controls itself
            err = rpc.fail("apply_patch", patch=new_file_patch(path))
            assert err["data"]["rule"] == "path-hidden-character", (path, err)
    assert rpc.call("observe")["pending"] is None
    rpc.close()


def test_a_policy_may_allow_hidden_characters_and_then_the_allowlist_sees_them(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    task = tmp_path / "fix-median"
    shutil.copytree(SANDBOXES / "fix-median", task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(
        toml.replace(
            'forbidden_paths = ["tests/**"]',
            'forbidden_paths = ["tests/**"]\nallow_hidden_characters = true',
        )
    )
    rpc = Rpc(gitrun, str(task), "--run-id", "h2", *LONG_LEASE)
    rpc.call("initialize", protocol="gitrun/1")
    done = rpc.call("write_file", path="stats/a\nb.py", content="x = 1\n")
    assert done["paths"] == ["stats/a\nb.py"]
    err = rpc.fail("write_file", path="tests/a\nb.py", content="x = 1\n")
    assert err["data"]["rule"] == "path-forbidden", err  # "tests/**" covers the newline
    rpc.close()
    names = git(gitrun.repo("fix-median"), "ls-tree", "-r", "-z", "--name-only", "gitrun/h2")
    assert "stats/a\nb.py" in names.split("\0")


@pytest.mark.parametrize(
    ("made", "rule"),
    [
        ("geometry/GIT~1/x", "path-git-dir"),
        ("geometry/.git /x", "path-git-dir"),
        ("geometry/.git::$INDEX_ALLOCATION/x", "path-git-dir"),
        ("geometry/.gi\u200ct/x", "path-git-dir"),
        ("geometry/a\u202eb.py", "path-hidden-character"),
    ],
)
def test_an_exec_making_a_name_git_refuses_is_a_refused_step_not_a_crash(
    gitrun: Gitrun, tmp_path: Path, made: str, rule: str
) -> None:
    task = tmp_path / "rename-api"
    shutil.copytree(SANDBOXES / "rename-api", task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace('allow = ["sed -i *"]', 'allow = ["*"]'))
    rpc = Rpc(gitrun, str(task), "--run-id", "x1", *LONG_LEASE)
    rpc.call("initialize", protocol="gitrun/1")
    parent = made.rpartition("/")[0]
    err = rpc.fail(
        "exec", command=["sh", "-c", 'mkdir -p "$1" && echo x > "$2"', "sh", parent, made]
    )
    assert err["data"]["rule"] == rule, err
    assert "put back" in err["message"]
    assert not (gitrun.home / "worktrees" / "x1" / made).exists()
    done = rpc.call("exec", command="sed -i s/calc_area/circle_area/g geometry/*.py")
    assert done["exit_code"] == 0  # the session goes on
    assert rpc.close() == 8


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(doc=JSON_VALUES, depth=st.integers(0, 3000), raw=st.binary(max_size=64))
def test_parse_answers_every_line_with_a_request_or_an_rpc_error(
    doc: object, depth: int, raw: bytes
) -> None:
    """Whatever the line (any JSON value, wrapped ``depth`` deep, any bytes, any lone
    surrogate), parsing it gives a request or an RpcError: nothing else escapes."""
    text = json.dumps(doc)
    codes: set[int] = set()
    for line in (
        ("[" * depth + text + "]" * depth).encode(),
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "observe", "params": {"x": doc}}).encode(),
        raw,
        text.encode("utf-8", "surrogatepass"),
    ):
        try:
            jsonrpc.parse(line)
        except jsonrpc.RpcError as err:
            codes.add(err.code)
    assert codes <= {-32700, -32600, -32602}
