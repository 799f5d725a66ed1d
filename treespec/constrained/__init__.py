"""Grammar-constrained decoding on xgrammar: compiled grammars (cached, compiled off the scheduler's
loop) and each request's matcher state. Scheduler process only (xgrammar imports torch)."""

from treespec.constrained.grammar_cache import GrammarCache
from treespec.constrained.matcher import GrammarState, apply_grammar_masks, apply_tree_grammar_masks

__all__ = ["GrammarCache", "GrammarState", "apply_grammar_masks", "apply_tree_grammar_masks"]
