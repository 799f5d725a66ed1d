"""RadixCache: share KV slots of common prompt prefixes across requests.

A radix tree (compressed edges) over token ids; each node's value holds the KV slot ids of its
tokens. Slot ownership is exclusive: every usable slot is at any time either on the allocator's
free list, in the tree (evictable when unlocked, protected when a request locks its path), or
private to one running request (the part of its req_to_token row past `req.prefix_indices`).
`check_pool_balance` (treespec/mem/balance.py) checks exactly this partition.

Bigram mode (EAGLE): the draft model's KV at position i is computed from token i+1, so a cached
position is valid only when the next token matches too. Keys are then pairs (t_i, t_{i+1}); n tokens
give n-1 keys covering positions 0..n-2, and position n-1 is never cached.

Scheduler protocol (kv_len = positions whose KV is written in the request's row):
- admit: m = match_prefix(ids[:-1]) (bigram mode: match_prefix(ids)), so >= 1 token is left to
  compute; inc_lock_ref(m.last_node) BEFORE any evict; set req.prefix_indices / req.last_node; write
  the prefix into the row; evict(need - available) if short, then allocate the rest.
- after a prefill chunk (optional, makes the prefix shareable): cache_unfinished_req(req, ids[:kv_len]).
- finish, abort and retraction alike: cache_finished_req(req, ids[:kv_len]), then free the row.
  Slots allocated past kv_len but never computed (a batch that did not run, rejected draft
  tokens) are not the cache's: the scheduler / spec worker frees them itself.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.req_to_token import ReqToTokenPool

TokenIds = Sequence[int] | torch.Tensor


class CacheReq(Protocol):
    """The request attributes the caches read and update."""

    req_pool_idx: int
    prefix_indices: torch.Tensor  # slots of the cached prefix this request holds a lock on
    last_node: Any  # the locked node (the cache's root when nothing is locked)


class TreeNode:
    """One compressed edge: `key` (tokens or bigrams) and `value` (their KV slots, int64)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")
    _ids = itertools.count()

    def __init__(
        self,
        parent: TreeNode | None = None,
        key: tuple[Hashable, ...] = (),
        value: torch.Tensor | None = None,
        lock_ref: int = 0,
        last_access: int = 0,
    ) -> None:
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.lock_ref = lock_ref
        self.last_access = last_access
        self.id = next(TreeNode._ids)  # tie-breaker in the eviction heap


@dataclass
class MatchResult:
    prefix_indices: torch.Tensor  # int64 KV slots of the matched positions
    last_node: TreeNode  # deepest matched node; lock it to keep the prefix from eviction


def _common_len(node_key: tuple[Hashable, ...], key: list[Hashable], start: int) -> int:
    n = min(len(node_key), len(key) - start)
    for i in range(n):
        if node_key[i] != key[start + i]:
            return i
    return n


def to_token_list(token_ids: TokenIds) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)


