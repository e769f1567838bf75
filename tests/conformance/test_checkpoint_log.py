"""The checkpoint log contract, against every implementation: CAS, fence, validation, refusals."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.stores import PARTS, REF, Stores, sample_state
from gitrun.core.errors import CasFailed, CheckpointRejected, InvalidState, LeaseLost
from gitrun.store.lease import Fence

pytestmark = pytest.mark.timeout(30)


def _fence(stores: Stores, worker: str = "w1") -> Fence:
    lease = stores.leases(worker)
    lease.acquire(0)
    return lease.fence


def test_first_advance_creates_the_head_and_each_next_one_chains_onto_it(stores: Stores) -> None:
    log = stores.checkpoints()
    fence = _fence(stores)
    assert log.head(REF) is None
    first = log.advance(REF, sample_state(1), None, fence)
    assert log.head(REF) == first
    second = log.advance(REF, sample_state(2), first, fence)
    assert second != first
    fresh = stores.checkpoints()
    assert fresh.head(REF) == second
    loaded = fresh.load(REF, scenario_parts=PARTS)
    assert loaded.oid == second
    assert loaded.state.generation == 2
    assert loaded.state == sample_state(2, started_at=loaded.state.started_at,
                                        updated_at=loaded.state.updated_at)  # fmt: skip
    assert fresh.load(REF, scenario_parts=None, offered=second).oid == second


def test_advance_from_a_stale_expected_head_is_cas_failed_and_leaves_the_head(
    stores: Stores,
) -> None:
    log = stores.checkpoints()
    fence = _fence(stores)
    first = log.advance(REF, sample_state(1), None, fence)
    second = log.advance(REF, sample_state(2), first, fence)
    with pytest.raises(CasFailed):
        log.advance(REF, sample_state(2, cursor=9), first, fence)
    with pytest.raises(CasFailed):
        log.advance(REF, sample_state(1, cursor=9), None, fence)
    assert log.head(REF) == second
    loaded = stores.checkpoints().load(REF, scenario_parts=PARTS)
    assert (loaded.oid, loaded.state.cursor) == (second, 1)


def test_advance_with_a_fence_of_a_lease_taken_over_is_lease_lost_and_leaves_the_head(
    stores: Stores,
) -> None:
    log = stores.checkpoints()
    old = stores.leases("w1")
    old.acquire(0)
    stale = old.fence
    first = log.advance(REF, sample_state(1), None, stale)
    old.release()
    new = stores.leases("w2")
    new.acquire(1)
    assert new.fence.version == stale.version + 1
    for fence in (stale, Fence("w2", stale.version), Fence("w1", new.fence.version)):
        with pytest.raises(LeaseLost):
            log.advance(REF, sample_state(2), first, fence)
        assert log.head(REF) == first
    # The fence is checked before the head: a stale writer learns it lost the lease.
    with pytest.raises(LeaseLost):
        log.advance(REF, sample_state(2), None, stale)
    assert log.advance(REF, sample_state(2), first, new.fence) == log.head(REF)


def test_an_invalid_state_is_refused_before_anything_is_written(stores: Stores) -> None:
    log = stores.checkpoints()
    fence = _fence(stores)
    before = stores.objects()
    bad = sample_state(1, phase="exploring")
    with pytest.raises(InvalidState, match="phase"):
        log.advance(REF, bad, None, fence)
    assert log.head(REF) is None
    assert stores.objects() == before
    first = log.advance(REF, sample_state(1), None, fence)
    before = stores.objects()
    for broken in (
        sample_state(0),
        sample_state(2, stop_reason="finished"),
        sample_state(2, budgets=dataclasses.replace(sample_state().budgets, steps=1)),
    ):
        with pytest.raises(InvalidState):
            log.advance(REF, broken, first, fence)
    assert log.head(REF) == first
    assert stores.objects() == before


def test_a_checkpoint_changed_behind_the_store_is_refused_on_load(stores: Stores) -> None:
    log = stores.checkpoints()
    log.advance(REF, sample_state(1), None, _fence(stores))
    stores.tamper_checkpoint(REF)
    with pytest.raises(CheckpointRejected) as caught:
        stores.checkpoints().load(REF, scenario_parts=PARTS)
    assert caught.value.reason == "bad-signature"


def test_a_checkpoint_signed_with_a_key_the_keyring_lacks_is_refused(stores: Stores) -> None:
    stores.checkpoints().advance(REF, sample_state(1), None, _fence(stores))
    with pytest.raises(CheckpointRejected) as caught:
        stores.checkpoints(other_keyring=True).load(REF, scenario_parts=PARTS)
    assert caught.value.reason == "unknown-key"


def test_load_refuses_a_missing_head_an_old_checkpoint_and_another_scenario(
    stores: Stores,
) -> None:
    log = stores.checkpoints()
    with pytest.raises(CheckpointRejected) as caught:
        log.load(REF, scenario_parts=PARTS)
    assert caught.value.reason == "high-water-mark-missing"
    fence = _fence(stores)
    first = log.advance(REF, sample_state(1), None, fence)
    log.advance(REF, sample_state(2), first, fence)
    with pytest.raises(CheckpointRejected) as caught:
        log.load(REF, scenario_parts=PARTS, offered=first)
    assert caught.value.reason == "stale-generation"
    with pytest.raises(CheckpointRejected) as caught:
        log.load(REF, scenario_parts={**PARTS, "policy": "sha256:other"})
    assert caught.value.reason == "scenario-changed"


def test_the_chain_lists_every_checkpoint_newest_first_each_verified(stores: Stores) -> None:
    log = stores.checkpoints()
    fence = _fence(stores)
    assert list(log.chain(REF)) == []
    heads = [log.advance(REF, sample_state(1), None, fence)]
    for generation in (2, 3):
        heads.append(log.advance(REF, sample_state(generation, cursor=0), heads[-1], fence))
    chain = stores.checkpoints().chain(REF)
    assert [(c.oid, c.state.generation) for c in chain] == [
        (heads[2], 3),
        (heads[1], 2),
        (heads[0], 1),
    ]
    assert [c.state.generation for c in log.chain(REF, limit=2)] == [3, 2]
    stores.tamper_checkpoint(REF)
    with pytest.raises(CheckpointRejected) as refused:
        stores.checkpoints().chain(REF)
    assert refused.value.reason == "bad-signature"
    with pytest.raises(CheckpointRejected):
        stores.checkpoints(other_keyring=True).chain(REF, limit=1)
