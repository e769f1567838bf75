"""The resident helper of one ``gitrun claude`` session: the hooks' work, done in a
process that stays up, so that a hook costs a small client (claude_hookclient.py) and
the work itself, not a Python process importing gitrun, pygit2 and reading the scan
cache, then walking 10,000 files, once per tool call.

``gitrun claude`` binds the socket (``hook.sock`` in a fresh ``0700`` directory) and
forks this loop before it becomes Claude Code; the helper stops when Claude Code (its
parent) is gone, and removes the directory. It serves ONE run: each request is handled
exactly as the in-process hook would (:func:`claude_code.answer`: the run opened under
its lease, the event handled, the lease let go), one at a time, with the scan cache and
an inotify watch of the worktree kept between requests (tool_steps.Resident). It holds
no lease between requests: ``gitrun rewind`` or ``gitrun log`` from Claude Code's shell
work as before, and a helper killed at any point leaves what a killed hook leaves.

Who can talk to it: the socket's directory is ``0700`` and the peer's uid must be ours
(``SO_PEERCRED``). A process of the same user — Claude Code's own ``Bash`` calls among
them — can connect and ask what ``gitrun hook`` on the command line already does for
that user (nothing more: the run, workspace and key file are the helper's own, never the
request's). Such a process could also kill the helper and serve the socket itself,
answering the hooks as it likes; it could as well edit the session's settings file or
the run's refs: against an agent running unconfined as the user, the hooks record and
gate, they do not confine (docs/claude-code.md, *Limits*).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import struct
from contextlib import suppress
from pathlib import Path

from gitrun.app import tool_steps
from gitrun.app.opening import Options
from gitrun.core.errors import BadInput
from gitrun.integrations import claude_code

SOCKET_NAME = "hook.sock"
READ_SECONDS = 10.0  # a client that connects and sends nothing is dropped after this
POLL_SECONDS = 1.0  # how often the helper looks whether Claude Code is still there
_UCRED = struct.Struct("3i")


def socket_dir() -> Path:
    """A fresh private directory for a helper's socket (short: a unix socket's path is
    limited to about 100 bytes)."""
    import tempfile

    base = os.environ.get("XDG_RUNTIME_DIR") or None
    if base is not None and not os.path.isdir(base):
        base = None
    return Path(tempfile.mkdtemp(prefix="gitrun-claude-", dir=base))


def listen(path: Path) -> socket.socket:
    """The helper's listening socket at ``path`` (its directory private, made by
    :func:`socket_dir`)."""
    st = os.lstat(path.parent)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise BadInput(f"{path.parent} is not a private directory of this user's")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(64)
    return listener


def _read(conn: socket.socket) -> bytes | None:
    conn.settimeout(READ_SECONDS)
    chunks, size = [], 0
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > claude_code.MAX_PAYLOAD + 4096:
            return None
    return b"".join(chunks)


def _reply(conn: socket.socket, data: dict[str, object]) -> None:
    with suppress(OSError):
        conn.sendall(json.dumps(data).encode())


FALLBACK: dict[str, object] = {"fallback": True}


def handle(conn: socket.socket, run_id: str, opts: Options, resident: tool_steps.Resident) -> None:
    """One request: the header line, then Claude Code's JSON; the hook's answer back."""
    peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    if _UCRED.unpack(peer)[1] != os.getuid():
        return
    try:
        data = _read(conn)
    except OSError:
        return
    _reply(conn, FALLBACK if data is None else respond(data, run_id, opts, resident))


def respond(
    data: bytes, run_id: str, opts: Options, resident: tool_steps.Resident
) -> dict[str, object]:
    """The answer to one request. Anything this helper cannot answer as the in-process
    hook would is answered ``fallback`` (the client then runs the hook in-process)."""
    line, _, raw = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        return FALLBACK
    event = header.get("event") if isinstance(header, dict) else None
    if not isinstance(event, str) or header.get("run") != run_id or event not in claude_code.EVENTS:
        return FALLBACK
    try:
        said = claude_code.answer(
            event, run_id, opts, raw, finish=header.get("finish") is True, warm=resident
        )
    except Exception:  # not a refusal: the in-process hook says what it is
        resident.forget()
        return FALLBACK
    return {"code": said.code, "stdout": said.stdout, "stderr": said.stderr}


def _stop(signum: int, frame: object) -> None:
    del frame
    raise SystemExit(128 + signum)  # the socket's directory removed on the way out


def serve(run_id: str, opts: Options, path: Path, *, parent: int | None = None,
          listener: socket.socket | None = None) -> int:  # fmt: skip
    """Serve the run's hooks on ``path`` until the parent process (Claude Code) is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is Claude Code's, not ours
    signal.signal(signal.SIGTERM, _stop)
    parent = os.getppid() if parent is None else parent
    listener = listener if listener is not None else listen(path)
    resident = tool_steps.Resident()
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([listener], [], [], POLL_SECONDS)
            if not ready:
                continue
            conn, _ = listener.accept()
            with conn:
                handle(conn, run_id, opts, resident)
    finally:
        listener.close()
        resident.close()
        shutil.rmtree(path.parent, ignore_errors=True)
    return 0


def serve_main(argv: list[str]) -> int:
    """``serve --run RUN --socket PATH [--workspace DIR] [--key-file FILE]`` (gitrun hook …):
    a helper in a process of its own (for a session started without ``gitrun claude``,
    and the benchmark); it stops when the process that started it is gone."""
    import sys

    from gitrun.app.opening import cli_options
    from gitrun.core.errors import GitrunError

    try:
        args = claude_code.parse_hook_args(argv)
        if args.socket is None:
            raise BadInput(
                f"gitrun hook serve: --socket PATH is required; {claude_code.HOOK_USAGE}"
            )
        return serve(args.run_id, cli_options(args.workspace, args.key_file), args.socket)
    except GitrunError as exc:
        sys.stderr.write(f"gitrun: {exc}\n")
        return int(exc.exit_code)


def start_beside(run_id: str, opts: Options, path: Path) -> None:
    """Fork the helper; this process goes on (to become Claude Code: the helper's
    parent). The socket is bound first, so a hook that comes before the helper's loop
    waits in the socket's queue rather than falling back."""
    listener = listen(path)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the helper
        code = 70
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)  # never Claude Code's terminal, nor a pipe kept open
            code = serve(run_id, opts, path, parent=parent, listener=listener)
        finally:
            os._exit(code)
    listener.close()
