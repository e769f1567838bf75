"""Starting ``python -m gitrun ...`` (and ``python -c CODE ...``) for the suite at a
fork's cost instead of an interpreter's: ~0.2 s of CPU per call saved, thousands of calls.

:func:`popen` and :func:`run` take the arguments :class:`subprocess.Popen` and
:func:`subprocess.run` take. When the command line is this interpreter (at the suite's
``-O`` level) running ``-m gitrun`` or ``-c CODE``, the process comes from this pytest
worker's fork server (tests/zygote.py), which imported gitrun once: a real process with
a real pid (SIGKILL, SIGSTOP and /proc reach it), the caller's descriptors as its stdin,
stdout and stderr, exactly the environment and directory asked for, default signal
handlers, and the interpreter's own exit handling. Its parent is the server, which reaps
it at once and passes its wait status on; the returned object is a ``subprocess.Popen``
(``pid``, ``poll``, ``wait``, ``communicate``, ``kill``, ``returncode`` ...).

Everything else is exec'd as before, and so is a call whose environment differs from the
server's in a variable read while gitrun was imported (or in any ``PYTHON*``, ``LC_*``,
``LANG*`` variable, which the interpreter reads when it starts), or that asks for what a
fork cannot give (another interpreter or flag, pass_fds, a preexec_fn, another user).
What a forked child is not: this process's child (``os.waitid``/``os.waitpid`` on its
pid and ``RUSAGE_CHILDREN`` see nothing of it: use the returned object's methods), nor a
fresh interpreter (it has every gitrun module imported, and the server's hash seed). A
test that needs either (test_scale waits on a stopped child with ``waitid``; start-up
time and lazy-import tests measure a fresh interpreter) calls :mod:`subprocess` itself.
``GITRUN_SUITE_FORK=0`` in the environment pytest starts with turns the server off:
every call is exec'd (the A/B switch for the suite's timings).
"""

from __future__ import annotations

import array
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zygote import HEADER, PID, STATUS

