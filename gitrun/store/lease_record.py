"""The lease record and its ref, apart from the ref updates of :mod:`gitrun.store.lease`:
what reading a lease needs, without pygit2 (``gitrun status`` reads it, issue #15)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from gitrun.core.codec import DecodeError, decode
from gitrun.core.errors import LeaseUnreadable

DEFAULT_DURATION = 30.0


@dataclass(frozen=True)
class Lease:
    """Who owns a run until when, and under which fencing version."""

    schema: int
    run_id: str
    owner_worker: str
    lease_version: int
    expires_at: float
    state_version: int  # checkpoint generation when the lease was last written
    acquired_at: float
    renewed_at: float  # last acquire or renewal: how stale the lease is, whatever its duration


def lease_ref(run_id: str) -> str:
    return f"refs/gitrun/runs/{run_id}/lease"


def default_worker_id() -> str:
    """Stable and readable: host, pid and a random part."""
    # (os.uname().nodename is gethostname(2) and os.urandom what secrets.token_hex reads:
    # neither socket nor secrets loads for `gitrun status`, issue #15)
    return f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"


def lease_from_bytes(oid: str, data: bytes) -> Lease:
    """The lease the blob ``oid`` (its bytes ``data``) holds; LeaseUnreadable otherwise."""
    try:
        return decode(Lease, json.loads(data))
    except (ValueError, DecodeError) as exc:
        raise LeaseUnreadable(oid, str(exc)) from exc


__all__ = ["DEFAULT_DURATION", "Lease", "default_worker_id", "lease_from_bytes", "lease_ref"]
