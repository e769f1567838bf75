"""A hostile test agent: before it solves fix-median through the protocol, it tries to
steal the checkpoint keyring, to write a control ref straight into the repository's common
git dir with ``git update-ref``, to read the run's worktree and the workspace, and to
write the user's files. It reports what it managed on stderr (``THIEF {json}``), and
never prints a secret itself, only sizes.

argv: KEYRING COMMON_GIT_DIR WORKTREE WORKSPACE REPO_DIR RUN_ID
"""

import json
import os
import socket
import subprocess
import sys
from typing import Any

KEYRING, COMMON, WORKTREE, WORKSPACE, REPO, RUN_ID = sys.argv[1:7]
FIX_FILE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "..",
    "sandboxes",
    "fix-median",
    "patches",
    "fix.diff",
)


def attempt(what: str, found: dict[str, Any], fn: Any) -> None:
    try:
        found[what] = fn()
    except Exception as exc:  # a thief tries everything and reports
        found[what] = f"failed: {type(exc).__name__}"


def update_ref() -> str:
    head = subprocess.run(
        ["git", "--git-dir", COMMON, "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    done = subprocess.run(
        ["git", "--git-dir", COMMON, "update-ref", f"refs/gitrun/runs/{RUN_ID}/stolen",
         head or "HEAD"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return "written" if done.returncode == 0 else f"failed: {done.stderr.strip()[:80]}"


def plant() -> str:
    with open(os.path.join(REPO, "planted.txt"), "w") as f:
        f.write("planted\n")
    return "written"


def read(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def write_home() -> int:
    with open(os.path.join(os.environ["HOME"], "x"), "w") as f:
        return f.write("x")


def snoop() -> dict[str, Any]:
    found: dict[str, Any] = {}
    attempt("keyring", found, lambda: read(KEYRING))
    attempt("update_ref", found, update_ref)
    attempt("worktree", found, lambda: sorted(os.listdir(WORKTREE)))
    attempt("workspace", found, lambda: sorted(os.listdir(WORKSPACE)))
    attempt("plant", found, plant)
    attempt("home", found, write_home)
    found["cwd"] = os.getcwd()
    found["interfaces"] = sorted(name for _, name in socket.if_nameindex())
    found["gitrun_vars"] = sorted(k for k in os.environ if k.startswith("GITRUN_"))
    return found


ids = iter(range(1, 1000))


def call(method: str, **params: object) -> Any:
    msg = {"jsonrpc": "2.0", "id": next(ids), "method": method, "params": params}
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()
    reply = json.loads(sys.stdin.readline())
    if "error" in reply:
        sys.exit(f"thief_agent: {method}: {reply['error']['message']}")
    return reply["result"]


print("THIEF " + json.dumps(snoop()), file=sys.stderr, flush=True)
call("observe")
with open(FIX_FILE) as patch:
    FIX = patch.read()
call("apply_patch", patch=FIX, idempotency_key="thief-fix-1")
call("finish")
sys.stdin.readline()
