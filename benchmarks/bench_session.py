"""Latency of the session protocol: requests over a real `gitrun session`'s pipes.

A client process (this one) speaks JSON-RPC lines to a `gitrun session` subprocess on a
100-file repository and times each request from writing its line to reading the answer:
``observe``, ``read_file`` (a 2 KB file), ``write_file`` (a 2 KB file, one gated step:
intent checkpoint, fenced write; its receipt rides in the next checkpoint) and
``exec`` of ``true`` when the build has exec steps. The same run measures the in-process
runtime step (``Runtime.step`` + ``Runtime.execute_pending``, no protocol) on the same
layout, so the protocol's own cost reads as the difference. Requests of each kind are
interleaved round by round, so a change in disk speed hits all alike.

    python benchmarks/bench_session.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

from gitrun.core.records import ACTION_KINDS
from gitrun.engine.jsonrpc import Eof, Timeout, Transport

WARMUP = 5


class Client:
    """A `gitrun session` subprocess and a line-at-a-time JSON-RPC client of it."""

    def __init__(self, task_dir: str, home: str) -> None:
        env = {**os.environ, "GITRUN_HOME": home}
        self.log = open(os.path.join(home, "session.log"), "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gitrun", "session", task_dir, "--run-id", "bench",
             "--lease-seconds", "3600"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, bufsize=0,
        )  # fmt: skip
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("no pipes to the session")
        self.t = Transport(self.proc.stdout.fileno(), self.proc.stdin.fileno())
        self.n = 0

    def call(self, method: str, **params: Any) -> tuple[int, dict[str, Any]]:
        """(nanoseconds from sending the line to reading the answer, the answer)."""
        self.n += 1
        line = json.dumps({"jsonrpc": "2.0", "id": self.n, "method": method, "params": params})
        t0 = time.perf_counter_ns()
        self.t.send(json.loads(line))
        reply = self.t.read_line(120)
        dt = time.perf_counter_ns() - t0
        if isinstance(reply, Eof | Timeout):
            self.log.flush()
            tail = open(self.log.name, "rb").read()[-2000:].decode(errors="replace")  # noqa: SIM115
            raise EOFError(f"{method}: no answer from the session: {tail}")  # noqa: TRY004
        doc: dict[str, Any] = json.loads(reply)
        return dt, doc

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def measure(rounds: int) -> dict[str, c.Stats | None]:
    lay = c.Layout(10, 10)
    with c.bench_dir("session") as tmp:
        repo, base = c.make_repo(tmp / "repo", lay)
        # make_repo leaves the main worktree empty; `gitrun session` wants a clean one
        subprocess.run(["git", "-C", str(tmp / "repo"), "checkout", "-qf", "main"], check=True)
        task = c.make_task(tmp / "task", tmp / "repo", base)
        _allow_exec_of_true(Path(task.task_dir) / "task.toml")
        home = tmp / "home"
        home.mkdir()
        client = Client(task.task_dir, str(home))
        in_proc = c.start_run(
            repo, base, task, run_id="inproc", worktree=tmp / "wt-inproc",
            key_file=tmp / "keys" / "checkpoint.keyring",
            actions=c.write_actions(lay, rounds + WARMUP, salt="inproc"),
        )  # fmt: skip
        writes = c.write_actions(lay, rounds + WARMUP, salt="session")
        _, probe = client.call("exec", command="true")
        has_exec = "result" in probe
        samples: dict[str, list[int]] = {
            k: [] for k in ("observe", "read_file", "write_file", "exec", "step")
        }
        try:
            for i in range(rounds + WARMUP):
                a = writes[i]
                timings = {
                    "observe": client.call("observe")[0],
                    "read_file": client.call("read_file", path=c.file_path(0, 0))[0],
                    "write_file": _ok(client.call("write_file", path=a.path, content=a.content)),
                    "step": c.timed(lambda: c.runtime_step(in_proc.runtime)),
                }
                if has_exec:
                    timings["exec"] = _ok(client.call("exec", command="true"))
                if i >= WARMUP:
                    for k, v in timings.items():
                        samples[k].append(v)
        finally:
            client.close()
    return {k: (c.stats(v) if v else None) for k, v in samples.items()}


def _allow_exec_of_true(toml: Path) -> None:
    """The shared bench task, with exec allowed for ``true`` (when this build has exec)."""
    text = toml.read_text()
    if "exec" not in ACTION_KINDS:
        return
    text = text.replace('"apply_patch"]', '"apply_patch", "exec"]')
    text = text.replace(
        'forbidden_paths = ["tests/**"]\n',
        'forbidden_paths = ["tests/**"]\n\n'
        '[policy.exec]\nallow = ["true"]\nmax_timeout_seconds = 30\n',
    )
    toml.write_text(text)


def _ok(answer: tuple[int, dict[str, Any]]) -> int:
    dt, doc = answer
    if "result" not in doc:
        raise RuntimeError(f"the session refused a benchmark write: {doc.get('error')}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 30 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="requests of each kind (200)")
    args = ap.parse_args()
    rounds = args.rounds or (30 if args.quick else 200)
    print(f"session benchmark: {c.machine_line()}")
    print(f"fsync on; {rounds} requests of each kind over the pipes, 100-file repository")
    pressure = c.Pressure()
    res = measure(rounds)
    step = res["step"]
    names = {
        "observe": "`observe`",
        "read_file": "`read_file` (2 KB)",
        "write_file": "`write_file` (2 KB; one gated step)",
        "exec": "`exec` of `true`",
        "step": "in-process runtime step (no protocol), same run",
    }
    lines = ["| request | median ms | p95 ms | median vs in-process step |", "|---|---:|---:|---:|"]
    for key, label in names.items():
        st = res[key]
        if st is None:
            lines.append(f"| {label} | — | — | not in this build |")
            continue
        ratio = st.median_ms / step.median_ms if step is not None and step.median_ms else 0.0
        lines.append(f"| {label} | {st.cells()} | {ratio:.2f}x |")
    c.markdown_block("session", lines, pressure)


if __name__ == "__main__":
    main()