class PrefixCacheBase:
    """What RadixCache and ChunkCache share: the pools they manage and how a key is counted."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        bigram_keys: bool = False,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.bigram_keys = bigram_keys
        self.device = token_to_kv_pool_allocator.device

    def key_len(self, num_tokens: int) -> int:
        """Key entries for `num_tokens` tokens: with bigram keys (EAGLE) the last token has no key yet."""
        return max(num_tokens - 1, 0) if self.bigram_keys else num_tokens


class RadixCache(PrefixCacheBase):
    """Prefix cache with LRU eviction of unlocked leaves; see the module docstring for ownership."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        bigram_keys: bool = False,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, bigram_keys)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(lock_ref=1)
        self._evictable = 0
        self._protected = 0
        self._tick = 0  # logical clock for LRU: deterministic, unlike wall time

    def reset(self) -> None:
        """Drop every cached prefix, returning its slots to the allocator (only when nothing is locked)."""
        if self._protected:
            raise RuntimeError(f"cannot reset the radix cache: {self._protected} tokens are locked")
        values = [n.value for n in self._nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()

    # ---- keys -------------------------------------------------------------------------------
    def _to_key(self, token_ids: TokenIds) -> list[Hashable]:
        ids = to_token_list(token_ids)
        return list(zip(ids[:-1], ids[1:], strict=False)) if self.bigram_keys else ids

    # ---- lookup and insertion ---------------------------------------------------------------
    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; the new upper node inherits lock count and access time."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n], child.lock_ref, child.last_access)
        assert child.parent is not None
        child.parent.children[upper.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[child.key[0]] = child
        return upper

    def match_prefix(self, token_ids: TokenIds) -> MatchResult:
        """Longest cached prefix; splits a node so that `last_node` ends exactly at the match."""
        key = self._to_key(token_ids)
        self._tick += 1
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._tick
            values.append(child.value)
            node, pos = child, pos + n
        indices = torch.cat(values) if values else torch.empty(0, dtype=torch.int64, device=self.device)
        return MatchResult(indices, node)

    def insert(self, token_ids: TokenIds, kv_indices: torch.Tensor) -> int:
        """Insert the first key_len(len(token_ids)) slots of `kv_indices`; return the length already cached.

        Ownership: slots kv_indices[prefix_len:key_len] now belong to the tree; kv_indices[:prefix_len]
        duplicate what the tree already had and stay with the caller (free them unless they are the
        tree's own slots, i.e. the caller's locked prefix). Slots past key_len stay with the caller.
        """
        key = self._to_key(token_ids)
        if kv_indices.numel() < len(key):
            raise ValueError(f"insert: {len(key)} positions but only {kv_indices.numel()} KV slots")
        self._tick += 1
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                value = kv_indices[pos : len(key)].to(device=self.device, dtype=torch.int64).clone()
                leaf = TreeNode(node, tuple(key[pos:]), value, 0, self._tick)
                node.children[key[pos]] = leaf
                self._evictable += len(leaf.key)
                return pos
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._tick
            node, pos = child, pos + n
        return pos

    # ---- locking ------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Protect the path root..node from eviction (None or the root: no-op)."""
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Undo one inc_lock_ref(node); nodes whose count reaches 0 become evictable again."""
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked node (unbalanced lock/unlock)")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------------
    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from least-recently-used unlocked leaves (fewer if the
        tree runs out); return how many were freed. A parent left childless becomes a candidate."""
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed.append(leaf.value)
            num_freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    # ---- request protocol ---------------------------------------------------------------------
    def _row(self, req: CacheReq, n: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)

    def _insert_req(self, req: CacheReq, token_ids: TokenIds) -> tuple[torch.Tensor, int, int]:
        """Insert the request's KV; free its duplicates. Returns (row slots, old prefix len, key len).

        The locked prefix may be one position longer than key_len in bigram mode (a request aborted
        right after admission: its match used the next prompt token); that part is already cached.
        """
        kv = self._row(req, len(token_ids))
        old, key_len = len(req.prefix_indices), self.key_len(len(token_ids))
        if old > len(token_ids) or not torch.equal(kv[:old], req.prefix_indices.to(kv)):
            raise RuntimeError(
                f"request {req.req_pool_idx}: its req_to_token row does not start with its locked "
                f"prefix ({old} slots, {len(token_ids)} tokens)"
            )
        new_prefix = self.insert(token_ids, kv)
        if new_prefix < min(old, key_len):
            raise RuntimeError(
                "locked prefix vanished from the radix tree (token ids differ from the match?)"
            )
        self.allocator.free(kv[old:new_prefix])
        return kv, old, key_len

    def cache_finished_req(self, req: CacheReq, token_ids: TokenIds) -> None:
        """Hand all the request's KV to the tree (or free it) and unlock; the request then owns no slots.

        `token_ids` are the tokens whose KV is in req_to_token[req.req_pool_idx, :len(token_ids)].
        In bigram mode the slot of the last position is freed. Resets req.prefix_indices to empty
        and req.last_node to the root, so calling it twice is harmless.
        """
        kv, old, key_len = self._insert_req(req, token_ids)
        self.allocator.free(kv[max(key_len, old) :])
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        req.last_node = self.root

    def cache_unfinished_req(self, req: CacheReq, token_ids: TokenIds) -> None:
        """Share the request's KV so far (chunked prefill): insert, point its row at the tree's slots,
        and move its lock to the new last node. In bigram mode the last position's slot stays private
        to the request (in its row, not in prefix_indices) until a later call or cache_finished_req."""
        if len(req.prefix_indices) > self.key_len(len(token_ids)):
            raise RuntimeError("cache_unfinished_req: no new KV since the request's matched prefix")
        _, old, key_len = self._insert_req(req, token_ids)
        match = self.match_prefix(token_ids)
        if match.prefix_indices.numel() != key_len:
            raise RuntimeError("re-match after insert came up short")
        self.req_to_token_pool.write(req.req_pool_idx, old, match.prefix_indices[old:])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = match.prefix_indices, match.last_node

    def req_private_len(self, req: CacheReq, kv_len: int) -> int:
        """Slots of req_to_token[req, :kv_len] owned by the request itself (not by the tree)."""
        return kv_len - len(req.prefix_indices)

    # ---- accounting and debugging -------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        """Tokens in the tree, recounted by a walk (a check on evictable + protected)."""
        return sum(len(n.key) for n in self._nodes())

    def all_indices(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64, device=self.device)

    def pretty_print(self, max_key: int = 8) -> None:
        def show(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                key = list(child.key[:max_key]) + (["..."] if len(child.key) > max_key else [])
                print(f"{'  ' * depth}{key} len={len(child.key)} lock={child.lock_ref} t={child.last_access}")
                show(child, depth + 1)

        print(
            f"RadixCache(bigram={self.bigram_keys}) evictable={self._evictable} protected={self._protected}"
        )
        show(self.root, 1)
