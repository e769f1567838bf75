"""mini-swe-agent on a gitrun run (issue #14): the real DefaultAgent and the real
deterministic test model drive GitrunEnvironment, each command one exec step, the
submit the verifier; SIGKILL of gitrun mid-run resumes to the uninterrupted tree."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip("minisweagent")

from conftest import SANDBOXES, git
from minisweagent.agents.default import DefaultAgent
from minisweagent.models.test_models import DeterministicModel, make_output

from gitrun.integrations.minisweagent import GitrunEnvironment

TASK = str(SANDBOXES / "rename-api")
SED = "sed -i 's/calc_area/circle_area/g' "
COMMANDS = [
    "grep -rn calc_area geometry",  # refused by the policy: an observation, not an exception
    SED + "geometry/shapes.py",
    SED + "geometry/__init__.py geometry/report.py geometry/totals.py",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
]
KEYS = ["mini-00002", "mini-00003"]  # the refused grep was position 1 and committed nothing
# A gitrun CLI that dies by SIGKILL at one fault point the first time it is started only.
CRASH_ONCE = """import os, sys
marker, point = sys.argv[1], sys.argv[2]
if not os.path.exists(marker):
    open(marker, "w").close()
    os.environ["GITRUN_CRASH_AT"] = point
os.execv(sys.executable, [sys.executable, "-m", "gitrun", *sys.argv[3:]])
"""


def environment(workspace: Path, **config: Any) -> GitrunEnvironment:
    return GitrunEnvironment(
        task_dir=TASK, run_id="mini", workspace=str(workspace), lease_seconds=5, **config
    )


def run_agent(env: GitrunEnvironment, commands: list[str]) -> tuple[DefaultAgent, dict[str, Any]]:
    """The real DefaultAgent with the real deterministic test model replaying ``commands``."""
    outputs = [make_output(f"step {i}", [{"command": c}], cost=0.0) for i, c in enumerate(commands)]
    model = DeterministicModel(outputs=outputs)  # type: ignore[no-untyped-call]
    agent = DefaultAgent(
        model, env, system_template="sys", instance_template="{{task}}",
        step_limit=len(commands) + 2,
    )  # fmt: skip
    return agent, agent.run("rename calc_area to circle_area")


def solve(
    workspace: Path, commands: list[str], **config: Any
) -> tuple[DefaultAgent, dict[str, Any]]:
    return run_agent(environment(workspace, **config), commands)


def branch(workspace: Path) -> tuple[list[str], str]:
    """The idempotency keys on gitrun/mini (oldest first, as PREFIX-POSITION: the chained
    digest that ends each key cut off) and its tree."""
    repo = workspace / "repos" / "rename-api"
    log = git(repo, "log", "--reverse", "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)",
              "gitrun/mini")  # fmt: skip
    tree = git(repo, "rev-parse", "gitrun/mini^{tree}").strip()
    keys = [line.strip() for line in log.splitlines() if line.strip()]
    assert all(re.fullmatch(r"mini-[0-9]{5}-[0-9a-f]{16}", k) for k in keys), keys
    return [k.rsplit("-", 1)[0] for k in keys], tree


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tree an uninterrupted run ends with."""
    workspace = tmp_path_factory.mktemp("reference")
    _, result = solve(workspace, COMMANDS)
    if result["gitrun"]["phase"] != "done":
        raise AssertionError(result)
    return branch(workspace)[1]


