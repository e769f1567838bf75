"""mini-swe-agent's own DefaultAgent and deterministic test model solve sandboxes/rename-api
on a gitrun run: each command is one exec step (a receipt commit), the submit runs the
verifier. No LLM, no network.  Usage: python examples/minisweagent_rename.py [WORKSPACE]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.agents.default import DefaultAgent
from minisweagent.models.test_models import DeterministicModel, make_output

from gitrun.integrations.minisweagent import GitrunEnvironment

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [
    "grep -rn calc_area geometry",  # the task's policy allows only `sed -i`: refused
    "sed -i 's/calc_area/circle_area/g' geometry/shapes.py",
    "sed -i 's/calc_area/circle_area/g' geometry/__init__.py geometry/report.py geometry/totals.py",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
]


def agent_for(env: GitrunEnvironment, commands: list[str]) -> DefaultAgent:
    """The real DefaultAgent with the real test model replaying ``commands``."""
    outputs = [make_output(f"step {i}", [{"command": c}], cost=0.0) for i, c in enumerate(commands)]
    return DefaultAgent(
        DeterministicModel(outputs=outputs),  # type: ignore[no-untyped-call]
        env,
        system_template="You are a helpful assistant.",
        instance_template="{{task}}",
        step_limit=len(commands) + 2,
    )


def main(workspace: Path, run_id: str = "mini-rename") -> dict[str, Any]:
    env = GitrunEnvironment(
        task_dir=str(ROOT / "sandboxes" / "rename-api"), run_id=run_id, workspace=str(workspace)
    )
    agent = agent_for(env, COMMANDS)
    result: dict[str, Any] = agent.run("rename calc_area to circle_area across geometry/")
    for message in agent.messages[2:]:
        if message["role"] == "assistant":
            print("$", message["extra"]["actions"][0]["command"])
        elif message["role"] == "user":
            extra = message["extra"]
            commit = extra.get("gitrun_commit", "")[:12] or "-"
            print(f"  returncode {extra['returncode']}  receipt {commit}")
            if extra["raw_output"].strip():
                print("  " + extra["raw_output"].strip().replace("\n", "\n  "))
        else:
            print(message["content"].strip())
    return result


if __name__ == "__main__":
    place = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="gitrun-"))
    verdict = main(place)["gitrun"]
    sys.exit(0 if verdict["phase"] == "done" else 1)
