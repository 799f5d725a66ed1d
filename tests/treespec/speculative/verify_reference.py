"""Verify a draft tree with the target's logits: greedy, lossless sampling, or both in one batch.

Engine use, after the TARGET_VERIFY forward over the bs*n tree nodes (row b*n + t = node t of request b):

    result = verify_tree(logits, candidates, retrive_index, retrive_next_token, retrive_next_sibling,
                         max_depth=num_steps, temperatures=..., top_ks=..., top_ps=..., min_ps=...)
    keep = result.accepted_rows()        # verify rows whose KV is kept (root + accepted drafts)
    new_tokens = result.accepted_tokens()  # tokens emitted (accepted drafts + bonus), same count
    counts = result.accept_length + 1      # per request, to split both flat tensors
"""

from dataclasses import dataclass

import torch

from treespec.kernels import tree_speculative_sampling_target_only, verify_tree_greedy
from treespec.sampling import apply_sampling_filters
from treespec.sampling_params import GREEDY_TEMPERATURE


@dataclass
class TreeVerifyResult:
    """Kernel outputs (layouts in treespec/kernels/tree_verify.py) plus flat views for the engine."""

    predicts: torch.Tensor  # int64 [bs*n]: token emitted after each accepted row
    accept_index: torch.Tensor  # int64 [bs, max_depth+1]: accepted verify rows, root first, -1 padded
    accept_length: torch.Tensor  # int64 [bs]: accepted draft tokens (bonus excluded)
    num_draft_tokens: int

    @property
    def accept_nodes(self) -> torch.Tensor:
        """Accepted node ids per request [bs, max_depth+1] (0 = root), -1 padded."""
        return torch.where(self.accept_index >= 0, self.accept_index % self.num_draft_tokens, -1)

    def accepted_rows(self) -> torch.Tensor:
        """Flat verify rows of the accepted nodes, request by request (accept_length+1 each)."""
        return self.accept_index[self.accept_index >= 0]

    def accepted_tokens(self) -> torch.Tensor:
        """Flat emitted tokens, request by request (accept_length+1 each: drafts then the bonus)."""
        return self.predicts[self.accepted_rows()]

    def tokens_per_request(self) -> list[list[int]]:
        counts = (self.accept_length + 1).tolist()
        return [chunk.tolist() for chunk in torch.split(self.accepted_tokens().cpu(), counts)]


def verify_tree(
    logits: torch.Tensor, candidates: torch.Tensor, retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor, max_depth: int,
    temperatures: torch.Tensor | None = None, top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None, min_ps: torch.Tensor | None = None,
    generator: torch.Generator | None = None, uniform_samples: torch.Tensor | None = None,
    uniform_samples_final: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Accept a path of the draft tree per request and emit one more token from the target.

    logits [bs*n, vocab]: target logits of the verify forward, row b*n + t = node t of request b.
    candidates int64 [bs, n]: node tokens (node 0 = root); retrive_* from `build_tree`; max_depth =
    num_steps. Sampling parameters are per request ([bs]); None means greedy for every request.
    Requests with temperature < 1e-6 are verified greedily even in a sampled batch (one-hot target).
    Coins come from `generator` unless given: uniform_samples [bs, n], uniform_samples_final [bs].
    """
    bs, n = candidates.shape
    if temperatures is None or bool((temperatures < GREEDY_TEMPERATURE).all()):
        target_predict = logits.argmax(-1).view(bs, n)
        outputs = verify_tree_greedy(candidates, retrive_index, retrive_next_token, retrive_next_sibling,
                                     target_predict, max_depth)
        return TreeVerifyResult(*outputs, num_draft_tokens=n)

    def per_row(values: torch.Tensor | None, default: float) -> torch.Tensor:
        if values is None:
            return torch.full((bs * n,), default, device=logits.device)
        return values.to(logits.device).repeat_interleave(n)

    probs = apply_sampling_filters(
        logits, per_row(temperatures, 1.0), per_row(top_ks, 0).to(torch.int64), per_row(top_ps, 1.0),
        per_row(min_ps, 0.0))
    if uniform_samples is None:
        uniform_samples = torch.rand((bs, n), generator=generator, device=logits.device)
    if uniform_samples_final is None:
        uniform_samples_final = torch.rand((bs,), generator=generator, device=logits.device)
    outputs = tree_speculative_sampling_target_only(
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, uniform_samples,
        uniform_samples_final, probs, max_depth)
    return TreeVerifyResult(*outputs, num_draft_tokens=n)
