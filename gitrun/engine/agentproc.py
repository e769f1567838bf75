"""External agents: ``--agent cmd:COMMAND`` runs COMMAND and serves the session over
its stdin/stdout (gitrun is the server; the agent's stderr is gitrun's).

The command is shlex-split and run without a shell, with no ``GITRUN_*`` variable in its
environment, under the verifier's supervisor (:data:`gitrun.adapter.sandbox.SUPERVISOR`): when
gitrun dies, even by SIGKILL, the supervisor sees its pipe close and kills the agent's
whole process group, so ``gitrun resume`` restarts both without a stray agent writing
requests to nobody. An agent that exits leaves the run resumable.

Under the run's isolation setting (as the verifier's) the agent runs in bubblewrap: the
root file system read-only, the workspace (keyring, witness, registry, every run's
worktree), the keyring file and the repository's common git dir hidden, a private pid
namespace, no capabilities; the user's ssh-agent socket (``$SSH_AUTH_SOCK``: push rights to
a ``--remote``) hidden and unset. It acts only through the protocol, so it needs no view of
its worktree. Unlike the tests it keeps the host network (model APIs;
``GITRUN_AGENT_NETWORK=none`` cuts it to loopback) and the host's ``/tmp``, read-only —
but not gitrun's scratch root there (:mod:`gitrun.adapter.scratch`: other runs' exec
output, test logs, agent homes) — and gets a private writable ``HOME`` under it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gitrun.adapter import sandbox, scratch
from gitrun.adapter.sandbox import Confinement, Layout, Supervised, supervise
from gitrun.core.errors import AgentGone, BadInput, GitrunError
from gitrun.core.records import Event, RunState
from gitrun.engine.jsonrpc import Transport

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime

EXIT_GRACE_SECONDS = 5.0  # after finish: how long the agent may take to exit on its own
NETWORK_ENV = "GITRUN_AGENT_NETWORK"  # read by gitrun only: "host" (default) or "none"
NETWORKS = ("host", "none")


def network_setting() -> str:
    """The agent's network: ``$GITRUN_AGENT_NETWORK``, checked before anything runs."""
    value = os.environ.get(NETWORK_ENV) or "host"
    if value not in NETWORKS:
        raise BadInput(f"{NETWORK_ENV} must be one of {', '.join(NETWORKS)}, not {value!r}")
    return value


CREDENTIAL_SOCKETS = ("SSH_AUTH_SOCK",)  # the user's key agent: a confined agent never sees it


def credential_sockets() -> list[Path]:
    """The user's credential agent sockets named in our environment (they exist)."""
    found = [Path(os.environ[name]) for name in CREDENTIAL_SOCKETS if os.environ.get(name)]
    return [p for p in found if p.is_absolute() and p.exists()]


def agent_env() -> dict[str, str]:
    """gitrun's environment without its own variables (keyring path, workspace, faults)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GITRUN_")}


def confinement_for(rt: Runtime) -> Confinement:
    """The run's isolation setting applied to the agent, with the agent's network."""
    try:
        found = sandbox.resolve(rt.isolation or rt.task.verifier.isolation, "agent")
    except sandbox.SandboxUnavailable as exc:
        raise sandbox.SandboxUnavailable(
            f"{exc}; the agent was not started: then gitrun resume {rt.state.run_id}"
        ) from exc
    if network_setting() == "host":
        return replace(found, network="host")
    if not found.confined or found.network != "loopback":
        raise sandbox.SandboxUnavailable(
            f"{NETWORK_ENV}=none needs bubblewrap with its own network namespace, and this "
            f"run's agent would run {'unconfined' if not found.confined else 'on the host network'}"
            f"; {sandbox.INSTALL_HINT}, or unset {NETWORK_ENV}"
        )
    return found


def record(rt: Runtime, confinement: Confinement, command: str) -> None:
    """Say, and keep in the checkpoint (an ``agent_started`` event), the agent's isolation."""
    shown = {"kind": confinement.kind, "network": confinement.network}
    if not confinement.confined:
        shown["unconfined_because"] = confinement.reason
    where = f"bwrap, network {confinement.network}" if confinement.confined else "none"
    rt.say(f"agent: {shlex.split(command)[0]} (isolation: {where})")
    if rt.state.agent_isolation != shown:
        event = Event("agent_started", time.time(), dict(shown))
        rt.commit(replace(rt.state, agent_isolation=shown).with_events(event))


@contextlib.contextmanager
def spawn(command: str, rt: Runtime) -> Iterator[Supervised]:
    """Start the agent command under the supervisor (in bwrap when the run's isolation
    gives one), its stdin and stdout piped to us; its private home removed afterwards."""
    argv = shlex.split(command)
    confinement = confinement_for(rt)
    record(rt, confinement, command)
    if not confinement.confined:
        yield supervise(
            argv, confined=False, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=agent_env()
        )
        return
    hide = rt._secrets()  # the runtime's one list of what children never see
    dirs = (*hide.dirs, rt.env.worktree)
    with scratch.private("gitrun-agent-") as own:
        home, blank = own / "home", own / "blank"
        (home / "tmp").mkdir(parents=True)
        blank.touch(0o444)
        cwd = Path.cwd().resolve()  # kept, unless hidden (a key file beside it is blanked)
        if any(cwd.is_relative_to(d.resolve()) for d in dirs):
            cwd = home
        files = (*hide.files, *credential_sockets())  # e.g. ssh-agent: push rights to a remote
        layout = Layout.of([home], dirs, files, cwd, blank, private_tmp=False)
        if confinement.bwrap is None:
            raise GitrunError("a bwrap confinement needs the bwrap path")
        named = {str(f) for f in files} | {str(f.resolve()) for f in files}
        env = {k: v for k, v in agent_env().items() if not any(n in v for n in named)}
        env = {k: v for k, v in env.items() if k not in CREDENTIAL_SOCKETS}
        env |= {"HOME": str(home), "TMPDIR": str(home / "tmp")}
        wrap = [confinement.bwrap, *layout.bwrap_args(confinement), "--"]
        yield supervise(
            argv, wrap, confined=True, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env,
        )  # fmt: skip


def serve_child(command: str, rt: Runtime, serve: Callable[[Transport], RunState]) -> RunState:
    """Run ``serve`` over the agent's pipes; stop the agent however the session ends."""
    with spawn(command, rt) as child:
        return _serve(child, command, serve)


def _serve(child: Supervised, command: str, serve: Callable[[Transport], RunState]) -> RunState:
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
