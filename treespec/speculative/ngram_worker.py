"""NgramWorker: training-free speculation (`--speculative-algorithm NGRAM`). Drafts come from a trie of
the n-grams in all requests' text (ngram_cache.NgramCache, one cache shared by every request); there is
no draft model, so no draft KV, no hidden states and no per-request draft state.

One step, with the same division of work as EagleWorker:
  1. `decode_step(reqs, shape)`: per request, up to `shape.num_draft_tokens - 1` drafts continuing its
     own prompt + output, each of at least the shape's estimated acceptance (a request with no such
     draft gets the root alone), one tree per request
     (tree.tree_from_parents), one TARGET_VERIFY forward, rejected slots freed, a `SpecStepResult`.
     Nothing else changes.
  2. The Scheduler commits the result.
  3. `draft_extend(reqs, result, committed)`: the committed tokens go into the cache.
A request's text goes in when it asks for drafts (`wants_drafts`: the prompt at its first decode step,
then each plain step's token at the next), all that is new at once. Under load, where the schedule
decodes plain, a request never asks: when it leaves (`release`) its text waits in `pending`, and the
Scheduler inserts it while it has no requests (`idle_work`, one text at a time), so a loaded server
spends no step on inserts (~15 us a token in Python, more right after a forward has flushed the CPU
caches: ~3 ms a code-editing request's prompt and output). Another request drafts from a text once it went in. A
retracted request is prefilled again and its text counted again: counts only order drafts, the target
decides every token.
"""

from __future__ import annotations

from collections import deque

import torch

from treespec.args import ServerArgs
from treespec.forward_batch import ForwardBatch, ModelOutput
from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.req_to_token import ReqToTokenPool
from treespec.model_runner import ModelRunner
from treespec.request import Req
from treespec.speculative.ngram_cache import NgramCache, NgramConfig, TextCursor
from treespec.speculative.shapes import SpecSchedule, SpecShape
from treespec.speculative.step_result import SpecStepResult, verify_tree_step
from treespec.speculative.tree import tree_from_parents

# released requests' text waiting for an idle scheduler; past this many, the oldest goes in at once
MAX_PENDING_TEXTS = 256
GRAMMAR_DRAFT_OVERSAMPLE = 2  # a constrained request draws this many times its budget, then keeps the allowed


def ngram_config(args: ServerArgs) -> NgramConfig:
    return NgramConfig(
        min_match_window=args.speculative_ngram_min_match_window_size,
        max_match_window=args.speculative_ngram_max_match_window_size,
        min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
        max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        branch_length=args.speculative_ngram_branch_length,
        capacity=args.speculative_ngram_capacity,
    )


def draft_limit(req: Req, shape: SpecShape) -> int:
    """Draft nodes worth verifying for `req` this step: the shape's budget, but no deeper than the tokens
    it may still emit (a step emits its accepted drafts and one more; max_new_tokens stops the rest), so
    a request's last steps verify no rows that could never be kept."""
    return max(0, min(shape.num_draft_tokens - 1, req.sampling_params.max_new_tokens - len(req.output_ids) - 1))


