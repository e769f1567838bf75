"""A resume ends a sandbox's init left alone holding the exec lock, and nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gitrun.adapter.sandbox import end_empty_sandboxes

BWRAP = shutil.which("bwrap")
pytestmark = pytest.mark.skipif(BWRAP is None, reason="bubblewrap is not installed")


def test_a_sandbox_still_running_a_command_is_never_ended(tmp_path: Path) -> None:
    lock = tmp_path / "gitrun-exec.flock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    argv = [str(BWRAP), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--unshare-pid", "--", "sleep", "60"]  # fmt: skip
    box = subprocess.Popen(argv, pass_fds=(fd,))
    try:
        os.close(fd)
        time.sleep(0.5)  # the init and its sleep are up
        assert end_empty_sandboxes(lock) == 0
        assert box.poll() is None
    finally:
        box.kill()
        box.wait(timeout=30)


def test_a_lock_nobody_holds_ends_nothing(tmp_path: Path) -> None:
    lock = tmp_path / "gitrun-exec.flock"
    lock.write_bytes(b"")
    assert end_empty_sandboxes(lock) == 0
