"""A pure test world for the state machine: run states, receipts, evidence, a model adapter.

No git: the model adapter keeps what the git adapter keeps (the branch tip, a receipt
per idempotency key, looked up before any write) so the machine can be driven through
every crash window in microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gitrun.core.codec import digest
from gitrun.core.machine import Grant
from gitrun.core.records import (
    ADAPTER_VERSION,
    Action,
    EnvState,
    Pending,
    Precondition,
    Receipt,
    RunState,
    Scope,
    first_state,
)

INSTANCE = "inst-1"
BRANCH = "refs/heads/gitrun/r-1"
CLEAN = "sha256:clean"


def oid(n: int) -> str:
    return f"{n:040x}"


BASE, BASE_TREE = oid(1), oid(2)


def initial_state() -> RunState:
    """Generation 1 of a run on a clean base commit, as ``runtime.begin`` writes it."""
    return first_state(
        run_id="r-1",
        task=("t-1", "1"),
        policy=("p-1", "1"),
        scenario=("sha256:scenario", {}),
        agent="script",
        identity="w-1",
        scope=Scope(("write_file", "delete_file"), ("**",), (), "1"),
        env=EnvState(INSTANCE, "/wt", BRANCH, BASE, BASE, BASE_TREE, CLEAN, BASE, 0),
        lease_version=1,
        at=0.0,
    )


def write(path: str = "a.txt", content: str = "x") -> Action:
    return Action("write_file", path, content)


def evidence(nonce: str, expires_at: float, key: str = "") -> dict[str, Any]:
    """Encoded Signed evidence, as ``pending.approval`` holds it (signature not checked here)."""
    claims = {"nonce": nonce, "expires_at": expires_at, "key": key}
    return {"claims": claims, "signer": "ed-approver", "signature": f"sig-{nonce}"}


def grant_of(p: Pending | None, expiry: dict[str, float]) -> Grant | None:
    """What the runtime's verification of the pending's evidence yields."""
    if p is None or p.approval is None:
        return None
    fp = digest(p.approval)
    return Grant(fp, expiry[fp])


@dataclass
class Adapter:
    """The git adapter's contract in memory: one receipt per key, looked up first."""

    branch: str = BASE
    trees: dict[str, str] = field(default_factory=lambda: {BASE: BASE_TREE})
    index: dict[str, Receipt] = field(default_factory=dict)
    counter: int = 100

    def _new(self) -> str:
        self.counter += 1
        return oid(self.counter)

    def commit(
        self, key: str, intent_digest: str, kind: str, grant: Grant | None, at: float
    ) -> Receipt:
        """A write commit on the branch tip with these trailers (no lookup)."""
        commit, tree = self._new(), self._new()
        receipt = Receipt(
            namespace="git:" + BRANCH,
            version=ADAPTER_VERSION,
            commit=commit,
            key=key,
            intent_digest=intent_digest,
            action=kind,
            parent=self.branch,
            tree=tree,
            run_id="r-1",
            instance_id=INSTANCE,
            lease=1,
            approval=grant.fingerprint if grant else "none",
            committed_at=int(at),
            paths=("a.txt",),
        )
        self.index[key] = receipt
        self.trees[commit] = tree
        self.branch = commit
        return receipt

    def execute(self, p: Pending, grant: Grant | None, at: float) -> tuple[Receipt, bool] | None:
        """``Environment.execute``: replay, conflict (other digest), or one new write."""
        found = self.index.get(p.key)
        if found is not None:
            return found, True
        if self.branch != p.precondition.head:
            return None  # the branch CAS refuses: nothing is written
        return self.commit(p.key, p.intent_digest, p.action.kind, grant, at), False


def precondition_at(adapter: Adapter, instance: str = INSTANCE) -> Precondition:
    return Precondition(instance, adapter.branch, adapter.trees[adapter.branch])


def with_pending(state: RunState, pending: Pending, **kw: Any) -> RunState:
    return replace(state, pending=pending, **kw)