class NgramWorker:
    target_capture_layers: tuple[int, ...] = ()
    needs_target_hidden = False

    def __init__(self, args: ServerArgs, target_runner: ModelRunner, req_to_token_pool: ReqToTokenPool,
                 allocator: TokenToKVPoolAllocator) -> None:
        ndraft = args.speculative_num_draft_tokens
        # Only the node budget matters for an n-gram tree. As a chain shape (num_draft_tokens - 1 steps,
        # topk 1) it needs num_draft_tokens slots per request, and the Scheduler's shrink rule (a shorter
        # chain when KV is short) hands this worker a smaller budget.
        # --speculative-config gives chains by batch size (the default model's tuned one: batch 1 only on
        # a CPU, with fewer, likelier nodes where its kernels run AVX2 code; up to batch 4 on CUDA);
        # without it, the same chain at every batch size
        self.schedule = SpecSchedule.from_flags(args.speculative_config, ndraft - 1, 1, ndraft,
                                                target_runner.schedule_kind())
        self.cache = NgramCache(ngram_config(args))
        self.min_accept_prob_flag = args.speculative_ngram_min_accept_prob  # None: each shape's own
        self.text: dict[str, TextCursor] = {}  # rid -> where its text stands in the cache (cheap inserts)
        self.pending: deque[tuple[list[int], TextCursor]] = deque()  # released text for `idle_work`
        self.target = target_runner
        self.req_to_token_pool, self.allocator = req_to_token_pool, allocator
        self.device = target_runner.device

    def after_prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch, output: ModelOutput) -> None:
        """A cursor for every request whose prefill completed: its text goes in when it first asks for
        drafts, or after it leaves."""
        for req in reqs:
            if req.kv_len == req.seq_len - 1:
                self.text.setdefault(req.rid, TextCursor())

    def draft_extend(self, reqs: list[Req], result: SpecStepResult, committed: list[int]) -> None:
        """Insert each request's committed tokens (finished requests too: their text helps others)."""
        for req, num_new in zip(reqs, committed, strict=True):
            self.cache.insert(req.all_ids, num_new, self.text.get(req.rid))

    def defer_extend(self, reqs: list[Req], tokens: list[int], batch: ForwardBatch, output: ModelOutput) -> None:
        """A plain step's tokens wait: `_catch_up` inserts them when the request drafts or leaves."""

    def _catch_up(self, req: Req, ids: list[int]) -> TextCursor | None:
        """Insert the request's tokens (`ids`: its all_ids) its cursor has not seen (those of its plain
        steps); returns the cursor, which then stands at the end of `ids`."""
        cursor = self.text.get(req.rid)
        if cursor is not None:
            self.cache.insert_rest(ids, cursor)
        return cursor

    def min_accept_prob(self, shape: SpecShape) -> float:
        """The estimated acceptance a draft node needs to join this step's tree."""
        flag = self.min_accept_prob_flag
        return shape.ngram_min_accept_prob if flag is None else flag

    def wants_drafts(self, reqs: list[Req], shape: SpecShape) -> bool:
        """Whether any request has a draft node worth verifying this step (else the Scheduler runs a
        plain step)."""
        contexts = [r.all_ids for r in reqs]  # one list per request (Req.all_ids builds a new one per access)
        cursors = [self._catch_up(r, ids) for r, ids in zip(reqs, contexts, strict=True)]
        min_accept = self.min_accept_prob(shape)
        return any(draft_limit(r, shape) > 0 and self.cache.has_match(ids, 0, min_accept, cursor)
                   for r, ids, cursor in zip(reqs, contexts, cursors, strict=True))

    def release(self, req: Req, keep_draft_kv: bool) -> None:
        """Forget the request's cursor; what the cache has not seen of its text waits for `idle_work`."""
        cursor = self.text.pop(req.rid, None)
        if cursor is None:
            return
        tokens = list(req.all_ids)  # one snapshot (Req.all_ids builds a new list per access)
        if cursor.length < len(tokens):
            self.pending.append((tokens, cursor))
            if len(self.pending) > MAX_PENDING_TEXTS:
                self.cache.insert_rest(*self.pending.popleft())

    def has_idle_work(self) -> bool:
        return bool(self.pending)

    def idle_work(self) -> None:
        """Insert the oldest released text still waiting (the Scheduler calls this with no request in
        flight, one text per call, so a request arriving meanwhile waits for one insert at most)."""
        if self.pending:
            self.cache.insert_rest(*self.pending.popleft())

    def flush(self) -> None:
        """Forget every request's text (`/flush_cache`, with no request in flight)."""
        self.cache = NgramCache(self.cache.config)
        self.text.clear()
        self.pending.clear()

    def _draft(self, req: Req, ids: list[int], cursor: TextCursor | None, max_drafts: int, min_accept: float
               ) -> tuple[list[int], list[int]]:
        """(tokens, parents) of one request's drafts (`ids`: its all_ids, `cursor`: its text's, caught
        up). A constrained request asks the cache for twice its budget and keeps the drafts its grammar
        allows, so its nodes go to tokens that can be accepted."""
        if req.grammar is None:
            draft = self.cache.draft(ids, max_drafts, min_accept, cursor)
            return draft.tokens, draft.parents
        draft = self.cache.draft(ids, GRAMMAR_DRAFT_OVERSAMPLE * max_drafts, min_accept, cursor)
        return req.grammar.allowed_drafts(draft.tokens, draft.parents, max_drafts)

    def decode_step(self, reqs: list[Req], shape: SpecShape) -> SpecStepResult:
        """Draft from the cache within `shape.num_draft_tokens` nodes per request (the root included) and
        verify. The Scheduler sized `shape` against the free KV; this allocates only what the largest
        tree needs (no drafts anywhere: a plain step)."""
        contexts = [r.all_ids for r in reqs]
        # wants_drafts caught every request up, unless a pinned seeded step skipped it
        cursors = [self._catch_up(r, ids) for r, ids in zip(reqs, contexts, strict=True)]
        kv_lens = [r.kv_len for r in reqs]
        prefix_slots = [self.req_to_token_pool.read(r.req_pool_idx, 0, k) for r, k in zip(reqs, kv_lens, strict=True)]
        roots = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=self.device)
        min_accept = self.min_accept_prob(shape)
        drafts = [self._draft(r, ids, cursor, draft_limit(r, shape), min_accept)
                  for r, ids, cursor in zip(reqs, contexts, cursors, strict=True)]
        tree = tree_from_parents(roots, [d[0] for d in drafts], [d[1] for d in drafts], kv_lens)
        return verify_tree_step(reqs, tree, kv_lens, prefix_slots, self.target, self.allocator,
                                self.target_capture_layers, return_all_hidden=False, node_sources="ngram")
