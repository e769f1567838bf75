"""The lease store contract, against every implementation: ownership, takeover, fencing."""

from __future__ import annotations

import time

import pytest

from conformance.stores import REF, Stores, sample_state
from gitrun.core.errors import LeaseHeld, LeaseLost

pytestmark = pytest.mark.timeout(30)

SHORT = 1.0  # seconds: a lease that expires within the test, yet outlives one push to a
# loaded git daemon (0.25 s did not: the remote-daemon store's first advance, a push, came
# after the expiry and was refused)


def test_acquire_renew_release_keep_one_version_for_one_owner(stores: Stores) -> None:
    lease = stores.leases("w1")
    with pytest.raises(LeaseLost):
        _ = lease.fence  # no lease yet: nothing to present
    got = lease.acquire(3)
    assert (got.owner_worker, got.lease_version, got.state_version) == ("w1", 1, 3)
    assert got.expires_at > time.time()
    assert (lease.fence.owner, lease.fence.version) == ("w1", 1)
    time.sleep(0.01)
    renewed = lease.renew(4)
    assert renewed.lease_version == 1
    assert renewed.state_version == 4
    assert renewed.expires_at > got.expires_at
    lease.release()
    with pytest.raises(LeaseLost):
        _ = lease.fence
    again = stores.leases("w1")
    assert again.acquire(5).lease_version == 1  # the same owner keeps its version


def test_a_second_worker_is_refused_while_the_lease_is_live_and_told_who_holds_it(
    stores: Stores,
) -> None:
    first = stores.leases("w1")
    held = first.acquire(0)
    before = stores.objects()
    other = stores.leases("w2")
    with pytest.raises(LeaseHeld) as caught:
        other.check_takeable()
    assert caught.value.owner == "w1"
    assert caught.value.expires_at == held.expires_at
    with pytest.raises(LeaseHeld) as caught:
        other.acquire(0)
    assert caught.value.owner == "w1"
    assert stores.objects() == before  # refusals write nothing
    with pytest.raises(LeaseLost):
        _ = other.fence
    assert first.renew().owner_worker == "w1"


def test_a_second_live_handle_with_the_same_worker_id_is_refused(stores: Stores) -> None:
    first = stores.leases("w1")
    first.acquire(0)
    with pytest.raises(LeaseHeld) as caught:
        stores.leases("w1").acquire(0)
    assert caught.value.owner == "w1"
    first.release()
    assert stores.leases("w1").acquire(0).lease_version == 1


def test_takeover_after_expiry_bumps_the_version_and_the_old_fence_is_refused_everywhere(
    stores: Stores,
) -> None:
    old = stores.leases("w1", duration=SHORT)
    old.acquire(0)
    stale = old.fence
    log = stores.checkpoints()
    first = log.advance(REF, sample_state(1), None, stale)
    receipts = stores.receipts()
    base = receipts.head()
    time.sleep(SHORT + 0.05)
    with pytest.raises(LeaseLost):  # expired, not yet taken over: refused already
        log.advance(REF, sample_state(2), first, stale)
    new = stores.leases("w2")
    taken = new.acquire(1)
    assert (taken.owner_worker, taken.lease_version) == ("w2", stale.version + 1)
    with pytest.raises(LeaseLost):
        log.advance(REF, sample_state(2), first, stale)
    with pytest.raises(LeaseLost):
        receipts.append(stores.draft("k-late", "sha256:late", base, stale), base, stale)
    with pytest.raises(LeaseLost):
        old.renew()
    assert log.head(REF) == first
    assert receipts.head() == base
    assert receipts.lookup("k-late") is None
    second = log.advance(REF, sample_state(2), first, new.fence)
    assert stores.checkpoints().head(REF) == second


def test_a_lease_not_renewed_for_takeover_after_seconds_can_be_taken_over(stores: Stores) -> None:
    old = stores.leases("w1")
    old.acquire(0)
    time.sleep(0.05)
    other = stores.leases("w2")
    with pytest.raises(LeaseHeld):
        other.acquire(0, takeover_after=60.0)
    taken = stores.leases("w2").acquire(0, takeover_after=0.01)
    assert (taken.owner_worker, taken.lease_version) == ("w2", 2)
    with pytest.raises(LeaseLost):
        old.renew()


def test_release_keeps_the_version_so_the_next_owner_is_fenced_above_it(stores: Stores) -> None:
    first = stores.leases("w1")
    first.acquire(0)
    first.release()
    second = stores.leases("w2")
    assert second.acquire(0).lease_version == 2
    second.release()
    third = stores.leases("w3")
    assert third.acquire(0).lease_version == 3
    assert third.fence.version == 3
