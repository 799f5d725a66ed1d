"""The n-gram cache: a bounded trie of the n-grams seen in requests' text, shared by all requests, from which
the NGRAM worker drafts (training-free speculation: no draft model).

Storage. Every path from the root is an n-gram of at most `branch_length` tokens that occurred in
inserted text; a node's `count` is how many times its n-gram occurred (each occurrence counted once,
when the token that ends it is inserted). Children are a dict token -> node, created on demand.

Capacity and eviction. At most `capacity` nodes (the root not counted). Recency is kept in one
OrderedDict, oldest first. Inserting from the root, matching or drafting touches a node and then each
of its ancestors (moved to the end deepest first); a request's later tokens extend its text through a
`TextCursor` instead, which touches only the n-grams that end at the new token (the nodes whose count
changes): ~branch_length dict operations a token instead of ~branch_length^2 / 2. So an ancestor can
be older than a descendant. Eviction pops the oldest node; a node that still has children goes back to
the end (as if used now: a descendant was, after it) and the next oldest is tried, so only leaves are
evicted and the least recently used branches go first, from their tips inward.

Drafting. `draft(context, max_drafts, min_accept_prob)` finds the longest suffix of `context` whose
length is within the match window and that is in the trie with a continuation, then grows the draft
tree best-first: every candidate node is scored by its path's estimated chance of acceptance (per node:
`continuation_accept_prob` of the context matched behind it, times its share of its siblings' counts),
and the likeliest candidate joins next, until `max_drafts` nodes or none left of at least
`min_accept_prob`. So a long, unambiguous match grows a chain and a short, ambiguous one a few
siblings or nothing; on a CPU, where every verified node costs ~0.2 of a decode step, the threshold
keeps out nodes that would cost more than they win. A node offers its `breadth` most frequent children
(ties: the most recently touched first, then the first created); the breadth shrinks linearly with the
match length, from `max_bfs_breadth` at `min_match_window` (a short match says little, so hedge) to
`min_bfs_breadth` at `max_match_window`. Where a drafted node ends its stored n-gram, the context plus
the drafts so far is matched again, so a draft can run past `branch_length`. Drafts steer only what is
verified: the target decides every emitted token, so one request's text can change another's drafts
but never its output.

Two implementations of one trie. `NativeNgramCache` (treespec/kernels/ngram_trie.cpp) is what the workers take
(`new_ngram_cache`) wherever the C++ kernels build; `PyNgramCache` is the reference it reproduces step
for step (the same node ids, counts, recency order, evictions and drafts: a test replays random
operations on both) and the fallback elsewhere. Both take the same `TextCursor`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from treespec.kernels import ngram_trie


@dataclass(frozen=True)
class NgramConfig:
    min_match_window: int = 1
    max_match_window: int = 12
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    branch_length: int = 18  # deepest stored n-gram
    capacity: int = 1_000_000  # nodes


@dataclass(frozen=True)
class NgramDraft:
    """Draft nodes of one request in breadth-first order. Verify-tree numbering: node 0 is the root (the
    last context token), draft i is node i + 1 and `parents[i]` is its parent node (0 = the root)."""

    tokens: list[int]
    parents: list[int]
    match_length: int  # tokens of context matched (0: no match, no drafts)


def _share(count: int, total: int, siblings: int) -> float:
    """A continuation's share of its siblings' counts (equal shares where none was counted yet: an
    insert's first tokens only begin n-grams)."""
    return count / total if total else 1.0 / siblings


class TextCursor:
    """Where one request's text stands in the cache: how many of its tokens were inserted, and the nodes
    of that text's last suffixes (lengths 1 .. branch_length - 1, shortest first) with their serial
    numbers, which the next insert extends by its new tokens instead of walking every n-gram from the
    root (a node id evicted and reused since has another serial)."""

    __slots__ = ("length", "suffixes", "serials")

    def __init__(self) -> None:
        self.length = 0
        self.suffixes: list[int] = []  # node ids
        self.serials: list[int] = []


ROOT = 0  # the root's node id

# How often the target's greedy token is a continuation, by the length of the context match behind it:
# 1 - MISS_AT_ONE * MISS_DECAY ** (width - 1), times the continuation's share of its siblings' counts.
# Fitted on the default model's greedy replies to a tuning set none of the benchmarks uses (48 prompts:
# ShareGPT training-split chat and multi-turn, functions of `rich` to comment, docstrings of `requests`
# and `starlette` to summarise): 0.47 after 1 matched token, 0.59 after 2, 0.77 after 4, 0.82 after 6,
# 0.96 after 12; the held-out workloads read the same within 0.06.
MISS_AT_ONE = 0.55
MISS_DECAY = 0.8


def continuation_accept_prob(width: int) -> float:
    """Estimated chance that the most likely reading of a `width`-token context match continues as
    stored (before its share among the node's continuations)."""
    return 1.0 - MISS_AT_ONE * MISS_DECAY ** max(0, width - 1)


class PyNgramCache:
    """The trie in Python: the reference that `NativeNgramCache` reproduces, and the fallback where the C++
    one cannot be built. The trie's nodes are integer ids into parallel lists of ints, and each node's
    children a dict of int -> int: none of it is an object Python's cycle collector tracks. (With a node object per n-gram,
    a full collection walked every node: a 200 ms pause at ~80k nodes, growing with the capacity.)"""

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        # per node id (a freed id is reused): token, count, tick (the clock when last touched: the
        # tie-break among equal counts), parent (-1: free), serial (when created), children (token -> id)
        self.token, self.count, self.tick, self.parent, self.serial = [-1], [0], [0], [-1], [0]
        self.children: list[dict[int, int] | None] = [None]
        self._free: list[int] = []
        self._recency: OrderedDict[int, None] = OrderedDict()  # oldest first; never holds the root
        self._clock = 0
        self._created = 0

    def __len__(self) -> int:
        return len(self._recency)

    def state(self) -> dict[str, list]:
        """Every column (token, count, tick, parent, serial, children, recency, free), for inspection."""
        return {"token": list(self.token), "count": list(self.count), "tick": list(self.tick),
                "parent": list(self.parent), "serial": list(self.serial),
                "children": [list((kids or {}).items()) for kids in self.children],
                "recency": list(self._recency), "free": list(self._free)}

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int], num_new: int | None = None, cursor: TextCursor | None = None) -> None:
        """Add the n-gram occurrences that end at the last `num_new` tokens of `tokens` (all of them when
        None); earlier tokens only give those n-grams their beginnings. With a request's `cursor` (updated
        here) that stands where the new tokens start, they extend its suffixes (module doc). Evicts down to
        capacity."""
        length = len(tokens)
        first_new = 0 if num_new is None else max(0, length - num_new)
        serial = self.serial
        if (cursor is not None and first_new > 0 and cursor.length == first_new
                and all(serial[node] == s for node, s in zip(cursor.suffixes, cursor.serials, strict=True))):
            self._extend(tokens, first_new, cursor)  # none of its nodes evicted
        else:
            self._insert_from_root(tokens, first_new, cursor)
        self._evict()

    def insert_rest(self, tokens: Sequence[int], cursor: TextCursor) -> None:
        """Insert what of `tokens` the request's `cursor` has not seen yet (all of it the first time)."""
        if len(tokens) > cursor.length:
            self.insert(tokens, len(tokens) - cursor.length, cursor)

    def _insert_from_root(self, tokens: Sequence[int], first_new: int, cursor: TextCursor | None) -> None:
        """Every n-gram that ends at a new token, walked from the root, each path touched deepest first."""
        length = len(tokens)
        depth_limit = self.config.branch_length
        suffixes: list[int] = []  # nodes of tokens[start:], start descending: shortest first
        # local names: the hot loop (a node's existing child is looked up inline, `_new_child` makes new ones)
        move_to_end, count, tick, children_of, new_child = (
            self._recency.move_to_end, self.count, self.tick, self.children, self._new_child)
        for start in range(max(0, first_new - depth_limit + 1), length):
            self._clock += 1  # later occurrences are more recent, also within one call
            clock, node, path = self._clock, ROOT, []
            for j in range(start, min(start + depth_limit, length)):
                kids = children_of[node]
                child = kids.get(tokens[j]) if kids else None
                if child is None:
                    child = new_child(node, tokens[j])
                if j >= first_new:
                    count[child] += 1
                path.append(child)
                node = child
            for touched in reversed(path):  # deepest first: ancestors end up newer than descendants
                tick[touched] = clock
                move_to_end(touched)
            if length - start < depth_limit:  # the walk reached the end: a suffix the cursor extends
                suffixes.append(node)
        if cursor is not None:
            cursor.length, cursor.suffixes = length, suffixes[::-1]
            cursor.serials = [self.serial[node] for node in cursor.suffixes]

    def _extend(self, tokens: Sequence[int], first_new: int, cursor: TextCursor) -> None:
        """The new tokens one by one: each extends the empty suffix and every suffix of the cursor, the
        same n-grams `_insert_from_root` would count, touching only those nodes."""
        longest = self.config.branch_length - 1  # suffixes kept: one token shorter than an n-gram
        move_to_end, count, tick, children_of, new_child = (
            self._recency.move_to_end, self.count, self.tick, self.children, self._new_child)
        for j in range(first_new, len(tokens)):
            token = tokens[j]
            self._clock += 1
            clock = self._clock
            extended: list[int] = []
            for node in (ROOT, *cursor.suffixes):
                kids = children_of[node]
                child = kids.get(token) if kids else None
                if child is None:
                    child = new_child(node, token)
                count[child] += 1
                tick[child] = clock
                move_to_end(child)
                if len(extended) < longest:
                    extended.append(child)
            cursor.suffixes = extended
        cursor.length = len(tokens)
        cursor.serials = [self.serial[node] for node in cursor.suffixes]

    def _new_child(self, node: int, token: int) -> int:
        """A new child of `node` for `token` (the caller found none), entered as the newest."""
        self._created += 1
        if self._free:
            child = self._free.pop()
            self.token[child], self.count[child], self.tick[child] = token, 0, 0
            self.parent[child], self.serial[child], self.children[child] = node, self._created, None
        else:  # a new id: every column grows by one (appends: the hot path of inserting new text)
            child = len(self.token)
            self.token.append(token)
            self.count.append(0)
            self.tick.append(0)
            self.parent.append(node)
            self.serial.append(self._created)
            self.children.append(None)
        children = self.children[node]
        if children is None:
            children = self.children[node] = {}
        children[token] = child
        self._recency[child] = None
        return child

    def _evict(self) -> None:
        while len(self._recency) > self.config.capacity:
            node, _ = self._recency.popitem(last=False)
            if self.children[node]:  # a descendant was used after it: keep it, as if used now (module doc)
                self._recency[node] = None
                continue
            parent = self.parent[node]
            siblings = self.children[parent]
            del siblings[self.token[node]]
            if not siblings:
                self.children[parent] = None
            self.parent[node], self.serial[node] = -1, 0
            self._free.append(node)

    def _touch(self, drafted: list[int], matched: int) -> None:
        """Mark a draft's nodes used: the drafted ones last-first (descendants before ancestors), then
        the matched node and its ancestors, which keeps the order invariant."""
        self._clock += 1
        for node in reversed(drafted):
            self.tick[node] = self._clock
            self._recency.move_to_end(node)
        node = matched
        while node != ROOT:
            self.tick[node] = self._clock
            self._recency.move_to_end(node)
            node = self.parent[node]

    # ------------------------------------------------------------------ draft
    def _cursor_nodes(self, context: Sequence[int], cursor: TextCursor | None) -> list[int] | None:
        """The nodes of `context`'s last suffixes (shortest first) from its text's cursor, when the cursor
        stands at the end of `context` and none of them was evicted since; else None (walk the trie)."""
        if cursor is None or cursor.length != len(context):
            return None
        serial = self.serial
        for node, s in zip(cursor.suffixes, cursor.serials, strict=True):
            if serial[node] != s:
                return None
        return cursor.suffixes

    def _longest_match(self, context: Sequence[int], min_width: int = 0,
                       cursor: TextCursor | None = None) -> tuple[int | None, int]:
        """The node of the longest suffix of `context` in the window (and of at least `min_width`
        tokens) that has continuations. With the cursor of `context`'s text (`_cursor_nodes`) each
        suffix's node is at hand: ~12 list reads instead of walking up to ~78 trie edges."""
        cfg = self.config
        longest = min(cfg.max_match_window, len(context), cfg.branch_length - 1)
        known = self._cursor_nodes(context, cursor)
        for width in range(longest, max(min_width, cfg.min_match_window) - 1, -1):
            node: int | None = ROOT
            if known is not None and width <= len(known):
                node = known[width - 1]
            else:
                for token in context[len(context) - width :]:
                    children = self.children[node]
                    node = children.get(token) if children else None
                    if node is None:
                        break
            if node is not None and self.children[node]:
                return node, width
        return None, 0

    def has_match(self, context: Sequence[int], min_width: int, min_accept_prob: float = 0.0,
                  cursor: TextCursor | None = None) -> bool:
        """Whether `draft` would match at least `min_width` tokens of `context` and propose a node of at
        least `min_accept_prob`. Cheaper than drafting, and touches nothing: asking is not using.
        `cursor`: the cursor of `context`'s text, if any (a cheaper match, the same result)."""
        node, width = self._longest_match(context, min_width, cursor)
        if node is None:
            return False
        counts = [self.count[c] for c in self.children[node].values()]
        return continuation_accept_prob(width) * _share(max(counts), sum(counts), len(counts)) >= min_accept_prob

    def breadth_for(self, match_length: int) -> int:
        """Children kept per expanded node: max_bfs_breadth at the shortest match window, falling
        linearly to min_bfs_breadth at the longest."""
        cfg = self.config
        span = max(1, cfg.max_match_window - cfg.min_match_window)
        frac = min(1.0, max(0.0, (match_length - cfg.min_match_window) / span))
        return round(cfg.max_bfs_breadth - frac * (cfg.max_bfs_breadth - cfg.min_bfs_breadth))

    def draft(self, context: Sequence[int], max_drafts: int, min_accept_prob: float = 0.0,
              cursor: TextCursor | None = None) -> NgramDraft:
        """At most `max_drafts` draft nodes continuing `context`, the likeliest first, none below
        `min_accept_prob` (see the module doc for the rule). `cursor` as in `has_match`."""
        node, width = self._longest_match(context, 0, cursor) if max_drafts > 0 else (None, 0)
        if node is None:
            return NgramDraft([], [], 0)
        breadth = self.breadth_for(width)
        tail = list(context[len(context) - self.config.max_match_window :])  # what a re-match can use
        tokens: list[int] = []
        parents: list[int] = []
        drafted: list[int] = []
        paths: list[list[int]] = [[]]  # per tree node, its drafted tokens from the root (for re-matching)
        heap: list[tuple[float, int, int, int, int]] = []  # (-path prob, offer order, trie node, width, parent)
        offers = itertools.count()  # equal scores: first offered first (most frequent, then most recent)
        self._push_continuations(heap, offers, node, width, 0, 1.0, breadth)
        while heap and len(tokens) < max_drafts:
            neg_prob, _, child, child_width, parent = heapq.heappop(heap)
            if -neg_prob < min_accept_prob:
                break
            tokens.append(self.token[child])
            parents.append(parent)
            drafted.append(child)
            paths.append(paths[parent] + [tokens[-1]])
            trie_node: int | None = child
            if not self.children[child]:  # the stored n-gram ends here: match again past the drafts
                trie_node, child_width = self._longest_match(tail + paths[-1])
            if trie_node is not None:
                self._push_continuations(heap, offers, trie_node, child_width, len(tokens), -neg_prob, breadth)
        self._touch(drafted, node)
        return NgramDraft(tokens, parents, width)

    def _push_continuations(self, heap: list, offers: Iterator[int], node: int, width: int, parent: int,
                            parent_prob: float, breadth: int) -> None:
        """Offer the `breadth` most frequent children of trie `node` (reached by `width` matched tokens)
        as children of draft-tree node `parent`, each scored by its path's estimated acceptance."""
        children = self.children[node]
        if not children:
            return
        count, tick = self.count, self.tick
        total = sum(count[c] for c in children.values())
        accept = parent_prob * continuation_accept_prob(width)
        for child in heapq.nlargest(breadth, children.values(), key=lambda c: (count[c], tick[c])):
            prob = accept * _share(count[child], total, len(children))
            heapq.heappush(heap, (-prob, next(offers), child, width + 1, parent))


