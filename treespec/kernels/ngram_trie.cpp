// The NGRAM draft source's trie in C++ (`ngram_trie.py` loads it; treespec/speculative/ngram_cache.py
// documents the rules and keeps the Python implementation, PyNgramCache, that this one reproduces step
// for step: the same node ids, counts, ticks, recency order, evictions and drafts).
//
// Why: in Python inserting a prompt costs ~40 us a token (~12 new trie nodes a token, each several dict
// and list operations); at 16 concurrent requests the own tries' inserts took ~8 % of a run. Here ~2 us
// (what is left is mostly cache misses: a node, its hash entry, its recency neighbours).
//
// Layout: nodes are ids into columns; a node's children are a doubly linked sibling list in creation
// order (Python dicts iterate in insertion order, and ties between equally counted, equally recent
// children go to the first created) with one hash map (parent, token) -> child for lookups; recency is
// an intrusive doubly linked list, oldest first (the OrderedDict of the Python trie).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <queue>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t kRoot = 0;
constexpr int32_t kNone = -1;

double share(int64_t count, int64_t total, int64_t siblings) {
  return total ? static_cast<double>(count) / static_cast<double>(total) : 1.0 / static_cast<double>(siblings);
}

// A request's cursor lives in Python (ngram_cache.TextCursor: length, suffixes, serials) so both tries
// take the same object; these read and write it.
struct CursorView {
  int64_t length = 0;
  std::vector<int32_t> suffixes;
  std::vector<int64_t> serials;

  static CursorView read(const py::object& cursor) {
    CursorView view;
    view.length = cursor.attr("length").cast<int64_t>();
    view.suffixes = cursor.attr("suffixes").cast<std::vector<int32_t>>();
    view.serials = cursor.attr("serials").cast<std::vector<int64_t>>();
    return view;
  }
};

struct Candidate {  // a draft-tree candidate, ordered as the Python heap orders (-prob, offer order)
  double neg_prob;
  int64_t order;
  int32_t node;
  int64_t width;
  int64_t parent;
  bool operator>(const Candidate& other) const {
    return neg_prob != other.neg_prob ? neg_prob > other.neg_prob : order > other.order;
  }
};

class NgramTrie {
 public:
  // miss_at_one, miss_decay: ngram_cache.continuation_accept_prob's constants (one source: Python's)
  NgramTrie(int64_t min_match_window, int64_t max_match_window, int64_t min_bfs_breadth, int64_t max_bfs_breadth,
            int64_t branch_length, int64_t capacity, double miss_at_one, double miss_decay)
      : min_w_(min_match_window), max_w_(max_match_window), min_b_(min_bfs_breadth), max_b_(max_bfs_breadth),
        branch_(branch_length), capacity_(capacity), miss_at_one_(miss_at_one), miss_decay_(miss_decay) {
    push_node(-1, kNone, 0);  // the root: never in the recency list, never evicted
  }

  int64_t size() const { return live_; }

  // tokens = the text's tokens from `offset` on (the caller slices off what no new n-gram reaches);
  // length = the whole text's length; first_new = where the new tokens start.
  void insert(const std::vector<int64_t>& tokens, int64_t offset, int64_t length, int64_t first_new,
              const py::object& cursor) {
    if (!cursor.is_none() && first_new > 0) {
      CursorView view = CursorView::read(cursor);
      if (view.length == first_new && cursor_valid(view)) {
        extend(tokens, offset, length, first_new, view);
        write_cursor(cursor, view);
        evict();
        return;
      }
    }
    std::vector<int32_t> suffixes = insert_from_root(tokens, offset, length, first_new);
    if (!cursor.is_none()) {
      CursorView view;
      view.length = length;
      view.suffixes.assign(suffixes.rbegin(), suffixes.rend());
      write_cursor(cursor, view);
    }
    evict();
  }

  // context = the last tokens of a context of `length` tokens (at least its last max_match_window)
  std::pair<int32_t, int64_t> longest_match(const std::vector<int64_t>& context, int64_t length, int64_t min_width,
                                            const py::object& cursor) const {
    std::vector<int32_t> known;
    bool have_known = false;
    if (!cursor.is_none()) {
      CursorView view = CursorView::read(cursor);
      if (view.length == length && cursor_valid(view)) {
        known = std::move(view.suffixes);
        have_known = true;
      }
    }
    return match(context, length, min_width, have_known ? &known : nullptr);
  }

