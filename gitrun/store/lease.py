"""Run ownership: one lease ref per run, taken and renewed only by compare-and-swap.

The lease ref ``refs/gitrun/runs/<run>/lease`` points at a blob holding a :class:`Lease`.
Its ``lease_version`` grows by one on every change of owner and is the fencing token:
every checkpoint advance and every adapter write locks the lease ref in the same ref
transaction that moves its own ref and refuses to move unless the lease is still the
caller's (:func:`fence_guard`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pygit2

from gitrun.core.codec import canonical_bytes, encode
from gitrun.core.errors import CasFailed, GitrunError, LeaseHeld, LeaseLost, LeaseUnreadable
from gitrun.store import gitstore
from gitrun.store.lease_record import DEFAULT_DURATION as DEFAULT_DURATION  # noqa: PLC0414 - re-export
from gitrun.store.lease_record import Lease as Lease  # noqa: PLC0414 - re-export
from gitrun.store.lease_record import default_worker_id as default_worker_id  # noqa: PLC0414
from gitrun.store.lease_record import lease_from_bytes
from gitrun.store.lease_record import lease_ref as lease_ref  # noqa: PLC0414 - re-export

if TYPE_CHECKING:
    # filelock (and the logging it pulls in) loads only when a lease is taken or probed.
    import filelock


@dataclass(frozen=True)
class Fence:
    """What a writer presents: the lease it believes it holds."""

    owner: str
    version: int


def read_lease(repo: pygit2.Repository, run_id: str) -> tuple[Lease | None, pygit2.Oid | None]:
    oid = gitstore.read_ref(repo, lease_ref(run_id))
    if oid is None:
        return None, None
    return _decode(repo, oid), oid


_decoded: dict[tuple[str, pygit2.Oid], Lease] = {}  # (repository, blob id) -> its lease
_DECODED_MAX = 64


def _decode(repo: pygit2.Repository, oid: pygit2.Oid) -> Lease:
    """The lease the blob ``oid`` holds. A step checks the lease three times (each after
    reading the ref afresh); the blob's bytes are fixed by its id, so its decoding is
    kept per repository and id: a rewritten ref names another blob, decoded anew."""
    found = _decoded.get((repo.path, oid))
    if found is not None:
        return found
    try:
        data = gitstore.read_blob(repo, oid)
    except ValueError as exc:
        raise LeaseUnreadable(str(oid), str(exc)) from exc
    lease = lease_from_bytes(str(oid), data)
    if len(_decoded) >= _DECODED_MAX:
        _decoded.clear()
    _decoded[(repo.path, oid)] = lease
    return lease


def _until(expires_at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(expires_at))


def owner_lock_path(repo: pygit2.Repository, run_id: str, worker: str) -> Path:
    name = hashlib.sha256(worker.encode()).hexdigest()[:32]
    return gitstore.common_dir(repo) / "gitrun" / "owners" / run_id / f"{name}.flock"


def owner_alive(repo: pygit2.Repository, run_id: str, worker: str) -> bool:
    """Whether a live process on this machine holds ``worker``'s owner lock on the run.

    Each worker holds its own lock while it owns the run and the kernel drops it when the
    worker dies, so a lock we can take proves that worker is gone. The short wait lets a
    concurrent probe of the same lock finish rather than pass for a live owner.
    """
    path = owner_lock_path(repo, run_id, worker)
    path.parent.mkdir(parents=True, exist_ok=True)
    import filelock

    lock = filelock.FileLock(str(path), timeout=0.2)
    try:
        lock.acquire()
    except filelock.Timeout:
        return True
    lock.release()
    return False


def fence_guard(repo: pygit2.Repository, run_id: str, fence: Fence) -> gitstore.Guard:
    """A guard that refuses unless the lease (read under its lock) is still ``fence``.
    Two guards of one fence are equal: a transaction staged by two stores checks it once."""
    return gitstore.Guard(lease_ref(run_id), _FenceCheck(repo, run_id, fence))


@dataclass(frozen=True)
class _FenceCheck:
    repo: pygit2.Repository = field(compare=False)
    run_id: str
    fence: Fence

    def __call__(self, oid: pygit2.Oid | None) -> None:
        run_id, fence = self.run_id, self.fence
        if oid is None:
            raise LeaseLost(None, f"run {run_id} has no lease; this worker no longer owns it")
        lease = _decode(self.repo, oid)
        if lease.owner_worker != fence.owner or lease.lease_version != fence.version:
            raise LeaseLost(
                lease.owner_worker,
                f"lease lost: run {run_id} is now owned by {lease.owner_worker} "
                f"(lease {lease.lease_version}); this worker held lease {fence.version}",
            )
        if lease.expires_at <= time.time():
            raise LeaseLost(
                None, f"lease {fence.version} on run {run_id} expired; renew or resume again"
            )


@contextmanager
def fenced(repo: pygit2.Repository, run_id: str, fence: Fence) -> Iterator[None]:
    """Hold the lease ref's OS lock and check the lease is still ``fence`` under it.

    Every change of the lease (a takeover's acquire included) takes that same lock, so
    what the block writes (the worktree's instance id, the registry) lands before any
    new owner holds the run, or not at all: a stale worker gets :class:`LeaseLost`.
    Inside the block no transaction may guard on the lease (its lock is ours).
    """
    ref = lease_ref(run_id)
    with gitstore.os_locks(repo, [ref]):
        fence_guard(repo, run_id, fence).check(gitstore.read_ref(repo, ref))
        yield


def next_version(current: Lease | None, worker: str, floor: int) -> int:
    """The version a new lease of ``worker`` gets: the same when it holds the lease
    already, one more on a change of owner, and always above ``floor`` when the lease ref
    was lost or rewound below what the run's writes and checkpoints carry."""
    if current is None or current.lease_version < floor:
        return floor + 1
    return current.lease_version + (0 if current.owner_worker == worker else 1)


class LeaseManager:
    """Acquire, renew and release one run's lease for one worker."""

    def __init__(
        self, repo: pygit2.Repository, run_id: str, worker: str, duration: float = DEFAULT_DURATION
    ) -> None:
        self.repo = repo
        self.run_id = run_id
        self.worker = worker
        gitstore.set_worker(worker)  # named in the ref locks it takes: who holds what
        self.duration = duration
        self.lease: Lease | None = None
        self._oid: pygit2.Oid | None = None
        self._owner_lock: filelock.BaseFileLock | None = None
        self._taken_over: Lease | None = None  # see pop_takeover

    def _claim_owner_lock(self) -> bool:
        """Take this worker's OS-level owner lock on the run without waiting.

        The lock is per worker, so it speaks for the worker the lease names and no one
        else: a lease taken over by expiry (its old owner stopped, not dead) is still
        protected by its new owner's lock once the old owner dies. False means another
        live process works under the same worker id.
        """
        if self._owner_lock is not None:
            return True
        path = owner_lock_path(self.repo, self.run_id, self.worker)
        path.parent.mkdir(parents=True, exist_ok=True)
        import filelock

        lock = filelock.FileLock(str(path), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            return False
        self._owner_lock = lock
        return True

    def _drop_owner_lock(self) -> None:
        if self._owner_lock is not None:
            self._owner_lock.release()
            self._owner_lock = None

    @property
    def fence(self) -> Fence:
        if self.lease is None:
            raise LeaseLost(None, f"worker {self.worker} holds no lease on run {self.run_id}")
        return Fence(self.worker, self.lease.lease_version)

    def _write(self, lease: Lease, expected: pygit2.Oid | None, what: str) -> None:
        oid = gitstore.write_blob(self.repo, canonical_bytes(encode(lease)))
        gitstore.transaction(self.repo).move(
            lease_ref(self.run_id), expected, oid, message=f"gitrun lease {what}", what=what
        ).commit()
        self.lease, self._oid = lease, oid

    def acquire(
        self, state_version: int, takeover_after: float | None = None, *, floor: int = 0
    ) -> Lease:
        """Take the lease if free, ours, expired, not renewed for ``takeover_after``
        seconds, or held by a worker that is dead (its owner lock is free). ``floor``: the
        highest lease version that ever wrote to the run; a lease ref deleted (or put back)
        by hand must not start below it, or the first write would be a stale fence."""
        current, oid = self.check_takeable(takeover_after)
        taken_over = self.takeover_of(current)
        now = time.time()
        version = next_version(current, self.worker, floor)
        lease = Lease(
            1, self.run_id, self.worker, version, now + self.duration, state_version, now, now
        )
        try:
            self._write(lease, oid, "acquire")
        except CasFailed as exc:
            winner, _ = read_lease(self.repo, self.run_id)
            owner = winner.owner_worker if winner else "unknown"
            expires = winner.expires_at if winner else 0.0
            self._drop_owner_lock()
            raise LeaseHeld(
                owner,
                expires,
                f"another worker took run {self.run_id} first: {owner} until {_until(expires)}",
            ) from exc
        self._taken_over = taken_over
        return lease

    def pop_takeover(self) -> Lease | None:
        """The lease the last acquire took from another worker not known to be gone (its
        lease expired or went stale while its process lived on, or lives elsewhere): a
        takeover, which the run's next checkpoint records. Once: None afterwards, and
        None after a plain resume."""
        taken, self._taken_over = self._taken_over, None
        return taken

    def takeover_of(self, current: Lease | None) -> Lease | None:
        """``current`` when taking it is a takeover: another worker's lease, whose owner is
        not known gone (a released lease's owner let its owner lock go with it; a killed
        one's kernel did)."""
        if current is None or current.owner_worker == self.worker:
            return None
        return None if self._owner_dead(current.owner_worker) else current

    def check_takeable(
        self, takeover_after: float | None = None
    ) -> tuple[Lease | None, pygit2.Oid | None]:
        """Raise :class:`LeaseHeld` unless :meth:`acquire` may take the lease now.

        Writes nothing (it only takes this worker's OS owner lock), so a resume can
        check ownership, then the environment, and refuse without changing the repo.
        """
        self._claim_or_refuse()
        try:
            current, oid = read_lease(self.repo, self.run_id)
            self._refuse_unless_takeable(current, takeover_after)
            # Re-read under the lease's OS lock, so a worker stopped while holding it (in
            # a write, or setting up) is named now, before we write. What we return is
            # what acquire's compare-and-swap expects, so it must be judged too: another
            # worker may have taken the lease since the first read.
            with gitstore.os_locks(self.repo, [lease_ref(self.run_id)]):
                again, again_oid = read_lease(self.repo, self.run_id)
            if again_oid != oid:
                self._refuse_unless_takeable(again, takeover_after)
        except GitrunError:
            self._drop_owner_lock()
            raise
        return again, again_oid

    def _claim_or_refuse(self) -> None:
        """Take this worker's OS owner lock, or LeaseHeld: a live process already uses the id."""
        if not self._claim_owner_lock():
            raise LeaseHeld(
                self.worker,
                0.0,
                f"worker id {self.worker} is already at work on run "
                f"{self.run_id} in another live process; pick another --worker-id",
            )

    def _refuse_unless_takeable(self, current: Lease | None, takeover_after: float | None) -> None:
        """LeaseHeld unless ``current`` is free, ours, expired, stale or its owner dead."""
        now = time.time()
        if current is None or current.owner_worker == self.worker:
            return
        taking_over = (
            current.expires_at <= now
            or (takeover_after is not None and now - current.renewed_at >= takeover_after)
            or self._owner_dead(current.owner_worker)
        )
        if not taking_over:
            raise LeaseHeld(
                current.owner_worker,
                current.expires_at,
                f"another worker owns run {self.run_id}: {current.owner_worker} until "
                f"{_until(current.expires_at)} ({current.expires_at - now:.0f}s left"
                f"{self._where()}); retry later or pass --takeover-after",
            )

    def _owner_dead(self, worker: str) -> bool:
        """True when ``worker``'s process is known gone (its OS lock on this repository is free)."""
        return not owner_alive(self.repo, self.run_id, worker)

    def _where(self) -> str:
        """Where the lease lives, for a refusal's message (nothing: this repository)."""
        return ""

    def renew(self, state_version: int | None = None) -> Lease:
        """Extend our lease by compare-and-swap; LeaseLost if it is no longer ours."""
        if self.lease is None:
            raise LeaseLost(None, "renew without a lease")
        current, oid = read_lease(self.repo, self.run_id)
        if current is None or oid != self._oid:
            owner = current.owner_worker if current else None
            raise LeaseLost(owner, f"lease lost on run {self.run_id}: now held by {owner}")
        if current.expires_at <= time.time():
            raise LeaseLost(None, f"lease on run {self.run_id} expired before renewal")
        now = time.time()
        lease = replace(
            current,
            expires_at=now + self.duration,
            renewed_at=now,
            state_version=current.state_version if state_version is None else state_version,
        )
        try:
            self._write(lease, oid, "renew")
        except CasFailed as exc:
            raise LeaseLost(None, f"lease lost on run {self.run_id} during renewal") from exc
        return lease

    def maybe_renew(self, state_version: int | None = None) -> None:
        """Renew when a third of the lease has passed (cheap to call often)."""
        if self.lease is not None and self.lease.expires_at - time.time() < self.duration * 2 / 3:
            self.renew(state_version)

    def release(self) -> None:
        """Give the lease up on clean exit (expires it now, keeps the version)."""
        if self.lease is None:
            self._drop_owner_lock()
            return
        try:
            current, oid = read_lease(self.repo, self.run_id)
            if current is not None and oid == self._oid:
                self._write(replace(current, expires_at=time.time()), oid, "release")
        except CasFailed:
            pass
        finally:
            self.lease = None
            self._drop_owner_lock()
