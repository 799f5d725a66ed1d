"""NgramWorker: training-free speculation (`--speculative-algorithm NGRAM`). Drafts come from tries of
n-grams (ngram_cache.NgramCache): each running request's own text (its prompt and output) in a trie of
its own, drafted from first, and past requests' text in one trie shared by every request, drafted from
where a request's own text offers no node, at a higher bar (`OTHER_TEXT_WEIGHT`). There is no draft
model, so no draft KV and no hidden states.

One step, with the same division of work as EagleWorker:
  1. `decode_step(reqs, shape)`: per request, up to `shape.num_draft_tokens - 1` drafts continuing its
     own prompt + output, each of at least the shape's estimated acceptance (a request with no such
     draft gets the root alone), one tree per request
     (tree.tree_from_parents), one TARGET_VERIFY forward, rejected slots freed, a `SpecStepResult`.
     Nothing else changes.
  2. The Scheduler commits the result.
  3. `draft_extend(reqs, result, committed)`: nothing; the committed tokens wait for the next step.
A request's text goes into its own trie when it asks for drafts (`wants_drafts`: the prompt at its first
decode step, then each step's committed tokens, plain or verified, at the next), all that is new at
once. Where the schedule decodes plain (above batch 16 on the default CPU schedule), a request never
asks. When it leaves (`release`) its whole text waits in `pending` for the shared trie, and the
Scheduler inserts it while it has no requests (`idle_work`, one text at a time), so a loaded server
spends no step on inserts into the shared trie. The tries are C++ where it builds (`new_ngram_cache`):
~2 us a prompt token and ~13 us an extend by one token through its cursor (more right after a
forward), against ~40 and ~20 in Python. Another request drafts from a text once it went in.

Why own text first: other requests' continuations of a match are accepted less often than the estimate
says (it was fitted on a request's own text), and in one shared trie they also dilute the share of the
request's own continuation. Replaying the held-out benchmark replies (`ngram_accept_fit.py`'s model,
12 nodes >= 0.3): own trie first, the shared one at 0.3 / 0.6 = 0.5 where the own one has nothing,
chat 1.275x, multi-turn 1.370x, code editing 2.182x, summarising 1.662x against 1.260x, 1.359x,
2.130x and 1.628x for one shared trie. A retracted request leaves as any other (its text waits for
the shared trie) and, prefilled again, starts a new own trie: its text may be counted twice, but counts
only order drafts; the target decides every token.
"""

from __future__ import annotations

from collections import deque

import torch

from treespec.args import ArgError, ServerArgs
from treespec.forward_batch import ForwardBatch, ModelOutput
from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.req_to_token import ReqToTokenPool
from treespec.model_runner import ModelRunner
from treespec.request import Req
from treespec.speculative.ngram_cache import NgramCache, NgramConfig, TextCursor, new_ngram_cache
from treespec.speculative.ngram_corpus import CorpusError, load_corpus
from treespec.speculative.shapes import SpecSchedule, SpecShape
from treespec.speculative.step_result import SpecStepResult, verify_tree_step
from treespec.speculative.tree import tree_from_parents

# released requests' text waiting for an idle scheduler; past this many, the oldest goes in at once
MAX_PENDING_TEXTS = 256
# A node drafted from other requests' text (the shared trie) counts at this fraction of its estimated
# acceptance against the threshold (0.3 -> 0.5 with the tuned schedule; a threshold of 0 takes any node)
OTHER_TEXT_WEIGHT = 0.6
GRAMMAR_DRAFT_OVERSAMPLE = 2  # a constrained request draws this many times its budget, then keeps the allowed


# --speculative-ngram-min-match-window-size's default (None): 1 where draft nodes need an estimated
# acceptance (a one-token match then drafts only where its continuation dominates), 2 where trees fill
# their node budget (after a one-token match mostly wrong drafts); ServerArgs' comment has the numbers
MIN_MATCH_WITH_THRESHOLD, MIN_MATCH_FILLING = 1, 2


def ngram_config(args: ServerArgs, thresholds: bool) -> NgramConfig:
    """The n-gram cache's settings from the flags; `thresholds`: whether draft nodes need an estimated
    acceptance (it picks the minimum match window where the flag is not given)."""
    min_match = args.speculative_ngram_min_match_window_size
    if min_match is None:
        min_match = MIN_MATCH_WITH_THRESHOLD if thresholds else MIN_MATCH_FILLING
    return NgramConfig(
        min_match_window=min_match,
        max_match_window=args.speculative_ngram_max_match_window_size,
        min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
        max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        branch_length=args.speculative_ngram_branch_length,
        capacity=args.speculative_ngram_capacity,
    )


def emit_room(req: Req) -> int:
    """Draft nodes of `req` that could still be kept: a step emits its accepted drafts and one more, and
    max_new_tokens stops the rest."""
    return max(0, req.sampling_params.max_new_tokens - len(req.output_ids) - 1)


