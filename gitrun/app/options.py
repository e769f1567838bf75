"""The options of a use case (workspace, worker, lease, remote, ...), apart from
:mod:`gitrun.app.opening` so that ``gitrun status`` builds them without pygit2 (issue #15)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gitrun.app.workspace import RunRecord, Workspace
from gitrun.store.lease_record import DEFAULT_DURATION, default_worker_id

if TYPE_CHECKING:
    from gitrun.engine.approvals import Approvals
    from gitrun.engine.verifier import Secrets

__all__ = ["Options", "quiet"]


def quiet(_: str) -> None:
    return None


@dataclass
class Options:
    """What a use case runs with: the workspace, this worker, its lease and remote."""

    workspace: Workspace
    worker: str = field(default_factory=default_worker_id)
    lease_seconds: float = DEFAULT_DURATION
    takeover_after: float | None = None
    say: Callable[[str], None] = quiet
    trust_roots: Path | None = None
    isolation: str | None = None  # --isolation: overrides the task's [verifier] isolation
    output_log: Path | None = None  # the verifier keeps its command's output here (swebench)
    remote: str | None = None  # --remote: the shared git remote is the runs' source of truth

    def remote_for(self, record: RunRecord | None = None) -> str | None:
        """The remote of a run: --remote, else the run's own (a registered run keeps its
        store), else for a run not registered here the workspace config's."""
        if self.remote:
            return self.remote
        if record is not None:
            return record.remote or None
        return self.workspace.config_remote

    @property
    def approvals(self) -> Approvals:
        from gitrun.engine.approvals import Approvals
        from gitrun.store.evidence import load_trust_roots

        return Approvals(load_trust_roots(self.trust_roots) if self.trust_roots else None)

    @property
    def secrets(self) -> Secrets:
        """What the code under test must never see: this workspace and its keyring."""
        from gitrun.engine.verifier import Secrets

        return Secrets((self.workspace.root,), (self.workspace.key_file,))
