"""mini-swe-agent as its users run it (issue #30): its own SWE-bench config and prompt flow
(``git diff -- FILE > patch.txt``, then ``cat patch.txt`` as the submission) with the real
DefaultAgent, its own CLI ``mini`` with each shipped config, and an agent killed (its whole
process group, SIGKILL) and started again on the same run, which replays instead of
running its commands twice. Real gitrun, real git, bubblewrap when the machine has it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip("minisweagent")

from conftest import ROOT, SANDBOXES, git
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir, get_config_from_spec
from minisweagent.models.test_models import DeterministicModel, make_output

from gitrun.adapter import sandbox
from gitrun.integrations.minisweagent import GitrunEnvironment

pytestmark = pytest.mark.timeout(300)
BWRAP = sandbox.bwrap_path() is not None and sandbox.bwrap_works(sandbox.bwrap_path() or "")
ISOLATION = "required" if BWRAP else "none"
GOLD = (SANDBOXES / "fix-median" / "model.patch").read_text()
PATCH = f"patch -p1 <<'GOLD'\n{GOLD}GOLD"
FLOW = [
    "grep -n 'return data' stats/median.py",
    PATCH,
    'pwd && echo "pager=$PAGER"',
    "git status --short && git diff -- stats/median.py > patch.txt",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt",
]
ENVIRONMENT_CLASS = "gitrun.integrations.minisweagent.GitrunEnvironment"
# Every config mini-swe-agent ships (the extra/ ones are for its other tools).
CONFIGS = sorted(
    str(p.relative_to(builtin_config_dir))
    for p in [*builtin_config_dir.glob("*.yaml"), *builtin_config_dir.glob("benchmarks/*.yaml")]
)
# swebench_modal.yaml holds only the environment and model: mini's docs put it after
# swebench.yaml (-c swebench.yaml -c swebench_modal.yaml).
ON_TOP = {"benchmarks/swebench_modal.yaml": ["swebench.yaml"]}
AGENT = """import json, os, sys
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.models.test_models import DeterministicModel, make_output
from gitrun.integrations.minisweagent import GitrunEnvironment
spec = json.loads(sys.argv[1])
config = get_config_from_spec("swebench.yaml")
environment = {**config["environment"], **spec["environment"]}
environment.pop("environment_class")
env = GitrunEnvironment(**environment)
commands = spec["commands"]
outputs = [make_output(f"step {i}", [{"command": c}], cost=0.0) for i, c in enumerate(commands)]
template = config["model"]["observation_template"]
model = DeterministicModel(outputs=outputs, observation_template=template)
agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": len(outputs)})
result = agent.run("fix median")
observed = [m.get("extra", {}) for m in agent.messages if m["role"] == "user"][1:]
print(json.dumps({"result": result, "observed": observed}, default=str))
"""


@pytest.fixture
def task(tmp_path: Path) -> Path:
    """The bundled fix-median task, its agent allowed shell commands and a patch.txt."""
    import shutil

    task = tmp_path / "fix-median"
    shutil.copytree(SANDBOXES / "fix-median", task)
    toml = task / "task.toml"
    text = toml.read_text()
    text = text.replace(
        'allowed_actions = ["write_file", "delete_file", "apply_patch"]',
        'allowed_actions = ["write_file", "delete_file", "apply_patch", "exec"]',
    ).replace('write_allowlist = ["stats/**"]', 'write_allowlist = ["stats/**", "patch.txt"]')
    text = text.replace(
        "[verifier]", '[policy.exec]\nallow = ["*"]\nmax_timeout_seconds = 30\n\n[verifier]'
    )
    toml.write_text(text)
    return task


def repo_of(workspace: Path) -> Path:
    return workspace / "repos" / "fix-median"


def fix_diff(workspace: Path, run_id: str) -> str:
    """The run's change to stats/median.py as git shows it outside the sandbox."""
    record = json.loads((workspace / "runs" / f"{run_id}.json").read_text())
    repo = repo_of(workspace)
    return git(repo, "diff", record["base_commit"], f"gitrun/{run_id}", "--", "stats/median.py")