def test_the_real_agent_solves_the_sandbox_one_receipt_per_command(
    tmp_path: Path, reference: str
) -> None:
    agent, result = solve(tmp_path, COMMANDS)
    assert result["exit_status"] == "Submitted"
    verdict = result["gitrun"]
    assert verdict["phase"] == "done"
    assert verdict["verifier"]["passed"] is True
    assert verdict["verifier"]["summary"] == "4/4 required tests passed"
    refused, first, second = [m.get("extra", {}) for m in agent.messages if m["role"] == "user"][1:]
    assert refused["returncode"] == 5  # gitrun's exit code for a gate refusal
    assert "exec-not-allowed" in refused["raw_output"]
    assert "sed -i *" in refused["raw_output"]  # it names the rule the agent broke
    assert first["returncode"] == second["returncode"] == 0
    keys, tree = branch(tmp_path)
    assert keys == KEYS
    repo = tmp_path / "repos" / "rename-api"
    assert git(repo, "rev-parse", "gitrun/mini").strip() == second["gitrun_commit"]
    assert git(repo, "grep", "-c", "calc_area", "gitrun/mini", "--", "geometry", check=False) == ""
    assert tree == reference
    assert agent.env.close() == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("point", ["exec_running", "write_ref_moved", "after_file_sync"])
def test_gitrun_killed_inside_an_exec_step_resumes_and_the_agent_goes_on(
    tmp_path: Path, reference: str, point: str
) -> None:
    wrapper = tmp_path / "crash_once.py"
    wrapper.write_text(CRASH_ONCE)
    marker = str(tmp_path / "crashed")
    gitrun = [sys.executable, str(wrapper), marker, f"{point}:2"]  # inside the second step
    agent, result = solve(tmp_path / "ws", COMMANDS, gitrun=gitrun)
    env = agent.env
    assert isinstance(env, GitrunEnvironment)
    assert env.client.deaths == [-signal.SIGKILL]  # gitrun really died once, mid-step
    assert result["gitrun"]["phase"] == "done", result
    keys, tree = branch(tmp_path / "ws")
    assert keys == KEYS  # every key once: the retried step was not run twice
    assert tree == reference


def test_gitrun_sigkilled_while_the_agent_thinks_is_resumed_by_the_next_command(
    tmp_path: Path, reference: str
) -> None:
    thinking = [*COMMANDS[:2], "/sleep 1.5", *COMMANDS[2:]]  # the test model's own pause
    env = environment(tmp_path)

    def kill_after_the_first_receipt() -> None:
        deadline = time.monotonic() + 30
        while not branch(tmp_path)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(env.client.pid, signal.SIGKILL)  # gitrun waits for the next request

    killer = threading.Thread(target=kill_after_the_first_receipt, daemon=True)
    killer.start()
    _, result = run_agent(env, thinking)
    killer.join(timeout=30)
    assert env.client.deaths == [-signal.SIGKILL]
    assert result["gitrun"]["phase"] == "done", result
    keys, tree = branch(tmp_path)
    assert keys == KEYS
    assert tree == reference


def test_a_submit_command_runs_whole_as_an_exec_step_then_finishes_as_mini_does(
    tmp_path: Path, reference: str
) -> None:
    """As mini-swe-agent's own environments: the submit command runs (what follows the
    marker too), and it submits only if its output starts with the marker and it exit 0."""
    task = tmp_path / "rename-api"
    shutil.copytree(TASK, task)
    toml = task / "task.toml"
    allow = 'allow = ["sed -i *", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT *"]'
    toml.write_text(toml.read_text().replace('allow = ["sed -i *"]', allow))
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && "
    commands = [
        SED + "geometry/shapes.py",
        submit + "sed -i s/x/y/ geometry/no-such-file",  # exits 2: not a submit, mini goes on
        submit + SED + "geometry/__init__.py geometry/report.py geometry/totals.py"
        " && grep -c circle_area geometry/totals.py",
    ]
    env = GitrunEnvironment(
        task_dir=str(task), run_id="mini", workspace=str(tmp_path / "ws"), lease_seconds=5
    )
    agent, result = run_agent(env, commands)
    assert result["exit_status"] == "Submitted", result
    assert result["gitrun"]["phase"] == "done", result
    assert result["submission"] == "1\n"  # the output after the marker, as mini's
    failed = [m.get("extra", {}) for m in agent.messages if m["role"] == "user"][2]
    assert failed["returncode"] == 2
    keys, tree = branch(tmp_path / "ws")
    assert keys == ["mini-00001", "mini-00002", "mini-00003"]  # every command a step
    assert tree == reference
