"""The external agent gitrun starts (`--agent cmd:`) runs confined like exec steps: a
hostile agent cannot read the keyring, write the repository's refs, see the worktree or
the workspace, or write the user's files — and its run ends as its protocol calls say."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, SANDBOXES, Gitrun, git
from test_exec import task_with

AGENTS = Path(__file__).resolve().parent / "session_agents"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def _thief(
    gitrun: Gitrun, run_id: str, *options: str, **env: str
) -> tuple[int, dict[str, Any], str]:
    """Run the thief agent on fix-median; what it managed, and gitrun's stderr."""
    repo = gitrun.repo("fix-median")  # made by the first run; its path is known in advance
    keyring = Path(env.get("GITRUN_KEY_FILE", gitrun.home / "keys" / "checkpoint.keyring"))
    argv = [
        sys.executable, str(AGENTS / "thief_agent.py"), str(keyring), str(repo / ".git"),
        str(gitrun.home / "worktrees" / run_id), str(gitrun.home), str(repo), run_id,
    ]  # fmt: skip
    res = gitrun(
        "run", str(SANDBOXES / "fix-median"), "--agent", "cmd:" + " ".join(argv),
        "--run-id", run_id, *options, **env,
    )  # fmt: skip
    lines = [ln for ln in res.err.splitlines() if ln.startswith("THIEF ")]
    assert lines, res.err
    return res.code, json.loads(lines[0].removeprefix("THIEF ")), res.err


def _status(gitrun: Gitrun, run_id: str) -> dict[str, Any]:
    res = gitrun("status", run_id, "--json")
    assert res.code == 0, res.err
    info: dict[str, Any] = json.loads(res.out)
    return info


@needs_bwrap
def test_a_confined_agent_cannot_steal_the_key_write_refs_or_see_the_worktree(
    gitrun: Gitrun,
) -> None:
    assert gitrun("run", str(SANDBOXES / "fix-median"), "--run-id", "warm").code in (0, 1)
    repo = gitrun.repo("fix-median")
    code, found, err = _thief(gitrun, "thief")
    assert code == 0, err  # the verdict is the protocol's: the fix passes
    assert str(found["keyring"]).startswith("failed"), found
    assert str(found["update_ref"]).startswith("failed"), found
    assert str(found["worktree"]).startswith("failed"), found
    assert found["workspace"] == [] or str(found["workspace"]).startswith("failed"), found
    assert str(found["plant"]).startswith("failed"), found
    assert found["home"] == 1, found  # HOME is usable: a private, writable directory
    assert found["gitrun_vars"] == []
    assert found["interfaces"] == sorted(name for _, name in socket.if_nameindex())  # kept
    assert git(repo, "for-each-ref", "refs/gitrun/runs/thief/stolen") == ""
    assert not (repo / "planted.txt").exists()
    info = _status(gitrun, "thief")
    assert info["phase"] == "done"
    assert info["agent_isolation"] == {"kind": "bwrap", "network": "host"}
    assert "isolation: bwrap, network host" in err


