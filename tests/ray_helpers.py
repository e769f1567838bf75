"""A Ray cluster for the tests and benchmarks: started with ``ray start --head`` in its own
session, every process of it killed by pid afterwards (never ``ray stop``, which stops every
Ray cluster of the machine, or a kill by name)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid in pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        out.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(pid)
    return out


def tree(roots: set[int]) -> set[int]:
    """``roots`` and every process below them."""
    kids, seen, todo = children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += kids.get(pid, [])
    return seen


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def group(pgid: int) -> set[int]:
    out = set()
    for pid in pids():
        try:
            if os.getpgid(pid) == pgid:
                out.add(pid)
        except OSError:
            continue
    return out


def kill_cluster(pgid: int, temp: Path) -> None:
    """SIGKILL every process the cluster started (its group, and the workers below its
    raylet, each in a group of its own), by pid; wait until none is alive."""
    deadline = time.monotonic() + 20
    while True:
        left = {p for p in tree(group(pgid)) if alive(p)}
        left |= {p for p in pids() if str(temp) in cmdline(p) and alive(p)}
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray processes left: {sorted(left)}")
        time.sleep(0.2)


class Head:
    """A head node being started: :meth:`address` waits until it is up."""

    def __init__(self, temp: Path, starting: subprocess.Popen[str]) -> None:
        self.temp, self.starting = temp, starting

    def address(self) -> str:
        """The cluster's GCS address, once ``ray start`` has returned."""
        _, err = self.starting.communicate(timeout=90)
        if self.starting.returncode != 0:
            raise RuntimeError(f"ray start failed: {err[-800:]}")
        port = next((self.temp / "session_latest").glob("gcs_server_port_*")).read_text()
        return f"127.0.0.1:{port.strip()}"


@contextmanager
def ray_head(
    temp: Path, cpus: int, env: dict[str, str], resources: dict[str, float] | None = None
) -> Iterator[Head]:
    """Start a head node of ``cpus`` CPUs (and custom ``resources``) in the background
    (session files under ``temp``: keep it short, Ray's socket paths must fit); everything
    it started is killed on exit."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    starting = subprocess.Popen(
        [ray_cli, "start", "--head", "--num-cpus", str(cpus), "--port", "0", "--temp-dir",
         str(temp), "--include-dashboard", "false", "--disable-usage-stats",
         "--resources", json.dumps(resources or {})],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        yield Head(temp, starting)
    finally:
        if starting.poll() is None:
            starting.kill()
            starting.communicate()
        kill_cluster(starting.pid, temp)
