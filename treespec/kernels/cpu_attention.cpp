// Paged attention over the KV pool for requests with few query rows (decode, tree verify, draft
// steps), fp32, AVX2 + FMA. Reads FlashInfer-format metadata (page size 1) and, for tree modes, the
// bit-packed custom mask as it is (little bit order, byte offsets per request).
//
// Why: torch's path gathers every request's K and V into a dense copy, tiles a mask and calls SDPA,
// ~90 us per layer for one decode row on the 2-core dev machine; this reads K and V in place.
// Each (query row, head) is computed alone over its visible KV columns as one dense list, in order:
// a row's result depends neither on the rest of the batch nor on where masked columns sit, so every
// tree-verify row is bit-identical to the decode of the same path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx2_math.h"

static inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

static inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // two chains: half the FMA latency
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float total = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < d; ++i) total += a[i] * b[i];
  return total;
}

struct Request {
  int64_t q_start, q_len, kv_start, kv_len, mask_bit;  // mask_bit: first bit of its packed mask, -1 = causal
};

struct Pool {
  const float *k, *v;
  int64_t slot_stride, head_dim;
  const float* row(const float* buf, int64_t slot, int64_t kv_head) const {
    return buf + slot * slot_stride + kv_head * head_dim;
  }
};

// K and V rows of a head are 256-byte pieces of slots far apart in the pool, and a decode step finds
// them out of cache (the weights streamed since evicted them): fetch a few columns ahead. Only loads
// move earlier; the arithmetic is unchanged.
constexpr int64_t kPrefetchAhead = 32;

