"""A run's witness lock held by a stopped gitrun process: every command that needs it
says at once that the holder is stopped (its pid, and kill -CONT / kill -KILL), exit 4,
as a ref lock held by a stopped process does; never that a live process held it long."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import spawn
from conftest import SANDBOXES, Gitrun
from helpers import PAUSING_WORKER, one_line

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(120)


def test_a_witness_lock_held_by_a_stopped_process_names_it_stopped_exit_4(
    gitrun: Gitrun, tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    assert gitrun("run", str(SANDBOXES / "fix-median"), "--run-id", "w", "-q").code == 0
    marker, go = tmp_path / "paused", tmp_path / "go"
    # A second run, stopped inside its checkpoint's witness write (it holds the lock).
    argv = [sys.executable, "-c", PAUSING_WORKER, "checkpoint_witness_torn", str(marker),
            str(go), "run", str(SANDBOXES / "fix-median"), "--run-id", "w2", "-q",
            "--worker-id", "holder-w"]  # fmt: skip
    holder = spawn.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=gitrun.env(), cwd=gitrun.home.parent)  # fmt: skip
    reap.append(holder)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "the holder never reached its witness write"
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        for argv in (["status", "w2"], ["resume", "w2", "-q"]):
            start = time.monotonic()
            res = gitrun(*argv)
            took = time.monotonic() - start
            assert res.code == Exit.OWNED, (argv, res.code, res.err)
            line = one_line(res.err)
            assert f"the witness of run w2 is locked by a stopped process: pid {holder.pid}" in line
            assert "worker holder-w" in line
            assert f"kill -CONT {holder.pid}" in line
            assert "live" not in line
            assert took < 20, took  # told at once, not after the 30 s wait
        other = gitrun("status", "w")  # another run's witness is not locked
        assert other.code == 0, other.err
    finally:
        go.write_text("go")
        os.kill(holder.pid, signal.SIGCONT)
    _, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert gitrun("status", "w2").code == 0
