"""Connecting to a Ray cluster (the ``ray`` extra), for gitrun's Ray executor and agent runs.

Ray is imported only here and only when asked for, so gitrun without the extra loses
nothing but the Ray options, which then say what to install (exit 10). A cluster gitrun
started itself (no address: a local one on this machine) is shut down when gitrun is
done with it; a cluster at an address is only disconnected from.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from types import ModuleType

from gitrun.core.errors import BadInput, ExtraMissing

PROBE_SECONDS = 5.0  # how long a --ray-address may take to accept a connection


def require_ray(what: str) -> ModuleType:
    """The ``ray`` module; :class:`ExtraMissing` (one line, exit 10) without the extra."""
    try:
        import ray
    except ImportError as exc:
        raise ExtraMissing("ray", what) from exc
    return ray


@contextlib.contextmanager
def connected(address: str | None, num_cpus: int | None, what: str) -> Iterator[ModuleType]:
    """Ray, connected to the cluster at ``address`` (``auto``: the one this machine is part
    of), or to a local cluster of ``num_cpus`` CPUs started here and shut down after;
    already connected (a trainer's own ``ray.init``): that connection, left as it is."""
    ray = require_ray(what)
    if ray.is_initialized():
        yield ray
        return
    # Ray's own log lines would interleave with gitrun's progress: gitrun reports each
    # task's outcome itself, and a task's failure reaches the driver as an exception.
    options = {"log_to_driver": False, "configure_logging": False}
    if address:
        _reachable(address, what)  # ray.init retries an unreachable address for ever
    try:
        if address:
            ray.init(address=address, **options)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise BadInput(
            f"{what}: could not connect to {where} ({first}); check --ray-address (host:port "
            "of the head node's GCS, or auto) and that this machine runs the same Ray and "
            "Python versions as the cluster"
        ) from exc
    try:
        yield ray
    finally:
        ray.shutdown()


def _reachable(address: str, what: str) -> None:
    """Refuse, in a few seconds, a ``host:port`` nothing listens on (``auto`` is Ray's)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        if address == "auto":
            return
        raise BadInput(f"{what}: --ray-address {address} is not HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise BadInput(
            f"{what}: no Ray cluster answers at {address} ({exc.strerror or exc}); start "
            "its head node (`ray start --head`) or fix --ray-address (the head's GCS "
            "address, HOST:PORT, as `ray start` printed it)"
        ) from exc


def node_name() -> str:
    """This node's host name, as the results say where each task ran."""
    return os.uname().nodename