  bool has_match(const std::vector<int64_t>& context, int64_t length, int64_t min_width, double min_accept_prob,
                 const py::object& cursor) const {
    auto [node, width] = longest_match(context, length, min_width, cursor);
    if (node == kNone) return false;
    int64_t best = 0, total = 0;
    for (int32_t c = first_child_[node]; c != kNone; c = next_sib_[c]) {
      best = std::max(best, count_[c]);
      total += count_[c];
    }
    return continuation_accept_prob(width) * share(best, total, num_children_[node]) >= min_accept_prob;
  }

  int64_t breadth_for(int64_t match_length) const {
    int64_t span = std::max<int64_t>(1, max_w_ - min_w_);
    double frac = std::min(1.0, std::max(0.0, static_cast<double>(match_length - min_w_) / static_cast<double>(span)));
    // Python's round(): half to even, as nearbyint in the default rounding mode
    return static_cast<int64_t>(std::nearbyint(static_cast<double>(max_b_) - frac * static_cast<double>(max_b_ - min_b_)));
  }

  // (tokens, parents, match length); context and length as in longest_match
  py::tuple draft(const std::vector<int64_t>& context, int64_t length, int64_t max_drafts, double min_accept_prob,
                  const py::object& cursor) {
    std::vector<int64_t> tokens, parents;
    auto [node, width] = max_drafts > 0 ? longest_match(context, length, 0, cursor) : std::make_pair(kNone, int64_t{0});
    if (node == kNone) return py::make_tuple(tokens, parents, 0);
    int64_t breadth = breadth_for(width);
    // what a re-match can use: the context's last max_match_window tokens
    int64_t keep = std::min<int64_t>(static_cast<int64_t>(context.size()), std::min(length, max_w_));
    std::vector<int64_t> tail(context.end() - keep, context.end());
    std::vector<int32_t> drafted;
    std::vector<std::vector<int64_t>> paths(1);  // per tree node, its drafted tokens from the root
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
    int64_t offers = 0;
    push_continuations(heap, offers, node, width, 0, 1.0, breadth);
    while (!heap.empty() && static_cast<int64_t>(tokens.size()) < max_drafts) {
      Candidate best = heap.top();
      heap.pop();
      if (-best.neg_prob < min_accept_prob) break;
      tokens.push_back(token_[best.node]);
      parents.push_back(best.parent);
      drafted.push_back(best.node);
      std::vector<int64_t> path = paths[best.parent];
      path.push_back(tokens.back());
      paths.push_back(std::move(path));
      int32_t trie_node = best.node;
      int64_t child_width = best.width;
      if (num_children_[best.node] == 0) {  // the stored n-gram ends here: match again past the drafts
        std::vector<int64_t> rematch(tail);
        rematch.insert(rematch.end(), paths.back().begin(), paths.back().end());
        std::tie(trie_node, child_width) = match(rematch, static_cast<int64_t>(rematch.size()), 0, nullptr);
      }
      if (trie_node != kNone)
        push_continuations(heap, offers, trie_node, child_width, static_cast<int64_t>(tokens.size()), -best.neg_prob,
                           breadth);
    }
    touch(drafted, node);
    return py::make_tuple(tokens, parents, width);
  }

  // every column, for tests and inspection: ids index them; children in creation order
  py::dict state() const {
    py::dict out;
    std::vector<std::vector<std::pair<int64_t, int32_t>>> children(token_.size());
    for (size_t n = 0; n < token_.size(); ++n)
      for (int32_t c = first_child_[n]; c != kNone; c = next_sib_[c]) children[n].emplace_back(token_[c], c);
    std::vector<int32_t> recency;
    for (int32_t n = rec_head_; n != kNone; n = rec_next_[n]) recency.push_back(n);
    out["token"] = token_;
    out["count"] = count_;
    out["tick"] = tick_;
    out["parent"] = parent_;
    out["serial"] = serial_;
    out["children"] = children;
    out["recency"] = recency;
    out["free"] = free_;
    return out;
  }

 private:
  int64_t min_w_, max_w_, min_b_, max_b_, branch_, capacity_;
  double miss_at_one_, miss_decay_;
  std::vector<int64_t> token_, count_, tick_, serial_;
  std::vector<int32_t> parent_;  // -1: free (and the root)
  std::vector<int32_t> first_child_, last_child_, next_sib_, prev_sib_, num_children_;
  std::vector<int32_t> rec_prev_, rec_next_;
  int32_t rec_head_ = kNone, rec_tail_ = kNone;
  int64_t live_ = 0;  // nodes in the recency list: every node but the root
  std::unordered_map<uint64_t, int32_t> edges_;  // (parent, token) -> child
  std::vector<int32_t> free_;
  int64_t clock_ = 0, created_ = 0;