SERVER = Path(__file__).resolve().parent / "zygote.py"
ENABLED = os.environ.get("GITRUN_SUITE_FORK", "1") != "0"
FLAGS = ["-O"] * sys.flags.optimize  # the interpreter flags every CLI child runs with
# What a forked child can be given as its subprocess.Popen was.
_FORKABLE = frozenset(
    {"stdin", "stdout", "stderr", "text", "env", "cwd", "bufsize", "start_new_session"}
)
_STARTUP = ("PYTHON", "LC_", "LANG")  # read by the interpreter itself as it starts
# Read while the server imported gitrun, and made right in each child: HOME by sysconfig's
# user base (this venv has no user site) and by libgit2 (its search path is reset).
_EMULATED = frozenset({"HOME", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE"})
# The server starts with the environment this process started with (the same for every
# test, whichever calls first), so which calls it serves does not depend on test order.
_BASE_ENV = dict(os.environ)


def optimize_level(env: Mapping[str, str]) -> int:
    """The ``sys.flags.optimize`` of ``python FLAGS`` started with ``env``."""
    value = env.get("PYTHONOPTIMIZE", "")
    return max(len(FLAGS), int(value) if value.isdigit() else int(bool(value)))


class Server:
    """This process's fork server: started on first use, gone when this process is."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gitrun-zygote-"))
        self.path = str(self.dir / "socket")
        control, self._control = os.pipe()
        with open(self.dir / "log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *FLAGS, str(SERVER), self.path, str(control)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                env=dict(env), cwd=self.dir, pass_fds=[control],
            )  # fmt: skip
        os.close(control)
        if self.proc.stdout is None:
            raise RuntimeError("no pipe from the fork server")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server did not start: {self.log()}")
        ready = json.loads(line)
        self.env: dict[str, str] = ready["env"]
        self.sensitive = {k for k in ready["read"] if k not in _EMULATED}

    def log(self) -> str:
        return (self.dir / "log").read_text(errors="replace")

    def serves(self, env: Mapping[str, str]) -> bool:
        """Would a child forked here see what an exec'd one with ``env`` would?"""
        names = set(env) | set(self.env)
        startup = {n for n in names if n.startswith(_STARTUP) and n not in _EMULATED}
        same = all(env.get(n) == self.env.get(n) for n in self.sensitive | startup)
        return same and optimize_level(env) == optimize_level(self.env)

    def fork(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        fds: list[int],
        *,
        session: bool = False,
    ) -> Any:
        """A child running ``argv`` (after the interpreter), in a new session if asked:
        its connection to this server, and its pid."""
        request = {"argv": argv, "flags": FLAGS, "env": dict(env), "cwd": cwd, "session": session}
        body = json.dumps(request)
        data = body.encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes(fds))
            conn.sendmsg([HEADER.pack(len(data))], [rights])
            conn.sendall(data)
            (pid,) = PID.unpack(_read(conn, PID.size))
        except (OSError, RuntimeError) as exc:
            conn.close()
            raise RuntimeError(f"the fork server failed ({exc}); its log: {self.log()}") from exc
        except BaseException:
            conn.close()
            raise
        return conn, pid

    def close(self) -> None:
        os.close(self._control)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _fd_bytes(fds: list[int]) -> bytes:
    return array.array("i", fds).tobytes()


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise RuntimeError("the fork server went away")
        data += chunk
    return data


_lock = threading.Lock()
_server: dict[int, Server] = {}  # this process's pid -> its server (a fork starts anew)


def server() -> Server:
    with _lock:
        found = _server.get(os.getpid())
        if found is None:
            found = _server[os.getpid()] = Server(_BASE_ENV)
            atexit.register(found.close)
        return found


class Forked(subprocess.Popen[Any]):
    """A ``subprocess.Popen`` whose process the fork server made and waits for."""

    def __init__(self, zygote: Server, args: list[str], **kwargs: Any) -> None:
        self._zygote = zygote
        self._conn: socket.socket | None = None
        super().__init__(args, **kwargs)

    def _execute_child(
        self, args: list[str], executable: Any, preexec_fn: Any, close_fds: Any,
        pass_fds: Any, cwd: Any, env: Any, startupinfo: Any, creationflags: Any, shell: Any,
        p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
        *rest: Any,
    ) -> None:  # fmt: skip
        fds = [fd if fd != -1 else i for i, fd in enumerate((p2cread, c2pwrite, errwrite))]
        where = os.fspath(cwd) if cwd is not None else os.getcwd()
        after = list(args[1 + len(FLAGS) :])  # what follows the interpreter and its flags
        env = os.environ if env is None else env
        session = bool(rest[-2])  # start_new_session (then process_group)
        self._conn, self.pid = self._zygote.fork(after, env, where, fds, session=session)
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]

    def _status(self, timeout: float | None) -> int | None:
        """The child's wait status once the server has it (None: not within ``timeout``)."""
        conn = self._conn
        if conn is None:
            raise RuntimeError(f"pid {self.pid}: no connection to the fork server")
        conn.settimeout(timeout)
        try:
            data = conn.recv(STATUS.size)
        except (TimeoutError, BlockingIOError):
            return None
        conn.settimeout(None)
        if data and len(data) < STATUS.size:
            data += _read(conn, STATUS.size - len(data))  # the four bytes came apart
        conn.close()
        self._conn = None
        if len(data) != STATUS.size:
            raise RuntimeError(f"the fork server lost pid {self.pid}")
        (status,) = STATUS.unpack(data)
        return int(status)

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            try:
                if self.returncode is None:
                    status = self._status(0)
                    if status is not None:
                        self._handle_exitstatus(status)  # type: ignore[attr-defined]
            except RuntimeError:
                if _deadstate is None:
                    raise
                self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _wait(self, timeout: float | None) -> int | None:
        with self._waitpid_lock:  # type: ignore[attr-defined]
            if self.returncode is None:
                status = self._status(timeout)
                if status is None:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                self._handle_exitstatus(status)  # type: ignore[attr-defined]
        return self.returncode


def _forkable(argv: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str] | None:
    """``argv`` as a list of str when it is a call the fork server can make."""
    args = [os.fspath(a) for a in argv]
    n = len(FLAGS)
    if not ENABLED or set(kwargs) - _FORKABLE or len(args) < n + 3:
        return None
    if args[0] != sys.executable or args[1 : n + 1] != FLAGS:
        return None
    if args[n + 1 : n + 3] != ["-m", "gitrun"] and args[n + 1] != "-c":
        return None
    return args


def popen(argv: Sequence[Any], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **kwargs)``, forked from the server where it can be."""
    args = _forkable(argv, kwargs)
    env = kwargs.get("env")
    env = os.environ if env is None else env
    cwd = kwargs.get("cwd")
    if args is not None and (cwd is None or os.path.isdir(cwd)):  # else exec: Popen raises
        zygote = server()
        if zygote.serves(env):
            return Forked(zygote, args, **kwargs)
    return subprocess.Popen(list(argv), **kwargs)


def run(
    argv: Sequence[Any],
    *,
    input: str | bytes | None = None,
    timeout: float | None = None,
    check: bool = False,
    capture_output: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` over :func:`popen`: same arguments, same result and errors."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with popen(argv, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            exc.stdout, exc.stderr = proc.communicate()
            raise
        except BaseException:
            proc.kill()
            raise
    code = proc.poll()
    if code is None:
        raise RuntimeError(f"pid {proc.pid} has no exit status after communicate")
    if check and code:
        raise subprocess.CalledProcessError(code, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, code, out, err)
