#!/usr/bin/env python3
"""A stdlib-only agent that fixes the fix-median sandbox through gitrun's session protocol.

It speaks JSON-RPC 2.0, one JSON object per line, on its stdin/stdout: run it with

    gitrun run sandboxes/fix-median --agent cmd:'python3 examples/agents/median_agent.py'

or connect it to `gitrun session sandboxes/fix-median` yourself. It looks before it acts,
so after any crash (its own or gitrun's) it can simply be started again: it reads the
file at HEAD, writes the fix only if the bug is still there, and its write carries its
own idempotency key, so a retry whose answer was lost is answered with the original
receipt (`replayed: true`) instead of writing twice.
"""

from __future__ import annotations

import json
import sys
from typing import Any

BUGGY = "    return data[mid]\n"
FIXED = "    return (data[mid - 1] + data[mid]) / 2\n"
KEY = "median-agent-fix-1"


class Client:
    """One request per line out, one response per line in."""

    def __init__(self) -> None:
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        msg = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            sys.exit("median_agent: gitrun closed the session")
        reply = json.loads(line)
        if "error" in reply:
            err = reply["error"]
            raise RuntimeError(f"{method}: {err['data']['rule']}: {err['message']}")
        result: dict[str, Any] = reply["result"]
        return result


def log(text: str) -> None:
    print(f"median_agent: {text}", file=sys.stderr, flush=True)


def main() -> int:
    rpc = Client()
    hello = rpc.call("initialize", protocol="gitrun/1", client={"name": "median_agent"})
    log(f"run {hello['run_id']}: {hello['task']['title'][:60]}")
    seen = rpc.call("observe")
    log(f"phase {seen['phase']}, {seen['receipt_count']} writes so far")
    hits = rpc.call("search", pattern="def median", glob="**/*.py")["matches"]
    path = hits[0]["path"]
    source = rpc.call("read_file", path=path)["content"]
    lines = source.splitlines(keepends=True)
    if lines and lines[-1] == BUGGY:  # the even-length branch returns the upper middle value
        fixed = "".join(lines[:-1]) + FIXED
        receipt = rpc.call("write_file", path=path, content=fixed, idempotency_key=KEY)
        log(f"wrote {path}: commit {receipt['commit'][:12]} (replayed: {receipt['replayed']})")
    else:
        log(f"{path} is already fixed at HEAD")
    tests = rpc.call("run_tests")
    log(f"tests: {tests['summary']}")
    end = rpc.call("finish")
    log(f"finished: {end['phase']} ({end['stop_reason']})")
    return 0 if end["phase"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
