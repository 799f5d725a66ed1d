"""Property-based tests of the prefix caches.

1. A state machine drives random insert / match / lock / unlock / evict against a naive model: a dict
   from every cached key prefix to its slot, with token-level access times and locks. Matches must
   return the longest cached prefix with the model's slots, and eviction must follow LRU order.
2. Random request lifecycles (admit, chunked prefill with or without cache_unfinished_req, finish or
   abort) where every slot carries the content it was computed from: every matched or row-referenced
   slot must hold the KV of the right prefix, and slot ownership must partition the pool.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.balance import check_pool_balance
from treespec.mem.chunk_cache import ChunkCache
from treespec.mem.radix_cache import RadixCache, TreeNode
from treespec.mem.req_to_token import ReqToTokenPool

POOL = 40
SEQ = st.lists(st.integers(0, 2), max_size=8)


class RadixMachine(RuleBasedStateMachine):
    bigram = False

    def __init__(self) -> None:
        super().__init__()
        self.alloc = TokenToKVPoolAllocator(POOL)
        self.cache = RadixCache(ReqToTokenPool(1, 8), self.alloc, bigram_keys=self.bigram)
        self.ref: dict[tuple, int] = {}  # cached key prefix -> slot of its last position
        self.atime: dict[tuple, int] = {}
        self.locks: list[tuple[TreeNode, tuple]] = []
        self.tick = 0

    def key(self, ids: list[int]) -> tuple:
        return tuple(zip(ids, ids[1:], strict=False)) if self.bigram else tuple(ids)

    def expected_len(self, key: tuple) -> int:
        n = 0
        while n < len(key) and key[: n + 1] in self.ref:
            n += 1
        return n

    def touch(self, key: tuple, n: int) -> None:
        self.tick += 1
        for i in range(n):
            self.atime[key[: i + 1]] = self.tick

    def locked(self) -> set[tuple]:
        return {p[:j] for _, p in self.locks for j in range(1, len(p) + 1)}

    def tree_entries(self) -> dict[tuple, int]:
        out, stack = {}, [(self.cache.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                p = prefix
                for k, v in zip(child.key, child.value.tolist(), strict=True):
                    p = p + (k,)
                    out[p] = v
                stack.append((child, p))
        return out

    def lru_order(self, n: int) -> list[tuple]:
        """Token-level LRU: repeatedly drop the unlocked leaf prefix with the oldest access time."""
        locked, remaining = self.locked(), set(self.ref)
        kids = Counter(p[:-1] for p in remaining)
        order: list[tuple] = []
        while len(order) < n:
            leaves = [p for p in remaining if kids[p] == 0 and p not in locked]
            if not leaves:
                break
            p = min(leaves, key=self.atime.__getitem__)
            order.append(p)
            remaining.discard(p)
            kids[p[:-1]] -= 1
        return order

    def evict_checked(self, n: int) -> None:
        model = self.lru_order(n)
        before = self.alloc.available_size()
        freed = self.cache.evict(n)
        entries = self.tree_entries()
        assert set(entries) <= set(self.ref) and all(self.ref[p] == s for p, s in entries.items())
        removed = set(self.ref) - set(entries)
        assert freed == len(removed) and self.alloc.available_size() == before + freed
        assert set(model) <= removed, "eviction did not follow LRU order"
        extra = removed - set(model)
        # the tree evicts whole nodes, so it may overshoot, but only within the node it stopped in
        assert not extra or (model and all(self.atime[p] == self.atime[model[-1]] for p in extra))
        assert not removed & self.locked()
        for p in removed:
            del self.ref[p], self.atime[p]

    @rule(ids=SEQ)
    def insert(self, ids: list[int]) -> None:
        key = self.key(ids)
        if self.alloc.available_size() < len(key):
            self.evict_checked(len(key) - self.alloc.available_size())
        if self.alloc.available_size() < len(key):
            return
        slots = self.alloc.alloc(len(key))
        dup = self.cache.insert(ids, slots)
        assert dup == self.expected_len(key)
        self.alloc.free(slots[:dup])
        for i in range(dup, len(key)):
            self.ref[key[: i + 1]] = int(slots[i])
        self.touch(key, len(key))

    def checked_match(self, ids: list[int]) -> tuple[TreeNode, tuple]:
        key = self.key(ids)
        res = self.cache.match_prefix(ids)
        n = self.expected_len(key)
        assert res.prefix_indices.tolist() == [self.ref[key[: i + 1]] for i in range(n)]
        depth, node = 0, res.last_node
        while node is not self.cache.root:
            depth, node = depth + len(node.key), node.parent
        assert depth == n, "last_node must end exactly at the match"
        self.touch(key, n)
        return res.last_node, key[:n]

    @rule(ids=SEQ)
    def match(self, ids: list[int]) -> None:
        self.checked_match(ids)

    @rule(ids=SEQ)
    def lock(self, ids: list[int]) -> None:
        node, prefix = self.checked_match(ids)
        self.cache.inc_lock_ref(node)
        self.locks.append((node, prefix))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        self.evict_checked(n)

    @invariant()
    def consistent(self) -> None:
        check_pool_balance(self.alloc, self.cache)
        locked = self.locked()
        assert self.cache.protected_size() == len(locked)
        assert self.cache.evictable_size() == len(self.ref) - len(locked)
        assert self.tree_entries() == self.ref

    def teardown(self) -> None:
        for node, _ in self.locks:
            self.cache.dec_lock_ref(node)
        self.cache.evict(POOL)
        assert self.alloc.available_size() == POOL and self.cache.total_size() == 0


class BigramRadixMachine(RadixMachine):
    bigram = True


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = _machine_settings
TestBigramRadixMachine = BigramRadixMachine.TestCase
TestBigramRadixMachine.settings = _machine_settings


@dataclass
class Req:
    req_pool_idx: int
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


@dataclass
class Running:
    req: Req
    ids: list[int]
    kv_len: int


@pytest.mark.parametrize("mode", ["radix", "bigram", "chunk"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_request_lifecycles_keep_kv_consistent(mode: str, data: st.DataObject) -> None:
    bigram, size = mode == "bigram", 24
    pool, alloc = ReqToTokenPool(3, 12), TokenToKVPoolAllocator(size)
    cache = ChunkCache(pool, alloc) if mode == "chunk" else RadixCache(pool, alloc, bigram_keys=bigram)
    content: dict[int, tuple] = {}  # slot -> what its KV was computed from
    running: list[Running] = []

    def want(ids: list[int], i: int) -> tuple:
        # bigram mode: the draft KV at position i also depends on token i+1
        return (i, tuple(ids[: i + 2] if bigram else ids[: i + 1]))

    def finish(r: Running) -> None:  # also abort and retraction
        running.remove(r)
        cache.cache_finished_req(r.req, r.ids[: r.kv_len])
        pool.free(r.req.req_pool_idx)

    def check() -> None:
        owned = [alloc.free_slots, cache.all_indices()]
        for r in running:
            row = pool.read(r.req.req_pool_idx, 0, r.kv_len)
            assert torch.equal(row[: r.req.prefix_indices.numel()], r.req.prefix_indices)
            assert [content[s] for s in row.tolist()] == [want(r.ids, i) for i in range(r.kv_len)]
            owned.append(row[r.kv_len - cache.req_private_len(r.req, r.kv_len) :])
        private = sum(cache.req_private_len(r.req, r.kv_len) for r in running)
        check_pool_balance(alloc, cache, private)
        assert sorted(torch.cat(owned).tolist()) == list(range(1, size + 1)), "slot ownership overlaps"

    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["admit", "step", "step", "finish"]))
        if action == "admit" and pool.available_size():
            ids = data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=10))
            m = cache.match_prefix(ids if bigram else ids[:-1])  # leave >= 1 token to compute
            got = [content[s] for s in m.prefix_indices.tolist()]
            assert got == [want(ids, i) for i in range(len(got))]
            cache.inc_lock_ref(m.last_node)
            req = Req(pool.alloc(), m.prefix_indices, m.last_node)
            pool.write(req.req_pool_idx, 0, m.prefix_indices)
            running.append(Running(req, ids, len(got)))
        elif action == "step" and running:
            r = data.draw(st.sampled_from(running))
            if r.kv_len < len(r.ids):
                c = data.draw(st.integers(1, len(r.ids) - r.kv_len))
                if alloc.available_size() < c:
                    cache.evict(c - alloc.available_size())
                if alloc.available_size() < c:
                    finish(r)  # out of memory: retract
                else:
                    slots = alloc.alloc(c)
                    pool.write(r.req.req_pool_idx, r.kv_len, slots)
                    for j, s in enumerate(slots.tolist()):
                        content[s] = want(r.ids, r.kv_len + j)
                    r.kv_len += c
                    if data.draw(st.booleans()):
                        cache.cache_unfinished_req(r.req, r.ids[: r.kv_len])
        elif action == "finish" and running:
            finish(data.draw(st.sampled_from(running)))
        check()
    for r in list(running):
        finish(r)
    check()
    assert cache.protected_size() == 0
    cache.evict(size)
    assert alloc.available_size() == size
