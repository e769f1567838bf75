"""The lease store on a shared git remote: taken, renewed and released by atomic push.

Build it with a :class:`~gitrun.store.remote.RemoteSite`:
``RemoteLeaseStore(site, run_id, worker, seconds)``. The lease ref and record are the
local store's (``refs/gitrun/runs/<run>/lease`` → a :class:`~gitrun.store.lease.Lease`
blob); only the commit point differs: a ``--force-with-lease`` push.

A worker known dead may be taken over at once only when it worked through this same
clone (its OS owner lock lives here and is free). A worker on another machine cannot be
proven dead from here: its lease is taken over when it expires, or after
``takeover_after`` seconds without a renewal, never earlier, so a partition never makes
two owners.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pygit2

from gitrun.core.codec import canonical_bytes, encode
from gitrun.core.errors import CasFailed, GitrunError, LeaseHeld, LeaseLost
from gitrun.store import gitstore
from gitrun.store.lease import (
    DEFAULT_DURATION,
    Lease,
    LeaseManager,
    lease_ref,
    next_version,
    owner_alive,
    owner_lock_path,
    read_lease,
)
from gitrun.store.remote import RemoteSite, RemoteTransaction


def _until(expires_at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(expires_at))


class RemoteLeaseStore(LeaseManager):
    """Acquire, renew and release one run's lease on the remote for one worker.

    A :class:`LeaseManager` (the runtime drives either): the same record, owner lock and
    fence, with every read fetched from the remote and every write a leased push.
    """

    def __init__(
        self, site: RemoteSite, run_id: str, worker: str, duration: float = DEFAULT_DURATION
    ) -> None:
        super().__init__(site.repo, run_id, worker, duration)
        self.site = site

    def _owner_dead(self, worker: str) -> bool:
        """True only for a worker that worked through this clone and whose process is gone."""
        if not owner_lock_path(self.repo, self.run_id, worker).exists():
            return False
        return not owner_alive(self.repo, self.run_id, worker)

    def check_takeable(
        self, takeover_after: float | None = None
    ) -> tuple[Lease | None, pygit2.Oid | None]:
        """Raise LeaseHeld unless acquire may take the lease now (read fresh from the
        remote); writes nothing. (current lease, its blob id)."""
        self._claim_or_refuse()
        try:
            self.site.sync(self.run_id)
            current, oid = read_lease(self.repo, self.run_id)
            self._refuse_unless_takeable(current, takeover_after)
        except GitrunError:
            self._drop_owner_lock()
            raise
        return current, oid

    def _where(self) -> str:
        return f", lease on {self.site.url}"

    def acquire(
        self, state_version: int, takeover_after: float | None = None, *, floor: int = 0
    ) -> Lease:
        """Take the lease (see the LeaseStore contract) by one leased push."""
        current, oid = self.check_takeable(takeover_after)
        taken_over = self.takeover_of(current)
        now = time.time()
        version = next_version(current, self.worker, floor)
        lease = Lease(
            1, self.run_id, self.worker, version, now + self.duration, state_version, now, now
        )
        blob = gitstore.write_blob(self.repo, canonical_bytes(encode(lease)))
        old = None if oid is None else str(oid)
        txn = RemoteTransaction(self.site, self.run_id)
        txn.move(lease_ref(self.run_id), old, str(blob), what="lease", seen=old)
        try:
            rejected = txn.commit(f"taking the lease of run {self.run_id}")
        except GitrunError:
            self._drop_owner_lock()
            raise
        if rejected is not None:
            self._drop_owner_lock()
            raise self._lost_race()
        self.lease, self._oid, self._taken_over = lease, blob, taken_over
        return lease

    def _lost_race(self) -> LeaseHeld:
        self.site.sync(self.run_id)
        winner, _ = read_lease(self.repo, self.run_id)
        owner = winner.owner_worker if winner else "unknown"
        expires = winner.expires_at if winner else 0.0
        return LeaseHeld(
            owner,
            expires,
            f"another worker took run {self.run_id} first: {owner} until {_until(expires)}",
        )

    def _ours(self, what: str) -> tuple[Lease, pygit2.Oid]:
        """The cached lease if it is still this handle's and live; LeaseLost otherwise."""
        current, oid = read_lease(self.repo, self.run_id)
        held = self.lease
        if held is None:
            raise LeaseLost(None, f"{what} without a lease")
        if current is None or oid is None:
            raise LeaseLost(None, f"run {self.run_id} has no lease on {self.site.url}")
        if (current.owner_worker, current.lease_version) != (self.worker, held.lease_version):
            raise LeaseLost(
                current.owner_worker,
                f"lease lost on run {self.run_id}: now held by {current.owner_worker} "
                f"(lease {current.lease_version})",
            )
        if current.expires_at <= time.time():
            raise LeaseLost(None, f"lease on run {self.run_id} expired before {what}")
        return current, oid

    def renew(self, state_version: int | None = None) -> Lease:
        """Extend our lease by one leased push; LeaseLost if it is no longer ours."""
        if self.lease is None:
            raise LeaseLost(None, "renew without a lease")

        def plan(txn: RemoteTransaction) -> Lease:
            current, oid = self._ours("renewal")
            now = time.time()
            lease = replace(
                current,
                expires_at=now + self.duration,
                renewed_at=max(now, current.renewed_at + 0.001),
                state_version=current.state_version if state_version is None else state_version,
            )
            blob = gitstore.write_blob(self.repo, canonical_bytes(encode(lease)))
            txn.move(lease_ref(self.run_id), str(oid), str(blob), what="lease", seen=str(oid))
            return lease

        self.lease = self.site.transact(self.run_id, plan, f"renewing run {self.run_id}'s lease")
        return self.lease

    def release(self) -> None:
        """Give the lease up (expire it now, keep its version); a lost lease is left alone."""
        if self.lease is None:
            self._drop_owner_lock()
            return

        def plan(txn: RemoteTransaction) -> None:
            current, oid = self._ours("release")
            lease = replace(current, expires_at=time.time())
            blob = gitstore.write_blob(self.repo, canonical_bytes(encode(lease)))
            txn.move(lease_ref(self.run_id), str(oid), str(blob), what="lease", seen=str(oid))

        try:
            self.site.transact(self.run_id, plan, f"releasing run {self.run_id}'s lease")
        except (LeaseLost, CasFailed):
            pass
        finally:
            self.lease = None
            self._drop_owner_lock()


__all__ = ["RemoteLeaseStore"]