def keys_on(workspace: Path, run_id: str) -> list[str]:
    fmt = "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)"
    log = git(repo_of(workspace), "log", "--reverse", fmt, f"gitrun/{run_id}", "--", check=False)
    return [line.strip() for line in log.splitlines() if line.strip()]


def test_minis_swebench_flow_submits_the_real_diff_from_git_inside_the_sandbox(
    task: Path, tmp_path: Path
) -> None:
    config = get_config_from_spec("swebench.yaml")
    environment = {k: v for k, v in config["environment"].items() if k != "environment_class"}
    assert environment["cwd"] == "/testbed"  # its own keys, as shipped
    assert {"env", "timeout", "interpreter"} <= set(environment)
    workspace = tmp_path / "ws"
    env = GitrunEnvironment(
        **environment, task_dir=str(task), run_id="swe", workspace=str(workspace),
        isolation=ISOLATION, lease_seconds=5,
    )  # fmt: skip
    outputs = [make_output(f"step {i}", [{"command": c}], cost=0.0) for i, c in enumerate(FLOW)]
    model = DeterministicModel(  # type: ignore[no-untyped-call]
        outputs=outputs, observation_template=config["model"]["observation_template"]
    )
    agent = DefaultAgent(model, env, **config["agent"])
    result = agent.run("median() is wrong for even-length input")
    assert result["exit_status"] == "Submitted", agent.messages[-1]["content"]
    verdict = result["gitrun"]
    assert verdict["phase"] == "done", verdict
    assert verdict["verifier"]["passed"] is True
    diff = fix_diff(workspace, "swe")
    assert diff.startswith("diff --git a/stats/median.py b/stats/median.py\n")
    assert result["submission"] == diff  # git diff in the step wrote the run's real change
    observed = [m.get("extra", {}) for m in agent.messages if m["role"] == "user"][1:]
    where = json.loads((workspace / "runs" / "swe.json").read_text())["worktree"]
    assert observed[2]["raw_output"] == f"{where}\npager=cat\n"  # cwd /testbed: the root
    assert observed[3]["raw_output"] == " M stats/median.py\n"
    assert observed[3]["returncode"] == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_minis_own_cli_runs_with_each_shipped_config(
    task: Path, tmp_path: Path, config: str
) -> None:
    workspace = tmp_path / "ws"
    outputs = [
        {"role": "assistant", "content": f"step {i}", "extra": {"actions": [{"command": c}],
         "cost": 0.0}}
        for i, c in enumerate(FLOW)
    ]  # fmt: skip
    traj = tmp_path / "traj.json"
    argv = [
        sys.executable, "-m", "minisweagent.run.mini",
        *[f for under in ON_TOP.get(config, []) for f in ("-c", under)], "-c", config,
        "-c", f"environment.task_dir={task}", "-c", f"environment.workspace={workspace}",
        "-c", "environment.run_id=cli", "-c", f"environment.isolation={ISOLATION}",
        "-c", "environment.lease_seconds=5", "-c", f"model.outputs={json.dumps(outputs)}",
        "--environment-class", ENVIRONMENT_CLASS,
        "--model-class", "minisweagent.models.test_models.DeterministicModel",
        "-m", "deterministic", "-t", "median() is wrong for even-length input",
        "-y", "--exit-immediately", "-o", str(traj),
    ]  # fmt: skip
    env = os.environ | {
        "MSWEA_CONFIGURED": "1",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mini-config"),
    }
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    info = json.loads(traj.read_text())["info"]
    assert info["exit_status"] == "Submitted", info
    assert info["submission"] == fix_diff(workspace, "cli")
    assert info["config"]["environment_type"] == ENVIRONMENT_CLASS
    assert info["gitrun"]["verdict"]["phase"] == "done"


