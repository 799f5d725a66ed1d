"""ChunkCache: the RadixCache interface with no sharing, for `--disable-radix-cache`.

Nothing is ever cached: every slot in a request's row is private to that request until
cache_finished_req frees it. Chunked prefill still works: cache_unfinished_req only records the
slots computed so far as the request's prefix.
"""

from __future__ import annotations

import torch

from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.radix_cache import CacheReq, MatchResult, PrefixCacheBase, TokenIds, TreeNode
from treespec.mem.req_to_token import ReqToTokenPool


class ChunkCache(PrefixCacheBase):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        bigram_keys: bool = False,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, bigram_keys)
        self.root = TreeNode(lock_ref=1)  # the only node; locking it is a no-op

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        pass

    def match_prefix(self, token_ids: TokenIds) -> MatchResult:
        return MatchResult(self._empty(), self.root)

    def insert(self, token_ids: TokenIds, kv_indices: torch.Tensor) -> int:
        """Same ownership contract as RadixCache.insert: the cache takes the first key_len slots (and,
        holding nothing, frees them at once); returns 0 since nothing was already cached."""
        self.allocator.free(kv_indices[: self.key_len(len(token_ids))])
        return 0

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def cache_finished_req(self, req: CacheReq, token_ids: TokenIds) -> None:
        """Free every slot of the request's row up to len(token_ids)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)]
        self.allocator.free(row.to(torch.int64))
        req.prefix_indices = self._empty()
        req.last_node = self.root

    def cache_unfinished_req(self, req: CacheReq, token_ids: TokenIds) -> None:
        """Keep all slots with the request; prefix_indices = its slots so far (shared with no one)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)]
        req.prefix_indices = row.to(torch.int64)  # .to copies: the row may be rewritten later
        req.last_node = self.root

    def req_private_len(self, req: CacheReq, kv_len: int) -> int:
        """All of the request's slots are its own: nothing is held by the cache."""
        return kv_len

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_indices(self) -> torch.Tensor:
        return self._empty()

    def pretty_print(self) -> None:
        print("ChunkCache (radix cache disabled): nothing cached")