@needs_bwrap
def test_a_key_file_beside_the_agents_working_directory_is_blanked(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    key = tmp_path / "checkpoint.keyring"  # in the directory the agent starts in
    assert gitrun("run", str(SANDBOXES / "fix-median"), "--run-id", "warm",
                  GITRUN_KEY_FILE=str(key)).code in (0, 1)  # fmt: skip
    code, found, err = _thief(gitrun, "keyed", GITRUN_KEY_FILE=str(key))
    assert code == 0, err
    assert found["keyring"] == 0, found  # an empty file over it, not the key
    assert found["cwd"] == str(tmp_path)  # the agent still starts where gitrun was started
    assert key.stat().st_size > 0


@needs_bwrap
def test_the_agent_network_can_be_cut_to_loopback(gitrun: Gitrun) -> None:
    assert gitrun("run", str(SANDBOXES / "fix-median"), "--run-id", "warm").code in (0, 1)
    code, found, err = _thief(gitrun, "offline", GITRUN_AGENT_NETWORK="none")
    assert code == 0, err
    assert found["interfaces"] == ["lo"]
    assert _status(gitrun, "offline")["agent_isolation"] == {
        "kind": "bwrap",
        "network": "loopback",
    }


def test_an_unconfined_agent_is_said_and_recorded_and_can_read_the_keyring(
    gitrun: Gitrun,
) -> None:
    """`--isolation none` is what the README's threat model says: the user's rights."""
    assert gitrun("run", str(SANDBOXES / "fix-median"), "--run-id", "warm").code in (0, 1)
    code, found, err = _thief(gitrun, "open", "--isolation", "none")
    assert code == 0, err
    assert isinstance(found["keyring"], int), found  # exposed, as documented
    assert found["gitrun_vars"] == []  # still scrubbed
    info = _status(gitrun, "open")
    assert info["agent_isolation"] == {
        "kind": "none",
        "network": "host",
        "unconfined_because": "isolation none",
    }
    git(gitrun.repo("fix-median"), "update-ref", "-d", "refs/gitrun/runs/open/stolen")


def test_a_bad_agent_network_setting_is_refused_before_anything_runs(gitrun: Gitrun) -> None:
    res = gitrun("run", str(SANDBOXES / "fix-median"), "--agent", "cmd:true",
                 GITRUN_AGENT_NETWORK="bogus")  # fmt: skip
    assert res.code == 2, res.err
    assert res.err.startswith("gitrun: GITRUN_AGENT_NETWORK must be one of host, none")
    assert not (gitrun.home / "runs").exists()


def test_without_bubblewrap_required_refuses_to_start_the_agent_and_auto_warns(
    gitrun: Gitrun,
) -> None:
    agent = f"cmd:{sys.executable} {ROOT / 'examples/agents/median_agent.py'}"
    task = str(SANDBOXES / "fix-median")
    refused = gitrun("run", task, "--agent", agent, "--run-id", "req", "--isolation", "required",
                     GITRUN_BWRAP="/nonexistent")  # fmt: skip
    assert refused.code == 5, refused.err
    assert "gitrun: agent isolation is required but bubblewrap cannot run here" in refused.err
    assert "the agent was not started: then gitrun resume req" in refused.err
    assert "median_agent" not in refused.err  # it never started
    warned = gitrun("run", task, "--agent", agent, "--run-id", "auto", GITRUN_BWRAP="/nonexistent")
    assert warned.code == 0, warned.err
    assert "the agent runs UNCONFINED" in warned.err
    assert _status(gitrun, "auto")["agent_isolation"]["kind"] == "none"


@needs_bwrap
def test_a_confined_agent_cannot_read_another_runs_scratch_output(
    gitrun: Gitrun, sandbox_copy: Callable[[str], Path], tmp_path: Path,
    reap: list[subprocess.Popen[str]],
) -> None:  # fmt: skip
    """Run A's exec prints a marker into its scratch output files while it sleeps; run
    B's agent sees the host's temp dir (read-only) and reads all it can there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "control.txt").write_text("CONTROL-WORD\n")  # proves the agent can read tmp at all
    marker = f"MARKER-{uuid.uuid4().hex}"
    task = task_with(sandbox_copy, [{"command": f"echo {marker}; echo {marker} >&2; sleep 8"}],
                     exec_table='allow = ["*"]')  # fmt: skip
    run_a = gitrun.popen("run", str(task), "--run-id", "a", TMPDIR=str(tmp))
    reap.append(run_a)
    deadline = time.monotonic() + 60
    while not _holding(tmp, marker):
        assert run_a.poll() is None, run_a.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    median = ROOT / "examples" / "agents" / "median_agent.py"
    agent = f"cmd:{sys.executable} {AGENTS / 'snoop_agent.py'} {tmp} {marker} CONTROL-WORD {median}"
    res = gitrun("run", str(SANDBOXES / "fix-median"), "--agent", agent, "--run-id", "b",
                 "--isolation", "required", TMPDIR=str(tmp))  # fmt: skip
    lines = [ln for ln in res.err.splitlines() if ln.startswith("SNOOP ")]
    assert lines, res.err
    seen = json.loads(lines[0].removeprefix("SNOOP "))
    assert seen["control"] == [str(tmp / "control.txt")], seen
    assert seen["found"] == [], seen
    assert res.code == 0, res.err
    _, err = run_a.communicate(timeout=90)
    assert run_a.returncode in (0, 1), err


def _holding(directory: Path, marker: str) -> bool:
    """Whether any file under ``directory`` holds ``marker`` (as the test sees it)."""
    for parent, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                if marker.encode() in (Path(parent) / name).read_bytes():
                    return True
    return False
