"""The environment adapter's records: the observation a step plans on, the approval facts
the adapter enforces at the commit point, and what one write did.

Pure (no pygit2, no I/O), so the agents and the approval rules need not import the git
adapter to speak of them; :mod:`gitrun.adapter.environment` re-exports all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gitrun.core.codec import digest
from gitrun.core.records import Receipt

__all__ = ["CLEAN_STATUS", "Approval", "Observation", "Outcome"]


@dataclass(frozen=True)
class Observation:
    """The state fingerprint; ``status_digest`` is the digest of uncommitted changes."""

    instance_id: str
    head: str
    tree: str
    status_digest: str
    dirty: tuple[str, ...]

    def fingerprint(self) -> str:
        """One digest of instance, HEAD, tree and status: what an intent was planned on."""
        return digest([self.instance_id, self.head, self.tree, self.status_digest])


@dataclass(frozen=True)
class Approval:
    """What the adapter itself enforces of an approval: its fingerprint and expiry."""

    fingerprint: str
    expires_at: float


@dataclass(frozen=True)
class Outcome:
    """What one execute did: the receipt, and whether it was already there (a replay)."""

    receipt: Receipt
    replayed: bool


CLEAN_STATUS = digest([])
