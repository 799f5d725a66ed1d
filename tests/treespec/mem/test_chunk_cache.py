"""ChunkCache (--disable-radix-cache): same interface, nothing shared, everything freed at finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.balance import check_pool_balance
from treespec.mem.chunk_cache import ChunkCache
from treespec.mem.req_to_token import ReqToTokenPool


@dataclass
class Req:
    req_pool_idx: int
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def test_chunk_cache_lifecycle() -> None:
    pool, alloc = ReqToTokenPool(2, 16), TokenToKVPoolAllocator(16)
    cache = ChunkCache(pool, alloc)
    ids = [1, 2, 3, 4, 5, 6]
    m = cache.match_prefix(ids)
    assert m.prefix_indices.numel() == 0
    cache.inc_lock_ref(m.last_node)
    req = Req(pool.alloc(), m.prefix_indices, m.last_node)
    first = alloc.alloc(4)
    pool.write(req.req_pool_idx, 0, first)
    cache.cache_unfinished_req(req, ids[:4])  # chunk 1 done
    assert torch.equal(req.prefix_indices, first)
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    check_pool_balance(alloc, cache, cache.req_private_len(req, 4))
    pool.write(req.req_pool_idx, 4, alloc.alloc(2))
    cache.cache_unfinished_req(req, ids)
    assert cache.match_prefix(ids).prefix_indices.numel() == 0, "nothing is ever shared"
    assert cache.evict(100) == 0
    cache.cache_finished_req(req, ids)
    cache.dec_lock_ref(req.last_node)
    assert req.prefix_indices.numel() == 0 and alloc.available_size() == 16
    check_pool_balance(alloc, cache)


def test_chunk_cache_insert_takes_and_drops_ownership() -> None:
    pool, alloc = ReqToTokenPool(1, 8), TokenToKVPoolAllocator(8)
    cache = ChunkCache(pool, alloc, bigram_keys=True)
    slots = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots) == 0  # like RadixCache: first key_len (3) slots handed over
    assert alloc.available_size() == 7
    alloc.free(slots[3:])
    check_pool_balance(alloc, cache)
    cache.reset()
    cache.pretty_print()