def start_agent(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", AGENT, json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def test_an_agent_killed_with_its_process_group_and_started_again_replays_its_steps(
    task: Path, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    commands = [*FLOW[:2], "sleep 4", *FLOW[3:]]
    spec = {
        "commands": commands,
        "environment": {
            "task_dir": str(task), "run_id": "again", "workspace": str(workspace),
            "isolation": ISOLATION, "lease_seconds": 5, "takeover_after": 0,
        },
    }  # fmt: skip
    first = start_agent(spec)
    try:
        deadline = time.monotonic() + 120
        while len(keys_on(workspace, "again") if repo_of(workspace).exists() else []) < 2:
            if first.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(first.communicate())
            time.sleep(0.1)
        time.sleep(1.0)  # the third command (sleep) is running
        os.killpg(first.pid, signal.SIGKILL)  # the agent, its gitrun, the command: all
    finally:
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    patched = keys_on(workspace, "again")[1]
    second = start_agent(spec)
    out, err = second.communicate(timeout=240)
    assert second.returncode == 0, err[-3000:]
    answer = json.loads(out.splitlines()[-1])
    result, observed = answer["result"], answer["observed"]
    assert result["exit_status"] == "Submitted", result
    assert result["gitrun"]["phase"] == "done", result
    assert [o["gitrun_replayed"] for o in observed[:2]] == [True, True]  # grep, the patch
    assert observed[1]["gitrun_key"] == patched
    keys = keys_on(workspace, "again")
    assert len(keys) == len(set(keys)) == len(commands)  # the submit is a step too
    assert keys.count(patched) == 1  # the gold patch ran once
    tree = git(repo_of(workspace), "ls-tree", "-r", "--name-only", "gitrun/again").split()
    assert not [p for p in tree if p.endswith((".rej", ".orig"))], tree
    assert result["submission"] == fix_diff(workspace, "again")


def test_a_different_command_at_a_replayed_position_is_a_new_step_not_a_conflict(
    task: Path, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    base = {"task_dir": str(task), "run_id": "fork", "workspace": str(workspace),
            "isolation": ISOLATION, "lease_seconds": 5}  # fmt: skip
    one = ["grep -c return stats/median.py", "echo one > stats/one.txt"]
    first = start_agent({"commands": one, "environment": base})
    out, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1])["result"]["exit_status"] == "LimitsExceeded"
    two = [one[0], "echo two > stats/two.txt", PATCH, *FLOW[3:]]
    second = start_agent({"commands": two, "environment": base})
    out, err = second.communicate(timeout=240)
    assert second.returncode == 0, err[-3000:]
    answer = json.loads(out.splitlines()[-1])
    assert [o["gitrun_replayed"] for o in answer["observed"][:2]] == [True, False]
    assert answer["result"]["gitrun"]["phase"] == "done", answer["result"]
    keys = keys_on(workspace, "fork")
    assert [k.rsplit("-", 1)[0] for k in keys] == [
        "mini-00001", "mini-00002", "mini-00002", "mini-00003", "mini-00004", "mini-00005",
    ]  # fmt: skip
    tree = git(repo_of(workspace), "ls-tree", "-r", "--name-only", "gitrun/fork").split()
    assert {"stats/one.txt", "stats/two.txt"} <= set(tree)


def test_the_walkthrough_in_docs_agents_git_runs_as_printed(tmp_path: Path) -> None:
    """docs/agents-git.md's walkthrough, its commands as printed (but the venv set-up:
    this test runs in one), in the checkout, with mini's and gitrun's own entry points."""
    doc = (ROOT / "docs" / "agents-git.md").read_text()
    block = doc.split("### Walkthrough", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    assert lines[0].startswith("python3 -m venv")
    assert lines[1].startswith("pip install")
    env = os.environ | {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TMPDIR": str(tmp_path),  # where the walkthrough's mktemp makes its workspace
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mini-config"),
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(lines[2:])], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=240, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert "gitrun run mini-demo: done (8/8 required tests passed)" in said
    assert " M stats/median.py" in said
    receipts = [line for line in done.stdout.splitlines() if " mini-0000" in line]
    assert len(receipts) == 5, done.stdout
    assert "patch.txt" in receipts[3]
    assert "verifier on" in done.stdout
