"""NgramCache: a bounded trie of the n-grams seen in requests' text, shared by all requests, from which
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

Drafting. `draft(context, max_drafts)` finds the longest suffix of `context` whose length is within
the match window and that is in the trie with a continuation, then expands the continuations
breadth-first: every expanded node contributes its `breadth` most frequent children (ties: the most
recently touched first, then the first created). The breadth shrinks linearly with the match length, from `max_bfs_breadth` at
`min_match_window` (a short match says little, so hedge) to `min_bfs_breadth` at `max_match_window`
(a long match is likely to continue one way). Drafts steer only what is verified: the target decides
every emitted token, so one request's text can change another's drafts but never its output.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


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


class NgramCache:
    """The trie's nodes are integer ids into parallel lists of ints, and each node's children a dict of
    int -> int: none of it is an object Python's cycle collector tracks. (With a node object per n-gram,
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
        move_to_end, count, tick = self._recency.move_to_end, self.count, self.tick  # local names: the hot loop
        for start in range(max(0, first_new - depth_limit + 1), length):
            self._clock += 1  # later occurrences are more recent, also within one call
            clock, node, path = self._clock, ROOT, []
            for j in range(start, min(start + depth_limit, length)):
                child = self._child(node, tokens[j])
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
        move_to_end, count, tick = self._recency.move_to_end, self.count, self.tick
        for j in range(first_new, len(tokens)):
            token = tokens[j]
            self._clock += 1
            clock = self._clock
            extended: list[int] = []
            for node in (ROOT, *cursor.suffixes):
                child = self._child(node, token)
                count[child] += 1
                tick[child] = clock
                move_to_end(child)
                if len(extended) < longest:
                    extended.append(child)
            cursor.suffixes = extended
        cursor.length = len(tokens)
        cursor.serials = [self.serial[node] for node in cursor.suffixes]

    def _child(self, node: int, token: int) -> int:
        """`node`'s child for `token`, created (and entered as the newest) if missing."""
        children = self.children[node]
        child = children.get(token) if children else None
        if child is None:
            self._created += 1
            if self._free:
                child = self._free.pop()
            else:  # a new id: every column grows by one
                child = len(self.token)
                for column in (self.token, self.count, self.tick, self.parent, self.serial, self.children):
                    column.append(None)
            self.token[child], self.count[child], self.tick[child] = token, 0, 0
            self.parent[child], self.serial[child], self.children[child] = node, self._created, None
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
    def _longest_match(self, context: Sequence[int], min_width: int = 0) -> tuple[int | None, int]:
        """The node of the longest suffix of `context` in the window (and of at least `min_width`
        tokens) that has continuations."""
        cfg = self.config
        longest = min(cfg.max_match_window, len(context), cfg.branch_length - 1)
        for width in range(longest, max(min_width, cfg.min_match_window) - 1, -1):
            node: int | None = ROOT
            for token in context[len(context) - width :]:
                children = self.children[node]
                node = children.get(token) if children else None
                if node is None:
                    break
            if node is not None and self.children[node]:
                return node, width
        return None, 0

    def has_match(self, context: Sequence[int], min_width: int) -> bool:
        """Whether `draft` would match at least `min_width` tokens of `context`. Cheaper than drafting,
        and touches nothing: asking is not using."""
        return self._longest_match(context, min_width)[0] is not None

    def breadth_for(self, match_length: int) -> int:
        """Children kept per expanded node: max_bfs_breadth at the shortest match window, falling
        linearly to min_bfs_breadth at the longest."""
        cfg = self.config
        span = max(1, cfg.max_match_window - cfg.min_match_window)
        frac = min(1.0, max(0.0, (match_length - cfg.min_match_window) / span))
        return round(cfg.max_bfs_breadth - frac * (cfg.max_bfs_breadth - cfg.min_bfs_breadth))

    def draft(self, context: Sequence[int], max_drafts: int) -> NgramDraft:
        """At most `max_drafts` draft nodes continuing `context` (see the module doc for the rule)."""
        node, width = self._longest_match(context) if max_drafts > 0 else (None, 0)
        if node is None:
            return NgramDraft([], [], 0)
        breadth = self.breadth_for(width)
        tokens: list[int] = []
        parents: list[int] = []
        drafted: list[int] = []
        frontier: deque[tuple[int, int]] = deque([(node, 0)])
        count, tick = self.count, self.tick
        while frontier and len(tokens) < max_drafts:
            trie_node, tree_node = frontier.popleft()
            children = self.children[trie_node]
            if not children:
                continue
            best = heapq.nlargest(breadth, children.values(), key=lambda c: (count[c], tick[c]))
            for child in best[: max_drafts - len(tokens)]:
                tokens.append(self.token[child])
                parents.append(tree_node)
                drafted.append(child)
                frontier.append((child, len(tokens)))  # its verify-tree node number
        self._touch(drafted, node)
        return NgramDraft(tokens, parents, width)