static inline void prefetch_row(const float* row, int64_t len) {
  for (int64_t i = 0; i < len; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

// out[d] = sum_j p[j] * V_j[d] over the visible columns, in order.
static void weighted_sum(const float* p, int64_t n, const int64_t* slots, const Pool& pool, int64_t kv_head,
                         float* out) {
  const int64_t d_all = pool.head_dim;
  int64_t d0 = 0;
  for (; d0 + 32 <= d_all; d0 += 32) {  // 4 accumulators stay in registers over all columns
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < n; ++j) {
      if (j + kPrefetchAhead < n) prefetch_row(pool.row(pool.v, slots[j + kPrefetchAhead], kv_head) + d0, 32);
      const float* v = pool.row(pool.v, slots[j], kv_head) + d0;
      const __m256 w = _mm256_set1_ps(p[j]);
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
    }
    _mm256_storeu_ps(out + d0, a0);
    _mm256_storeu_ps(out + d0 + 8, a1);
    _mm256_storeu_ps(out + d0 + 16, a2);
    _mm256_storeu_ps(out + d0 + 24, a3);
  }
  for (int64_t d = d0; d < d_all; ++d) {
    float acc = 0.f;
    for (int64_t j = 0; j < n; ++j) acc = std::fma(p[j], pool.row(pool.v, slots[j], kv_head)[d], acc);
    out[d] = acc;
  }
}

// Scores s[0, n) (padded with -inf to a multiple of 8) -> exp(s - max) in place; returns 1 / their sum
// (0 where no column is visible: the output is then 0).
static float softmax_in_place(float* s, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t padded = (n + 7) / 8 * 8;
  __m256 mv = _mm256_set1_ps(kNegInf);
  for (int64_t j = 0; j < padded; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = lanes[0];
  for (float x : lanes) m = std::max(m, x);
  if (n == 0) m = 0.f;
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {  // padding is -inf: exp gives exactly 0
    const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  const float denom = hsum(sum);
  return denom > 0.f ? 1.f / denom : 0.f;
}

struct Scratch {
  std::vector<float> scores;
  std::vector<int64_t> visible;  // a masked row's visible slots, in column order
};

// Whether bit `bit` of a packed mask (FlashInfer's little bit order) is set: that column is visible.
static inline bool column_visible(const uint8_t* mask, int64_t bit) { return (mask[bit >> 3] >> (bit & 7)) & 1; }

// One query head (its KV head kv_head) of row i of request `req`. The row attends to its visible
// columns only, taken in order as one dense list: the arithmetic depends on that list alone, not on
// where masked columns sit, so a tree node equals the plain decode of the same path bit for bit.
static void attend(const Request& req, int64_t i, int64_t kv_head, const float* q_head, const Pool& pool,
                   const int64_t* kv_indices, const uint8_t* mask, float scale, float* out, Scratch& scratch) {
  const int64_t* slots = kv_indices + req.kv_start;
  int64_t n = std::clamp<int64_t>(req.kv_len - req.q_len + i + 1, 0, req.kv_len);  // causal
  if (req.mask_bit >= 0) {
    scratch.visible.clear();
    for (int64_t j = 0; j < req.kv_len; ++j) {
      const int64_t bit = req.mask_bit + i * req.kv_len + j;
      if (column_visible(mask, bit)) scratch.visible.push_back(slots[j]);
    }
    slots = scratch.visible.data();
    n = static_cast<int64_t>(scratch.visible.size());
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t padded = (n + 7) / 8 * 8;
  scratch.scores.assign(padded, kNegInf);
  float* s = scratch.scores.data();
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) prefetch_row(pool.row(pool.k, slots[j + kPrefetchAhead], kv_head), pool.head_dim);
    s[j] = dot(q_head, pool.row(pool.k, slots[j], kv_head), pool.head_dim) * scale;
  }
  const float inv = softmax_in_place(s, n);
  weighted_sum(s, n, slots, pool, kv_head, out);
  for (int64_t d = 0; d < pool.head_dim; ++d) out[d] *= inv;
}

// The queries of one unit: rows [row0, row1) of request `req` x query heads [head0, head1), all on KV
// head kv_head.
struct Unit {
  int64_t req, kv_head, row0, row1, head0, head1;
};

// A row's own visible columns' slots (after the shared ones), in column order: a causal row's are a run of
// its request's slots, a masked row's are listed apart.
struct SlotSpan {
  const int64_t* slots = nullptr;
  int64_t count = 0;
};

// A row's own visible columns (after the shared ones): their K and V rows on the unit's KV head, shared
// by the row's queries.
struct OwnColumns {
  std::vector<const float*> k, v;
};

// One query's part of a unit: its q, output, softmax weights p (its dense list: the shared columns, then
// its own) and its row's own columns.
struct Query {
  const float* q;
  float* out;
  const float* p;
  float inv;
  const OwnColumns* own;
};

// A unit's columns and queries, gathered once for either ISA's unit code: the shared columns' K and V
// rows, each row's own visible ones, and a Query per (row, head) of the unit; then the unit code's
// scratch (scores, per-query lengths and pointers). One per thread, reused unit after unit: a prefill
// runs ~80 units a layer, and allocating these afresh for each put ~3.5 % of its CPU samples in malloc
// and free (now ~0.8 %; its wall time moved within noise, a 12-row verify's ~1.5 % down).
struct UnitWork {
  std::vector<const float*> shared_k, shared_v;
  std::vector<OwnColumns> own;  // the unit's rows' first (entries past them keep their capacity)
  std::vector<Query> qs;
  int64_t longest = 0;  // the most own columns of any row
  std::vector<float> scores;
  std::vector<int64_t> lengths;
  std::vector<float*> score_rows;
  std::vector<Query*> order;
};

static void gather_unit(const Unit& u, const Request& req, const float* qp, int64_t q_row_stride,
                        int64_t num_heads, const Pool& pool, const int64_t* kv_slots, int64_t shared,
                        const std::vector<SlotSpan>& own_slots, float* op, UnitWork& w) {
  const int64_t* shared_slots = kv_slots + req.kv_start;
  w.shared_k.resize(shared);
  w.shared_v.resize(shared);
  for (int64_t j = 0; j < shared; ++j) {
    w.shared_k[j] = pool.row(pool.k, shared_slots[j], u.kv_head);
    w.shared_v[j] = pool.row(pool.v, shared_slots[j], u.kv_head);
  }
  const int64_t rows = u.row1 - u.row0;
  if (static_cast<int64_t>(w.own.size()) < rows) w.own.resize(rows);  // before any Query points into it
  w.qs.clear();
  w.longest = 0;
  for (int64_t r = u.row0; r < u.row1; ++r) {
    const int64_t row = req.q_start + r;
    OwnColumns& cols = w.own[r - u.row0];
    cols.k.clear();
    cols.v.clear();
    const SlotSpan own = own_slots[row];
    for (int64_t c = 0; c < own.count; ++c) {
      cols.k.push_back(pool.row(pool.k, own.slots[c], u.kv_head));
      cols.v.push_back(pool.row(pool.v, own.slots[c], u.kv_head));
    }
    w.longest = std::max<int64_t>(w.longest, static_cast<int64_t>(cols.k.size()));
    for (int64_t h = u.head0; h < u.head1; ++h)
      w.qs.push_back({qp + row * q_row_stride + h * pool.head_dim, op + (row * num_heads + h) * pool.head_dim,
                      nullptr, 0.f, &cols});
  }
}

// fn(std::integral_constant<int, t>) for the largest t <= T that is at most count (count >= 1): a unit's
// weighted sums run queries in tiles of a compile-time size, the last tile smaller.
template <int T, typename Fn>
static void with_tile(int64_t count, Fn&& fn) {
  if constexpr (T > 1) {
    if (count < T) return with_tile<T - 1>(count, fn);
  }
  fn(std::integral_constant<int, T>{});
}

#include "cpu_attention_avx2_units.h"
#include "cpu_attention_avx512.h"

// fn(std::integral_constant<int, nc>) for nc = head_dim / 16 in 1..8 (the caller checks): the unit codes
// are templates on it, so a head's chunks sit in registers.
template <typename Fn>
static void with_chunks(int64_t nc, Fn&& fn) {
  switch (nc) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    default: return fn(std::integral_constant<int, 8>{});
  }
}

// How many of the `limit` mask bits from `bit` on are set before the first clear one. Whole bytes at a
// time where it can (a verify's rows see the whole committed prefix: ~300 bits a row, each layer), and
// never a byte past the bits it checks.
static int64_t leading_visible(const uint8_t* mask, int64_t bit, int64_t limit) {
  int64_t n = 0;
  for (; n < limit && ((bit + n) & 7) != 0; ++n)
    if (!column_visible(mask, bit + n)) return n;
  while (n + 8 <= limit && mask[(bit + n) >> 3] == 0xFF) n += 8;
  while (n < limit && column_visible(mask, bit + n)) ++n;
  return n;
}

// The unit paths (head_dim a multiple of 16, at most 128; AVX-512 or AVX2 code, the same bits): units of
// (request, KV head, rows) over the threads, each with the leading columns all its rows see (a masked
// request's: all of its rows'; a causal one's: the unit's first row's) and each row's visible columns
// after them.
static void attention_units(const std::vector<Request>& reqs, int64_t num_rows, int64_t num_heads, int64_t group,
                            const float* qp, int64_t q_row_stride, const Pool& pool, const int64_t* slots,
                            const uint8_t* mask, float scale, float* op, bool avx512) {
  const int64_t bs = static_cast<int64_t>(reqs.size()), num_kv_heads = num_heads / group;
  std::vector<int64_t> shared(bs);  // masked requests: the leading columns all their rows see
  std::vector<std::vector<int64_t>> masked_tails(num_rows);  // masked rows' visible slots past the shared ones
  std::vector<SlotSpan> tails(num_rows);  // every row's own slots (a causal row's: set per unit below)
  for (int64_t b = 0; b < bs; ++b) {
    const Request& req = reqs[b];
    const int64_t* req_slots = slots + req.kv_start;
    if (req.mask_bit < 0) continue;  // causal: per unit below
    int64_t common = req.kv_len;
    for (int64_t i = 0; i < req.q_len; ++i) common = leading_visible(mask, req.mask_bit + i * req.kv_len, common);
    shared[b] = req.q_len > 0 ? common : 0;
    for (int64_t i = 0; i < req.q_len; ++i) {
      std::vector<int64_t>& listed = masked_tails[req.q_start + i];
      for (int64_t j = shared[b]; j < req.kv_len; ++j)
        if (column_visible(mask, req.mask_bit + i * req.kv_len + j)) listed.push_back(req_slots[j]);
      tails[req.q_start + i] = {listed.data(), static_cast<int64_t>(listed.size())};
    }
  }
  // Units: up to `max_rows` rows x all heads of a KV head (heads stay together: a unit of one query runs
  // its V sums as a few fma chains, latency-bound). Rows split evenly within a request so the units of
  // one request weigh alike. Each thread takes a run of consecutive units, the runs balanced by an
  // estimated cost, and max_rows is the largest of 8, 4, 2, 1 whose runs finish soonest. A 12-row verify
  // over 3 KV heads on 2 threads: 3 units of 6 rows a thread, where 9 units of 4 rows ran 5 and 4 (and
  // four 8-row requests: 12 units that read K and V once, where 24 of 4 rows read them twice). Which
  // thread runs a unit never changes its bits.
  const int64_t threads = at::get_num_threads();
  auto chunks = [](int64_t n, int64_t most) { return (n + most - 1) / most; };
  // the columns row i of a causal request sees
  auto seen = [](const Request& req, int64_t i) {
    return std::clamp<int64_t>(req.kv_len - req.q_len + i + 1, 0, req.kv_len);
  };
  // cost of a unit: its queries' visible columns, plus one K and V read of its longest row's columns
  auto unit_cost = [&](const Request& req, int64_t row0, int64_t row1) {
    auto cols = [&](int64_t i) { return req.mask_bit < 0 ? seen(req, i) : req.kv_len; };
    int64_t total = 0;
    for (int64_t i = row0; i < row1; ++i) total += group * cols(i);
    return total + 2 * cols(row1 - 1);
  };
  // where each thread's run of consecutive units starts (threads + 1 bounds; consecutive units keep each
  // thread's reads in the pool's order, which the prefetchers follow), each cut where the running cost
  // is nearest its share of the total; returns the largest run's cost
  auto balance = [&](const std::vector<int64_t>& costs, std::vector<int64_t>& cut) {
    const int64_t n = static_cast<int64_t>(costs.size());
    int64_t total = 0;
    for (int64_t c : costs) total += c;
    cut.assign(threads + 1, n);
    cut[0] = 0;
    int64_t i = 0, prefix = 0, longest = 0;
    for (int64_t t = 1; t < threads; ++t) {
      const int64_t target = total * t / threads;
      while (i < n && prefix + costs[i] <= target) prefix += costs[i++];
      // nearer after it, or as near (the caller's thread, first, starts before the others wake)
      if (i < n && (prefix + costs[i] - target) <= (target - prefix)) prefix += costs[i++];
      cut[t] = i;
    }
    for (int64_t t = 0; t < threads; ++t) {
      int64_t run = 0;
      for (int64_t j = cut[t]; j < cut[t + 1]; ++j) run += costs[j];
      longest = std::max(longest, run);
    }
    return longest;
  };
  auto row_range = [](int64_t q_len, int64_t row_chunks, int64_t c) {
    return std::pair<int64_t, int64_t>{q_len * c / row_chunks, q_len * (c + 1) / row_chunks};
  };
  auto costs_for = [&](int64_t max_rows) {
    std::vector<int64_t> costs;
    for (const Request& req : reqs) {
      const int64_t row_chunks = chunks(req.q_len, max_rows);
      for (int64_t c = 0; c < row_chunks; ++c) {
        const auto [row0, row1] = row_range(req.q_len, row_chunks, c);
        costs.insert(costs.end(), num_kv_heads, unit_cost(req, row0, row1));
      }
    }
    return costs;
  };
  // the chosen max_rows and the threads' runs of its units (costs_for lists them per request, row chunk
  // and KV head: the order the units are built in below)
  int64_t max_rows = 8, longest_q = 0;
  std::vector<int64_t> bounds;
  int64_t best = balance(costs_for(max_rows), bounds);
  for (const Request& req : reqs) longest_q = std::max(longest_q, req.q_len);
  for (int64_t rows : {4, 2, 1}) {
    if (rows >= longest_q) continue;  // the same units as the larger max_rows (always, for decodes)
    std::vector<int64_t> cut;
    const int64_t makespan = balance(costs_for(rows), cut);
    if (makespan < best) best = makespan, max_rows = rows, bounds = std::move(cut);
  }
  // A causal request's unit shares the columns its first row sees (row i sees kv_len - q_len + i + 1):
  // in a prefill every K and V row is then read once per unit rather than once per query. Where the
  // shared columns end does not change a query's dense list, so not its bits either.
  std::vector<Unit> units;
  std::vector<int64_t> unit_shared;
  for (int64_t b = 0; b < bs; ++b) {
    const Request& req = reqs[b];
    const int64_t q_len = req.q_len, row_chunks = chunks(q_len, max_rows);
    for (int64_t c = 0; c < row_chunks; ++c) {
      const auto [row0, row1] = row_range(q_len, row_chunks, c);
      int64_t chunk_shared = shared[b];
      if (req.mask_bit < 0) {
        chunk_shared = seen(req, row0);
        const int64_t* req_slots = slots + req.kv_start;
        for (int64_t i = row0; i < row1; ++i) tails[req.q_start + i] = {req_slots + chunk_shared, seen(req, i) - chunk_shared};
      }
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        units.push_back({b, g, row0, row1, g * group, (g + 1) * group});
        unit_shared.push_back(chunk_shared);
      }
    }
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    UnitWork work;  // this thread's, reused by its units
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = bounds[t]; i < bounds[t + 1]; ++i) {
        const auto& u = units[i];
        with_chunks(pool.head_dim / 16, [&](auto chunks) {
          constexpr int NC = decltype(chunks)::value;
          const auto run = avx512 ? attention_avx512::run_unit<NC> : attention_avx2::run_unit<NC>;
          run(u, reqs[u.req], qp, q_row_stride, num_heads, pool, slots, unit_shared[i], tails, scale, op, work);
        });
      }
    }
  });
}

