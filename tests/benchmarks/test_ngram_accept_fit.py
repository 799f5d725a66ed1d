"""The acceptance fit's replay: greedy acceptance along a draft tree, and a replayed server that
speculates where its text repeats and decodes plain where the threshold says a draft is not worth it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402


def test_accepted_along_follows_the_matching_path() -> None:
    fit = load_benchmark("ngram_accept_fit")
    tokens, parents = [5, 6, 7, 8], [0, 0, 2, 3]  # 5 and 6 under the root, 6 -> 7 -> 8
    assert fit.accepted_along(tokens, parents, [6, 7, 8, 9]) == 3
    assert fit.accepted_along(tokens, parents, [5, 7]) == 1
    assert fit.accepted_along(tokens, parents, [9]) == 0


def test_replay_speculates_on_repeated_text_and_not_below_the_threshold() -> None:
    fit = load_benchmark("ngram_accept_fit")
    text = list(range(100, 140))
    replies = [(text, text * 2)]  # the reply repeats its prompt twice: long, unambiguous matches

    def cost(rows: int) -> float:
        return 1.0 + 0.2 * (rows - 1)

    hit = fit.replay(replies, budget=8, min_accept=0.4, verify_cost=cost)
    assert hit["verify_steps"] > 0 and hit["accepted_drafts"] > 5 * hit["verify_steps"] and hit["speedup"] > 2
    none = fit.replay(replies, budget=8, min_accept=0.99, verify_cost=cost)
    assert none == {"verify_steps": 0, "accepted_drafts": 0, "speedup": 1.0}
    # a second reply that repeats the first one's text but not its own prompt drafts from the earlier
    # reply's text, unless that text counts for nothing
    other = [(text, text), ([7, 8, 9], text)]
    shared = fit.replay(other, budget=8, min_accept=0.4, verify_cost=cost, other_text_weight=1.0)
    own_only = fit.replay(other, budget=8, min_accept=0.4, verify_cost=cost, other_text_weight=0.0)
    assert shared["accepted_drafts"] > own_only["accepted_drafts"] + 10
    table = fit.fit_table([replies])
    assert table[12][1] == 1.0  # every 12-token match continued as stored


def test_replay_drafts_from_the_warm_corpus_as_the_server_does() -> None:
    """A reply whose text is only in the corpus drafts from it (the shared trie starts with it)."""
    fit = load_benchmark("ngram_accept_fit")
    text = list(range(100, 140))

    def cost(rows: int) -> float:
        return 1.0 + 0.2 * (rows - 1)

    replies = [([7, 8, 9], text)]
    warm = fit.replay(replies, budget=8, min_accept=0.4, verify_cost=cost, other_text_weight=1.0, corpus=[text])
    cold = fit.replay(replies, budget=8, min_accept=0.4, verify_cost=cost, other_text_weight=1.0)
    assert warm["accepted_drafts"] > cold["accepted_drafts"] + 10
