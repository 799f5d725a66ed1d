"""What a speculative worker gives the Scheduler, and the verify half both workers share.

A worker (EagleWorker, NgramWorker) drafts a tree per request; `verify_tree_step` verifies it with one
TARGET_VERIFY forward, frees the rejected nodes' slots and returns a `SpecStepResult`. The Scheduler
commits that result once (stop rules, req_to_token, counters); the worker then catches up on what was
committed (`draft_extend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from treespec.forward_batch import ForwardBatch, ModelOutput
from treespec.mem.allocator import TokenToKVPoolAllocator
from treespec.model_runner import ModelRunner
from treespec.request import Req
from treespec.speculative.shapes import SpecSchedule, SpecShape
from treespec.speculative.tree import DraftTree, split_accepted, verify_batch
from treespec.speculative.verify import token_logprobs, verify_tree_mixed


@dataclass(frozen=True)
class SpecStepResult:
    """What one draft-and-verify step produced, per request (in the order of the step's requests)."""

    tokens: list[list[int]]  # accepted draft tokens then the bonus token
    kept_slots: list[torch.Tensor]  # target KV slots of the accepted nodes (root first), one per token
    # (logprob, top logprobs) per token under the target distribution, None where not asked for
    logprobs: list[list[tuple[float, list]] | None]
    # for the draft extend: each request's kv_len before the step, its accepted verify rows, the output
    kv_lens: list[int]
    accept_rows: list[list[int]]  # verify rows, root first (host ints: only EagleWorker makes a tensor of them)
    verify_output: ModelOutput
    # per request and token, where it came from: a draft source ("eagle", "ngram") or "target" (the bonus)
    sources: list[list[str]]


class SpecWorker(Protocol):
    """What the Scheduler calls on a speculative worker."""

    schedule: SpecSchedule
    target_capture_layers: tuple[int, ...]  # target layers whose inputs the prefill must return
    needs_target_hidden: bool  # whether the prefill must return every row's hidden state

    def after_prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch, output: ModelOutput) -> None: ...

    def wants_drafts(self, reqs: list[Req], shape: SpecShape) -> bool: ...

    def decode_step(self, reqs: list[Req], shape: SpecShape) -> SpecStepResult: ...

    def draft_extend(self, reqs: list[Req], result: SpecStepResult, committed: list[int]) -> None: ...

    # A plain step (target alone, one sampled token per request) and a request leaving with its KV.
    def defer_extend(self, reqs: list[Req], tokens: list[int], batch: ForwardBatch, output: ModelOutput) -> None: ...

    def release(self, req: Req, keep_draft_kv: bool) -> None: ...

    def flush(self) -> None: ...  # `/flush_cache`, no request in flight: forget past requests' text

    # Work kept off the steps (released text for the n-gram cache), done while no request is in flight.
    def has_idle_work(self) -> bool: ...

    def idle_work(self) -> None: ...


def verify_tree_step(
    reqs: list[Req], tree: DraftTree, kv_lens: list[int], prefix_slots: list[torch.Tensor],
    target: ModelRunner, allocator: TokenToKVPoolAllocator, capture_layers: tuple[int, ...],
    return_all_hidden: bool, node_sources: str | list[list[str]],
) -> SpecStepResult:
    """Verify `tree` with one target forward over fresh slots, keep the accepted nodes' slots for the
    Scheduler and free the rest. `node_sources`: the drafts' source, or per request each draft node's
    (node i + 1 = entry i)."""
    device = target.device
    node_rows = tree.verify_rows()  # [b][node] -> verify row (padding nodes are not verified)
    verify_slots = allocator.alloc(sum(map(len, node_rows)))
    # nodes past the context length are never emitted (max_new_tokens stops first); clamp for RoPE (the
    # host knows whether any node gets there: no tensor op right after a forward where none does)
    deepest = max(kv_lens) + tree.max_depth
    positions = tree.positions if deepest < target.context_len else tree.positions.clamp(max=target.context_len - 1)
    vbatch = verify_batch(tree, prefix_slots, verify_slots, positions, capture_layers, device)
    out = target.forward(vbatch, return_all_hidden=return_all_hidden)
    predicted, row_lists = verify_tree_mixed(reqs, out.logits, tree)
    kept_slots, rejected = split_accepted(row_lists, verify_slots)
    allocator.free(rejected)
    tokens = [[predicted[r] for r in rows] for rows in row_lists]
    logprobs = [
        token_logprobs(req, out.logits[torch.tensor(rows, device=device)], toks) if req.return_logprob else None
        for req, rows, toks in zip(reqs, row_lists, tokens, strict=True)
    ]
    sources = []
    for b, rows in enumerate(row_lists):
        per_node = [node_sources] * len(node_rows[b]) if isinstance(node_sources, str) else ["root", *node_sources[b]]
        # the accepted drafts' nodes (row node_rows[b][0] + node), then the bonus token
        sources.append([per_node[r - node_rows[b][0]] for r in rows[1:]] + ["target"])
    return SpecStepResult(tokens, kept_slots, logprobs, kv_lens, row_lists, out, sources)
