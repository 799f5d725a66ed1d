"""RadixCache unit tests: matching, splits, LRU eviction, locks, request lifecycle, bigram mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.balance import check_pool_balance
from treespec.mem.radix_cache import RadixCache
from treespec.mem.req_to_token import ReqToTokenPool


@dataclass
class Req:
    """The attributes the scheduler's request exposes to the cache."""

    req_pool_idx: int
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def make(size: int = 32, bigram: bool = False) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator, RadixCache]:
    pool, alloc = ReqToTokenPool(4, 32), TokenToKVPoolAllocator(size)
    return pool, alloc, RadixCache(pool, alloc, bigram_keys=bigram)


def put(cache: RadixCache, ids: list[int]) -> torch.Tensor:
    """Insert `ids` with fresh slots, freeing duplicates as a caller must; return the new slots."""
    slots = cache.allocator.alloc(cache.key_len(len(ids)))
    dup = cache.insert(ids, slots)
    cache.allocator.free(slots[:dup])
    return slots


def admit(cache: RadixCache, pool: ReqToTokenPool, ids: list[int]) -> Req:
    """Scheduler admission: match, lock, write the prefix, allocate and 'compute' the rest."""
    m = cache.match_prefix(ids)
    cache.inc_lock_ref(m.last_node)
    req = Req(pool.alloc(), m.prefix_indices, m.last_node)
    k = m.prefix_indices.numel()
    pool.write(req.req_pool_idx, 0, m.prefix_indices)
    pool.write(req.req_pool_idx, k, cache.allocator.alloc(len(ids) - k))
    return req


def test_match_after_insert() -> None:
    _, alloc, cache = make()
    slots = put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert torch.equal(m.prefix_indices, slots) and m.last_node.key == (1, 2, 3, 4)
    miss = cache.match_prefix([9, 1])
    assert miss.prefix_indices.numel() == 0 and miss.last_node is cache.root
    assert cache.match_prefix([]).prefix_indices.numel() == 0
    assert cache.evictable_size() == 4 and cache.protected_size() == 0 and cache.total_size() == 4
    check_pool_balance(alloc, cache)


def test_partial_match_splits_node() -> None:
    _, alloc, cache = make()
    slots = put(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 9])
    assert torch.equal(m.prefix_indices, slots[:3])
    upper = m.last_node
    assert upper.key == (1, 2, 3) and list(upper.children.values())[0].key == (4, 5, 6)
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).prefix_indices, slots)
    assert cache.total_size() == 6 == cache.evictable_size()
    check_pool_balance(alloc, cache)


def test_split_keeps_lock_counts_and_access_times() -> None:
    _, _, cache = make()
    put(cache, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(node)
    t_locked = node.last_access
    upper = cache.match_prefix([1, 2]).last_node  # split inside the locked node
    assert upper.lock_ref == 1 and node.lock_ref == 1 and node.parent is upper
    assert upper.last_access > t_locked == node.last_access
    assert cache.protected_size() == 6 and cache.evictable_size() == 0
    cache.dec_lock_ref(node)
    assert upper.lock_ref == 0 and cache.protected_size() == 0 and cache.evictable_size() == 6
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)


def test_lru_eviction_order_and_frees_to_allocator() -> None:
    _, alloc, cache = make()
    a, b, c = put(cache, [1, 2, 3]), put(cache, [4, 5, 6]), put(cache, [7, 8])
    cache.match_prefix([1, 2, 3])  # A is now the most recently used
    free_before = alloc.available_size()
    assert cache.evict(3) == 3  # B is the oldest
    assert set(alloc.free_slots.tolist()[free_before:]) == set(b.tolist())
    assert cache.match_prefix([4, 5, 6]).prefix_indices.numel() == 0
    assert cache.evict(1) == 2  # whole leaf C goes, even though only 1 was asked for
    assert torch.equal(cache.match_prefix([1, 2, 3]).prefix_indices, a)
    assert not set(c.tolist()) & set(cache.all_indices().tolist())
    check_pool_balance(alloc, cache)


def test_evicted_parent_becomes_leaf() -> None:
    _, alloc, cache = make()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])  # root -> (1,2) -> {(3,4), (5,6)}
    assert cache.evict(4) == 4
    assert cache.match_prefix([1, 2, 9]).prefix_indices.numel() == 2
    assert cache.evict(1) == 2 and cache.total_size() == 0
    assert cache.evict(5) == 0
    assert alloc.available_size() == alloc.size