// q [T, H, D]; k_buf, v_buf [slots, Hkv, D]; qo_indptr, kv_indptr int64 [bs + 1] (host);
// kv_indices int64; custom_mask uint8 packed bits with mask_indptr int64 [bs + 1] byte offsets, or
// empty tensors for bottom-right causal attention. avx512: run the AVX-512 code (same bits) where
// head_dim is a multiple of 16. Returns [T, H, D].
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                        const torch::Tensor& qo_indptr, const torch::Tensor& kv_indptr,
                        const torch::Tensor& kv_indices, const torch::Tensor& custom_mask,
                        const torch::Tensor& mask_indptr, double scale, bool avx512) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && q.scalar_type() == torch::kFloat32,
              "attention: q must be fp32 [T, H, D] with contiguous rows");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes() &&
                  k_buf.scalar_type() == torch::kFloat32 && v_buf.scalar_type() == torch::kFloat32,
              "attention: K and V buffers must be contiguous fp32 [slots, Hkv, D] of one shape");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == head_dim && num_heads % num_kv_heads == 0,
              "attention: head shapes do not match");
  for (const auto* t : {&qo_indptr, &kv_indptr, &kv_indices, &mask_indptr})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "attention: index tensors must be contiguous int64");
  const bool masked = custom_mask.numel() > 0;
  TORCH_CHECK(!masked || (custom_mask.scalar_type() == torch::kUInt8 && custom_mask.is_contiguous() &&
                          mask_indptr.numel() == qo_indptr.numel()),
              "attention: custom_mask must be packed uint8 with one byte offset per request");
  const int64_t bs = qo_indptr.numel() - 1, group = num_heads / num_kv_heads;
  const int64_t* qo = qo_indptr.data_ptr<int64_t>();
  const int64_t* kv = kv_indptr.data_ptr<int64_t>();
  std::vector<Request> reqs(bs);
  std::vector<int64_t> row_req(q.size(0));
  for (int64_t b = 0; b < bs; ++b) {
    reqs[b] = {qo[b], qo[b + 1] - qo[b], kv[b], kv[b + 1] - kv[b], masked ? mask_indptr.data_ptr<int64_t>()[b] * 8 : -1};
    for (int64_t r = qo[b]; r < qo[b + 1]; ++r) row_req[r] = b;
  }
  auto out = torch::empty({q.size(0), num_heads, head_dim}, q.options());
  const int64_t q_row_stride = q.stride(0);
  const float* qp = q.data_ptr<float>();
  const Pool pool{k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), num_kv_heads * head_dim, head_dim};
  const int64_t* slots = kv_indices.data_ptr<int64_t>();
  const uint8_t* mask = masked ? custom_mask.data_ptr<uint8_t>() : nullptr;
  float* op = out.data_ptr<float>();
  if (head_dim % 16 == 0 && head_dim <= 128) {
    attention_units(reqs, q.size(0), num_heads, group, qp, q_row_stride, pool, slots, mask, static_cast<float>(scale),
                    op, avx512);
    return out;
  }
  // other head sizes: one task per (query row, query head), each computed alone by `attend`
  at::parallel_for(0, q.size(0) * num_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t / num_heads, head = t % num_heads;
      const Request& req = reqs[row_req[row]];
      attend(req, row - req.q_start, head / group, qp + row * q_row_stride + head * head_dim, pool, slots, mask,
             static_cast<float>(scale), op + t * head_dim, scratch);
    }
  });
  return out;
}

