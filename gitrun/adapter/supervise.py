"""The supervisor every child gitrun starts runs under (:data:`SUPERVISOR`), inside bwrap
or not (:mod:`gitrun.adapter.sandbox`): it holds the read end of a pipe whose write end
only gitrun holds, and kills the command's whole process tree when that pipe reports
end-of-file (which the kernel does when gitrun dies, even by SIGKILL); over a second pipe
it tells gitrun whether the command started and how it ended.

Descriptors: the supervisor holds gitrun's ends of those pipes and, for an exec step, the
exec lock of the worktree's hidden git dir; inside bubblewrap it shares the command's pid
namespace and user, so the command could reopen them through ``/proc/<pid>/fd`` (the lock
file read-write). The supervisor makes itself undumpable first (``PR_SET_DUMPABLE`` 0):
its ``/proc/<pid>/fd`` then needs ``CAP_SYS_PTRACE``, which the sandbox drops. The command
itself inherits none of them (``close_fds``); bwrap's own pid 1 closes every descriptor but
its event fd before it forks the supervisor.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gitrun.core.errors import Exit, GitrunError

_STOP_GRACE_SECONDS = 5.0


class SandboxFailed(GitrunError):
    """bubblewrap could not set the sandbox up for this command; nothing was judged."""

    exit_code = Exit.REFUSED


SUPERVISOR = r"""
import os, select, signal, subprocess, sys, time

def children():
    me, kids = str(os.getpid()), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return kids
    for name in names:
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[1] == me:
                kids.append(int(name))
    return kids

def sweep(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)

def main():
    alive, status = int(sys.argv[1]), int(sys.argv[2])
    for fd in (alive, status):
        os.set_inheritable(fd, False)
    try:  # before anything of the command runs: see "Descriptors" in the module docstring
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            raise OSError(ctypes.get_errno(), "prctl")
    except Exception as exc:
        said = "error cannot make the supervisor undumpable: " + str(exc) + "\n"
        os.write(status, said.encode())
        return 127
    try:
        import ctypes
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
    except Exception:
        pass
    passed = [int(fd) for fd in sys.argv[3][7:].split(",")] if sys.argv[3][:7] == "--pass=" else []
    try:
        child = subprocess.Popen(sys.argv[4:], start_new_session=True, pass_fds=passed)
    except OSError as exc:
        os.write(status, ("error " + (exc.strerror or type(exc).__name__) + "\n").encode())
        return 127
    os.write(status, ("started " + str(child.pid) + "\n").encode())
    while True:
        ready = select.select([alive], [], [], 0.05)[0]
        if ready and not os.read(alive, 64):
            sweep(child.pid)  # gitrun died or gave up: nothing of the tests may outlive it
            return 137
        code = child.poll()
        if code is not None:
            break
    sweep(child.pid)
    os.write(status, ("exit " + str(code) + "\n").encode())
    return 0

sys.exit(main())
"""


@dataclass
class Supervised:
    """A test command running under the supervisor (inside bwrap when confined)."""

    proc: subprocess.Popen[bytes]
    alive_fd: int  # the write end only gitrun holds; closing it kills the command's tree
    status_fd: int
    confined: bool
    status: str | None = None  # what the supervisor reported, once it has exited
    sandbox_init: int = -1  # a pidfd of bwrap's pid 1 in the sandbox (its pid namespace)

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stop(self) -> None:
        """Kill the command's whole tree (through the supervisor), reap it, read its report."""
        if self.alive_fd >= 0:
            os.close(self.alive_fd)
            self.alive_fd = -1
        try:
            self.proc.wait(timeout=_STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._await_sandbox_end()
        if self.status is None:
            self.status = self._read_status()
        pid = self._reported("started")
        if not self.confined and pid and not self._reported("exit"):
            # The supervisor died before it could sweep (a hostile test may kill it):
            # the command's process group is still ours to end. Inside bwrap the pid
            # namespace has already taken every process with it.
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.killpg(int(pid), signal.SIGKILL)

    def _await_sandbox_end(self) -> None:
        """bwrap exits with its command's status as soon as its pid 1 reports it, before
        that pid 1 has exited and so before the kernel has ended every other process of
        the sandbox's pid namespace (a test's escapee was seen running right after): wait
        for pid 1's end, which comes only after theirs; kill it if it lingers."""
        if self.sandbox_init < 0:
            return
        try:
            ready, _, _ = select.select([self.sandbox_init], [], [], _STOP_GRACE_SECONDS)
            if not ready:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(self.sandbox_init, signal.SIGKILL)
                select.select([self.sandbox_init], [], [], _STOP_GRACE_SECONDS)
        finally:
            os.close(self.sandbox_init)
            self.sandbox_init = -1

    def outcome(self) -> tuple[bool, int | None, str]:
        """(started, exit code, why it could not start), as the supervisor reported them."""
        if self.status is None:
            raise GitrunError("the supervised command has not been stopped yet")
        error = self._reported("error")
        if error is not None:
            return False, None, error
        code = self._reported("exit")
        started = self._reported("started") is not None
        return started, None if code is None else int(code), ""

    def _reported(self, word: str) -> str | None:
        for line in (self.status or "").splitlines():
            head, _, rest = line.partition(" ")
            if head == word:
                return rest
        return None

    def _read_status(self) -> str:
        flags = fcntl.fcntl(self.status_fd, fcntl.F_GETFL)
        fcntl.fcntl(self.status_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        chunks = []
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.status_fd, 4096):
                chunks.append(chunk)
        os.close(self.status_fd)
        self.status_fd = -1
        return b"".join(chunks).decode("utf-8", "replace")


def sandbox_init(info_r: int) -> int:
    """A pidfd of the sandbox's pid 1, from bwrap's info (written and closed right after
    it made the namespace); -1 when bwrap wrote none (it failed to start) or it is gone."""
    chunks, deadline = [], time.monotonic() + _STOP_GRACE_SECONDS
    try:
        while select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(info_r)
    try:
        pid = int(json.loads(b"".join(chunks))["child-pid"])
        return os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return -1


def supervise(
    argv: Sequence[str],
    wrap: Sequence[str] = (),
    *,
    confined: bool,
    hold: Sequence[int] = (),
    give: Sequence[int] = (),
    **popen: Any,
) -> Supervised:
    """Start ``argv`` under the supervisor (inside ``wrap``, e.g. bwrap's own argv), in
    its own session; it dies with us through the alive pipe only we hold the write end of.
    The verifier, exec steps and external agents all start their children here. ``give``:
    descriptors the command inherits, at the same numbers (the verifier's outcome channel).
    """
    alive_r, alive_w = os.pipe()
    status_r, status_w = os.pipe()
    passing = "--pass=" + ",".join(str(fd) for fd in give) if give else "--"
    inner = [sys.executable, "-I", "-S", "-c", SUPERVISOR, str(alive_r), str(status_w), passing]
    full = [*wrap, *inner, *argv]
    try:
        proc = subprocess.Popen(
            full, start_new_session=True, pass_fds=(alive_r, status_w, *hold, *give), **popen
        )
    except OSError as exc:
        for fd in (alive_w, status_r):
            os.close(fd)
        raise SandboxFailed(f"cannot start {full[0]}: {exc.strerror or exc}") from exc
    finally:
        for fd in (alive_r, status_w):
            with contextlib.suppress(OSError):
                os.close(fd)
    return Supervised(proc, alive_w, status_r, confined)
