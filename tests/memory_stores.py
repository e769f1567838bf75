"""In-memory implementations of the three store contracts: a test helper, never the product.

They honour :mod:`gitrun.core.contracts` exactly as the git stores do (compare-and-swap of one
head, the fence re-checked in the same step and before the compare, strict refusals that
change nothing, validation before anything is written, signed checkpoints verified on
load), so the conformance suite runs the same tests against both, and a pure test can
use them without git. All three share one :class:`MemoryBackend`, as the git stores
share one repository: a fence taken from the lease store is what the other two check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from gitrun.core.codec import canonical_bytes, digest, encode
from gitrun.core.contracts import Appended
from gitrun.core.errors import (
    CasFailed,
    CheckpointRejected,
    LeaseHeld,
    LeaseLost,
    ReceiptConflict,
    ReceiptDrift,
)
from gitrun.core.records import Receipt, RunState
from gitrun.core.validate import validate_state
from gitrun.store.checkpoint import _check_scenario
from gitrun.store.checkpoint_verify import decode_state
from gitrun.store.keys import Keyring
from gitrun.store.lease import Fence, Lease

DOMAIN = b"gitrun-memory-checkpoint/1\n"


def _hex_id(value: object) -> str:
    """A 40-hex id, like a git object id, derived from the content."""
    return digest(value).removeprefix("sha256:")[:40]


@dataclass
class CheckpointObject:
    """A stored checkpoint: the canonical payload and the MAC over (ref, parent, payload)."""

    parent: str
    payload: bytes
    key_id: str
    mac: str
    committed_at: int


@dataclass(frozen=True)
class MemoryStored:
    """A verified checkpoint (the memory twin of :class:`gitrun.store.checkpoint.Stored`)."""

    state: RunState
    oid: str
    key_id: str
    committed_at: int


@dataclass(frozen=True)
class MemoryWrite:
    """A prepared write: what the git adapter puts in a commit's trailers and tree."""

    run_id: str
    key: str
    intent_digest: str
    action: str
    parent: str
    paths: tuple[str, ...]
    instance_id: str = "memory-instance"
    lease: int = 0
    approval: str = "none"

    @property
    def id(self) -> str:
        return _hex_id(encode(self))


@dataclass
class MemoryBackend:
    """Everything one in-memory "repository" holds; ``objects`` counts every stored object."""

    checkpoint_heads: dict[str, str] = field(default_factory=dict)
    checkpoints: dict[str, CheckpointObject] = field(default_factory=dict)
    leases: dict[str, tuple[Lease, int]] = field(default_factory=dict)  # run → (lease, serial)
    live_owners: set[tuple[str, str]] = field(default_factory=set)  # (run, worker) at work
    bases: dict[str, str] = field(default_factory=dict)
    branches: dict[str, list[str]] = field(default_factory=dict)  # run → receipt ids, oldest first
    receipts: dict[str, Receipt] = field(default_factory=dict)
    index: dict[tuple[str, str], str] = field(default_factory=dict)
    objects: int = 0

    def check_fence(self, run_id: str, fence: Fence) -> None:
        """Refuse unless the run's lease is still ``fence`` and unexpired (as fence_guard)."""
        held = self.leases.get(run_id)
        if held is None:
            raise LeaseLost(None, f"run {run_id} has no lease; this worker no longer owns it")
        lease = held[0]
        if lease.owner_worker != fence.owner or lease.lease_version != fence.version:
            raise LeaseLost(
                lease.owner_worker,
                f"lease lost: run {run_id} is now owned by {lease.owner_worker} "
                f"(lease {lease.lease_version}); this worker held lease {fence.version}",
            )
        if lease.expires_at <= time.time():
            raise LeaseLost(None, f"lease {fence.version} on run {run_id} expired")


# -- the checkpoint log ------------------------------------------------------------------


def _signed(ref: str, parent: str, payload: bytes) -> bytes:
    return DOMAIN + ref.encode() + b"\n" + parent.encode() + b"\n" + payload


