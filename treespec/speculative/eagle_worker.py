"""EagleWorker: the draft-and-verify half of one EAGLE-2 / EAGLE-3 tree speculative step.

Positions and the one-token shift: the draft's row at position i takes (token i+1, target hidden
state at i) and predicts token i+2. Between steps a request has target and draft KV for positions
[0, kv_len) with kv_len == seq_len - 1 (the last token, the tree root, has none yet), plus the draft's
output (logits, hidden state) at position kv_len - 1, from which drafting starts.

Ownership: the Scheduler owns requests, their KV bookkeeping and the stop rules; this worker owns the
draft model and its per-request state. One step is:
  1. `decode_step(reqs, shape)`: draft `shape.num_steps` levels with EAGLE-2 top-k expansion (scratch
     draft KV in slots taken under an allocator backup and given back right after), rerank to
     `shape.num_draft_tokens` nodes, build the tree, verify it with one TARGET_VERIFY forward, free the
     rejected nodes' slots and return a `SpecStepResult` (the verify half is
     step_result.verify_tree_step, shared with the NGRAM worker): per request the accepted tokens
     (drafts + the bonus token) and the target KV slots of the accepted nodes, same count. Nothing
     else changes.
  2. The Scheduler commits the result (stop rules, req_to_token, kv_len, surplus slots freed).
  3. `draft_extend(reqs, result, committed)`: records acceptance and defers the draft over the committed
     tokens; `catch_up` runs it (with any plain steps' rows) before the request next drafts with the
     head (steps whose trees hold n-gram nodes alone need no draft forward).

Plain steps (the schedule's choice above some batch size, or too little free KV) run the target alone,
as a plain server would: `defer_extend` keeps each new token's target features, and the draft extend
over them runs later in one batch (`catch_up`): when the request speculates again, or once it is
MAX_DRAFT_LAG tokens behind or the running requests hold more than MAX_DEFERRED_ROWS (which bounds the
features held). A prefill's rows are deferred the same way. A request that leaves with rows still
deferred parks them (`release`): the radix cache keeps its positions, and their draft extend runs only
if a later request's cached prefix takes them in (`adopt_parked`, before that request's own draft
extend at prefill). Under load most finished requests' text is never hit again, so a plain step of the
schedule costs what a plain server's step costs. MAX_PARKED_ROWS bounds the rows kept; past it the
oldest are dropped, and their positions keep a stale draft KV (worse drafts on a later hit there,
never other outputs: the verify reads the target's KV alone).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from treespec.args import ServerArgs
from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ModelOutput
from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.mem.req_to_token import ReqToTokenPool
from treespec.model_runner import ModelRunner
from treespec.request import Req
from treespec.speculative.adaptivity import HeadRecord, next_budget
from treespec.speculative.draft_runner import DraftRunner, draft_extend_batch, draft_tree_step_batch
from treespec.speculative.expansion import (
    draft_topk,
    extend_branch_slots,
    organize_draft_results,
    select_top_k_tokens,
)
from treespec.speculative.hybrid import HYBRID_MIN_MATCH, hybrid_ngram_config, merge_drafts, tree_parents
from treespec.speculative.ngram_cache import TextCursor, new_ngram_cache
from treespec.speculative.ngram_worker import emit_room, ngram_config
from treespec.speculative.shapes import SpecSchedule, SpecShape
from treespec.speculative.step_result import SpecStepResult, verify_tree_step
from treespec.speculative.tree import DraftTree, make_draft_tree, root_only_tree, tree_from_parents

# deferred rows (prompt and plain-step tokens) a request may hold before it catches up, and all running
# requests together (EAGLE-3 features: ~7 KB a row, so ~56 MB); past the total the longest lists run
MAX_DRAFT_LAG = 2048
MAX_DEFERRED_ROWS = 8192
# rows of finished requests kept for a later prefix hit (~56 MB of EAGLE-3 features at most)
MAX_PARKED_ROWS = 8192


class DeferredRow(NamedTuple):
    """One token of a plain step, as the draft extend will take it."""

    position: int
    slot: int
    next_token: int  # the token sampled at this position: the draft's input at it
    features: torch.Tensor  # the target's features at this position (_draft_features)


class EagleWorker:
    needs_target_hidden = True  # the draft extend reads the target's hidden state at every position

    def __init__(self, args: ServerArgs, target_runner: ModelRunner, req_to_token_pool: ReqToTokenPool,
                 allocator: TokenToKVPoolAllocator) -> None:
        if not args.speculative_draft_model_path:
            raise ValueError(f"--speculative-draft-model-path is required with --speculative-algorithm "
                             f"{args.speculative_algorithm}")
        self.schedule = SpecSchedule.from_flags(args.speculative_config, args.speculative_num_steps,
                                                args.speculative_eagle_topk, args.speculative_num_draft_tokens,
                                                target_runner.schedule_kind())
        self.target = target_runner
        self.draft = DraftRunner(args.speculative_draft_model_path, args.speculative_algorithm, target_runner,
                                 args.torch_draft_dtype(), args.speculative_token_map,
                                 args.speculative_draft_model_quantization)
        self.req_to_token_pool, self.allocator = req_to_token_pool, allocator
        self.device = target_runner.device
        # EAGLE-3: the target layers captured (ascending), and where the head's fc takes them in another
        # order, the captured layers' positions in fc order (None: ascending already, the shipped heads)
        self.target_capture_layers: tuple[int, ...] = ()
        self.aux_order: torch.Tensor | None = None
        if self.draft.model.algorithm == "EAGLE3":
            layers = self.draft.model.capture_layers(target_runner.config.num_layers)
            self.target_capture_layers = tuple(sorted(set(layers)))
            if list(self.target_capture_layers) != layers:
                self.aux_order = torch.tensor([self.target_capture_layers.index(i) for i in layers])
        # rid -> (draft logits, draft hidden state) at the request's position kv_len - 1
        self.draft_states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # rid -> plain-step tokens whose draft extend has not run yet (positions in order, contiguous)
        self.deferred: dict[str, list[DeferredRow]] = {}
        # KV slot -> a finished request's deferred row at that (cached) position, oldest first
        self.parked: dict[int, DeferredRow] = {}
        # the hybrid's n-gram cache (speculative/hybrid.py): every request's prompt and committed tokens
        self.hybrid_ngram_tokens = args.speculative_hybrid_ngram_tokens
        self.ngram = new_ngram_cache(hybrid_ngram_config(ngram_config(args, thresholds=False))) if self.hybrid_ngram_tokens else None
        # rid -> (n-gram node budget, n-gram nodes in this step's tree): per-request adaptivity
        self.ngram_budget: dict[str, tuple[int, int]] = {}
        # rid -> where its text stands in the n-gram cache (TextCursor: tokens inserted, suffix nodes).
        # Text goes in lazily, when the request speculates (and the rest when it leaves, if it ever
        # speculated): a plain step or a prefill under load pays nothing for the hybrid.
        self.ngram_text: dict[str, TextCursor] = {}
        # rid -> its measured head acceptance, and whether this step's tree has its head nodes
        # (speculative/adaptivity.py)
        self.head_records: dict[str, HeadRecord] = {}
        self.head_offered: dict[str, bool] = {}

    # ------------------------------------------------------------------ draft extend
    def _draft_features(self, output: ModelOutput, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target hidden states a draft extend takes: EAGLE the final (post-norm) hidden state,
        EAGLE-3 the three captured layers in the head's fc order."""
        if not self.target_capture_layers:  # EAGLE
            feats = output.hidden_states
            return feats if rows is None else feats[rows]
        aux = output.aux_hidden_states if rows is None else output.aux_hidden_states[rows]
        if self.aux_order is None:  # captured in fc order already: no copy (every plain step takes this)
            return aux
        width = aux.shape[-1] // len(self.target_capture_layers)
        return aux.view(aux.shape[0], -1, width)[:, self.aux_order.to(aux.device)].reshape(aux.shape[0], -1)

    def after_prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch, output: ModelOutput) -> None:
        """Draft extend over the tokens the target just prefilled (same slots and attention). A chunk's
        last position takes the next prompt token, a finished prefill's the sampled one. The rows are
        deferred like a plain step's (`catch_up` runs them when the request first drafts; under load
        it may never draft, and its prompt's rows end up parked). Requests that already finished are
        run at once: their slots may now hold cached prefix, which needs draft KV."""
        qo = batch.attn.qo_indptr.tolist()
        starts = batch.positions[torch.tensor(qo[:-1])].tolist()
        self.adopt_parked(reqs, starts)
        input_ids: list[int] = []
        for req, n, start in zip(reqs, lens, starts, strict=True):
            input_ids.extend(req.all_ids[start + 1 : start + n + 1])
        if not any(req.finished for req in reqs):
            feats = self._draft_features(output)
            positions, slots = batch.positions.tolist(), batch.out_cache_loc.tolist()
            rows = []
            for a, b in zip(qo, qo[1:], strict=False):
                own = feats[a:b].clone()  # a request's rows must not keep the whole batch's features alive
                rows.append([DeferredRow(positions[i], slots[i], input_ids[i], own[i - a]) for i in range(a, b)])
            self._defer(reqs, rows)
            return
        self.catch_up([r for r in reqs if not r.finished])  # earlier chunks' deferred rows first
        last_rows = torch.tensor(qo[1:], device=self.device) - 1
        dbatch = draft_extend_batch(torch.tensor(input_ids, device=self.device), batch.positions,
                                    batch.out_cache_loc, batch.attn, self._draft_features(output), last_rows)
        out = self.draft.forward(dbatch)
        for i, req in enumerate(reqs):
            if not req.finished and req.kv_len == req.seq_len - 1:
                self.draft_states[req.rid] = (out.logits[i], out.hidden_states[i])

    def draft_extend(self, reqs: list[Req], result: SpecStepResult, committed: list[int]) -> None:
        """Record each request's acceptance (adaptivity) and defer the draft extend over its first
        `committed[b]` tokens, at the positions and slots the Scheduler kept for them: it runs batched
        with any later plain steps' rows (`catch_up`) before the request next drafts, or when it leaves
        (finished requests too: their slots now hold cached prefix, which needs draft KV). Most
        speculative steps are followed by plain ones, so this saves a draft forward per step there."""
        for b, (req, n) in enumerate(zip(reqs, committed, strict=True)):
            record = self.head_records.get(req.rid, HeadRecord())
            accepted = result.sources[b][:n].count("eagle")
            self.head_records[req.rid] = record.after_step(self.head_offered.pop(req.rid, False), accepted)
        if self.ngram is not None:
            for b, (req, n) in enumerate(zip(reqs, committed, strict=True)):
                budget, offered = self.ngram_budget.get(req.rid, (self.hybrid_ngram_tokens, 0))
                accepted = result.sources[b][:n].count("ngram")
                self.ngram_budget[req.rid] = (next_budget(budget, offered, accepted, self.hybrid_ngram_tokens), 0)
        rows = torch.tensor([r for rows, n in zip(result.accept_rows, committed, strict=True) for r in rows[:n]],
                            dtype=torch.int64)
        feats = self._draft_features(result.verify_output, rows.to(self.device))
        new_rows, i = [], 0
        for b, n in enumerate(committed):
            slots = result.kept_slots[b][:n].tolist()
            new_rows.append([DeferredRow(result.kv_lens[b] + j, slots[j], result.tokens[b][j], feats[i + j])
                             for j in range(n)])
            i += n
        self._defer(reqs, new_rows)

    def defer_extend(self, reqs: list[Req], tokens: list[int], batch: ForwardBatch, output: ModelOutput) -> None:
        """A plain decode step ran the target alone (with the capture layers): keep what the draft extend
        over its tokens needs and run it later, batched."""
        feats = self._draft_features(output).unbind(0)  # one call for every row's view
        positions, slots = batch.positions.tolist(), batch.out_cache_loc.tolist()
        for req in reqs:
            # a plain step counts toward the next probe of a request whose head drafts were turned off
            self.head_records[req.rid] = self.head_records.get(req.rid, HeadRecord()).after_step(False, 0)
        self._defer(reqs, [[DeferredRow(positions[i], slots[i], tokens[i], feats[i])] for i in range(len(reqs))])

    def _defer(self, reqs: list[Req], rows: list[list[DeferredRow]]) -> None:
        """Queue each request's new rows for its next catch-up (its draft state is stale until then); a
        running request MAX_DRAFT_LAG rows behind catches up now, and past MAX_DEFERRED_ROWS held in all
        the longest of these requests' lists do: that bounds the features held."""
        for req, new in zip(reqs, rows, strict=True):
            self.draft_states.pop(req.rid, None)
            self.deferred.setdefault(req.rid, []).extend(new)
        running = [r for r in reqs if not r.finished]
        due = {r.rid for r in running if len(self.deferred[r.rid]) >= MAX_DRAFT_LAG}
        total = sum(len(x) for rid, x in self.deferred.items() if rid not in due)
        if total > MAX_DEFERRED_ROWS:  # the longest lists first, until the rest fit
            for req in sorted(running, key=lambda r: len(self.deferred[r.rid]), reverse=True):
                if total <= MAX_DEFERRED_ROWS:
                    break
                if req.rid not in due:
                    due.add(req.rid)
                    total -= len(self.deferred[req.rid])
        self.catch_up([r for r in running if r.rid in due])  # one draft forward for all that are due

    def wants_drafts(self, reqs: list[Req], shape: SpecShape) -> bool:
        """Whether any request's drafts are worth a verify this step: its head drafts (by its measured
        acceptance, adaptivity.HeadRecord) or a usable n-gram match (`shape` does not change it). Else
        the Scheduler runs a plain step, and this worker defers the draft's work as for any plain step."""
        if any(self.head_records.get(r.rid, HeadRecord()).drafts for r in reqs):
            return True
        if self.ngram is None:
            return False
        contexts = self._insert_text(reqs)
        return any(emit_room(r) > 0 and self.ngram.has_match(ids, HYBRID_MIN_MATCH, 0.0, self.ngram_text[r.rid])
                   for r, ids in zip(reqs, contexts, strict=True))

    def catch_up(self, reqs: list[Req]) -> None:
        """Run the deferred draft extends of `reqs` in one draft forward; each still-running request gets
        its draft state back."""
        reqs = [r for r in reqs if self.deferred.get(r.rid)]
        if not reqs:
            return
        rows = [self.deferred.pop(r.rid) for r in reqs]
        # causal over each request's prefix and its deferred rows (their slots are in req_to_token)
        kv_lists = [self.req_to_token_pool.read(r.req_pool_idx, 0, x[-1].position + 1) for r, x in zip(reqs, rows, strict=True)]
        out = self._extend_rows(kv_lists, rows)
        for i, req in enumerate(reqs):
            if not req.finished:
                self.draft_states[req.rid] = (out.logits[i], out.hidden_states[i])

    def _extend_rows(self, kv_lists: list[torch.Tensor], rows: list[list[DeferredRow]]) -> ModelOutput:
        """One draft extend over runs of rows, run i causal over kv_lists[i] (its positions are that
        list's last ones); logits and hidden state at each run's last row."""
        counts = [len(x) for x in rows]
        flat = [row for x in rows for row in x]
        last_rows = torch.cumsum(torch.tensor(counts), 0) - 1
        dbatch = draft_extend_batch(
            torch.tensor([row.next_token for row in flat], device=self.device),
            torch.tensor([row.position for row in flat], device=self.device),
            torch.tensor([row.slot for row in flat], device=self.device),
            build_metadata(counts, kv_lists, device=self.device),
            torch.stack([row.features for row in flat]), last_rows.to(self.device))
        return self.draft.forward(dbatch)

    def adopt_parked(self, reqs: list[Req], starts: list[int]) -> None:
        """Before a prefill's draft extend: the parked rows at positions of each request's cached prefix
        (its first `starts[b]` positions), and the deferred rows of running requests there (a shared
        prefix, such as a system prompt), run now in one draft extend, so the draft KV this prefill
        attends to is current. A parked row counts only at its own position with its own next token."""
        if not any(start > 0 for start in starts) or not (self.parked or self.deferred):
            return
        # KV slot -> the running request whose deferred rows hold it (derived here, off the hot path)
        owner_of = {row.slot: rid for rid, pending in self.deferred.items() for row in pending}
        keys = torch.tensor([*self.parked, *owner_of], dtype=torch.int64)
        kv_lists: list[torch.Tensor] = []
        runs: list[list[DeferredRow]] = []
        emptied: dict[str, int] = {}  # owner whose deferred rows were all taken -> its run's index
        for req, start in zip(reqs, starts, strict=True):
            if start == 0 or req.req_pool_idx is None:  # no cached prefix, or already released
                continue
            prefix = self.req_to_token_pool.read(req.req_pool_idx, 0, start).to(torch.int64).cpu()
            hits = torch.isin(prefix, keys).nonzero().flatten().tolist()
            rows, owners = [], {}
            for p in hits:
                slot = int(prefix[p])
                row = self.parked.get(slot)
                if row is not None and row.position == p and req.all_ids[p + 1] == row.next_token:
                    rows.append(self.parked.pop(slot))
                elif owner_of.get(slot, req.rid) != req.rid:  # its own earlier chunks wait
                    owners[owner_of[slot]] = p
            for run in _contiguous_runs(rows):
                kv_lists.append(prefix[: run[-1].position + 1])
                runs.append(run)
            for owner, last in owners.items():  # the owner's rows up to `last`: a prefix of its list
                pending = self.deferred.get(owner, [])
                taken = [row for row in pending if row.position <= last]
                if not taken:  # another request of this batch took them already
                    continue
                self.deferred[owner] = pending[len(taken) :]
                kv_lists.append(prefix[: taken[-1].position + 1])
                runs.append(taken)
                if not self.deferred[owner]:
                    del self.deferred[owner]
                    emptied[owner] = len(runs) - 1
        if runs:
            out = self._extend_rows(kv_lists, runs)
            for owner, i in emptied.items():  # caught up whole: its draft state is this run's last row
                self.draft_states[owner] = (out.logits[i], out.hidden_states[i])

    def _park(self, rows: list[DeferredRow]) -> None:
        for row in rows:
            self.parked.pop(row.slot, None)  # a slot parked before holds older text: this row replaces it
            self.parked[row.slot] = row
        while len(self.parked) > MAX_PARKED_ROWS:
            del self.parked[next(iter(self.parked))]  # the oldest: its position keeps a stale draft KV

    def release(self, req: Req, keep_draft_kv: bool) -> None:
        """The request leaves (finished, aborted, retracted) while it still holds its KV slots: rows whose
        positions stay cached are parked for a later prefix hit (`adopt_parked`); then forget it."""
        rows = self.deferred.pop(req.rid, None)
        if keep_draft_kv and rows:
            self._park(rows)
        self.draft_states.pop(req.rid, None)
        self.ngram_budget.pop(req.rid, None)
        self.head_records.pop(req.rid, None)
        self.head_offered.pop(req.rid, None)
        cursor = self.ngram_text.pop(req.rid, None)
        if cursor is not None:  # a request that speculated leaves the rest of its text too
            self.ngram.insert_rest(req.all_ids, cursor)

    def has_idle_work(self) -> bool:
        return False  # a leaving request's hybrid n-gram text goes in at `release`

    def idle_work(self) -> None:
        pass

    def flush(self) -> None:
        """`/flush_cache` with no request in flight: forget past requests' text (the n-gram corpus) and
        the parked draft rows, whose KV slots the radix cache reset just freed."""
        if self.ngram is not None:
            self.ngram = new_ngram_cache(self.ngram.config)
        self.ngram_text.clear()  # cursors into the old cache
        self.parked.clear()

    # ------------------------------------------------------------------ drafting
    def _draft_tree(self, reqs: list[Req], kv_lens: list[int], prefix_slots: list[torch.Tensor],
                    roots: torch.Tensor, steps: int, topk: int, num_nodes: int) -> DraftTree:
        bs, hot = len(reqs), self.draft.hot_token_map
        topk_p, topk_index = draft_topk(torch.stack([self.draft_states[r.rid][0] for r in reqs]), topk, hot)
        hidden = torch.stack([self.draft_states[r.rid][1] for r in reqs])
        row_kv_lens = torch.tensor(kv_lens).repeat_interleave(topk)
        scores, infos, branch_slots = None, [], None
        backup = self.allocator.backup_state()
        try:
            scratch = self.allocator.alloc(bs * topk * (steps - 1)).view(steps - 1, bs, topk)
            for step in range(steps):
                input_ids, hidden, scores, info = select_top_k_tokens(step, topk_p, topk_index, hidden, scores, topk)
                infos.append(info)
                if step == steps - 1:
                    break
                parent_rows = None  # frontier row (0..k-1) of the previous step holding each row's parent
                if step > 0:
                    parent_rows = ((info.parents - topk - topk * topk * (step - 1)) // topk).cpu()
                branch_slots = extend_branch_slots(branch_slots, parent_rows, scratch[step])
                positions = self.draft.clamp_positions(row_kv_lens + step).to(self.device)
                batch = draft_tree_step_batch(input_ids.to(self.device), hidden, positions, prefix_slots,
                                              scratch[: step + 1], branch_slots, self.device)
                out = self.draft.forward(batch)
                topk_p, topk_index = draft_topk(out.logits, topk, hot)
                hidden = out.hidden_states
        finally:
            self.allocator.restore_state(backup)
        parent_list, top_index, draft_tokens = organize_draft_results(
            [i.scores for i in infos], [i.tokens for i in infos], [i.parents for i in infos], num_nodes)
        return make_draft_tree(roots, draft_tokens, parent_list, top_index, kv_lens, topk, steps)

    # ------------------------------------------------------------------ one speculative step
    def decode_step(self, reqs: list[Req], shape: SpecShape) -> SpecStepResult:
        """Draft a tree of `shape` per request (num_steps 0: the root alone, a plain step) and verify
        it. The Scheduler sized `shape` against the free KV slots; this only allocates what it needs."""
        kv_lens = [r.kv_len for r in reqs]
        prefix_slots = [self.req_to_token_pool.read(r.req_pool_idx, 0, k) for r, k in zip(reqs, kv_lens, strict=True)]
        roots = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=self.device)
        head = [shape.num_steps > 0 and self.head_records.get(r.rid, HeadRecord()).drafts for r in reqs]
        for req, offered in zip(reqs, head, strict=True):
            self.head_offered[req.rid] = offered
        if any(head):
            # the draft KV of the steps since each request last drafted with the head; a request whose
            # tree has no head nodes this step (n-gram nodes only) keeps its rows deferred
            self.catch_up(reqs)
            tree = self._draft_tree(reqs, kv_lens, prefix_slots, roots, shape.num_steps, shape.topk,
                                    shape.num_draft_tokens)
        else:  # no request wants head drafts this step: no draft forwards
            tree = root_only_tree(roots, kv_lens)
        tree, sources = self._assemble_tree(reqs, tree, roots, kv_lens, head)
        return verify_tree_step(reqs, tree, kv_lens, prefix_slots, self.target, self.allocator,
                                self.target_capture_layers, return_all_hidden=True, node_sources=sources)

    def _assemble_tree(self, reqs: list[Req], tree: DraftTree, roots: torch.Tensor, kv_lens: list[int],
                       head: list[bool]) -> tuple[DraftTree, str | list[list[str]]]:
        """The tree verified: each request's head nodes where `head` says so, plus (hybrid) its n-gram
        nodes. The head's tree as it is when nothing changes it."""
        drafts = self._ngram_drafts(reqs) if self.ngram is not None else [None] * len(reqs)
        usable = [d is not None and d.match_length >= HYBRID_MIN_MATCH and bool(d.tokens) for d in drafts]
        if all(head) and not any(usable):
            return tree, "eagle"
        tokens, parents, sources = [], [], []
        for b, (req, d) in enumerate(zip(reqs, drafts, strict=True)):
            t, p = tree_parents(tree, b) if head[b] else ([], [])
            extra = (d.tokens, d.parents) if usable[b] else ([], [])
            t, p, s = merge_drafts(t, p, *extra, "eagle", "ngram")
            if self.ngram is not None:
                self.ngram_budget[req.rid] = (self.ngram_budget.get(req.rid, (self.hybrid_ngram_tokens, 0))[0],
                                              s.count("ngram"))
            tokens.append(t)
            parents.append(p)
            sources.append(s)
        return tree_from_parents(roots, tokens, parents, kv_lens), sources

    def _insert_text(self, reqs: list[Req]) -> list[list[int]]:
        """Put each request's text since it last asked for drafts into the n-gram cache (its prompt, the
        first time); returns the texts (Req.all_ids builds a new list per access), each request's cursor
        now standing at the end of its text."""
        contexts = [r.all_ids for r in reqs]
        for req, ids in zip(reqs, contexts, strict=True):
            self.ngram.insert_rest(ids, self.ngram_text.setdefault(req.rid, TextCursor()))
        return contexts

    def _ngram_drafts(self, reqs: list[Req]) -> list:
        """The hybrid's n-gram drafts, each within its request's budget and no more than it could still
        keep (`emit_room`); its text inserted first, matched through its cursor."""
        contexts = self._insert_text(reqs)
        budgets = [min(self.ngram_budget.get(r.rid, (self.hybrid_ngram_tokens, 0))[0], emit_room(r)) for r in reqs]
        return [self.ngram.draft(ids, n, 0.0, self.ngram_text[r.rid])
                for r, ids, n in zip(reqs, contexts, budgets, strict=True)]


def _contiguous_runs(rows: list[DeferredRow]) -> list[list[DeferredRow]]:
    """Rows in position order, split where a position is skipped."""
    runs: list[list[DeferredRow]] = []
    for row in rows:
        if runs and runs[-1][-1].position + 1 == row.position:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs
