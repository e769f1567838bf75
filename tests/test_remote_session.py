"""``gitrun session`` and ``gitrun mcp`` with ``--remote`` (issue #16) through the real CLI:
a session's writes and exec steps commit through a bare repository served by a real
``git daemon``; a session killed with SIGKILL on machine A is continued on machine B."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_helpers
from conftest import SANDBOXES, Gitrun
from remote_helpers import Daemon, hermetic_git
from session_client import Rpc

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(120)

TASK = str(SANDBOXES / "fix-median")
RENAME = str(SANDBOXES / "rename-api")
SED = "sed -i 's/calc_area/circle_area/g'"
FIX = (SANDBOXES / "fix-median" / "patches" / "fix.diff").read_text()
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture(autouse=True)
def _reap_sessions() -> Iterator[None]:
    yield
    Rpc.reap_all()


def session(cli: Gitrun, *args: str) -> Rpc:
    """A client of a real ``gitrun session ARGS`` process (no pytest plugins in its tests)."""
    return Rpc(cli, *args, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


class Machines(remote_helpers.Machines):
    """Two workspaces (machines A and B), one keyring shared out of band, one remote."""

    def cli(self, machine: str) -> Gitrun:
        return Gitrun(self.tmp / machine)

    def cache_tip(self, machine: str, run_id: str) -> str:
        repo = next((self.tmp / machine / "repos").iterdir())
        return hermetic_git("-C", str(repo), "rev-parse", f"gitrun/{run_id}").strip()


@pytest.fixture
def machines(tmp_path: Path, git_daemon: Daemon) -> Machines:
    return Machines(tmp_path, git_daemon)


def test_a_session_killed_on_machine_a_is_continued_on_machine_b_each_key_once(
    machines: Machines,
) -> None:
    start = [RENAME, "--run-id", "s1", "--remote", machines.url, "--lease-seconds", "600"]
    a = session(machines.cli("a"), *start, *machines.args("a"))
    one = a.call("exec", command=SED + " geometry/shapes.py", idempotency_key="sess-key-1")
    # The answer comes after the remote took the step: its branch holds the commit.
    assert machines.remote_git("rev-parse", "gitrun/s1") == one["commit"]
    two = a.call("exec", command=SED + " geometry/report.py", idempotency_key="sess-key-2")
    assert (two["exit_code"], two["paths"]) == (0, ["geometry/report.py"])
    assert machines.remote_git("rev-parse", "gitrun/s1") == two["commit"]
    assert machines.cache_tip("a", "s1") == two["commit"]  # the cache follows the remote
    # The exec's output tree went in the same push: B can check and replay it.
    kept = machines.remote_git("rev-parse", "refs/gitrun/runs/s1/outputs/sess-key-2")
    assert kept == two["output_blob"]
    a.proc.kill()  # SIGKILL mid-session: its lease stays held for 600 s
    assert a.proc.wait(timeout=10) == -9
    assert machines.writes_on_remote("s1") == ["sess-key-1", "sess-key-2"]
    go_on = [RENAME, "--run-id", "s1", "--remote", machines.url, "--takeover-after", "0"]
    b = session(machines.cli("b"), *go_on, *machines.args("b"))
    assert b.call("observe")["head"]["commit"] == two["commit"]
    again = b.call("exec", command=SED + " geometry/report.py", idempotency_key="sess-key-2")
    assert again == {**two, "replayed": True}  # the client's retry on B: A's receipt
    rest = b.call("exec", command=SED + " geometry/*.py", idempotency_key="sess-key-3")
    assert machines.remote_git("rev-parse", "gitrun/s1") == rest["commit"]
    assert b.call("finish")["phase"] == "done"
    assert b.close() == Exit.DONE
    assert machines.writes_on_remote("s1") == [
        "sess-key-1",
        "sess-key-2",
        "sess-key-3",
    ]  # each once
    # Machine A, started again later, finds the run finished on B and writes nothing.
    late = machines.cli("a").run(["resume", "s1", *machines.args("a")], FAST)
    assert late.code == Exit.DONE, late.err
    assert machines.writes_on_remote("s1") == ["sess-key-1", "sess-key-2", "sess-key-3"]


def test_the_workspace_config_remote_is_the_session_default(machines: Machines) -> None:
    (machines.tmp / "a" / "config.toml").write_text(f'remote = "{machines.url}"\n')
    rpc = session(machines.cli("a"), TASK, "--run-id", "s2", *machines.args("a"))
    wrote = rpc.call("apply_patch", patch=FIX, idempotency_key="cfg-key-1")
    assert machines.remote_git("rev-parse", "gitrun/s2") == wrote["commit"]
    assert rpc.call("finish")["phase"] == "done"
    assert rpc.close() == Exit.DONE
    assert machines.writes_on_remote("s2") == ["cfg-key-1"]


def test_a_session_with_another_remote_than_the_run_s_own_is_refused(machines: Machines) -> None:
    a = machines.cli("a")
    local = session(a, TASK, "--run-id", "s3", *machines.args("a"))
    assert local.close() == Exit.AGENT_GONE  # a local run, left before finish
    refused = session(a, TASK, "--run-id", "s3", "--remote", machines.url, *machines.args("a"))
    assert refused.close() == Exit.BAD_INPUT
    assert "local run" in refused.stderr()


def _server_pid(run_id: str) -> int:
    """The `gitrun mcp ... --run-id RUN_ID` process (the MCP client's child)."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if b"mcp" in argv and run_id.encode() in argv and b"gitrun" in argv:
            return int(entry.name)
    raise AssertionError(f"no gitrun mcp process for {run_id}")


def test_gitrun_mcp_killed_on_machine_a_is_continued_on_machine_b(machines: Machines) -> None:
    pytest.importorskip("mcp")
    import anyio
    import mcp_types as types
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    def server(machine: str, *extra: str) -> StdioServerParameters:
        args = ["mcp", TASK, "--run-id", "m1", "--remote", machines.url, *extra]
        return StdioServerParameters(
            command=sys.executable, args=["-m", "gitrun", *args, *machines.args(machine)],
            env=machines.cli(machine).env(**FAST), cwd=str(machines.tmp),
        )  # fmt: skip

    async def call(s: ClientSession, name: str, **arguments: object) -> dict[str, object]:
        result = await s.call_tool(name, arguments)
        block = result.content[0]
        assert not result.is_error, result
        assert isinstance(block, types.TextContent)
        out: dict[str, object] = json.loads(block.text)
        return out

    written: list[dict[str, object]] = []
    note = {"path": "stats/n.py", "content": "A = 1\n", "idempotency_key": "mcp-key-1"}

    async def on_a() -> None:
        async with (
            stdio_client(server("a", "--lease-seconds", "600")) as (r, w),
            ClientSession(r, w) as s,
        ):
            await s.initialize()
            written.append(await call(s, "write_file", **note))
            assert machines.remote_git("rev-parse", "gitrun/m1") == written[0]["commit"]
            os.kill(_server_pid("m1"), signal.SIGKILL)  # mid-session, its lease held
            with anyio.fail_after(10):
                await s.call_tool("observe", {})

    async def on_b() -> None:
        with anyio.fail_after(90):
            async with (
                stdio_client(server("b", "--takeover-after", "0")) as (r, w),
                ClientSession(r, w) as s,
            ):
                await s.initialize()
                again = await call(s, "write_file", **note)
                assert (again["replayed"], again["commit"]) == (True, written[0]["commit"])
                await call(s, "apply_patch", patch=FIX, idempotency_key="mcp-key-2")
                assert (await call(s, "finish"))["phase"] == "done"

    with pytest.raises(Exception):  # noqa: B017 - whatever the SDK raises for a dead server
        anyio.run(on_a)
    assert machines.writes_on_remote("m1") == ["mcp-key-1"]
    anyio.run(on_b)
    assert machines.writes_on_remote("m1") == ["mcp-key-1", "mcp-key-2"]  # each key landed once
    assert machines.cache_tip("b", "m1") == machines.remote_git("rev-parse", "gitrun/m1")
