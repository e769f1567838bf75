"""The suite's fork server: one per pytest worker, it has imported gitrun once and forks a
real process for each CLI call the tests make (tests/spawn.py is its client and says when
it is used). Run as ``python [-O] tests/zygote.py SOCKET CONTROL_FD`` by the client only.

Each request is a connection on SOCKET carrying three descriptors (the child's stdin,
stdout and stderr) and a JSON body: the argv after the interpreter (``-m gitrun ...`` or
``-c CODE ...``), the whole environment, and the directory to run in. The server forks;
the child takes the descriptors as 0, 1 and 2, closes every other one, replaces its
environment wholesale, restores default signal handlers, and runs the module or code
exactly as ``python -m`` / ``python -c`` would: ``SystemExit`` and an uncaught
exception end it with the interpreter's codes and messages, then it joins its threads, runs
its atexit handlers and flushes its stdio as the interpreter's shutdown does, and leaves
with ``os._exit`` (tearing down the hundreds of modules this server imported would cost
a second of CPU, mostly copying pages the fork shared). The server answers with the
child's pid and, when it has reaped it, its wait status. It holds no thread, writes
nothing to its own stdio, and exits when CONTROL_FD reads end of file (its pytest worker
has gone).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import pkgutil
import select
import signal
import socket
import struct
import sys
import threading
import time
import types
from typing import Any

FDS = 3  # stdin, stdout, stderr
HEADER = struct.Struct("!I")  # the JSON body's length
PID = struct.Struct("!q")
STATUS = struct.Struct("!i")
# Not imported ahead: gitrun.integrations is a library for agent frameworks (no command
# uses it) and reads the user's configuration when imported; __main__ would run the CLI.
SKIPPED = (".integrations", ".__main__")


def preload() -> list[str]:
    """Import gitrun's CLI and every module a command imports later; return the
    environment variables read while importing (the client falls back to a real exec
    when a request's value of one of them differs from this process's)."""
    import gitrun

    read: set[str] = set()
    environ: Any = type(os.environ)
    getitem = environ.__getitem__

    def recording(self: Any, key: str) -> Any:
        read.add(key)
        return getitem(self, key)

    environ.__getitem__ = recording
    try:
        importlib.import_module("gitrun.cli")
        for info in pkgutil.walk_packages(gitrun.__path__, "gitrun."):
            if not any(part in info.name for part in SKIPPED):
                importlib.import_module(info.name)
    finally:
        environ.__getitem__ = getitem
    return sorted(read)


def receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: its body and the descriptors that came with it."""
    fds: list[int] = []
    size = socket.CMSG_LEN(FDS * 4)
    head, ancillary, _, _ = conn.recvmsg(HEADER.size, size)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
    if len(head) != HEADER.size or len(fds) != FDS:
        raise OSError("a malformed request")
    (length,) = HEADER.unpack(head)
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise OSError("a truncated request")
        body += chunk
    request: dict[str, Any] = json.loads(body)
    return request, fds


def reap(children: dict[int, socket.socket]) -> None:
    """Send every exited child's wait status to its client."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # the client may have stopped listening
                conn.sendall(STATUS.pack(status))
            conn.close()


def serve(listener: socket.socket, control: int) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a child per request until ``control`` closes. Returns, in a child only, the
    request that child is to run; in the server, None when it is time to exit."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener.fileno(), wake_r, control], [], [])
        if control in ready:
            return None
        if wake_r in ready:
            drain(wake_r)
            reap(children)
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            try:
                request, fds = receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                return request, fds
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            with contextlib.suppress(OSError):
                conn.sendall(PID.pack(pid))
            reap(children)


def drain(fd: int) -> None:
    """Empty the signal wakeup pipe (non-blocking)."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def become(request: dict[str, Any], fds: list[int]) -> None:
    """In the child: the process ``python ARGV`` started with ``request`` would be."""
    if request.get("session"):
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
    import pygit2
    from pygit2.enums import ConfigLevel, Option

    # libgit2 read HOME and XDG_CONFIG_HOME when this server imported pygit2: look again.
    for level in (ConfigLevel.GLOBAL, ConfigLevel.XDG, ConfigLevel.SYSTEM, ConfigLevel.PROGRAMDATA):
        pygit2.option(Option.SET_SEARCH_PATH, level, None)


def run(request: dict[str, Any]) -> None:
    """``-m MODULE ARGS`` or ``-c CODE ARGS``, as the interpreter runs them."""
    argv: list[str] = request["argv"]
    sys.orig_argv = [sys.executable, *request["flags"], *argv]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if argv[0] == "-m":
        import runpy

        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in sys.argv[0]
        sys.path.insert(0, os.getcwd())
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        return
    sys.argv = ["-c", *argv[2:]]
    sys.path.insert(0, "")
    exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - as python -c


def start(path: str) -> socket.socket:
    """Import, listen, and say which environment variables the imports read."""
    sys.path.pop(0)  # this script's directory: the children set their own sys.path[0]
    read = preload()
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit("zygote: a thread runs after the imports; forking is unsafe")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    gc.freeze()  # the children's collections leave what they share with this process alone
    sys.stdout.write(json.dumps({"read": read, "env": dict(os.environ)}) + "\n")
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    return listener


def finish(request: dict[str, Any]) -> int:
    """Run the request, then do what the interpreter does as it exits; the exit code."""
    code = 0
    try:
        run(request)
    except SystemExit as exc:
        code = exit_code(exc)
    except KeyboardInterrupt as exc:
        report(exc)
        code = -signal.SIGINT  # the interpreter ends itself with SIGINT here
    except BaseException as exc:
        report(exc)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def report(exc: BaseException) -> None:
    """The traceback the interpreter prints, from the code it ran (not this server's frames)."""
    tb = exc.__traceback__
    here = report.__code__.co_filename  # this file (the -c child's __main__ is not it)
    while tb is not None and tb.tb_frame.f_code.co_filename == here:
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def exit_code(exc: SystemExit) -> int:
    """The process exit code ``raise SystemExit(code)`` gives (printing a non-int code)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    got = serve(start(sys.argv[1]), int(sys.argv[2]))
    if got is None:
        raise SystemExit(0)
    become(*got)
    os._exit(finish(got[0]))
