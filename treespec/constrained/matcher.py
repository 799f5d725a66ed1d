"""Per-request grammar state (an xgrammar GrammarMatcher) and the token masks it puts on logits.

The matcher advances over committed tokens only (Req.append_token). Plain decoding masks each
constrained request's row with the matcher's next-token bitmask; a speculative verify masks every
tree node's row with the bitmask of the grammar state along that node's own path (xgrammar walks the
tree, accepting and rolling back, so no state leaks between branches and the matcher ends where it
began). The target then never picks a token the grammar forbids, so an accepted path is always valid
and greedy output equals plain greedy output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from treespec.request import Req
    from treespec.speculative.tree import DraftTree

ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        # a model without a stop token ends a request once its grammar is complete and allows no more
        self.no_stop_token = not compiled.tokenizer_info.stop_token_ids
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def accept(self, token: int) -> bool:
        """Advance over one committed token; False if the grammar does not allow it (state unchanged)."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted (or, for a model without one, it
        allows nothing more): the request is done."""
        if self.matcher.is_terminated():
            return True
        if not (self.no_stop_token and self.matcher.is_completed()):
            return False
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            # a dead end (no token of this vocabulary continues the grammar): leave the row finite; the
            # token drawn is then refused by accept() and the request ends with an abort, not a crash
            bitmask[row] = ALL_ALLOWED

    def jump_forward_string(self) -> str:
        """The text the grammar forces from here (empty if it allows a choice)."""
        return self.matcher.find_jump_forward_string()

    def jump_forward_tokens(self, tokenizer) -> list[int]:
        """Tokens for the text the grammar forces from here, as the tokenizer encodes that text alone,
        without its last token (which may merge with what the model writes next) and cut where the
        grammar stops accepting them. The matcher's state is unchanged."""
        text = self.jump_forward_string()
        if not text:
            return []
        tokens = tokenizer.encode(text, add_special_tokens=False)[:-1]
        accepted = 0
        for tok in tokens:
            if not self.matcher.accept_token(tok):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return tokens[:accepted]

    def allowed_drafts(self, tokens: list[int], parents: list[int], max_drafts: int) -> tuple[list[int], list[int]]:
        """Draft nodes (breadth-first, `parents[i]` = 0 for the root or j + 1 for draft j) cut to those whose
        path from the root the grammar accepts, at most `max_drafts`, renumbered the same way: the tree's
        budget goes to tokens that can be accepted. The matcher's state is unchanged."""
        new_number = {0: 0}  # old node number -> new
        kept_tokens: list[int] = []
        kept_parents: list[int] = []
        paths: dict[int, list[int]] = {0: []}
        for i, (tok, parent) in enumerate(zip(tokens, parents, strict=True)):
            if len(kept_tokens) == max_drafts:
                break
            if parent not in new_number:
                continue  # under a rejected node
            path = paths[parent] + [tok]
            accepted = 0
            for t in path:
                if not self.matcher.accept_token(t):
                    break
                accepted += 1
            self.matcher.rollback(accepted)
            if accepted < len(path):
                continue
            kept_tokens.append(tok)
            kept_parents.append(new_number[parent])
            new_number[i + 1] = len(kept_tokens)
            paths[i + 1] = path
        return kept_tokens, kept_parents

    def fill_tree_masks(self, tree: DraftTree, b: int, bitmask: torch.Tensor) -> None:
        """bitmask [n, words]: node t's row = the tokens allowed after the path root .. t of request b's
        tree. Nodes the grammar rejects (and their subtrees) can never be accepted; their rows allow
        everything, so their logits stay finite."""
        n = tree.num_nodes
        bitmask.fill_(ALL_ALLOWED)
        if n == 1:
            self.fill_mask(bitmask, 0)
        else:
            self.matcher.traverse_draft_tree(tree.retrive_next_token[b].cpu(), tree.retrive_next_sibling[b].cpu(),
                                             tree.candidates[b].cpu(), bitmask)
        # all-zero rows: rejected nodes, or a path that already ended with the grammar's stop token
        bitmask[~bitmask.any(dim=1)] = ALL_ALLOWED


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1],
                                    indices=rows)


def apply_grammar_masks(reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
    """logits [bs, V] (row i = reqs[i]'s next token) with each constrained row's forbidden tokens at
    -inf: a float32 copy if any row is constrained, else `logits` itself."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return logits
    logits = logits.float().clone()
    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[-1])
    for i in rows:
        reqs[i].grammar.fill_mask(bitmask, i)
    _apply(logits, bitmask, rows)
    return logits


def apply_tree_grammar_masks(reqs: list[Req], logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """The tree verify's version: logits [bs*n, V], row b*n + t = node t of request b."""
    constrained = [b for b, r in enumerate(reqs) if r.grammar is not None]
    if not constrained:
        return logits
    n = tree.num_nodes
    logits = logits.float().clone()
    bitmask = xgr.allocate_token_bitmask(len(reqs) * n, logits.shape[-1])
    for b in constrained:
        reqs[b].grammar.fill_tree_masks(tree, b, bitmask[b * n : (b + 1) * n])
    _apply(logits, bitmask, [b * n + t for b in constrained for t in range(n)])
    return logits
