"""The NGRAM draft source (treespec/speculative/ngram_cache.py): what a draft proposes (longest match,
likeliest nodes first down to a threshold, breadth by match length), counts under incremental inserts, and the capacity bound
with least-recently-used eviction."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.kernels import ngram_trie
from treespec.kernels.cpu_extension import cpu_supports_avx2
from treespec.speculative.ngram_cache import (
    ROOT,
    NativeNgramCache,
    NgramCache,
    NgramConfig,
    PyNgramCache,
    continuation_accept_prob,
    new_ngram_cache,
)

# every test runs on the Python trie and on the C++ one (where it builds: every AVX2 machine)
IMPLS = [PyNgramCache] + ([NativeNgramCache] if ngram_trie.load() is not None else [])
each_trie = pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: impl.__name__)


def cache_with(impl: type, *texts: list[int], **config) -> NgramCache:
    cache = impl(NgramConfig(**config))
    for text in texts:
        cache.insert(text)
    return cache


def ngram_counts(cache: NgramCache) -> dict[tuple[int, ...], int]:
    """Every stored n-gram with its count, and the structure checked on the way: one recency entry per
    node, each node its parent's child (cursor inserts touch only the n-grams they count, so a parent may
    be older than its child: eviction skips such interior nodes)."""
    state = cache.state()
    order = {node: i for i, node in enumerate(state["recency"])}
    counts, stack = {}, [(ROOT, ())]
    while stack:
        node, path = stack.pop()
        for token, child in state["children"][node]:
            assert state["parent"][child] == node and state["token"][child] == token
            counts[path + (token,)] = state["count"][child]
            stack.append((child, path + (token,)))
    assert len(counts) == len(cache) == len(order)
    assert len(state["token"]) - len(state["free"]) == len(cache) + 1  # every id live or free (and the root)
    return counts


def spelled(cache: NgramCache, node: int) -> list[int]:
    """The n-gram that trie node `node` stands for."""
    state, path = cache.state(), []
    while node != ROOT:
        path.append(state["token"][node])
        node = state["parent"][node]
    return path[::-1]


@each_trie
def test_longest_match_then_likeliest_first_by_count_then_recency(impl):
    cache = cache_with(impl, [1, 2, 3, 4, 1, 2, 3, 5])
    draft = cache.draft([9, 1, 2], 5)
    # [9, 1, 2] is unseen, [1, 2] matched; 3 follows it twice; 4 and 5 once each, 5 more recently
    assert draft.match_length == 2
    assert draft.tokens == [3, 5, 4, 1, 2]
    assert draft.parents == [0, 1, 1, 3, 4]
    assert cache.draft([9, 1, 2], 0).tokens == []
    assert cache.draft([7], 5).tokens == [] and cache.draft([7], 5).match_length == 0


@each_trie
def test_frequency_beats_recency_and_longer_matches_win(impl):
    cache = cache_with(impl, [10, 11, 12], [10, 11, 12], [10, 11, 13])
    assert cache.draft([10, 11], 2).tokens == [12, 13]
    cache = cache_with(impl, [5, 2, 7], [6, 2, 7], [1, 2, 8])
    assert cache.draft([3, 1, 2], 1).tokens == [8]  # the 2-token match [1, 2]
    assert cache.draft([3, 2], 1).tokens == [7]  # only [2] matches: its most frequent continuation
    short = cache_with(impl, [5, 2, 7], [6, 2, 7], [1, 2, 8], max_match_window=1)
    assert short.draft([3, 1, 2], 1).tokens == [7]
    long_only = cache_with(impl, [5, 2, 7], [6, 2, 7], [1, 2, 8], min_match_window=2)
    assert long_only.draft([3, 2], 1).tokens == []


@each_trie
def test_breadth_falls_from_max_at_short_matches_to_min_at_long_ones(impl):
    cache = impl(NgramConfig(min_match_window=2, max_match_window=6, min_bfs_breadth=1, max_bfs_breadth=5))
    breadths = [cache.breadth_for(w) for w in range(2, 7)]
    assert breadths == [5, 4, 3, 2, 1]
    # a 1-token match after many different continuations proposes max_bfs_breadth of them
    texts = [[1, t] for t in range(20, 30)]
    wide = cache_with(impl, *texts, min_match_window=1, max_match_window=4, max_bfs_breadth=3)
    assert len(wide.draft([1], 8).tokens) == 3


@each_trie
def test_stored_ngrams_stop_at_branch_length(impl):
    cache = cache_with(impl, list(range(100, 110)), branch_length=4)
    assert max(len(path) for path in ngram_counts(cache)) == 4
    # a stored continuation of a 2-token match is at most 2 deep; past it the draft matches again
    draft = cache.draft([100, 101], 10)
    assert draft.tokens == list(range(102, 110)) and draft.parents == list(range(8))
    assert cache.draft([100, 101], 10, min_accept_prob=0.0).tokens == draft.tokens
    assert cache.draft([100, 101], 2).tokens == [102, 103]


@each_trie
def test_nodes_join_by_estimated_acceptance_down_to_the_threshold(impl):
    # [1, 2] continues as 3 three times and 4 once; [1, 2, 3] always continues as 5
    cache = cache_with(impl, [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 4])
    p3 = continuation_accept_prob(2) * 3 / 4
    p5 = p3 * continuation_accept_prob(3)
    p4 = continuation_accept_prob(2) * 1 / 4
    assert p3 > p5 > p4
    assert cache.draft([1, 2], 3).tokens == [3, 5, 4]  # the likeliest first, whatever the depth
    assert cache.draft([1, 2], 3).parents == [0, 1, 0]
    assert cache.draft([1, 2], 3, min_accept_prob=p4 + 1e-9).tokens == [3, 5]
    assert cache.draft([1, 2], 3, min_accept_prob=p3 + 1e-9).tokens == []
    assert cache.has_match([1, 2], 2, min_accept_prob=p3) and not cache.has_match([1, 2], 2, p3 + 1e-9)
    # longer matches are trusted more
    assert [round(continuation_accept_prob(w), 2) for w in (1, 2, 6, 12)] == [0.45, 0.56, 0.82, 0.95]


@each_trie
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.lists(st.integers(1, 6), max_size=10))
def test_incremental_inserts_count_like_one_insert(impl, text, cuts):
    """Inserting a sequence piece by piece (num_new = the new piece) stores the same counts as at once."""
    whole = cache_with(impl, text, branch_length=5)
    pieces = impl(NgramConfig(branch_length=5))
    end = 0
    for cut in cuts + [len(text)]:
        new_end = min(len(text), end + cut)
        if new_end > end:
            pieces.insert(text[:new_end], new_end - end)
        end = new_end
    assert ngram_counts(pieces) == ngram_counts(whole)


@each_trie
def test_capacity_is_never_exceeded_and_the_structure_stays_sound(impl):
    rng = random.Random(0)
    cache = impl(NgramConfig(capacity=200, branch_length=6))
    for _ in range(300):
        text = [rng.randrange(12) for _ in range(rng.randrange(1, 30))]
        cache.insert(text, rng.randrange(1, len(text) + 1))
        cache.draft(text[: rng.randrange(1, len(text) + 1)], rng.randrange(0, 9))
        assert len(cache) <= 200
    ngram_counts(cache)  # recency entries and trie agree


@each_trie
def test_least_recently_used_branches_are_evicted_first(impl):
    first, second, third = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]
    size = len(cache_with(impl, first, branch_length=3))  # 15 nodes: 6 + 5 + 4
    # untouched since inserted: the oldest text goes entirely, the newer one is intact
    cache = cache_with(impl, first, second, branch_length=3, capacity=2 * size)
    before = cache.draft([11, 12], 1).tokens
    cache.insert(third)
    assert len(cache) == 2 * size
    assert cache.draft([1, 2], 1).tokens == [] and cache.draft([11, 12], 1).tokens == before == [13]
    assert all(path[0] not in first for path in ngram_counts(cache))
    # a draft from the oldest text marks its path used: that path survives, the newer text loses instead
    cache = cache_with(impl, first, second, branch_length=3, capacity=2 * size)
    assert cache.draft([1, 2], 1).tokens == [3]  # one node: a longer draft would touch more of the text
    cache.insert(third)
    assert cache.draft([1, 2], 1).tokens == [3]
    assert (1, 2, 3) in ngram_counts(cache) and (11, 12, 13) not in ngram_counts(cache)


@each_trie
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.lists(st.integers(1, 7), min_size=1, max_size=12),
       st.integers(2, 7))
def test_cursor_inserts_count_like_inserts_from_the_root(impl, text, steps, branch_length):
    """A request's tokens added through its cursor (a few at a time, as speculative steps commit them)
    store the same n-grams with the same counts as inserting from the root; the cursor's suffixes are
    the nodes of the text's last 1 .. branch_length - 1 tokens."""
    from treespec.speculative.ngram_cache import TextCursor

    cursor, by_cursor = TextCursor(), impl(NgramConfig(branch_length=branch_length))
    by_root = impl(NgramConfig(branch_length=branch_length))
    done = 0
    for step in steps + [len(text)]:
        end = min(len(text), done + step)
        if end > done:
            by_cursor.insert(text[:end], end - done if done else None, cursor)
            by_root.insert(text[:end], end - done if done else None)
            done = end
    assert cursor.length == len(text)
    assert ngram_counts(by_cursor) == ngram_counts(by_root)
    for length, node in enumerate(cursor.suffixes, start=1):
        assert spelled(by_cursor, node) == text[len(text) - length :]
    assert len(cursor.suffixes) == min(len(text), branch_length - 1)


