"""Rollouts as gitrun runs on Ray: an RL-style loop scores candidate fixes by their verdicts.

Each rollout is one gitrun run of the bundled ``sandboxes/fix-median`` task, run as a Ray
task: a session callback (the "policy") reads the buggy function through the run's
session, writes its candidate fix as one receipted step and asks for the verdict. The
loop gets each run's outcome back (phase, verdict, receipts) and turns it into a reward.

    pip install 'gitrun[ray]'
    python examples/ray/rollouts.py            # a local Ray cluster of 2 CPUs
    python examples/ray/rollouts.py --address auto   # the cluster this machine is part of

Every node needs this checkout (the task directory) at the same path; the runs' state
stays in a temporary workspace here (pass --workspace to keep it).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from gitrun.integrations.ray_runs import AgentRun, run_many
from gitrun.integrations.session_client import SessionClient, step_key

TASK = Path(__file__).resolve().parents[2] / "sandboxes" / "fix-median"
BUGGY = "    return data[mid]\n"
CANDIDATES = [  # what a policy might propose for the even-length branch
    "    return (data[mid - 1] + data[mid]) / 2\n",  # right
    "    return data[mid - 1]\n",  # the lower middle value: wrong
    "    return (data[mid - 1] + data[mid]) // 2\n",  # integer division: wrong for 1, 2
    "    return sum(data[mid - 1 : mid + 1]) / 2\n",  # right, another way
]


@dataclass(frozen=True)
class Policy:
    """One rollout's agent: replace the buggy line by ``line``, then finish."""

    line: str

    def __call__(self, client: SessionClient) -> None:
        client.request("initialize", {"protocol": "gitrun/1", "client": {"name": "rollout"}})
        path = client.request("search", {"pattern": "def median", "glob": "**/*.py"})["matches"]
        source = client.request("read_file", {"path": path[0]["path"]})["content"]
        head, _, last = source.rstrip("\n").rpartition("\n")
        if last + "\n" == BUGGY:  # the even-length branch; a retried rollout finds it written
            params = {"path": path[0]["path"], "content": f"{head}\n{self.line}"}
            key = step_key("rollout", 1, "", params)
            client.request("write_file", params | {"idempotency_key": key})
        client.request("finish")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="the Ray cluster (default: a local one)")
    parser.add_argument("--workspace", type=Path, help="where the runs' state stays")
    parser.add_argument("--rollouts", type=int, default=len(CANDIDATES), help="how many")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gitrun-rollouts-") as tmp:
        ws = args.workspace or Path(tmp)
        batch = uuid.uuid4().hex[:8]
        candidates = CANDIDATES[: args.rollouts]
        runs = [
            AgentRun(
                str(TASK),
                f"rollout-{batch}-{i}",
                workspace=str(ws),
                key_file=str(ws / "checkpoint.keyring"),
                isolation="auto",
            )
            for i in range(len(candidates))
        ]
        started = time.monotonic()
        outcomes = run_many(runs, [Policy(line) for line in candidates], address=args.address,
                            local_cpus=2)  # fmt: skip
        for line, out in zip(candidates, outcomes, strict=True):
            print(f"reward {out.reward:.0f}  {out.phase:6}  {len(out.receipts)} receipt(s)  "
                  f"{out.summary[:40]:40}  {line.strip()}")  # fmt: skip
        print(f"{len(outcomes)} rollouts in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