class NativeNgramCache:
    """The same trie in C++ (treespec/kernels/ngram_trie.cpp): the same node ids, counts, recency order, evictions
    and drafts as `PyNgramCache`, step for step, at ~2 us a prompt token inserted (~40 in Python) and
    ~5x cheaper drafts. Only the tokens a call can reach cross into C++: an insert's from where its new n-grams
    start, a match's last `max_match_window`."""

    def __init__(self, config: NgramConfig, trie=None) -> None:
        self.config = config
        self._trie = trie if trie is not None else ngram_trie.load().NgramTrie(
            config.min_match_window, config.max_match_window, config.min_bfs_breadth, config.max_bfs_breadth,
            config.branch_length, config.capacity, MISS_AT_ONE, MISS_DECAY)

    def __len__(self) -> int:
        return self._trie.size()

    def __deepcopy__(self, memo: dict) -> NativeNgramCache:
        return NativeNgramCache(self.config, type(self._trie)(self._trie))

    def insert(self, tokens: Sequence[int], num_new: int | None = None, cursor: TextCursor | None = None) -> None:
        """As `PyNgramCache.insert`."""
        length = len(tokens)
        first_new = 0 if num_new is None else max(0, length - num_new)
        offset = max(0, first_new - self.config.branch_length + 1)
        self._trie.insert(tokens[offset:], offset, length, first_new, cursor)

    def insert_rest(self, tokens: Sequence[int], cursor: TextCursor) -> None:
        """As `PyNgramCache.insert_rest`."""
        if len(tokens) > cursor.length:
            self.insert(tokens, len(tokens) - cursor.length, cursor)

    def _tail(self, context: Sequence[int]) -> list[int]:
        return context[-self.config.max_match_window:]

    def _longest_match(self, context: Sequence[int], min_width: int = 0,
                       cursor: TextCursor | None = None) -> tuple[int | None, int]:
        node, width = self._trie.longest_match(self._tail(context), len(context), min_width, cursor)
        return (None if node < 0 else node), width

    def has_match(self, context: Sequence[int], min_width: int, min_accept_prob: float = 0.0,
                  cursor: TextCursor | None = None) -> bool:
        """As `PyNgramCache.has_match`."""
        return self._trie.has_match(self._tail(context), len(context), min_width, min_accept_prob, cursor)

    def breadth_for(self, match_length: int) -> int:
        return self._trie.breadth_for(match_length)

    def draft(self, context: Sequence[int], max_drafts: int, min_accept_prob: float = 0.0,
              cursor: TextCursor | None = None) -> NgramDraft:
        """As `PyNgramCache.draft`."""
        tokens, parents, width = self._trie.draft(self._tail(context), len(context), max_drafts, min_accept_prob,
                                                  cursor)
        return NgramDraft(tokens, parents, width)

    def state(self) -> dict[str, list]:
        """Every column (token, count, tick, parent, serial, children, recency, free), for inspection."""
        return self._trie.state()


NgramCache = PyNgramCache | NativeNgramCache


def new_ngram_cache(config: NgramConfig) -> NgramCache:
    """The C++ trie where it builds on this machine, else the Python one (the same drafts either way)."""
    return NativeNgramCache(config) if ngram_trie.load() is not None else PyNgramCache(config)
