"""A confined agent keeps the host network, so on a ``--remote`` run it can reach the
remote itself: it pushes the run's checkpoint ref back to an older, validly signed
checkpoint. The machine that ran the run must refuse that rollback on its next read,
naming both generations, rather than resume (or report) the older state."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import SANDBOXES, Gitrun
from remote_helpers import Daemon, hermetic_git

from gitrun.core.errors import Exit

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
]
AGENT = Path(__file__).resolve().parent / "session_agents" / "rollback_agent.py"
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _rolled_back_run(gitrun: Gitrun, url: str, run_id: str) -> dict[str, Any]:
    """Run fix-median on ``url`` with the rollback agent; what the agent did."""
    agent = f"cmd:{sys.executable} {AGENT} {url} {run_id}"
    res = gitrun.run(
        ["run", str(SANDBOXES / "fix-median"), "--run-id", run_id, "--remote", url,
         "--agent", agent],
        FAST,
    )  # fmt: skip
    lines = [ln for ln in res.err.splitlines() if ln.startswith("ROLLBACK ")]
    assert lines, res.err
    found: dict[str, Any] = json.loads(lines[0].removeprefix("ROLLBACK "))
    assert "failed" not in found, found  # the push itself works: the agent has the network
    assert found["dropped"] >= 2, found
    return found


def test_an_agent_that_pushes_the_remote_checkpoint_back_is_refused_on_resume(
    gitrun: Gitrun, git_daemon: Daemon
) -> None:
    url = git_daemon.bare()
    found = _rolled_back_run(gitrun, url, "rb")
    bare = git_daemon.path_url()
    assert hermetic_git(f"--git-dir={bare}", "rev-parse", found["ref"]).strip() == found["to"]
    status = gitrun.run(["status", "rb", "--json"], FAST)
    assert status.code == 0, status.err  # status reports the refusal, as for a local run
    said = json.loads(status.out)["checkpoint_error"]
    assert said.startswith("checkpoint rejected (rolled-back)"), said
    assert found["from"] in said  # it names what the ref held before it was moved back
    resumed = gitrun.run(["resume", "rb"], FAST)
    assert resumed.code == Exit.REFUSED, resumed.err
    assert resumed.err.startswith("gitrun: checkpoint rejected (rolled-back)"), resumed.err
    # Nothing was changed by the refusals: the remote still holds the rolled-back ref.
    assert hermetic_git(f"--git-dir={bare}", "rev-parse", found["ref"]).strip() == found["to"]
    verified = gitrun.run(["checkpoint", "verify", "rb"], FAST)
    assert verified.code == Exit.REFUSED, verified.err
    assert "rolled-back" in verified.err
    # A human who restored the remote on purpose accepts it, naming its generation.
    gen = int(said.split("--generation ")[1].split()[0])
    accepted = gitrun.run(["checkpoint", "rewitness", "rb", "--generation", str(gen)], FAST)
    assert accepted.code == 0, accepted.err
    assert (
        json.loads(gitrun.run(["status", "rb", "--json"], FAST).out).get("checkpoint_error") is None
    )