@each_trie
def test_cursor_survives_eviction_by_walking_from_the_root(impl):
    """When eviction took a node the cursor holds, the next insert walks from the root: the counts stay
    right and the bound holds."""
    from treespec.speculative.ngram_cache import TextCursor

    rng = random.Random(3)
    cache = impl(NgramConfig(capacity=40, branch_length=4))
    cursor, text = TextCursor(), [rng.randrange(20) for _ in range(10)]
    cache.insert(text, None, cursor)
    for _ in range(30):
        cache.insert([rng.randrange(20, 40) for _ in range(12)])  # other requests' text evicts ours
        text.append(rng.randrange(20))
        cache.insert(text, 1, cursor)
        assert len(cache) <= 40 and cursor.length == len(text)
        assert all(cache.state()["parent"][node] != -1 for node in cursor.suffixes)
        for length, node in enumerate(cursor.suffixes, start=1):  # ids reused since spell our text still
            assert spelled(cache, node) == text[len(text) - length :]
    counts = ngram_counts(cache)
    assert counts[tuple(text[-3:])] >= 1  # the newest n-grams of our text are in


@each_trie
def test_matching_through_a_cursor_finds_what_walking_the_trie_finds(impl):
    """has_match and draft given the text's cursor (its suffixes' nodes at hand) return what walking the
    trie returns, while other texts evict and reuse node ids and the cursor sometimes lags (then it is
    not used)."""
    import copy

    from treespec.speculative.ngram_cache import TextCursor

    rng = random.Random(5)
    for capacity, window in ((60, 3), (400, 6), (10_000, 12)):
        cache = impl(NgramConfig(capacity=capacity, branch_length=7, max_match_window=window))
        cursor, text = TextCursor(), [rng.randrange(8) for _ in range(12)]
        cache.insert(text, None, cursor)
        for _ in range(150):
            text += [rng.randrange(8) for _ in range(rng.randrange(0, 4))]
            if rng.random() < 0.8:  # else its cursor lags behind the text: it must not be used
                cache.insert_rest(text, cursor)
            # another request's text, after: it may evict (and reuse) the nodes the cursor holds
            cache.insert([rng.randrange(12) for _ in range(rng.randrange(1, 15))])
            for min_width in (0, 2, 4):
                assert cache._longest_match(text, min_width, cursor) == cache._longest_match(text, min_width)
            for min_accept in (0.0, 0.3, 0.6):
                assert cache.has_match(text, 0, min_accept, cursor) == cache.has_match(text, 0, min_accept)
            min_accept = rng.choice((0.0, 0.3))
            walking = copy.deepcopy(cache)  # drafting touches nodes: each way drafts from the same state
            drafted, walked = cache.draft(text, 6, min_accept, cursor), walking.draft(text, 6, min_accept)
            assert (drafted.tokens, drafted.parents, drafted.match_length) == (
                    walked.tokens, walked.parents, walked.match_length)