// Rotary embedding and KV store for one layer's fused projection qkv [T, (H + 2 Hkv) * D]: the q heads are
// rotated in place, the rotated k heads and the v heads are written to k_buf / v_buf at slots loc [T].
// cos / sin [T, D] are the rotate-half tables with the sign folded into sin (models/layers.py):
// x * cos + roll(x, D / 2) * sin, element by element (no element depends on the rest of the batch).
constexpr int64_t kMaxRopeDim = 512;  // rope_store's stack row

void rope_store(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& loc,
                torch::Tensor& k_buf, torch::Tensor& v_buf, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32, "rope_store: qkv must be contiguous fp32 [T, width]");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes() &&
                  k_buf.scalar_type() == torch::kFloat32 && v_buf.scalar_type() == torch::kFloat32,
              "rope_store: K and V buffers must be contiguous fp32 [slots, Hkv, D] of one shape");
  const int64_t tokens = qkv.size(0), num_kv_heads = k_buf.size(1), head_dim = k_buf.size(2), half = head_dim / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && head_dim % 2 == 0, "rope_store: qkv width does not match the heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && cos.numel() == tokens * head_dim && sin.numel() == tokens * head_dim,
              "rope_store: cos and sin must be contiguous fp32 [T, D]");
  TORCH_CHECK(loc.scalar_type() == torch::kInt64 && loc.is_contiguous() && loc.numel() == tokens, "rope_store: loc must be int64 [T]");
  float* x = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slots = loc.data_ptr<int64_t>();
  float *kp = k_buf.data_ptr<float>(), *vp = v_buf.data_ptr<float>();
  const int64_t width = qkv.size(1), kv_stride = num_kv_heads * head_dim, slot_count = k_buf.size(0);
  TORCH_CHECK(head_dim <= kMaxRopeDim, "rope_store: head_dim above ", kMaxRopeDim);
  float rotated[kMaxRopeDim];
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slot_count, "rope_store: slot out of range");
    float* row = x + t * width;
    const float *c = cp + t * head_dim, *s = sp + t * head_dim;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      float* head = row + h * head_dim;
      // x * cos + roll(x, half) * sin, as two loops over the halves: the same expression per element
      // (the same bits), but no modulo in the index, so the compiler vectorizes them (a 9-row call
      // took 17.7 us, now 1.9)
      for (int64_t d = 0; d < half; ++d) rotated[d] = head[d] * c[d] + head[d + half] * s[d];
      for (int64_t d = half; d < head_dim; ++d) rotated[d] = head[d] * c[d] + head[d - half] * s[d];
      float* dst = h < num_heads ? head : kp + slots[t] * kv_stride + (h - num_heads) * head_dim;
      std::copy(rotated, rotated + head_dim, dst);
    }
    std::copy(row + (num_heads + num_kv_heads) * head_dim, row + width, vp + slots[t] * kv_stride);
  }
}

#ifndef TREESPEC_NO_MODULE  // compiled into cpu_layers.cpp's extension without its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_store", &rope_store, "rotate q in place, write rotated k and v to the KV pool (fp32)");
  m.def("attention", &attention, "paged attention for few query rows per request (fp32)");
  m.def("cpu_has_avx512", [] { return static_cast<bool>(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")); },
        "whether this CPU runs the AVX-512 code");
}
#endif