def draft_limit(req: Req, shape: SpecShape) -> int:
    """Draft nodes worth verifying for `req` this step: the shape's budget, but no more than `emit_room`,
    so a request's last steps verify no rows that could never be kept."""
    return min(shape.num_draft_tokens - 1, emit_room(req))


class OwnText:
    """A running request's own text: its trie and the cursor that says how much of its text went in."""

    __slots__ = ("cache", "cursor")

    def __init__(self, config: NgramConfig) -> None:
        self.cache = new_ngram_cache(config)
        self.cursor = TextCursor()


def draft_source(ids: list[int], own: OwnText | None, shared: NgramCache, min_accept: float,
                 other_text_weight: float = OTHER_TEXT_WEIGHT) -> tuple[NgramCache, TextCursor | None, float] | None:
    """Where a request's drafts for context `ids` come from this step: (trie, its cursor if any,
    threshold). Its own trie if that offers a node of at least `min_accept`; else the shared trie if it
    offers one at `other_text_weight` of its estimate (the threshold divided by the weight; a weight of
    0 never drafts from it); else None."""
    if own is not None and own.cache.has_match(ids, 0, min_accept, own.cursor):
        return own.cache, own.cursor, min_accept
    if other_text_weight > 0:
        other = min_accept / other_text_weight
        if other < 1.0 and shared.has_match(ids, 0, other):
            return shared, None, other
    return None


