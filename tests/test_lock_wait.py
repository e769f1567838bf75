"""A running (not stopped) holder of a ref's OS lock: the waiting process says at once —
after about a second, in one stderr line — who holds it and that it is waiting, then
goes on waiting (up to the lock timeout) and carries on when the holder lets go."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import spawn
from conftest import SANDBOXES, Gitrun
from helpers import PAUSING_WORKER, reap_all

pytestmark = pytest.mark.timeout(120)
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _holder(gitrun: Gitrun, tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """`gitrun run` held, running, inside its first write's branch ref transaction."""
    marker, go = tmp_path / "held", tmp_path / "go"
    args = ("run", str(SANDBOXES / "fix-median"), "--run-id", "r", "-q", "--worker-id", "worker-a")
    proc = spawn.popen(
        [sys.executable, "-c", PAUSING_WORKER, "write_ref_locked", str(marker), str(go), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=gitrun.env(**FAST), cwd=gitrun.home.parent,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not marker.exists():
        raise AssertionError(f"the holder never reached its lock: {proc.communicate()}")
    return proc, go


def test_a_process_waiting_on_a_running_lock_holder_names_it_within_seconds_and_waits(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    a, go = _holder(gitrun, tmp_path)
    b = gitrun.popen("resume", "r", "--worker-id", "worker-b", "--takeover-after", "0", **FAST)
    try:
        if b.stderr is None:
            raise AssertionError("no stderr pipe")
        started = time.monotonic()
        line = b.stderr.readline()
        while line and "waiting" not in line:
            line = b.stderr.readline()
        took = time.monotonic() - started
        assert took < 5, f"named the holder only after {took:.1f}s"
        assert line.startswith("gitrun: waiting for ref "), line
        assert f"pid {a.pid}" in line
        assert "worker worker-a" in line
        assert "host " in line
        assert "since " in line
        assert "up to 30s" in line
        assert b.poll() is None  # still waiting, not given up
        go.write_text("go")  # the holder carries on and lets go of the lock
        a.communicate(timeout=60)
        _, rest = b.communicate(timeout=60)
        assert "waiting for ref" not in rest  # one line, not one per poll
        assert b.returncode != 4 or "for over 30s" not in rest, rest
    finally:
        reap_all([a, b])
