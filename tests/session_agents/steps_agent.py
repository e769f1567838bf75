"""A test agent: writes stats/gen_<i>.py for i < N, each under its own key, choosing the
next one from HEAD (so a restarted agent carries on), then finishes.

argv: PIDFILE N [DELAY]. It records its pid so a test can SIGKILL it.
"""

import json
import os
import sys
import time
from typing import Any

PIDFILE, COUNT = sys.argv[1], int(sys.argv[2])
DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
ids = iter(range(1, 1_000_000))


def call(method: str, **params: object) -> Any:
    msg = {"jsonrpc": "2.0", "id": next(ids), "method": method, "params": params}
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        sys.exit(3)
    reply = json.loads(line)
    if "error" in reply:
        sys.exit(f"steps_agent: {method}: {reply['error']['message']}")
    return reply["result"]


try:
    with open(PIDFILE, "a") as f:
        f.write(f"{os.getpid()}\n")
except OSError:
    pass  # confined: nothing outside its private HOME is writable (tests find it by argv)
call("observe")
have = {f["path"] for f in call("list_files", glob="stats/gen_*.py")["files"]}
for i in range(COUNT):
    path = f"stats/gen_{i}.py"
    if path in have:
        continue
    call("write_file", path=path, content=f"VALUE = {i}\n", idempotency_key=f"gen-step-{i:04d}")
    time.sleep(DELAY)
call("finish")