def test_locked_nodes_never_evicted() -> None:
    _, alloc, cache = make()
    a = put(cache, [1, 2, 3])
    put(cache, [1, 2, 7, 8])
    put(cache, [5, 6])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3  # path (1,2) + (3,)
    assert cache.evict(100) == 4  # (7,8) then (5,6); nothing locked
    assert torch.equal(cache.match_prefix([1, 2, 3]).prefix_indices, a)
    assert cache.evictable_size() == 0
    check_pool_balance(alloc, cache)
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 3 and alloc.available_size() == alloc.size


def test_duplicate_insert_returns_prefix_len() -> None:
    _, alloc, cache = make()
    first = put(cache, [1, 2, 3])
    second = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], second) == 3
    alloc.free(second[:3])
    expected = torch.cat([first, second[3:]])
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5]).prefix_indices, expected)
    assert cache.insert([1, 2, 3, 4, 5], expected) == 5  # re-inserting the tree's own slots: no-op
    assert cache.total_size() == 5
    check_pool_balance(alloc, cache)


def test_unfinished_then_finished_lifecycle_shares_slots() -> None:
    pool, alloc, cache = make()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a = admit(cache, pool, ids[:5])  # nothing cached yet: A and B compute the same prefix
    b = admit(cache, pool, ids[:5])
    a_slots = pool.read(a.req_pool_idx, 0, 5)
    b_own = pool.read(b.req_pool_idx, 0, 5)
    check_pool_balance(alloc, cache, 10)
    cache.cache_unfinished_req(a, ids[:5])
    assert torch.equal(a.prefix_indices, a_slots) and cache.protected_size() == 5
    assert torch.equal(pool.read(a.req_pool_idx, 0, 5), a_slots)
    free_before = alloc.available_size()
    cache.cache_unfinished_req(b, ids[:5])
    assert alloc.available_size() == free_before + 5, "B's duplicate slots are freed"
    assert set(alloc.free_slots.tolist()) >= set(b_own.tolist())
    assert torch.equal(pool.read(b.req_pool_idx, 0, 5), a_slots), "B's row now points at the tree"
    assert torch.equal(b.prefix_indices, a_slots) and b.last_node is a.last_node
    assert a.last_node.lock_ref == 2
    check_pool_balance(alloc, cache, 0)
    # A computes 3 more tokens, then finishes
    pool.write(a.req_pool_idx, 5, alloc.alloc(3))
    check_pool_balance(alloc, cache, cache.req_private_len(a, 8))
    cache.cache_finished_req(a, ids)
    assert a.prefix_indices.numel() == 0 and a.last_node is cache.root
    assert cache.protected_size() == 5 and cache.evictable_size() == 3  # B still holds the first 5
    cache.cache_finished_req(b, ids[:5])
    assert cache.protected_size() == 0 and cache.total_size() == 8
    check_pool_balance(alloc, cache)


def test_admission_reuses_cached_prefix() -> None:
    pool, alloc, cache = make()
    ids = [1, 2, 3, 4, 5]
    r = admit(cache, pool, ids)
    cache.cache_finished_req(r, ids)
    r2 = admit(cache, pool, ids[:3] + [7, 7])
    assert torch.equal(r2.prefix_indices, pool.read(r.req_pool_idx, 0, 3))
    check_pool_balance(alloc, cache, cache.req_private_len(r2, 5))
    cache.cache_finished_req(r2, ids[:3] + [7, 7])
    assert cache.total_size() == 7
    check_pool_balance(alloc, cache)


def test_bigram_keys_cover_all_but_last_position() -> None:
    pool, alloc, cache = make(bigram=True)
    slots = put(cache, [1, 2, 3, 4])
    assert slots.numel() == 3 and cache.total_size() == 3
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).prefix_indices, slots)
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 8]).prefix_indices, slots)
    assert torch.equal(cache.match_prefix([1, 2, 3]).prefix_indices, slots[:2])
    # position 2 needs the next token to match too: (3, 9) != (3, 4)
    assert torch.equal(cache.match_prefix([1, 2, 3, 9]).prefix_indices, slots[:2])
    assert cache.match_prefix([1]).prefix_indices.numel() == 0
    check_pool_balance(alloc, cache)


