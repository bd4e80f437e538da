"""The KV block ledger: allocation, freeing, prefix-cache sharing and eviction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.block_manager import BlockManager
from backend.engine.request import Request


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids)


def compute(manager: BlockManager, request: Request, num_tokens: int) -> None:
    """What a scheduled step does to the ledger: allocate, run, then register full blocks."""
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request)


def test_allocate_across_block_boundaries():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(5)))
    assert manager.allocate_slots(request, 5) == [0, 1]
    request.num_computed_tokens = 5
    request.append_token(5)
    assert manager.allocate_slots(request, 1) == []  # token 6 still fits in block 1
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1) == [2]
    assert request.block_ids == [0, 1, 2]
    assert (manager.num_used_blocks, manager.num_free_blocks) == (3, 5)
    assert manager.usage == pytest.approx(3 / 8)
    manager.check_invariants([request])

    manager.free(request)
    assert request.block_ids == []
    assert manager.num_free_blocks == 8
    manager.check_invariants([request])


def test_full_pool_answers_none_and_changes_nothing():
    manager = BlockManager(num_blocks=3, block_size=2)
    a, b = make_request("a", [1] * 4), make_request("b", [2] * 4)
    assert manager.allocate_slots(a, 4) == [0, 1]
    assert not manager.can_allocate(2)
    assert manager.allocate_slots(b, 4) is None
    assert b.block_ids == []
    assert manager.num_free_blocks == 1
    manager.check_invariants([a, b])
    manager.free(a)
    assert manager.allocate_slots(b, 4) is not None
    manager.check_invariants([a, b])


def test_impossible_arguments_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
    manager = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(make_request("a", [1]), -1)


def test_prefix_cache_off_never_hits():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(manager, a, 5)
    assert manager.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == 0
    assert manager.cached_block_ids == {}


def test_prefix_cache_hit_shares_blocks_with_refcounts():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert manager.get_computed_blocks(a) == 0
    compute(manager, a, 5)
    b = make_request("b", [1, 2, 3, 4, 9, 9])
    assert manager.get_computed_blocks(b) == 4
    assert b.block_ids == a.block_ids[:2]
    assert [manager.ref_counts[i] for i in a.block_ids] == [2, 2, 1]
    manager.check_invariants([a, b])

    b.num_computed_tokens = 4
    assert manager.allocate_slots(b, 2) == [3]
    manager.free(a)
    assert [manager.ref_counts[i] for i in b.block_ids] == [1, 1, 1]
    manager.check_invariants([a, b])


def test_diverging_prefix_stops_the_hit():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    compute(manager, a := make_request("a", [1, 2, 3, 4, 5, 6, 7]), 7)
    # Same second block, different first block: the chained hash must not match it.
    assert manager.get_computed_blocks(make_request("b", [0, 0, 3, 4, 5, 6, 7])) == 0
    assert manager.get_computed_blocks(c := make_request("c", [1, 2, 0, 4, 5, 6, 7])) == 2
    manager.check_invariants([a, c])


def test_hit_never_covers_the_last_token():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4])
    compute(manager, a, 4)
    assert len(manager.cached_block_ids) == 2
    # An identical 4-token prompt may reuse only the first block: its last token must be computed for logits.
    b = make_request("b", [1, 2, 3, 4])
    assert manager.get_computed_blocks(b) == 2
    assert b.block_ids == a.block_ids[:1]


def test_freed_blocks_stay_hittable_until_reallocated():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(manager, a, 5)
    cached_ids = list(a.block_ids[:2])
    manager.free(a)
    assert manager.num_free_blocks == 4
    # Tail first: the partial block 2 was freed first, then 1, then 0; the never-used block 3 is oldest.
    assert list(manager.free_block_ids) == [3, 2, 1, 0]

    b = make_request("b", [1, 2, 3, 4, 8])
    assert manager.get_computed_blocks(b) == 4
    assert b.block_ids == cached_ids
    assert manager.num_free_blocks == 2
    manager.check_invariants([b])
    manager.free(b)

    # Allocating the whole pool reuses the cached blocks and evicts their hashes.
    c = make_request("c", [7] * 8)
    assert manager.get_computed_blocks(c) == 0
    assert len(manager.allocate_slots(c, 8)) == 4
    assert manager.cached_block_ids == {}
    manager.check_invariants([c])
    manager.free(c)
    assert manager.get_computed_blocks(make_request("d", [1, 2, 3, 4, 8])) == 0


def test_identical_block_computed_twice_keeps_the_first_entry():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [1, 2, 3])
    for request in (a, b):  # both admitted before either block was cached
        assert manager.get_computed_blocks(request) == 0
    compute(manager, a, 3)
    compute(manager, b, 3)
    assert manager.cached_block_ids == {a.block_hashes[0]: a.block_ids[0]}
    manager.check_invariants([a, b])


def test_invariant_check_catches_corruption():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    manager.allocate_slots(a, 3)
    manager.ref_counts[a.block_ids[0]] += 1
    with pytest.raises(AssertionError, match="ref_count"):
        manager.check_invariants([a])
    manager.ref_counts[a.block_ids[0]] -= 1
    a.block_ids.append(a.block_ids[0])
    with pytest.raises(AssertionError, match="twice"):
        manager.check_invariants([a])


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(1, 12),
    caching=st.booleans(),
    ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(1, 9)), max_size=40),
)
def test_random_allocate_and_free_keep_the_ledger_consistent(block_size, num_blocks, caching, ops):
    """Random admissions, growth and frees over five slots with prompts from a tiny vocabulary (many hits)."""
    manager = BlockManager(num_blocks, block_size, caching)
    slots: dict[int, Request] = {}
    for n, (slot, action, length) in enumerate(ops):
        request = slots.get(slot)
        if request is None:
            request = make_request(f"r{n}", [t % 2 for t in range(length)])
            request.num_computed_tokens = manager.get_computed_blocks(request)
            assert request.num_computed_tokens < request.num_tokens
            if manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens) is None:
                manager.free(request)
            else:
                request.num_computed_tokens = request.num_tokens
                manager.cache_full_blocks(request)
                slots[slot] = request
        elif action == 0:
            manager.free(request)
            del slots[slot]
        else:
            free_before = manager.num_free_blocks
            request.append_token(action)
            if manager.allocate_slots(request, 1) is None:
                assert manager.num_free_blocks == free_before
            else:
                request.num_computed_tokens += 1
                manager.cache_full_blocks(request)
        manager.check_invariants(slots.values())
    for request in slots.values():
        manager.free(request)
    assert manager.num_free_blocks == num_blocks
