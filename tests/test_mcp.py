"""`gitrun mcp` (issue #14): the MCP SDK's own client drives a real `gitrun mcp` process
over stdio: it solves a sandbox, a refusal is an isError result naming the rule, and a
server killed with SIGKILL mid-session is started again and the client carries on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import pytest
from conftest import SANDBOXES, Gitrun, git

pytest.importorskip("mcp")

import anyio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

FIX = (SANDBOXES / "fix-median" / "patches" / "fix.diff").read_text()
TASK = str(SANDBOXES / "fix-median")
TOOLS = {"observe", "read_file", "list_files", "search", "write_file", "delete_file",
         "apply_patch", "run_tests", "finish", "rewind"}  # fmt: skip


def params(gitrun: Gitrun, *args: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "gitrun", "mcp", *args],
        env=gitrun.env(),
        cwd=str(gitrun.home.parent),
    )


@asynccontextmanager
async def client(
    gitrun: Gitrun, *args: str, errlog: TextIO = sys.stderr
) -> AsyncIterator[ClientSession]:
    async with (
        stdio_client(params(gitrun, *args), errlog=errlog) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        with anyio.fail_after(90):
            await fn()

    anyio.run(bounded)


async def call(session: ClientSession, name: str, **arguments: Any) -> types.CallToolResult:
    result = await session.call_tool(name, arguments)
    assert isinstance(result, types.CallToolResult)
    return result


def body(result: types.CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    out: dict[str, Any] = json.loads(block.text)
    return out


def text_of(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


def keys_on_branch(gitrun: Gitrun, run_id: str) -> list[str]:
    out = git(
        gitrun.repo("fix-median"),
        "log",
        "--reverse",
        "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)",
        f"gitrun/{run_id}",
    )
    return [line for line in out.splitlines() if line.strip()]


def status(gitrun: Gitrun, run_id: str) -> dict[str, Any]:
    res = gitrun("status", run_id, "--json")
    assert res.code == 0, res.err
    info: dict[str, Any] = json.loads(res.out)
    return info


def test_the_sdk_client_solves_fix_median_through_gitrun_mcp(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    err = tmp_path / "server.err"

    async def go() -> None:
        with err.open("w") as log:
            await solve(log)

    async def solve(log: TextIO) -> None:
        async with client(gitrun, TASK, "--run-id", "m1", errlog=log) as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert set(tools) == TOOLS  # exec is not in fix-median's policy
            patch = tools["apply_patch"]
            assert patch.description
            assert patch.input_schema["required"] == ["patch"]
            assert patch.input_schema["additionalProperties"] is False
            read = body(await call(s, "read_file", path="stats/median.py"))
            assert "return data[mid]" in read["content"]
            wrote = body(await call(s, "apply_patch", patch=FIX, idempotency_key="mcp-fix-0001"))
            assert wrote["paths"] == ["stats/median.py"]
            assert wrote["replayed"] is False
            again = body(await call(s, "apply_patch", patch=FIX, idempotency_key="mcp-fix-0001"))
            assert again["commit"] == wrote["commit"]
            assert again["replayed"] is True
            resources = (await s.list_resources()).resources
            assert [str(r.uri) for r in resources] == ["gitrun://run/m1/state"]
            state = await s.read_resource("gitrun://run/m1/state")
            assert isinstance(state, types.ReadResourceResult)
            content = state.contents[0]
            assert isinstance(content, types.TextResourceContents)
            assert json.loads(content.text)["head"]["commit"] == wrote["commit"]
            done = body(await call(s, "finish"))
            assert done["phase"] == "done"
            assert done["verifier"]["passed"] is True

    run(go)
    assert status(gitrun, "m1")["phase"] == "done"
    # the result line goes to stderr after serving: stdout is the client's wire
    assert "run m1: done (8/8 required tests passed)" in err.read_text()
    assert keys_on_branch(gitrun, "m1") == ["mcp-fix-0001"]


def test_a_refused_write_is_an_is_error_result_naming_the_rule(gitrun: Gitrun) -> None:
    async def go() -> None:
        async with client(gitrun, TASK, "--run-id", "m2") as s:
            refused = await call(s, "write_file", path="tests/test_median.py", content="x\n")
            assert refused.is_error
            assert "path-forbidden" in text_of(refused)
            assert "tests/test_median.py" in text_of(refused)
            assert "propose another action" in text_of(refused)
            bad = await call(s, "write_file", path="stats/x.py")
            assert bad.is_error
            assert "bad-params" in text_of(bad)
            assert "content" in text_of(bad)
            seen = body(await call(s, "observe"))
            assert seen["receipt_count"] == 0
            assert seen["phase"] == "running"

    run(go)
    assert keys_on_branch(gitrun, "m2") == []


def test_gitrun_mcp_without_the_extra_is_one_line_and_exit_2(gitrun: Gitrun) -> None:
    blocked = (
        "import sys; sys.modules['mcp'] = None; from gitrun.cli import main; main(sys.argv[1:])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", blocked, "mcp", TASK, "--run-id", "m3"],
        capture_output=True, text=True, env=gitrun.env(), timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == "gitrun: the MCP server needs the mcp extra: pip install 'gitrun[mcp]'\n"
    assert not (gitrun.home / "runs" / "m3").exists()


def _server_pid(run_id: str) -> int:
    """The `gitrun mcp ... --run-id RUN_ID` process (the client's child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mcp" in argv and run_id.encode() in argv and b"gitrun" in argv:
            return int(entry.name)
    raise AssertionError(f"no gitrun mcp process for {run_id}")


def test_sigkill_of_the_server_mid_session_then_the_client_goes_on(gitrun: Gitrun) -> None:
    """The client writes, the server dies by SIGKILL, a new server on the same run id
    takes over; the client retries its key (a replay), writes on and finishes done."""
    first = "stats/notes.py"
    written: list[dict[str, Any]] = []

    async def before() -> None:
        async with client(gitrun, TASK, "--run-id", "m4") as s:
            written.append(body(await call(s, "write_file", path=first, content="A = 1\n",
                                           idempotency_key="mcp-step-0001")))  # fmt: skip
            os.kill(_server_pid("m4"), signal.SIGKILL)
            with anyio.fail_after(10):
                await call(s, "observe")  # the dead server: the transport's own error

    async def after() -> None:
        async with client(gitrun, TASK, "--run-id", "m4", "--takeover-after", "0") as s:
            retried = body(await call(s, "write_file", path=first, content="A = 1\n",
                                      idempotency_key="mcp-step-0001"))  # fmt: skip
            assert retried["replayed"] is True
            assert retried["commit"] == written[0]["commit"]
            body(await call(s, "apply_patch", patch=FIX, idempotency_key="mcp-step-0002"))
            assert body(await call(s, "finish"))["phase"] == "done"

    with pytest.raises(Exception):  # noqa: B017 - whatever the SDK raises for a dead server
        anyio.run(before)
    assert len(written) == 1
    run(after)
    assert status(gitrun, "m4")["phase"] == "done"
    assert keys_on_branch(gitrun, "m4") == ["mcp-step-0001", "mcp-step-0002"]


def test_the_rewind_tool_restores_an_earlier_tree_as_a_new_step(gitrun: Gitrun) -> None:
    async def go() -> None:
        async with client(gitrun, TASK, "--run-id", "m5") as s:
            one = body(await call(s, "write_file", path="stats/n.py", content="A = 1\n"))
            body(await call(s, "write_file", path="stats/n.py", content="A = 2\n"))
            back = body(await call(s, "rewind", to=one["commit"][:9]))
            assert back["action"] == "rewind"
            assert back["tree"] == one["tree"]
            assert back["paths"] == ["stats/n.py"]
            same = await call(s, "rewind", to=one["commit"])
            assert same.is_error
            assert "rewind-no-change" in text_of(same)
            seen = body(await call(s, "observe"))
            assert seen["budgets"]["used"]["steps"] == 3
            assert [r["action"] for r in seen["receipts"]] == ["rewind", "write_file", "write_file"]

    run(go)
    assert len(keys_on_branch(gitrun, "m5")) == 3


def test_a_ping_and_list_tools_answer_while_an_exec_runs(gitrun: Gitrun, tmp_path: Path) -> None:
    """Blocking tool work runs off the server's event loop: the client is never left
    waiting on a ping (nor a second tool call, which waits its turn) while a command runs."""
    task = tmp_path / "rename-api"
    shutil.copytree(SANDBOXES / "rename-api", task)
    toml = task / "task.toml"
    toml.write_text(
        toml.read_text().replace('allow = ["sed -i *"]', 'allow = ["sed -i *", "sleep *"]')
    )

    async def go() -> None:
        async with client(gitrun, str(task), "--run-id", "m-busy") as s:
            done: list[float] = []

            async def slow() -> None:
                result = body(
                    await call(s, "exec", command="sleep 4", idempotency_key="busy-exec-1")
                )
                assert result["exit_code"] == 0, result
                done.append(anyio.current_time())

            async with anyio.create_task_group() as tg:
                tg.start_soon(slow)
                await anyio.sleep(0.5)  # the exec is running now
                await s.send_ping()
                names = {t.name for t in (await s.list_tools()).tools}
                # Order, not a latency bound: a loaded CI machine may be slow to answer,
                # but an answer that waited for the exec would come after its 4 s.
                assert not done, "the ping was answered only after the exec"
                assert "exec" in names
                seen = body(await call(s, "observe"))  # waits for the exec, then answers
                assert done
                assert seen["receipt_count"] == 1

    run(go)