  // ngram_cache.continuation_accept_prob: pow as Python's float ** int (both call the C library's pow)
  double continuation_accept_prob(int64_t width) const {
    return 1.0 - miss_at_one_ * std::pow(miss_decay_, static_cast<double>(std::max<int64_t>(0, width - 1)));
  }

  static uint64_t edge(int32_t node, int64_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) | static_cast<uint32_t>(token);
  }

  int32_t child_of(int32_t node, int64_t token) const {
    if (num_children_[node] == 0) return kNone;
    auto it = edges_.find(edge(node, token));
    return it == edges_.end() ? kNone : it->second;
  }

  void push_node(int64_t token, int32_t parent, int64_t serial) {
    token_.push_back(token);
    count_.push_back(0);
    tick_.push_back(0);
    parent_.push_back(parent);
    serial_.push_back(serial);
    for (auto* column : {&first_child_, &last_child_, &next_sib_, &prev_sib_, &rec_prev_, &rec_next_})
      column->push_back(kNone);
    num_children_.push_back(0);
  }

  void recency_append(int32_t node) {
    rec_prev_[node] = rec_tail_;
    rec_next_[node] = kNone;
    if (rec_tail_ != kNone) rec_next_[rec_tail_] = node; else rec_head_ = node;
    rec_tail_ = node;
    ++live_;
  }

  void recency_unlink(int32_t node) {
    int32_t prev = rec_prev_[node], next = rec_next_[node];
    if (prev != kNone) rec_next_[prev] = next; else rec_head_ = next;
    if (next != kNone) rec_prev_[next] = prev; else rec_tail_ = prev;
    --live_;
  }

  void move_to_end(int32_t node) {
    if (node == rec_tail_) return;
    recency_unlink(node);
    recency_append(node);
  }

  int32_t new_child(int32_t node, int64_t token) {
    ++created_;
    int32_t child;
    if (!free_.empty()) {
      child = free_.back();
      free_.pop_back();
      token_[child] = token;
      count_[child] = 0;
      tick_[child] = 0;
      parent_[child] = node;
      serial_[child] = created_;
      first_child_[child] = last_child_[child] = kNone;
      num_children_[child] = 0;
    } else {
      child = static_cast<int32_t>(token_.size());
      push_node(token, node, created_);
    }
    prev_sib_[child] = last_child_[node];
    next_sib_[child] = kNone;
    if (last_child_[node] != kNone) next_sib_[last_child_[node]] = child; else first_child_[node] = child;
    last_child_[node] = child;
    ++num_children_[node];
    edges_[edge(node, token)] = child;
    recency_append(child);
    return child;
  }

  void evict() {
    while (live_ > capacity_) {
      int32_t node = rec_head_;
      recency_unlink(node);
      if (num_children_[node] > 0) {  // a descendant was used after it: keep it, as if used now
        recency_append(node);
        continue;
      }
      int32_t parent = parent_[node];
      int32_t prev = prev_sib_[node], next = next_sib_[node];
      if (prev != kNone) next_sib_[prev] = next; else first_child_[parent] = next;
      if (next != kNone) prev_sib_[next] = prev; else last_child_[parent] = prev;
      --num_children_[parent];
      edges_.erase(edge(parent, token_[node]));
      parent_[node] = kNone;
      serial_[node] = 0;
      free_.push_back(node);
    }
  }

  bool cursor_valid(const CursorView& view) const {
    if (view.suffixes.size() != view.serials.size()) return false;
    for (size_t i = 0; i < view.suffixes.size(); ++i) {
      int32_t node = view.suffixes[i];
      if (node < 0 || node >= static_cast<int32_t>(serial_.size()) || serial_[node] != view.serials[i]) return false;
    }
    return true;
  }

  void write_cursor(const py::object& cursor, CursorView& view) const {
    view.serials.clear();
    for (int32_t node : view.suffixes) view.serials.push_back(serial_[node]);
    cursor.attr("length") = view.length;
    cursor.attr("suffixes") = py::cast(view.suffixes);
    cursor.attr("serials") = py::cast(view.serials);
  }

  std::vector<int32_t> insert_from_root(const std::vector<int64_t>& tokens, int64_t offset, int64_t length,
                                        int64_t first_new) {
    std::vector<int32_t> suffixes, path;
    for (int64_t start = std::max<int64_t>(0, first_new - branch_ + 1); start < length; ++start) {
      int64_t clock = ++clock_;  // later occurrences are more recent, also within one call
      int32_t node = kRoot;
      path.clear();
      for (int64_t j = start; j < std::min(start + branch_, length); ++j) {
        int64_t token = tokens[j - offset];
        int32_t child = child_of(node, token);
        if (child == kNone) child = new_child(node, token);
        if (j >= first_new) ++count_[child];
        path.push_back(child);
        node = child;
      }
      for (auto it = path.rbegin(); it != path.rend(); ++it) {  // deepest first
        tick_[*it] = clock;
        move_to_end(*it);
      }
      if (length - start < branch_) suffixes.push_back(node);
    }
    return suffixes;
  }

  void extend(const std::vector<int64_t>& tokens, int64_t offset, int64_t length, int64_t first_new,
              CursorView& view) {
    size_t longest = static_cast<size_t>(branch_ - 1);
    std::vector<int32_t> extended;
    for (int64_t j = first_new; j < length; ++j) {
      int64_t token = tokens[j - offset];
      int64_t clock = ++clock_;
      extended.clear();
      for (size_t k = 0; k <= view.suffixes.size(); ++k) {
        int32_t node = k == 0 ? kRoot : view.suffixes[k - 1];
        int32_t child = child_of(node, token);
        if (child == kNone) child = new_child(node, token);
        ++count_[child];
        tick_[child] = clock;
        move_to_end(child);
        if (extended.size() < longest) extended.push_back(child);
      }
      view.suffixes.swap(extended);
    }
    view.length = length;
  }

  void touch(const std::vector<int32_t>& drafted, int32_t matched) {
    int64_t clock = ++clock_;
    for (auto it = drafted.rbegin(); it != drafted.rend(); ++it) {
      tick_[*it] = clock;
      move_to_end(*it);
    }
    for (int32_t node = matched; node != kRoot; node = parent_[node]) {
      tick_[node] = clock;
      move_to_end(node);
    }
  }

  // the node of the longest suffix of the context (its last tokens in `context`, `length` in all) in the
  // window and of at least min_width tokens that has continuations; `known`: its suffixes' nodes
  std::pair<int32_t, int64_t> match(const std::vector<int64_t>& context, int64_t length, int64_t min_width,
                                    const std::vector<int32_t>* known) const {
    int64_t longest = std::min(std::min(max_w_, length), branch_ - 1);
    int64_t size = static_cast<int64_t>(context.size());
    for (int64_t width = longest; width >= std::max(min_width, min_w_); --width) {
      int32_t node = kRoot;
      if (known != nullptr && width <= static_cast<int64_t>(known->size()) && !(width == 0 && known->empty())) {
        node = width == 0 ? known->back() : (*known)[width - 1];  // width 0: Python's known[-1]
      } else {
        for (int64_t i = size - width; i < size && node != kNone; ++i) node = child_of(node, context[i]);
      }
      if (node != kNone && num_children_[node] > 0) return {node, width};
    }
    return {kNone, 0};
  }

  void push_continuations(std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>>& heap,
                          int64_t& offers, int32_t node, int64_t width, int64_t parent, double parent_prob,
                          int64_t breadth) const {
    if (num_children_[node] == 0 || breadth <= 0) return;
    std::vector<int32_t> kids;
    int64_t total = 0;
    for (int32_t c = first_child_[node]; c != kNone; c = next_sib_[c]) {
      kids.push_back(c);
      total += count_[c];
    }
    double accept = parent_prob * continuation_accept_prob(width);
    // heapq.nlargest by (count, tick): the largest first, ties to the first created (a stable sort)
    std::stable_sort(kids.begin(), kids.end(), [this](int32_t a, int32_t b) {
      return count_[a] != count_[b] ? count_[a] > count_[b] : tick_[a] > tick_[b];
    });
    int64_t n = std::min<int64_t>(breadth, static_cast<int64_t>(kids.size()));
    for (int64_t i = 0; i < n; ++i) {
      int32_t child = kids[i];
      double prob = accept * share(count_[child], total, num_children_[node]);
      heap.push(Candidate{-prob, offers++, child, width + 1, parent});
    }
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NgramTrie>(m, "NgramTrie")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def(py::init<const NgramTrie&>())
      .def("size", &NgramTrie::size)
      .def("insert", &NgramTrie::insert)
      .def("longest_match", &NgramTrie::longest_match)
      .def("has_match", &NgramTrie::has_match)
      .def("breadth_for", &NgramTrie::breadth_for)
      .def("draft", &NgramTrie::draft)
      .def("state", &NgramTrie::state);
}
