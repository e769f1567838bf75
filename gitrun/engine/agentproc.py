"""External agents: ``--agent cmd:COMMAND`` runs COMMAND and serves the session over
its stdin/stdout (gitrun is the server; the agent's stderr is gitrun's).

The command is shlex-split and run without a shell, with no ``GITRUN_*`` variable in its
environment, under the verifier's supervisor (:data:`gitrun.adapter.sandbox.SUPERVISOR`): when
gitrun dies, even by SIGKILL, the supervisor sees its pipe close and kills the agent's
whole process group, so ``gitrun resume`` restarts both without a stray agent writing
requests to nobody. An agent that exits leaves the run resumable.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from collections.abc import Callable

from gitrun.adapter.sandbox import Supervised, supervise
from gitrun.core.errors import AgentGone, GitrunError
from gitrun.core.records import RunState
from gitrun.engine.jsonrpc import Transport

EXIT_GRACE_SECONDS = 5.0  # after finish: how long the agent may take to exit on its own


def agent_env() -> dict[str, str]:
    """gitrun's environment without its own variables (keyring path, workspace, faults)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GITRUN_")}


def spawn(command: str) -> Supervised:
    """Start the agent command under the supervisor, its stdin and stdout piped to us."""
    argv = shlex.split(command)
    return supervise(
        argv, confined=False, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=agent_env()
    )


def serve_child(command: str, serve: Callable[[Transport], RunState]) -> RunState:
    """Run ``serve`` over the agent's pipes; stop the agent however the session ends."""
    child = spawn(command)
    proc = child.proc
    if proc.stdin is None or proc.stdout is None:
        raise GitrunError("the agent's pipes were not made")
    transport = Transport(proc.stdout.fileno(), proc.stdin.fileno())
    try:
        return serve(transport)
    except AgentGone as exc:
        raise AgentGone(f"{exc.message} ({_how_it_ended(child, command)})") from exc
    finally:
        transport.closed = True
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the agent reads EOF: its cue to exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=EXIT_GRACE_SECONDS)
        child.stop()
        proc.stdout.close()


def _how_it_ended(child: Supervised, command: str) -> str:
    """Why the agent left, as its supervisor saw it."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(timeout=EXIT_GRACE_SECONDS)
    child.stop()
    started, code, why = child.outcome()
    name = shlex.split(command)[0]
    if not started:
        return f"the agent {name} could not start: {why}"
    if code is None:
        return f"the agent {name} was killed"
    if code < 0:
        return f"the agent {name} was killed by signal {-code}"
    return f"the agent {name} exited with code {code}"