def test_bigram_finished_req_frees_last_slot() -> None:
    pool, alloc, cache = make(bigram=True)
    r = admit(cache, pool, [5, 6, 7, 8])
    last = int(pool.req_to_token[r.req_pool_idx, 3])
    cache.cache_finished_req(r, [5, 6, 7, 8])
    assert cache.total_size() == 3 and last in alloc.free_slots.tolist()
    check_pool_balance(alloc, cache)


def test_bigram_unfinished_req_keeps_last_slot_private() -> None:
    pool, alloc, cache = make(bigram=True)
    ids = [5, 6, 7, 8, 9, 10]
    r = admit(cache, pool, ids[:4])
    tail = int(pool.req_to_token[r.req_pool_idx, 3])
    cache.cache_unfinished_req(r, ids[:4])
    assert r.prefix_indices.numel() == 3 and cache.protected_size() == 3
    assert int(pool.req_to_token[r.req_pool_idx, 3]) == tail
    assert cache.req_private_len(r, 4) == 1
    check_pool_balance(alloc, cache, cache.req_private_len(r, 4))
    pool.write(r.req_pool_idx, 4, alloc.alloc(2))  # next chunk
    cache.cache_unfinished_req(r, ids)
    assert int(r.prefix_indices[3]) == tail, (
        "the private tail slot joins the tree once its next token is known"
    )
    check_pool_balance(alloc, cache, cache.req_private_len(r, 6))
    cache.cache_finished_req(r, ids)
    assert cache.total_size() == 5 and cache.protected_size() == 0
    check_pool_balance(alloc, cache)


def test_bigram_abort_right_after_admission() -> None:
    pool, alloc, cache = make(bigram=True)
    r = admit(cache, pool, [5, 6, 7, 8])
    cache.cache_finished_req(r, [5, 6, 7, 8])
    m = cache.match_prefix([5, 6, 7, 8, 9])  # 3 positions (their keys use tokens 0..3)
    cache.inc_lock_ref(m.last_node)
    r2 = Req(pool.alloc(), m.prefix_indices, m.last_node)
    pool.write(r2.req_pool_idx, 0, m.prefix_indices)
    cache.cache_finished_req(r2, [5, 6, 7])  # aborted before any forward: 3 tokens, 2 keys
    assert cache.total_size() == 3 and cache.protected_size() == 0
    check_pool_balance(alloc, cache)


def test_finished_req_twice_is_harmless_and_bad_prefix_raises() -> None:
    pool, alloc, cache = make()
    r = admit(cache, pool, [1, 2, 3])
    cache.cache_finished_req(r, [1, 2, 3])
    cache.cache_finished_req(r, [])
    check_pool_balance(alloc, cache)
    r2 = admit(cache, pool, [1, 2, 3, 4])
    pool.write(r2.req_pool_idx, 0, torch.tensor([9]))  # row no longer starts with the locked prefix
    with pytest.raises(RuntimeError):
        cache.cache_finished_req(r2, [1, 2, 3, 4])


def test_reset_and_pretty_print(capsys: pytest.CaptureFixture[str]) -> None:
    _, alloc, cache = make()
    put(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2]).last_node
    cache.pretty_print()
    assert "lock=0" in capsys.readouterr().out
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_balance_check_reports_leak_and_double_free() -> None:
    _, alloc, cache = make()
    slots = put(cache, [1, 2, 3])
    leaked = alloc.alloc(2)
    with pytest.raises(AssertionError, match="2 slots leaked"):
        check_pool_balance(alloc, cache)
    alloc.free(leaked)
    check_pool_balance(alloc, cache)
    good = alloc.free_slots.clone()
    alloc.free_slots = torch.cat([good[1:], slots[:1]])  # counts balance, but a cached slot is free
    with pytest.raises(AssertionError, match="both free and cached"):
        check_pool_balance(alloc, cache)
    alloc.free_slots = torch.cat([good[1:], good[1:2]])  # counts balance, a slot listed twice
    with pytest.raises(AssertionError, match="listed twice"):
        check_pool_balance(alloc, cache)
    check_pool_balance(alloc, cache, deep=False)  # the cheap check cannot see it
    alloc.free_slots = torch.cat([good, slots[:1]])
    with pytest.raises(AssertionError, match="counted twice"):
        check_pool_balance(alloc, cache, deep=False)
