"""Test helpers for the remote store: a bare repository served by a real ``git daemon``.

``git_daemon`` (a pytest fixture, re-exported by conftest) starts
``git daemon --reuseaddr --export-all --enable=receive-pack --base-path=DIR
--listen=127.0.0.1 --port=<free port> DIR`` over a fresh directory and stops it at
teardown; :meth:`Daemon.bare` makes a bare repository there and returns its ``git://``
URL (:meth:`Daemon.path_url` is the same repository as a file path). :meth:`Daemon.stop`
plays a network partition mid-test; :meth:`Daemon.start` ends it. :func:`machine` makes
one "machine": a clone of the remote with its own directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gitrun.store.remote_git import git_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def hermetic_git(*args: str, cwd: Path | None = None) -> str:
    """Run the real git CLI with the store's hermetic environment; its stdout."""
    proc = subprocess.run(
        ["git", *args], cwd=cwd, env=git_env(), capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


class Daemon:
    """A ``git daemon`` on 127.0.0.1 serving the bare repositories under ``base``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.proc is not None:
            return
        cmd = [
            "git", "daemon", "--reuseaddr", "--export-all", "--enable=receive-pack",
            f"--base-path={self.base}", "--listen=127.0.0.1", f"--port={self.port}",
            str(self.base),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=git_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        self.stop()
        raise AssertionError(f"git daemon did not listen on port {self.port}")

    def stop(self) -> None:
        """Stop the daemon and its children (a partition: connections are refused)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self.proc = None

    def bare(self, name: str = "remote.git") -> str:
        """A new bare repository served by the daemon; its ``git://`` URL."""
        path = self.base / name
        hermetic_git("init", "--quiet", "--bare", "--initial-branch=main", str(path))
        return self.url(name)

    def url(self, name: str = "remote.git") -> str:
        return f"git://127.0.0.1:{self.port}/{name}"

    def path_url(self, name: str = "remote.git") -> str:
        return str(self.base / name)


def machine(url: str, where: Path) -> Path:
    """One machine's clone of the remote at ``where`` (its cache of the remote's refs)."""
    hermetic_git("clone", "--quiet", url, str(where))
    return where


@pytest.fixture
def git_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A running ``git daemon`` over ``tmp_path/served``, stopped at teardown."""
    base = tmp_path / "served"
    base.mkdir()
    daemon = Daemon(base)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


class Machines:
    """Machines sharing one remote: each its own workspace under ``tmp/<name>``, one
    keyring file handed to all of them out of band, the remote's bare repository."""

    def __init__(self, tmp: Path, daemon: Daemon, names: str = "ab") -> None:
        self.tmp = tmp
        self.url = daemon.bare()
        self.bare = Path(daemon.path_url())
        self.key = tmp / "shared.keyring"  # handed to every machine out of band
        for name in names:
            (tmp / name).mkdir()

    def args(self, machine: str) -> list[str]:
        return ["--workspace", str(self.tmp / machine), "--key-file", str(self.key)]

    def remote_git(self, *args: str) -> str:
        return hermetic_git(f"--git-dir={self.bare}", *args).strip()

    def writes_on_remote(self, run_id: str) -> list[str]:
        """The idempotency keys of the write commits on the remote branch, oldest first."""
        out = self.remote_git(
            "log", "--reverse", "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)",
            f"gitrun/{run_id}",
        )  # fmt: skip
        return [line for line in out.split() if line]
