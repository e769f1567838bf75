"""``gitrun session`` and ``gitrun mcp`` with ``--remote`` (issue #16) through the real CLI:
a session's writes and exec steps commit through a bare repository served by a real
``git daemon``; a session killed with SIGKILL on machine A is continued on machine B."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
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


class Machines:
    """Two workspaces (machines A and B), one keyring shared out of band, one remote."""

    def __init__(self, tmp: Path, daemon: Daemon) -> None:
        self.tmp = tmp
        self.url = daemon.bare()
        self.bare = Path(daemon.path_url())
        self.key = tmp / "shared.keyring"
        for name in ("a", "b"):
            (tmp / name).mkdir()

    def cli(self, machine: str) -> Gitrun:
        return Gitrun(self.tmp / machine)

    def args(self, machine: str) -> list[str]:
        return ["--workspace", str(self.tmp / machine), "--key-file", str(self.key)]

    def remote_git(self, *args: str) -> str:
        return hermetic_git(f"--git-dir={self.bare}", *args).strip()

    def keys(self, run_id: str) -> list[str]:
        """The idempotency keys of the write commits on the remote branch, oldest first."""
        out = self.remote_git(
            "log", "--reverse", "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)",
            f"gitrun/{run_id}",
        )  # fmt: skip
        return [line for line in out.split() if line]

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
    assert machines.keys("s1") == ["sess-key-1", "sess-key-2"]
    go_on = [RENAME, "--run-id", "s1", "--remote", machines.url, "--takeover-after", "0"]
    b = session(machines.cli("b"), *go_on, *machines.args("b"))
    assert b.call("observe")["head"]["commit"] == two["commit"]
    again = b.call("exec", command=SED + " geometry/report.py", idempotency_key="sess-key-2")
    assert again == {**two, "replayed": True}  # the client's retry on B: A's receipt
    rest = b.call("exec", command=SED + " geometry/*.py", idempotency_key="sess-key-3")
    assert machines.remote_git("rev-parse", "gitrun/s1") == rest["commit"]
    assert b.call("finish")["phase"] == "done"
    assert b.close() == Exit.DONE
    assert machines.keys("s1") == ["sess-key-1", "sess-key-2", "sess-key-3"]  # each once
    # Machine A, started again later, finds the run finished on B and writes nothing.
    late = machines.cli("a").run(["resume", "s1", *machines.args("a")], FAST)
    assert late.code == Exit.DONE, late.err
    assert machines.keys("s1") == ["sess-key-1", "sess-key-2", "sess-key-3"]


def test_the_workspace_config_remote_is_the_session_default(machines: Machines) -> None:
    (machines.tmp / "a" / "config.toml").write_text(f'remote = "{machines.url}"\n')
    rpc = session(machines.cli("a"), TASK, "--run-id", "s2", *machines.args("a"))
    wrote = rpc.call("apply_patch", patch=FIX, idempotency_key="cfg-key-1")
    assert machines.remote_git("rev-parse", "gitrun/s2") == wrote["commit"]
    assert rpc.call("finish")["phase"] == "done"
    assert rpc.close() == Exit.DONE
    assert machines.keys("s2") == ["cfg-key-1"]


def test_a_session_with_another_remote_than_the_run_s_own_is_refused(machines: Machines) -> None:
    a = machines.cli("a")
    local = session(a, TASK, "--run-id", "s3", *machines.args("a"))
    assert local.close() == Exit.AGENT_GONE  # a local run, left before finish
    refused = session(a, TASK, "--run-id", "s3", "--remote", machines.url, *machines.args("a"))
    assert refused.close() == Exit.BAD_INPUT
    assert "local run" in refused.stderr()


def test_gitrun_mcp_with_remote_commits_through_the_remote(machines: Machines) -> None:
    pytest.importorskip("mcp")
    import anyio
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    cli = machines.cli("a")
    server = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "gitrun",
            "mcp",
            TASK,
            "--run-id",
            "m1",
            "--remote",
            machines.url,
            *machines.args("a"),
        ],
        env=cli.env(**FAST),
        cwd=str(machines.tmp),
    )
    tips: list[str] = []

    async def go() -> None:
        with anyio.fail_after(90):
            async with (
                stdio_client(server) as (read, write),
                ClientSession(read, write) as s,
            ):
                await s.initialize()
                await s.call_tool("apply_patch", {"patch": FIX, "idempotency_key": "mcp-key-1"})
                tips.append(machines.remote_git("rev-parse", "gitrun/m1"))
                await s.call_tool("finish", {})

    anyio.run(go)
    assert machines.keys("m1") == ["mcp-key-1"]
    assert tips == [machines.cache_tip("a", "m1")]
