"""A confined agent keeps the host network; with the user's ssh-agent it could also
authenticate as the user (push to the run's ``--remote``, roll its checkpoint back from
another machine). The socket ``$SSH_AUTH_SOCK`` names is hidden from it and unset."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun

AGENT = Path(__file__).resolve().parent / "session_agents" / "socket_agent.py"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def _serve(server: socket.socket) -> None:
    """A stand-in ssh-agent: whoever connects is handed a secret."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.sendall(b"SIGNED-BY-YOUR-KEY")


def test_a_confined_agent_cannot_reach_the_users_ssh_agent(gitrun: Gitrun, tmp_path: Path) -> None:
    where = tmp_path / "ssh-XXXX"
    where.mkdir()
    path = where / "agent.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    threading.Thread(target=_serve, args=(server,), daemon=True).start()
    try:
        agent = f"cmd:{sys.executable} {AGENT} {path}"
        res = gitrun(
            "run", str(SANDBOXES / "fix-median"), "--run-id", "sock", "--agent", agent,
            SSH_AUTH_SOCK=str(path),
        )  # fmt: skip
    finally:
        server.close()
    lines = [ln for ln in res.err.splitlines() if ln.startswith("SOCKET ")]
    assert lines, res.err
    found = json.loads(lines[0].removeprefix("SOCKET "))
    assert res.code == 0, res.err  # the run itself is the protocol's
    assert found["env"] is None, found
    assert str(found["told"]).startswith("failed"), found
