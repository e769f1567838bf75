"""A hostile agent on a ``--remote`` run: it solves fix-median through the protocol,
then, with the host network every agent keeps, pushes the remote's checkpoint ref back
to the run's first (validly signed, older) checkpoint and the branch back to its base,
with plain ``git push --force``.
It reports what it did on stderr (``ROLLBACK {json}``).

argv: REMOTE_URL RUN_ID
"""

import json
import os
import subprocess
import sys
from typing import Any

URL, RUN_ID = sys.argv[1:3]
FIX_FILE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "sandboxes", "fix-median",
    "patches", "fix.diff",
)  # fmt: skip
ids = iter(range(1, 1000))


def call(method: str, **params: object) -> Any:
    msg = {"jsonrpc": "2.0", "id": next(ids), "method": method, "params": params}
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()
    reply = json.loads(sys.stdin.readline())
    if "error" in reply:
        sys.exit(f"rollback_agent: {method}: {reply['error']['message']}")
    return reply["result"]


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {args[0]}: {done.stderr.strip()[:200]}")
    return done.stdout


def roll_back() -> dict[str, Any]:
    """Point the remote's checkpoint ref at the oldest checkpoint of its chain."""
    scratch = os.path.join(os.environ["HOME"], "scratch.git")
    git("init", "--quiet", "--bare", scratch)
    listed = git("ls-remote", URL, f"refs/gitrun/runs/{RUN_ID}/*").split("\n")
    refs = [ln.split("\t")[1] for ln in listed if "/checkpoints/" in ln]
    ref = refs[0]
    git("--git-dir", scratch, "fetch", "--quiet", URL, f"+{ref}:{ref}")
    chain = git("--git-dir", scratch, "rev-list", "--first-parent", ref).split()
    branch = f"refs/heads/gitrun/{RUN_ID}"
    git("--git-dir", scratch, "fetch", "--quiet", URL, f"+{branch}:{branch}")
    log = git("--git-dir", scratch, "log", "--format=%H %s", branch).splitlines()
    base = next(line.split()[0] for line in log if not line.split(" ", 1)[1].startswith("gitrun:"))
    git("--git-dir", scratch, "push", "--quiet", "--force", "--atomic", URL,
        f"{chain[-1]}:{ref}", f"{base}:{branch}")  # fmt: skip
    return {"ref": ref, "from": chain[0], "to": chain[-1], "dropped": len(chain) - 1}


call("observe")
with open(FIX_FILE) as patch:
    call("apply_patch", patch=patch.read(), idempotency_key="rollback-fix-1")
call("finish")
try:
    found: dict[str, Any] = roll_back()
except Exception as exc:  # a hostile agent reports what it could not do
    found = {"failed": f"{type(exc).__name__}: {exc}"}
print("ROLLBACK " + json.dumps(found), file=sys.stderr, flush=True)
sys.stdin.readline()
