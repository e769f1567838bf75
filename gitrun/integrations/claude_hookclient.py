"""The command Claude Code runs for each hook of a ``gitrun claude`` session: a client of
the session's resident helper (:mod:`gitrun.integrations.claude_helper`).

It imports the standard library only and is started as ``python -I -S THIS_FILE SOCKET
EVENT --run RUN …`` (no site, no gitrun package: about 10 ms of the interpreter), so a
hook costs what the helper does, not a Python process importing gitrun and pygit2. It
sends the event and Claude Code's JSON over the helper's unix socket and hands back the
helper's answer (exit status, stdout, stderr). When there is no helper — none started
(``gitrun claude --no-launch``), killed, or answering anything but a whole answer — it
runs ``python -m gitrun hook EVENT …`` in a process of its own with the same input: the
work is done in-process then, so correctness never depends on the helper (a helper killed
mid-call leaves what a killed hook process leaves; the key of the call makes it once).

The socket must sit in a directory of this user's, not reachable by others (``0700``),
and the helper's process must be this user's (``SO_PEERCRED``): a socket another user
planted at a reused path is never spoken to.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import sys

MAX_PAYLOAD = 64 << 20  # as gitrun.integrations.claude_code.MAX_PAYLOAD
ANSWER_SECONDS = 900.0  # a hook may wait that long for the run's lease (a long rewind)
_UCRED = struct.Struct("3i")  # pid, uid, gid


def _private(path: str) -> bool:
    """``path``'s directory is this user's and nobody else's; the socket too."""
    try:
        d = os.lstat(os.path.dirname(path) or ".")
        s = os.lstat(path)
    except OSError:
        return False
    uid = os.getuid()
    return (
        stat.S_ISDIR(d.st_mode)
        and d.st_uid == uid
        and d.st_mode & 0o077 == 0
        and stat.S_ISSOCK(s.st_mode)
        and s.st_uid == uid
    )


def _exchange(path: str, header: dict[str, object], raw: bytes) -> bytes | None:
    """Send the request and read the whole answer; None when no helper of ours answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(ANSWER_SECONDS)
            conn.connect(path)
            peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            if _UCRED.unpack(peer)[1] != os.getuid():
                return None
            conn.sendall(json.dumps(header).encode() + b"\n" + raw)
            conn.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := conn.recv(1 << 16):
                chunks.append(chunk)
    except (OSError, AttributeError):  # AttributeError: no SO_PEERCRED on this system
        return None
    return b"".join(chunks)


def ask(path: str, header: dict[str, object], raw: bytes) -> tuple[int, str, str] | None:
    """The helper's (code, stdout, stderr), or None: no helper, or no whole answer."""
    got = _exchange(path, header, raw) if _private(path) else None
    try:
        data = json.loads(got) if got else None
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("fallback"):
        return None
    code, out, err = data.get("code"), data.get("stdout"), data.get("stderr")
    if not isinstance(code, int) or not isinstance(out, str) or not isinstance(err, str):
        return None
    return code, out, err


def in_process(args: list[str], raw: bytes) -> int:
    """``python -m gitrun hook ARGS`` with the same input: the hook without a helper."""
    import subprocess

    # -P -E: run in the worktree, `-m` would import a gitrun/ package planted there first
    argv = [sys.executable, "-P", "-E", "-m", "gitrun", "hook", *args]
    return subprocess.run(argv, input=raw, check=False).returncode


def main(argv: list[str]) -> int:
    """``SOCKET EVENT --run RUN [--workspace DIR] [--key-file FILE] [--finish]``."""
    if len(argv) < 2:
        return in_process(argv[1:], b"")  # gitrun hook says what is wrong
    path, args = argv[0], argv[1:]
    event = args[0]
    raw = sys.stdin.buffer.read(MAX_PAYLOAD + 1) if event != "finish" else b""
    run = args[args.index("--run") + 1] if "--run" in args[:-1] else ""
    header = {"event": event, "run": run, "finish": "--finish" in args}
    said = ask(path, header, raw)
    if said is None:
        return in_process(args, raw)
    code, out, err = said
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