@each_trie
def test_the_trie_adds_no_objects_for_the_cycle_collector(impl):
    """Nodes are ids into lists of ints, children dicts of ints: a full collection does not walk the
    trie, however large (node objects cost a 200 ms pause at ~80k nodes)."""
    import gc

    rng = random.Random(5)
    cache = impl(NgramConfig(capacity=20_000))
    cache.insert([rng.randrange(50) for _ in range(200)])
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(20):
        cache.insert([rng.randrange(50) for _ in range(200)])
    gc.collect()
    assert len(cache) > 10_000
    assert len(gc.get_objects()) - before < 50


def test_the_native_trie_builds_on_every_avx2_machine():
    """Where the C++ kernels build, so does the trie, and the worker takes it (a broken build would
    otherwise leave every server on the slower Python trie without a failing test)."""
    if not cpu_supports_avx2():
        pytest.skip("no AVX2: the kernels, this trie among them, are not built here")
    assert ngram_trie.load() is not None
    assert isinstance(new_ngram_cache(NgramConfig()), NativeNgramCache)


@pytest.mark.skipif(len(IMPLS) < 2, reason="the C++ trie is not built on this machine")
@pytest.mark.parametrize("seed", range(12))
def test_the_native_trie_reproduces_the_python_trie_step_for_step(seed):
    """Random inserts (with and without cursors, some lagging), matches and drafts under random configs
    and capacities small enough to evict: after every operation both tries hold the same columns (node
    ids, counts, ticks, serials, children in order, recency order, free ids), and return the same drafts,
    matches and cursors."""
    from treespec.speculative.ngram_cache import TextCursor

    rng = random.Random(seed)
    config = NgramConfig(min_match_window=rng.choice([1, 2]), max_match_window=rng.choice([3, 6, 12]),
                         max_bfs_breadth=rng.choice([1, 3, 10]), branch_length=rng.choice([4, 7, 18]),
                         capacity=rng.choice([30, 200, 100_000]))
    python, native = PyNgramCache(config), NativeNgramCache(config)
    texts = [[rng.randrange(10) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    cursors = [(TextCursor(), TextCursor()) for _ in texts]
    for step in range(250):
        i = rng.randrange(len(texts))
        text, (py_cursor, native_cursor) = texts[i], cursors[i]
        op = rng.random()
        if op < 0.4:  # a running request's new tokens, through its cursor
            text += [rng.randrange(10) for _ in range(rng.randrange(0, 4))]
            python.insert_rest(text, py_cursor)
            native.insert_rest(text, native_cursor)
            assert vars_of(py_cursor) == vars_of(native_cursor)
        elif op < 0.55:  # another text, whole or its last tokens
            other = [rng.randrange(10) for _ in range(rng.randrange(1, 15))]
            num_new = rng.choice([None, rng.randrange(1, len(other) + 1)])
            python.insert(other, num_new)
            native.insert(other, num_new)
        elif op < 0.8:
            max_drafts, min_accept = rng.randrange(0, 10), rng.choice([0.0, 0.2, 0.5])
            use_cursor = rng.random() < 0.5
            a = python.draft(text, max_drafts, min_accept, py_cursor if use_cursor else None)
            b = native.draft(text, max_drafts, min_accept, native_cursor if use_cursor else None)
            assert a == b, (seed, step)
        else:
            min_width, min_accept = rng.randrange(0, 4), rng.choice([0.0, 0.3, 0.6])
            assert python.has_match(text, min_width, min_accept, py_cursor) == native.has_match(
                text, min_width, min_accept, native_cursor)
            assert python._longest_match(text, min_width) == native._longest_match(text, min_width)
        assert comparable(python.state()) == comparable(native.state()), (seed, step)


def vars_of(cursor) -> tuple:
    return cursor.length, list(cursor.suffixes), list(cursor.serials)


def comparable(state: dict[str, list]) -> dict[str, list]:
    return {**state, "children": [[tuple(pair) for pair in kids] for kids in state["children"]]}