class MemoryCheckpointLog:
    """:class:`gitrun.core.contracts.CheckpointLog` over a :class:`MemoryBackend`."""

    def __init__(self, backend: MemoryBackend, keyring: Keyring) -> None:
        self.backend = backend
        self.keyring = keyring

    def head(self, ref: str) -> str | None:
        return self.backend.checkpoint_heads.get(ref)

    def advance(self, ref: str, state: RunState, expected: str | None, fence: Fence | None) -> str:
        payload = validate_state(state)
        parent = expected or ""
        key_id, mac = self.keyring.sign(_signed(ref, parent, payload))
        if fence is not None:
            self.backend.check_fence(state.run_id, fence)
        actual = self.head(ref)
        if actual != expected:
            raise CasFailed(ref, expected, actual, f"checkpoint generation {state.generation}")
        oid = _hex_id([parent, payload.decode(), mac])
        self.backend.checkpoints[oid] = CheckpointObject(
            parent, payload, key_id, mac, int(time.time())
        )
        self.backend.objects += 1
        self.backend.checkpoint_heads[ref] = oid
        return oid

    def load(
        self, ref: str, *, scenario_parts: dict[str, str] | None, offered: str | None = None
    ) -> MemoryStored:
        head = self.head(ref)
        if head is None:
            raise CheckpointRejected("high-water-mark-missing", f"{ref} does not exist")
        if offered is not None and offered != head:
            raise CheckpointRejected(
                "stale-generation", f"checkpoint {offered} is not the high-water mark {head}"
            )
        stored = self.read(ref, head)
        if scenario_parts is not None:
            _check_scenario(stored.state, scenario_parts)
        return stored

    def chain(self, ref: str, limit: int | None = None) -> list[MemoryStored]:
        out: list[MemoryStored] = []
        oid = self.head(ref)
        while oid and (limit is None or len(out) < limit):
            out.append(self.read(ref, oid))
            oid = self.backend.checkpoints[oid].parent
        return out

    def read(self, ref: str, oid: str) -> MemoryStored:
        """Verify one stored checkpoint's MAC and decode it strictly."""
        obj = self.backend.checkpoints.get(oid)
        if obj is None:
            raise CheckpointRejected("corrupt", f"checkpoint object {oid} is missing")
        verdict = self.keyring.verify(obj.key_id, _signed(ref, obj.parent, obj.payload), obj.mac)
        if verdict is None:
            raise CheckpointRejected("unknown-key", f"checkpoint {oid}: unknown key {obj.key_id}")
        if not verdict:
            raise CheckpointRejected("bad-signature", f"checkpoint {oid} does not verify")
        state = _decode_state(obj.payload, oid)
        parent = self.backend.checkpoints.get(obj.parent) if obj.parent else None
        parent_gen = _decode_state(parent.payload, obj.parent).generation if parent else 0
        if state.generation != parent_gen + 1:
            raise CheckpointRejected(
                "generation-gap", f"generation {state.generation} follows {parent_gen}"
            )
        return MemoryStored(state, oid, obj.key_id, obj.committed_at)


def _decode_state(payload: bytes, oid: str) -> RunState:
    """The git store's own payload checks (JSON, schema, fields), then canonical bytes."""
    state = decode_state(payload, oid)
    if canonical_bytes(encode(state)) != payload:
        raise CheckpointRejected("corrupt", f"checkpoint {oid} payload is not canonical")
    return state


# -- the lease store ---------------------------------------------------------------------


class MemoryLeaseStore:
    """:class:`gitrun.core.contracts.LeaseStore` over a :class:`MemoryBackend`.

    ``live_owners`` plays the part of the git store's per-worker OS owner lock: a handle
    claims it while it works on the run and drops it on release or a lost acquire.
    """

    def __init__(
        self, backend: MemoryBackend, run_id: str, worker: str, duration: float = 30.0
    ) -> None:
        self.backend = backend
        self.run_id = run_id
        self.worker = worker
        self.duration = duration
        self.lease: Lease | None = None
        self._serial: int | None = None
        self._claimed = False

    @property
    def fence(self) -> Fence:
        if self.lease is None:
            raise LeaseLost(None, f"worker {self.worker} holds no lease on run {self.run_id}")
        return Fence(self.worker, self.lease.lease_version)

    def _claim(self) -> bool:
        me = (self.run_id, self.worker)
        if self._claimed:
            return True
        if me in self.backend.live_owners:
            return False
        self.backend.live_owners.add(me)
        self._claimed = True
        return True

    def _drop(self) -> None:
        if self._claimed:
            self.backend.live_owners.discard((self.run_id, self.worker))
            self._claimed = False

    def _write(self, lease: Lease, expected: int | None) -> None:
        held = self.backend.leases.get(self.run_id)
        actual = held[1] if held else None
        if actual != expected:
            raise CasFailed(f"lease {self.run_id}", str(expected), str(actual), "lease")
        serial = (actual or 0) + 1
        self.backend.leases[self.run_id] = (lease, serial)
        self.backend.objects += 1
        self.lease, self._serial = lease, serial

    def check_takeable(self, takeover_after: float | None = None) -> tuple[Lease | None, object]:
        if not self._claim():
            raise LeaseHeld(
                self.worker, 0.0, f"worker id {self.worker} is already at work on {self.run_id}"
            )
        held = self.backend.leases.get(self.run_id)
        current, serial = held if held else (None, None)
        now = time.time()
        if current is not None and current.owner_worker != self.worker:
            taking_over = (
                current.expires_at <= now
                or (takeover_after is not None and now - current.renewed_at >= takeover_after)
                or (self.run_id, current.owner_worker) not in self.backend.live_owners
            )
            if not taking_over:
                self._drop()
                raise LeaseHeld(
                    current.owner_worker,
                    current.expires_at,
                    f"another worker owns run {self.run_id}: {current.owner_worker}",
                )
        return current, serial

    def acquire(self, state_version: int, takeover_after: float | None = None) -> Lease:
        current, serial = self.check_takeable(takeover_after)
        now = time.time()
        version = (
            1
            if current is None
            else current.lease_version + (0 if current.owner_worker == self.worker else 1)
        )
        lease = Lease(
            1, self.run_id, self.worker, version, now + self.duration, state_version, now, now
        )
        try:
            self._write(lease, serial if isinstance(serial, int) else None)
        except CasFailed as exc:
            self._drop()
            raise LeaseHeld("unknown", 0.0, f"another worker took {self.run_id} first") from exc
        return lease

    def renew(self, state_version: int | None = None) -> Lease:
        if self.lease is None:
            raise LeaseLost(None, "renew without a lease")
        held = self.backend.leases.get(self.run_id)
        if held is None or held[1] != self._serial:
            owner = held[0].owner_worker if held else None
            raise LeaseLost(owner, f"lease lost on run {self.run_id}: now held by {owner}")
        current = held[0]
        now = time.time()
        if current.expires_at <= now:
            raise LeaseLost(None, f"lease on run {self.run_id} expired before renewal")
        sv = current.state_version if state_version is None else state_version
        lease = replace(current, expires_at=now + self.duration, renewed_at=now, state_version=sv)
        self._write(lease, self._serial)
        return lease

    def maybe_renew(self, state_version: int | None = None) -> None:
        if self.lease is not None and self.lease.expires_at - time.time() < self.duration * 2 / 3:
            self.renew(state_version)

    def release(self) -> None:
        held = self.backend.leases.get(self.run_id)
        if self.lease is not None and held is not None and held[1] == self._serial:
            self._write(replace(held[0], expires_at=time.time()), self._serial)
        self.lease = None
        self._drop()

    def pop_takeover(self) -> Lease | None:
        """Always None: the memory store models no other worker alive at a takeover."""
        return None


