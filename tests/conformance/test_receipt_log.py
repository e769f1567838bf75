"""The receipt log contract, against every implementation: lookup, append, the key index."""

from __future__ import annotations

import pytest

from conformance.stores import Stores
from gitrun.core.contracts import ReceiptStore
from gitrun.core.errors import CasFailed, LeaseLost, ReceiptConflict, ReceiptDrift
from gitrun.core.records import Receipt
from gitrun.store.lease import Fence

pytestmark = pytest.mark.timeout(30)


class Log:
    """One run's receipt log with a held lease, and a helper to append a write."""

    def __init__(self, stores: Stores) -> None:
        self.stores = stores
        self.lease = stores.leases("w1")
        self.lease.acquire(0)
        self.log: ReceiptStore[object] = stores.receipts()

    @property
    def fence(self) -> Fence:
        return self.lease.fence

    def write(self, key: str, digest: str = "", on: str | None = None) -> Receipt:
        parent = self.log.head() if on is None else on
        draft = self.stores.draft(key, digest or f"sha256:{key}", parent, self.fence)
        appended = self.log.append(draft, parent, self.fence)
        assert not appended.replayed
        return appended.receipt


@pytest.fixture
def run(stores: Stores) -> Log:
    return Log(stores)


def test_an_appended_write_becomes_the_head_and_is_found_by_its_key(run: Log) -> None:
    base = run.log.head()
    assert base == run.stores.base
    assert run.log.lookup("k1") is None
    first = run.write("k1")
    assert (first.key, first.intent_digest, first.parent) == ("k1", "sha256:k1", base)
    assert first.lease == run.fence.version
    assert run.log.head() == first.commit
    second = run.write("k2")
    assert second.parent == first.commit
    fresh = run.stores.receipts()
    assert fresh.lookup("k1") == first
    assert fresh.lookup("k2", since=first.commit) == second
    assert fresh.receipts() == [first, second]
    assert run.stores.index_entry("k1") == first.commit


def test_the_same_key_twice_gives_the_same_receipt_and_never_a_second_one(run: Log) -> None:
    first = run.write("k1")
    head = run.log.head()
    again = run.stores.draft("k1", "sha256:k1", head, run.fence)
    replay = run.log.append(again, head, run.fence)
    assert replay.replayed
    assert replay.receipt == first
    assert run.log.lookup("k1") == run.stores.receipts().lookup("k1") == first
    other = run.stores.draft("k1", "sha256:another-intent", head, run.fence)
    with pytest.raises(ReceiptConflict) as caught:
        run.log.append(other, head, run.fence)
    assert caught.value.receipt == first
    assert caught.value.intent_digest == "sha256:another-intent"
    assert run.log.head() == head
    assert run.log.receipts() == [first]
    assert run.stores.index_entry("k1") == first.commit


def test_append_on_a_stale_head_is_cas_failed_and_nothing_becomes_visible(run: Log) -> None:
    base = run.log.head()
    first = run.write("k1")
    late = run.stores.draft("k2", "sha256:k2", base, run.fence)
    with pytest.raises(CasFailed):
        run.log.append(late, base, run.fence)
    assert run.log.head() == first.commit
    assert run.log.lookup("k2") is None
    assert run.stores.index_entry("k2") is None
    misplaced = run.stores.draft("k3", "sha256:k3", base, run.fence)
    with pytest.raises(ReceiptDrift) as caught:  # a write not based on the head it names
        run.log.append(misplaced, first.commit, run.fence)
    assert caught.value.reason == "not-a-write"
    assert run.log.head() == first.commit


def test_append_with_a_stale_fence_is_lease_lost_and_nothing_becomes_visible(run: Log) -> None:
    run.write("k1")
    stale = run.fence
    run.lease.release()
    new = run.stores.leases("w2")
    new.acquire(0)
    head = run.log.head()
    late = run.stores.draft("k2", "sha256:k2", head, stale)
    with pytest.raises(LeaseLost):
        run.log.append(late, head, stale)
    # Even a replay is refused to a stale worker: it learns it lost the lease.
    replay = run.stores.draft("k1", "sha256:k1", head, stale)
    with pytest.raises(LeaseLost):
        run.log.append(replay, head, stale)
    assert run.log.head() == head
    assert run.log.lookup("k2") is None
    landed = run.log.append(late, head, new.fence)
    assert landed.receipt.key == "k2"
    assert run.log.head() == landed.receipt.commit


def test_a_deleted_index_entry_is_rebuilt_from_the_history(run: Log) -> None:
    first, second = run.write("k1"), run.write("k2")
    run.stores.drop_index("k1")
    run.stores.drop_index("k2")
    assert run.stores.index_entry("k1") is None
    assert run.log.lookup("k1", repair=False) == first
    assert run.stores.index_entry("k1") is None  # a read-only lookup writes nothing
    assert run.log.lookup("k1") == first
    assert run.stores.index_entry("k1") == first.commit  # the walk repaired it
    assert run.log.rebuild_index() == 1
    assert run.stores.index_entry("k2") == second.commit
    assert run.log.rebuild_index() == 0
    run.stores.drop_index("k1")
    run.stores.drop_index("k2")
    assert run.stores.receipts().rebuild_index() == 2
    assert run.stores.receipts().lookup("k2") == second


def test_lookup_walks_the_history_only_down_to_since(run: Log) -> None:
    base = run.log.head()
    first, second = run.write("k1"), run.write("k2")
    run.stores.drop_index("k1")
    run.stores.drop_index("k2")
    assert run.log.lookup("k1", since=first.commit, repair=False) is None
    assert run.log.lookup("k2", since=first.commit, repair=False) == second
    assert run.log.lookup("k1", since=base, repair=False) == first
    assert run.log.lookup("k2", since=second.commit, repair=False) is None
    # The index is not bounded: a key it holds is found whatever ``since`` says.
    run.log.rebuild_index()
    assert run.log.lookup("k1", since=second.commit) == first


def test_an_index_entry_naming_another_receipt_is_drift_never_a_replay(run: Log) -> None:
    run.write("k1")
    second = run.write("k2")
    run.stores.point_index("k1", second.commit)
    with pytest.raises(ReceiptDrift) as caught:
        run.stores.receipts().lookup("k1")
    assert caught.value.reason == "index-mismatch"
    head = run.log.head()
    with pytest.raises(ReceiptDrift):
        run.log.append(run.stores.draft("k1", "sha256:k1", head, run.fence), head, run.fence)
    assert run.log.head() == head
