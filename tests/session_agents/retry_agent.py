"""A test agent that kills itself right after sending a write (never reading the answer),
then, started again by `gitrun resume`, retries the same write with the same key and
records the answer in OUT.

argv: MARKER OUT
"""

import json
import os
import signal
import sys

MARKER, OUT = sys.argv[1], sys.argv[2]
WRITE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "write_file",
    "params": {
        "path": "stats/retry.py",
        "content": "RETRIED = True\n",
        "idempotency_key": "retry-agent-write-1",
    },
}

sys.stdout.write(json.dumps(WRITE) + "\n")
sys.stdout.flush()
if not os.path.exists(MARKER):
    open(MARKER, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)  # lost: the answer, and the agent with it
with open(OUT, "w") as f:
    f.write(sys.stdin.readline())
sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "finish"}) + "\n")
sys.stdout.flush()
sys.stdin.readline()