class NgramWorker:
    target_capture_layers: tuple[int, ...] = ()
    needs_target_hidden = False

    def __init__(self, args: ServerArgs, target_runner: ModelRunner, req_to_token_pool: ReqToTokenPool,
                 allocator: TokenToKVPoolAllocator) -> None:
        ndraft = args.speculative_num_draft_tokens
        # Only the node budget matters for an n-gram tree. As a chain shape (num_draft_tokens - 1 steps,
        # topk 1) it needs num_draft_tokens slots per request, and the Scheduler's shrink rule (a shorter
        # chain when KV is short) hands this worker a smaller budget.
        # --speculative-config gives chains by batch size (the default model's tuned one: up to batch 16
        # on a CPU, up to batch 4 with fewer, likelier nodes where its kernels run AVX2 code, up to batch 4
        # on CUDA); without it, the same chain at every batch size
        self.schedule = SpecSchedule.from_flags(args.speculative_config, ndraft - 1, 1, ndraft,
                                                target_runner.schedule_kind())
        self.min_accept_prob_flag = args.speculative_ngram_min_accept_prob  # None: each shape's own
        thresholds = any(self.min_accept_prob(shape) > 0 for _, shape in self.schedule.entries)
        self.config = ngram_config(args, thresholds)
        # the shared trie's warm corpus (--speculative-ngram-corpus), put in again after every flush
        self.corpus: list[list[int]] = []
        if args.speculative_ngram_corpus is not None:
            try:
                self.corpus = load_corpus(args.speculative_ngram_corpus, target_runner.config.vocab_size)
            except CorpusError as err:
                raise ArgError(f"--speculative-ngram-corpus: {err}") from err
        self.cache = self._warm_shared_cache()  # past requests' text, shared (--speculative-ngram-capacity)
        self.text: dict[str, OwnText] = {}  # rid -> its own trie and cursor, while it runs
        self.pending: deque[list[int]] = deque()  # released text for the shared trie (`idle_work`)
        # this step's `draft_source` results from `wants_drafts`, by (rid, context length, threshold), so
        # `decode_step` does not look them up again (nothing changes the tries between the two)
        self.found_sources: dict[tuple[str, int, float], tuple[NgramCache, TextCursor | None, float] | None] = {}
        self.target = target_runner
        self.req_to_token_pool, self.allocator = req_to_token_pool, allocator
        self.device = target_runner.device

    def _warm_shared_cache(self) -> NgramCache:
        """A new shared trie holding the warm corpus (its texts in file order: with more than the
        capacity holds, the last ones stay)."""
        cache = new_ngram_cache(self.config)
        for text in self.corpus:
            cache.insert(text)
        return cache

    def after_prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch, output: ModelOutput) -> None:
        """An own trie for every request whose prefill completed: its text goes in when it first asks
        for drafts (and into the shared trie after it leaves)."""
        for req in reqs:
            if req.kv_len == req.seq_len - 1 and req.rid not in self.text:
                self.text[req.rid] = OwnText(self.config)

    def draft_extend(self, reqs: list[Req], result: SpecStepResult, committed: list[int]) -> None:
        """A verify step's committed tokens wait as a plain step's do: the next step's `_catch_up` inserts
        them with the context list it builds anyway (the own trie sees the same operations in the same
        order: nothing touches it between this step's commit and the next step's lookups), and a request
        that finished here inserts nothing."""

    def defer_extend(self, reqs: list[Req], tokens: list[int], batch: ForwardBatch, output: ModelOutput) -> None:
        """A plain step's tokens wait: `_catch_up` inserts them when the request drafts or leaves."""

    def _catch_up(self, req: Req, ids: list[int]) -> OwnText | None:
        """Insert into the request's own trie its tokens (`ids`: its all_ids) not in yet (its prompt,
        its plain steps' tokens); its cursor then stands at the end of `ids`."""
        own = self.text.get(req.rid)
        if own is not None:
            own.cache.insert_rest(ids, own.cursor)
        return own

    def min_accept_prob(self, shape: SpecShape) -> float:
        """The estimated acceptance a draft node needs to join this step's tree."""
        flag = self.min_accept_prob_flag
        return shape.ngram_min_accept_prob if flag is None else flag

    def wants_drafts(self, reqs: list[Req], shape: SpecShape) -> bool:
        """Whether any request has a draft node worth verifying this step (else the Scheduler runs a
        plain step)."""
        contexts = [r.all_ids for r in reqs]  # one list per request (Req.all_ids builds a new one per access)
        owns = [self._catch_up(r, ids) for r, ids in zip(reqs, contexts, strict=True)]
        min_accept = self.min_accept_prob(shape)
        self.found_sources = {}
        for r, ids, own in zip(reqs, contexts, owns, strict=True):
            if draft_limit(r, shape) > 0:
                source = self.found_sources[(r.rid, len(ids), min_accept)] = draft_source(ids, own, self.cache,
                                                                                          min_accept)
                if source is not None:
                    return True
        return False

    def release(self, req: Req, keep_draft_kv: bool) -> None:
        """Drop the request's own trie; its whole text waits for `idle_work` to go into the shared one."""
        if self.text.pop(req.rid, None) is None:
            return
        self.pending.append(list(req.all_ids))  # one snapshot (Req.all_ids builds a new list per access)
        if len(self.pending) > MAX_PENDING_TEXTS:
            self.cache.insert(self.pending.popleft())

    def has_idle_work(self) -> bool:
        return bool(self.pending)

    def idle_work(self) -> None:
        """Insert the oldest released text still waiting (the Scheduler calls this with no request in
        flight, one text per call, so a request arriving meanwhile waits for one insert at most)."""
        if self.pending:
            self.cache.insert(self.pending.popleft())

    def flush(self) -> None:
        """Forget every request's text (`/flush_cache`, with no request in flight); the warm corpus
        goes in again."""
        self.cache = self._warm_shared_cache()
        self.text.clear()
        self.pending.clear()
        self.found_sources = {}

    def _draft(self, req: Req, ids: list[int], own: OwnText | None, max_drafts: int, min_accept: float
               ) -> tuple[list[int], list[int]]:
        """(tokens, parents) of one request's drafts (`ids`: its all_ids, `own`: its own trie, caught up),
        from the source `draft_source` picks. A constrained request asks for twice its budget and keeps the
        drafts its grammar allows, so its nodes go to tokens that can be accepted."""
        if max_drafts <= 0:
            return [], []
        key = (req.rid, len(ids), min_accept)
        source = (self.found_sources[key] if key in self.found_sources
                  else draft_source(ids, own, self.cache, min_accept))
        if source is None:
            return [], []
        cache, cursor, threshold = source
        if req.grammar is None:
            draft = cache.draft(ids, max_drafts, threshold, cursor)
            return draft.tokens, draft.parents
        draft = cache.draft(ids, GRAMMAR_DRAFT_OVERSAMPLE * max_drafts, threshold, cursor)
        return req.grammar.allowed_drafts(draft.tokens, draft.parents, max_drafts)

    def decode_step(self, reqs: list[Req], shape: SpecShape) -> SpecStepResult:
        """Draft from the cache within `shape.num_draft_tokens` nodes per request (the root included) and
        verify. The Scheduler sized `shape` against the free KV; this allocates only what the largest
        tree needs (no drafts anywhere: a plain step)."""
        contexts = [r.all_ids for r in reqs]
        # wants_drafts caught every request up, unless a pinned seeded step skipped it
        owns = [self._catch_up(r, ids) for r, ids in zip(reqs, contexts, strict=True)]
        kv_lens = [r.kv_len for r in reqs]
        prefix_slots = [self.req_to_token_pool.read(r.req_pool_idx, 0, k) for r, k in zip(reqs, kv_lens, strict=True)]
        roots = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=self.device)
        min_accept = self.min_accept_prob(shape)
        drafts = [self._draft(r, ids, own, draft_limit(r, shape), min_accept)
                  for r, ids, own in zip(reqs, contexts, owns, strict=True)]
        self.found_sources = {}
        tree = tree_from_parents(roots, [d[0] for d in drafts], [d[1] for d in drafts], kv_lens)
        return verify_tree_step(reqs, tree, kv_lens, prefix_slots, self.target, self.allocator,
                                self.target_capture_layers, return_all_hidden=False, node_sources="ngram")