# -- the receipt log ---------------------------------------------------------------------


class MemoryReceiptLog:
    """:class:`gitrun.core.contracts.ReceiptStore` of :class:`MemoryWrite` over a backend."""

    def __init__(self, backend: MemoryBackend, run_id: str) -> None:
        self.backend = backend
        self.run_id = run_id

    @property
    def _history(self) -> list[str]:
        return self.backend.branches.setdefault(self.run_id, [])

    def head(self) -> str:
        history = self._history
        return history[-1] if history else self.backend.bases[self.run_id]

    def lookup(self, key: str, since: str | None = None, *, repair: bool = True) -> Receipt | None:
        indexed = self.backend.index.get((self.run_id, key))
        if indexed is not None:
            return self._check_indexed(key, indexed)
        for rid in reversed(self._history):
            if rid == since:
                break
            receipt = self.backend.receipts[rid]
            if receipt.key == key:
                if repair:
                    self._write_index(key, rid)
                return receipt
        return None

    def _check_indexed(self, key: str, rid: str) -> Receipt:
        receipt = self.backend.receipts.get(rid)
        if receipt is None:
            raise ReceiptDrift("index-dangling", f"receipt index for {key} points at nothing")
        if receipt.key != key:
            raise ReceiptDrift("index-mismatch", f"receipt index for {key} points at {rid}")
        if rid not in self._history:
            raise ReceiptDrift("receipt-not-on-branch", f"receipt {rid} is not in the history")
        return receipt

    def _write_index(self, key: str, rid: str) -> bool:
        if self.backend.index.get((self.run_id, key)) == rid:
            return False
        self.backend.index[(self.run_id, key)] = rid
        return True

    def append(self, write: MemoryWrite, expected: str, fence: Fence) -> Appended:
        found = self.lookup(write.key, since=expected, repair=False)
        if found is not None:
            self.backend.check_fence(self.run_id, fence)
            if found.intent_digest != write.intent_digest:
                raise ReceiptConflict(found, write.intent_digest)
            return Appended(found, replayed=True)
        if write.run_id != self.run_id or write.parent != expected:
            raise ReceiptDrift("not-a-write", f"write {write.id} is not based on {expected}")
        self.backend.check_fence(self.run_id, fence)
        actual = self.head()
        if actual != expected:
            raise CasFailed(f"receipts {self.run_id}", expected, actual, "branch")
        receipt = Receipt(
            namespace=f"memory:{self.run_id}",
            version="gitrun-memory/1",
            commit=write.id,
            key=write.key,
            intent_digest=write.intent_digest,
            action=write.action,
            parent=write.parent,
            tree=digest(list(write.paths)),
            run_id=self.run_id,
            instance_id=write.instance_id,
            lease=write.lease,
            approval=write.approval,
            committed_at=int(time.time()),
            paths=write.paths,
        )
        self.backend.receipts[write.id] = receipt
        self.backend.objects += 1
        self._history.append(write.id)
        self._write_index(write.key, write.id)
        return Appended(receipt, replayed=False)

    def rebuild_index(self) -> int:
        return sum(self._write_index(self.backend.receipts[r].key, r) for r in self._history)

    def receipts(self) -> list[Receipt]:
        return [self.backend.receipts[r] for r in self._history]
