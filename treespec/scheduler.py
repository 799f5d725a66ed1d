"""Scheduler: waiting queue, admission, chunked prefill, decode batches, retraction and abort.

Pure engine logic, no sockets: the in-process Engine calls `step()` in a loop and the server's
scheduler process wraps the same object in a ZMQ loop. One step runs one batch: a prefill batch of
waiting requests (longest cached prefix first by default) when any can be admitted, else one decode
step of every running request.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

import torch

from treespec.args import ServerArgs
from treespec.batch_builder import build_decode_batch, build_extend_batch
from treespec.constrained import GrammarCache, GrammarState
from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.balance import check_pool_balance
from treespec.mem.chunk_cache import ChunkCache
from treespec.mem.radix_cache import RadixCache
from treespec.mem.req_to_token import ReqToTokenPool
from treespec.model_loader import resolve_model_path
from treespec.model_runner import ModelRunner
from treespec.request import Req, RequestOutput
from treespec.sampling import sample_next_tokens
from treespec.sampling_params import InvalidRequest, SamplingParams
from treespec.speculative.shapes import SpecShape

logger = logging.getLogger(__name__)

DEFAULT_KV_TOKENS = 65536
RESERVE_CAP = 256  # per request, at most this many future decode tokens are reserved at admission
IN_BATCH_PREFIX_MIN = 32  # defer a request sharing this many uncached tokens with the batch
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001
PLAIN_STEP = SpecShape(0, 1, 1)  # a speculative step without drafts: the root alone is verified
GRAMMAR_WAIT_S = 0.05  # an idle step waits this long for a grammar being compiled
# a jump-forward costs a prefill step over its tokens: worth it from two tokens on
MIN_JUMP_FORWARD_TOKENS = 2

if TYPE_CHECKING:
    from treespec.distributed.parallel_state import TPGroup
    from treespec.speculative.step_result import SpecStepResult, SpecWorker


def _retraction_order(req: Req) -> tuple:
    """Which running request to retract first: unseeded before seeded (a seeded request resumes by a
    prefill, which draws its next token differently from the step it would have had), then the one
    with the least progress (its recompute is cheapest)."""
    return (req.sampling_params.seeded, len(req.output_ids), -len(req.origin_input_ids))


class Scheduler:
    def __init__(self, args: ServerArgs, tp: TPGroup | None = None, device: torch.device | None = None) -> None:
        """`tp`: this rank's tensor-parallel group, whose ranks each run a Scheduler on the same inputs
        (server/scheduler_process.py) and so take the same decisions; `device`: this rank's device."""
        self.args = args
        self.tp = tp
        self.device = device or args.torch_device()
        self.dtype = args.torch_dtype()
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.model_dir = resolve_model_path(args.model_path)
        pool_size = args.max_total_tokens or DEFAULT_KV_TOKENS
        self.runner = ModelRunner(self.model_dir, self.dtype, self.device, pool_size, args.context_length,
                                  packed_linear=not args.disable_packed_linear,
                                  block_quant=not args.disable_block_quant,
                                  block_quant_activations=args.block_quant_activations, tp=tp,
                                  keep_full_vocab=args.speculative_algorithm in ("EAGLE", "EAGLE3"))
        self.model_config = self.runner.config
        self.context_len = self.runner.context_len
        self.vocab_size = self.model_config.vocab_size
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests, self.context_len + 8)
        self.allocator = TokenToKVPoolAllocator(pool_size)
        self.spec_enabled = args.speculative_algorithm != "NONE"
        if args.disable_radix_cache:
            self.cache = ChunkCache(self.req_to_token_pool, self.allocator)
        else:
            # EAGLE: the draft KV at position i depends on token i+1, so key the cache on bigrams
            # (NGRAM has no draft KV: plain keys)
            bigram_keys = args.speculative_algorithm in ("EAGLE", "EAGLE3")
            self.cache = RadixCache(self.req_to_token_pool, self.allocator, bigram_keys=bigram_keys)
        self.spec_worker: SpecWorker | None = None
        if args.speculative_algorithm == "NGRAM":
            from treespec.speculative.ngram_worker import NgramWorker

            self.spec_worker = NgramWorker(args, self.runner, self.req_to_token_pool, self.allocator)
        elif self.spec_enabled:
            from treespec.speculative.eagle_worker import EagleWorker

            self.spec_worker = EagleWorker(args, self.runner, self.req_to_token_pool, self.allocator)
        self.tokenizer = None  # set by the owner when stop strings must be checked
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        # grammars compile on a worker thread; a request waits in `waiting` until its grammar is ready
        self.grammars = GrammarCache(args.tokenizer_path or self.model_dir, self.vocab_size, self.eos_token_ids)
        self.refused: list[tuple[str, InvalidRequest]] = []  # (rid, error) of requests whose grammar failed

        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.stats = {"num_retractions": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "generated_tokens": 0, "num_finished": 0, "prefill_tokens": 0,
                      "spec_verify_ct": 0, "spec_emitted_tokens": 0, "spec_shrunk_steps": 0, "spec_retracted_for_shape": 0,
                      "jump_forward_tokens": 0}
        # the one accept counter: tokens committed per request per verify step (stats above pool it)
        self.spec_accept_histogram: Counter[int] = Counter()
        self.spec_accepted_drafts: Counter[str] = Counter()  # committed draft tokens by source
        self.start_time = time.time()
        self._seed_counter = args.random_seed

    # ------------------------------------------------------------------ requests in and out
    def add_request(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
    ) -> Req:
        """Queue a tokenized request. The caller has checked it (treespec.request_checks.check_request:
        the Engine and the TokenizerManager do); `sampling_params` is valid by construction. `stream`:
        report its new tokens as they come (--stream-interval; else at its first token and when it
        finishes: Req.stream)."""
        req = Req(rid, list(input_ids), sampling_params, return_logprob, top_logprobs_num,
                  logprob_start_len, eos_token_ids=self.eos_token_ids, stream=stream)
        self._seed_counter += 1
        req.init_sampling_state(self.vocab_size, self._seed_counter)
        if sampling_params.grammar is not None:
            req.grammar_future = self.grammars.submit(*sampling_params.grammar)
        self.waiting.append(req)
        return req

    def take_refused(self) -> list[tuple[str, InvalidRequest]]:
        """Requests dropped because their grammar did not compile (the owner answers each with a 400)."""
        refused, self.refused = self.refused, []
        return refused

    def abort_request(self, rid: str) -> RequestOutput | None:
        """Abort a request wherever it is; its KV goes back to the pool / cache at once."""
        abort = {"type": "abort", "message": "aborted"}
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = abort
                return req.take_output()
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            req.finished_reason = abort
            self._release(req)
            return req.take_output()
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                req.finished_reason = abort
                self._release(req)
                return req.take_output()
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def has_idle_work(self) -> bool:
        """Whether the speculative worker keeps work for a moment without requests (`idle_work`)."""
        return self.spec_worker is not None and self.spec_worker.has_idle_work()

    def idle_work(self) -> None:
        """One piece of the speculative worker's idle work (the n-gram cache's insert of one released
        request's text); its owner calls this only while `has_work()` is false."""
        if self.spec_worker is not None and not self.has_work():
            self.spec_worker.idle_work()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        batch = self._pick_prefill()
        if batch:
            outputs = self._run_prefill(*batch)
        elif self.running:
            outputs = self._run_decode()
        else:
            self._wait_for_a_grammar()
            return []
        if not self.has_work():
            self.check_pool_balance()  # the idle-time leak check (docs/architecture.md, memory)
        return outputs

    # ------------------------------------------------------------------ admission
    def _reserved_tokens(self, req: Req) -> int:
        remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
        return int(min(remaining, RESERVE_CAP) * self.new_token_ratio)

    def _pick_prefill(self) -> tuple[list[Req], list[int]] | None:
        budget = min(self.args.chunked_prefill_size, self.args.max_prefill_tokens)
        reqs: list[Req] = []
        lens: list[int] = []
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            n = min(len(req.all_ids) - req.kv_len, budget)
            if not self._alloc_ready(n):
                self.chunked_req = req
                return None
            reqs.append(req)
            lens.append(n)
            budget -= n
        self._resolve_grammars()
        if not self.waiting or budget <= 0:
            return (reqs, lens) if reqs else None
        free_req_slots = self.req_to_token_pool.available_size()
        reserve = sum(self._reserved_tokens(r) for r in self.running)
        candidates = [r for r in self.waiting if r.grammar_future is None]  # the rest wait for their grammar
        if self.args.schedule_policy == "lpm" and len(candidates) > 1:
            lengths = {id(r): len(self._match(r).prefix_indices) for r in candidates}
            candidates.sort(key=lambda r: -lengths[id(r)])
        for req in candidates:
            if budget <= 0 or free_req_slots <= 0 or len(self.running) + len(reqs) >= self.args.max_running_requests:
                break
            fill = req.all_ids
            match = self._match(req)
            prefix_len = len(match.prefix_indices)
            if isinstance(self.cache, RadixCache) and self._shares_uncached_prefix(fill, prefix_len, reqs):
                continue  # next step it hits the cache instead of computing the same prefix twice
            n = min(len(fill) - prefix_len, budget)
            # slots this batch will allocate, plus decode headroom for everything running
            need = sum(lens) + n + self._reserved_tokens(req) + reserve
            self.cache.inc_lock_ref(match.last_node)
            nothing_else = not self.running and not reqs
            if not self._alloc_ready(need if not nothing_else else n):
                self.cache.dec_lock_ref(match.last_node)
                break
            self.waiting.remove(req)
            req.req_pool_idx = self.req_to_token_pool.alloc()
            free_req_slots -= 1
            req.prefix_indices, req.last_node = match.prefix_indices, match.last_node
            self.req_to_token_pool.write(req.req_pool_idx, 0, match.prefix_indices)
            req.kv_len = prefix_len
            if not req.output_ids:
                req.cached_tokens = prefix_len
            reqs.append(req)
            lens.append(n)
            budget -= n
            reserve += self._reserved_tokens(req)
        return (reqs, lens) if reqs else None

    def _resolve_grammars(self) -> None:
        """Give each waiting request whose grammar has compiled its matcher; drop (into `refused`) those
        whose grammar failed."""
        if self.tp is not None:
            # when a compile finishes is timing, which differs by rank: under tensor parallelism every
            # rank waits for its grammars, so all admit the same requests in the same step
            concurrent.futures.wait([r.grammar_future for r in self.waiting if r.grammar_future is not None])
        for req in [r for r in self.waiting if r.grammar_future is not None and r.grammar_future.done()]:
            future, req.grammar_future = req.grammar_future, None
            error = future.exception()
            if error is None:
                req.grammar = GrammarState(future.result())
                continue
            self.waiting.remove(req)
            if not isinstance(error, InvalidRequest):
                field = req.sampling_params.grammar[0]
                error = InvalidRequest(f"could not compile {field}: {type(error).__name__}: {error}", param=field)
            self.refused.append((req.rid, error))

    def _wait_for_a_grammar(self) -> None:
        """Nothing to run: block briefly on a compiling grammar rather than spin."""
        pending = [r.grammar_future for r in self.waiting if r.grammar_future is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=GRAMMAR_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    @staticmethod
    def _shares_uncached_prefix(ids: list[int], cached_len: int, batch: list[Req]) -> bool:
        """True if a request already in this prefill batch shares a longer prefix than the cache has."""
        for other in batch:
            common = len(os.path.commonprefix([ids, other.all_ids]))
            if common >= IN_BATCH_PREFIX_MIN and common > cached_len + IN_BATCH_PREFIX_MIN:
                return True
        return False

    def _match(self, req: Req):
        """Cached prefix for a request, leaving at least its last token (and any prompt positions
        whose logprobs were asked for) to compute. Bigram keys already stop one short."""
        ids = req.all_ids
        limit = len(ids) if getattr(self.cache, "bigram_keys", False) else len(ids) - 1
        if req.wants_input_logprobs:
            limit = min(limit, req.logprob_start_len)
        return self.cache.match_prefix(ids[:limit])

    def _alloc_ready(self, need: int) -> bool:
        """Make `need` slots free (evicting cached prefixes if needed); False if impossible."""
        free = self.allocator.available_size()
        if free >= need:
            return True
        if free + self.cache.evictable_size() < need:
            return False
        self.cache.evict(need - free)
        return self.allocator.available_size() >= need

    # ------------------------------------------------------------------ prefill
    def _run_prefill(self, reqs: list[Req], lens: list[int]) -> list[RequestOutput]:
        out_loc = self.allocator.alloc(sum(lens))
        self.stats["prefill_tokens"] += sum(lens)
        logit_rows = []
        for req, n in zip(reqs, lens, strict=True):
            done = req.kv_len + n == len(req.all_ids)
            rows = [n - 1] if done else []
            if req.wants_input_logprobs:
                # prompt logprobs: the logits at position p score token p + 1
                first = max(req.logprob_start_len - req.kv_len, 0)
                rows = sorted(set(range(first, n)) | set(rows))
            logit_rows.append(rows)
        batch = build_extend_batch(reqs, lens, out_loc, self.req_to_token_pool, logit_rows, self.device)
        if self.spec_worker is not None and self.spec_worker.needs_target_hidden:
            batch.capture_layers = self.spec_worker.target_capture_layers
            output = self.runner.forward(batch, return_all_hidden=True)
        else:
            output = self.runner.forward(batch)
        outputs: list[RequestOutput] = []
        row = 0
        finished_prefill: list[Req] = []
        last_rows: list[int] = []
        for req, n, rows in zip(reqs, lens, logit_rows, strict=True):
            start = req.kv_len
            req.kv_len += n
            if rows and req.wants_input_logprobs:
                self._record_input_logprobs(req, output.logits[row : row + len(rows)], start, rows)
            # share what is computed so far: later requests with the same prefix hit the cache
            self.cache.cache_unfinished_req(req, req.all_ids[: req.kv_len])
            if req.kv_len == len(req.all_ids):
                finished_prefill.append(req)
                last_rows.append(row + len(rows) - 1)
            else:
                self.chunked_req = req  # chunk boundary: continue next step
            row += len(rows)
        # max_new_tokens 0 (SGLang's prompt scoring): finished once prefilled, nothing sampled
        scored = [req for req in finished_prefill if req.sampling_params.max_new_tokens == 0]
        for req in scored:
            req.finished_reason = {"type": "length", "length": 0}
            self._finish(req)
            outputs.append(req.take_output())
        sample = [(req, r) for req, r in zip(finished_prefill, last_rows, strict=True) if not req.finished]
        if sample:
            logits = output.logits[torch.tensor([r for _, r in sample])]
            outputs += self._sample_and_append([req for req, _ in sample], logits)
        if self.spec_worker is not None:
            # draft extend over the same tokens (a finished request's KV is already released). It reads
            # the token after each position; a scored prompt has none, so its last token stands in for
            # the draft KV of its last position, which is freed, never cached (bigram keys).
            for req in scored:
                req.output_ids.append(req.origin_input_ids[-1])
            self.spec_worker.after_prefill(reqs, lens, batch, output)
            for req in scored:
                req.output_ids.pop()
        for req in finished_prefill:
            if not req.finished:
                self.running.append(req)
        return outputs

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor, start: int, rows: list[int]) -> None:
        """SGLang's input logprobs: prompt tokens logprob_start_len .. end, the first with logprob None
        (and top None); the logits row of position p scores token p + 1."""
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        ids = req.all_ids
        if not req.input_token_logprobs:
            req.input_token_logprobs.append((None, ids[req.logprob_start_len]))
            req.input_top_logprobs.append(None)
        for i, r in enumerate(rows):
            pos = start + r + 1
            if req.logprob_start_len < pos < len(req.origin_input_ids):
                req.input_token_logprobs.append((float(logprobs[i, ids[pos]]), ids[pos]))
                if req.top_logprobs_num > 0:
                    vals, top_ids = logprobs[i].topk(req.top_logprobs_num)
                    req.input_top_logprobs.append(list(zip(vals.tolist(), top_ids.tolist(), strict=True)))
                else:
                    req.input_top_logprobs.append([])

    # ------------------------------------------------------------------ decode
    def _run_decode(self) -> list[RequestOutput]:
        self._make_room_for_decode(len(self.running))
        shape = self._spec_step_shape() if self.spec_worker is not None else PLAIN_STEP
        if shape.num_steps and not self._keep_spec_shape() and not self.spec_worker.wants_drafts(self.running, shape):
            shape = PLAIN_STEP  # no request has drafts worth a verify this step: a plain step is cheaper
        if shape.num_steps:
            return self._run_spec_decode(shape)
        reqs = self.running
        out_loc = self.allocator.alloc(len(reqs))
        batch = build_decode_batch(reqs, out_loc, self.req_to_token_pool, self.device)
        if self.spec_worker is not None:
            batch.capture_layers = self.spec_worker.target_capture_layers
        output = self.runner.forward(batch)
        for req in reqs:
            req.kv_len += 1
        tokens, logprob_info = sample_next_tokens(reqs, output.logits)
        self._append_sampled(reqs, tokens, logprob_info)
        if self.spec_worker is not None:
            # A plain step under speculation costs what a plain server's step costs: the draft's share
            # (its extend over the new tokens) waits until the request speculates again or leaves.
            self.spec_worker.defer_extend(reqs, tokens, batch, output)
        return self._end_decode_step(reqs)

    def _run_spec_decode(self, shape: SpecShape) -> list[RequestOutput]:
        """One speculative step for every running request: the worker drafts and verifies, then this
        commits its result once (stop rules, KV, counters) and the draft catches up on what was kept."""
        reqs = self.running
        result = self.spec_worker.decode_step(reqs, shape)
        committed = [self._commit_spec_tokens(req, result, b) for b, req in enumerate(reqs)]
        self.spec_worker.draft_extend(reqs, result, committed)
        return self._end_decode_step(reqs)

    def _end_decode_step(self, reqs: list[Req]) -> list[RequestOutput]:
        jumped = self._jump_forward(reqs) if self.args.enable_jump_forward else set()
        outputs = self._finish_and_take_outputs(reqs)
        self.running = [r for r in reqs if not r.finished and id(r) not in jumped]
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return outputs

    def _jump_forward(self, reqs: list[Req]) -> set[int]:
        """Append the text each constrained request's grammar forces now (JSON keys, punctuation) without
        a model step. Those tokens have no KV yet: the request goes back to the queue and its next prefill
        computes them (the rest of its sequence is a cache hit). Returns id() of the requeued requests."""
        jumped = set()
        for req in reqs:
            if req.grammar is None or req.finished or req.return_logprob:
                continue
            tokens = req.grammar.jump_forward_tokens(self.tokenizer)
            if len(tokens) < MIN_JUMP_FORWARD_TOKENS:
                continue
            for tok in tokens:
                self.stats["jump_forward_tokens"] += 1
                if req.append_token(tok, self.tokenizer):
                    break
            if not req.finished:
                self._release(req)
                req.kv_len = 0
                self.waiting.appendleft(req)
                jumped.add(id(req))
        return jumped

    def _keep_spec_shape(self) -> bool:
        """Under a pinned shape, a seeded sampling request keeps speculative steps even when no request has
        drafts worth a verify: whether its step is plain or a root-only verify would otherwise depend on
        the other requests' drafts, and the two draw its random numbers differently."""
        return self.spec_worker.schedule.pinned and any(r.sampling_params.seeded for r in self.running)

    def _spec_step_shape(self) -> SpecShape:
        """The tree shape of this step, sized against the free KV slots (the only place that does):
        the schedule's tree for this batch size if evicting cached prefixes gets there, else the longest
        chain that fits (0 steps: a plain step). The caller made room for a plain step first."""
        bs = len(self.running)
        shape = self.spec_worker.schedule.shape_for(bs)
        if shape.num_steps == 0:
            return PLAIN_STEP
        short = bs * shape.slots_per_request - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)  # as much as it can; the tree shrinks below if that is not enough
        free = self.allocator.available_size()
        if bs * shape.slots_per_request <= free:
            return shape
        if self.spec_worker.schedule.pinned and any(r.sampling_params.seeded for r in self.running):
            # A seeded request's draws follow its tree's shape, so under a pinned shape its output must
            # not depend on how full the pool is: make room for the full tree by retracting others
            # (unseeded first: _retraction_order) rather than shrink.
            while len(self.running) > 1 and len(self.running) * shape.slots_per_request > free:
                self._retract(min(self.running, key=_retraction_order))
                self.stats["spec_retracted_for_shape"] += 1
                free = self.allocator.available_size()
            bs = len(self.running)
            if bs * shape.slots_per_request <= free:
                return shape
        self.stats["spec_shrunk_steps"] += 1
        steps = max(0, min(shape.num_steps, free // bs - 1))
        # a chain of `steps`; every other setting of the step (its n-gram threshold) stays the schedule's
        return dataclasses.replace(shape, num_steps=steps, topk=1, num_draft_tokens=steps + 1) if steps else PLAIN_STEP

    def _commit_spec_tokens(self, req: Req, result: SpecStepResult, b: int) -> int:
        """Append request b's verified tokens one at a time, so stop rules cut exactly where plain
        decoding would; keep the KV of the tokens kept, free the rest. Returns the count kept."""
        tokens, slots, logprobs = result.tokens[b], result.kept_slots[b], result.logprobs[b]
        kept = 0
        for tok, source in zip(tokens, result.sources[b], strict=True):
            if logprobs is not None:
                req.output_token_logprobs.append((logprobs[kept][0], tok))
                req.output_top_logprobs.append(logprobs[kept][1])
            if source != "target":
                req.spec_accepted_drafts[source] += 1
                self.spec_accepted_drafts[source] += 1
            kept += 1
            if req.append_token(tok, self.tokenizer):
                break
        # KV covers all_ids[:-1]: the slots of the kept tokens' positions kv_len .. kv_len + kept - 1
        self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[:kept])
        self.allocator.free(slots[kept:])
        req.kv_len += kept
        req.spec_verify_ct += 1
        req.spec_emitted_tokens += kept
        self.stats["spec_verify_ct"] += 1
        self.stats["spec_emitted_tokens"] += kept
        self.stats["generated_tokens"] += kept
        self.spec_accept_histogram[kept] += 1
        return kept

    def _make_room_for_decode(self, need: int) -> None:
        """Retract running requests until `need` new slots fit; retracted ones resume later."""
        while not self._alloc_ready(need):
            if len(self.running) <= 1:
                raise RuntimeError("KV pool too small for even one running request")
            self._retract(min(self.running, key=_retraction_order))
            need -= 1

    def _retract(self, victim: Req) -> None:
        """Take a running request off the batch and back to the queue; it resumes by a prefill of its
        sequence (mostly a cache hit), its outputs and sampling state kept."""
        self.running.remove(victim)
        self._release(victim)
        victim.kv_len = 0
        victim.num_retractions += 1
        self.stats["num_retractions"] += 1
        self.waiting.appendleft(victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)

    # ------------------------------------------------------------------ sampling and finishing
    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> list[RequestOutput]:
        tokens, logprob_info = sample_next_tokens(reqs, logits)
        self._append_sampled(reqs, tokens, logprob_info)
        return self._finish_and_take_outputs(reqs)

    def _finish_and_take_outputs(self, reqs: list[Req]) -> list[RequestOutput]:
        """Release the requests a step finished; the new tokens of those that report now (Req.wants_output)."""
        outputs = []
        for req in reqs:
            if req.finished:
                self._finish(req)
            if req.wants_output(self.args.stream_interval):
                outputs.append(req.take_output())
        return outputs

    def _append_sampled(self, reqs: list[Req], tokens: list[int], logprob_info: list) -> None:
        """Append one sampled token per request (stop rules mark finished requests; not released here)."""
        for i, (req, tok) in enumerate(zip(reqs, tokens, strict=True)):
            if req.return_logprob:
                lp, top = logprob_info[i]
                req.output_token_logprobs.append((lp, tok))
                req.output_top_logprobs.append(top)
            self.stats["generated_tokens"] += 1
            req.append_token(tok, self.tokenizer)

    def _finish(self, req: Req) -> None:
        self._release(req)
        self.stats["num_finished"] += 1
        self.stats["prompt_tokens"] += len(req.origin_input_ids)
        self.stats["cached_tokens"] += req.cached_tokens

    def _release(self, req: Req) -> None:
        """Give the request's KV back: cacheable positions to the tree, the rest to the allocator."""
        if req.req_pool_idx is None:
            return
        if self.spec_worker is not None:
            # deferred draft extends run now: a cached position's draft KV must be current before
            # another request can hit it (only the radix cache keeps positions for others)
            self.spec_worker.release(req, keep_draft_kv=isinstance(self.cache, RadixCache))
        self.cache.cache_finished_req(req, req.all_ids[: req.kv_len])
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    # ------------------------------------------------------------------ introspection
    def check_pool_balance(self) -> None:
        private = sum(self.cache.req_private_len(r, r.kv_len) for r in self._active_reqs())
        check_pool_balance(self.allocator, self.cache, private, deep=not self.has_work())

    def _active_reqs(self) -> list[Req]:
        return self.running + ([self.chunked_req] if self.chunked_req else [])

    def flush_cache(self) -> bool:
        """Forget cached text when idle: the radix cache and the speculative worker's caches of past
        requests (n-gram corpus, parked draft rows). False (nothing done) while requests are in flight."""
        if self.has_work():
            return False
        self.cache.reset()
        if self.spec_worker is not None:
            self.spec_worker.flush()
        return True

    def get_stats(self) -> dict:
        prompt = self.stats["prompt_tokens"]
        return {
            **self.stats,
            "num_running_reqs": len(self.running) + (1 if self.chunked_req else 0),
            "num_waiting_reqs": len(self.waiting),
            "max_total_num_tokens": self.allocator.size,
            "free_tokens": self.allocator.available_size(),
            "evictable_tokens": self.cache.evictable_size(),
            "protected_tokens": self.cache.protected_size(),
            "token_usage": 1 - (self.allocator.available_size() + self.cache.evictable_size()) / self.allocator.size,
            "cache_hit_rate": self.stats["cached_tokens"] / prompt if prompt else 0.0,
            "speculative_algorithm": self.args.speculative_algorithm,
            # what --block-quant-activations resolved to ("auto": int8 where GGUF blocks are streamed)
            "block_quant_activations": self.runner.block_quant_activations,
            **{f"spec_accepted_drafts_{src}": n for src, n in sorted(self.spec_accepted_drafts.items())},
            # tokens emitted per verify step (accepted drafts + the bonus token), since start
            "avg_spec_accept_length": (
                self.stats["spec_emitted_tokens"] / self.stats["spec_verify_ct"] if self.stats["spec_verify_ct"] else 0.0
            ),
        }
