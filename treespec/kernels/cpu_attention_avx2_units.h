// AVX2 paged attention in units of queries that share a KV head: the arithmetic of cpu_attention.cpp's
// per-(row, head) code (`attend`), bit for bit, with the K and V rows read once per unit.
//
// Why: `attend` reads every K row once per query and reduces each q.k dot on its own (a horizontal sum
// per column). A 2048-token prefill's queries each stream ~0.5 MB of K per layer from L2, and on
// AVX2-only hosts that prefill took 1.6x the AVX-512 unit code's time. Here, as in
// cpu_attention_avx512.h, a unit's queries score a block of 8 columns while its K rows sit in L1, and
// the 8 dots of a block are reduced together by one shuffle tree.
//
// Same bits as `attend`, element by element (V rows, too, serve several queries a load):
// - a dot q.k over head_dim (a multiple of 16) is `dot`'s two 8-lane fma chains over the 16-float
//   chunks in order, added, then hsum's tree: lanes l + (l+4), then + (l+2), + (l+1) (reduce8);
// - softmax is `softmax_in_place` itself;
// - each output element is one fma chain over the query's dense list of visible columns in order, then
//   times 1 / sum, as `weighted_sum` and `attend` do.
// Included by cpu_attention.cpp after Pool, Request, Unit, SlotSpan, UnitWork, with_tile, prefetch_row and softmax_in_place.

namespace attention_avx2 {

// The 8 columns' lane sums, column c in lane c: per column exactly hsum's additions (module comment).
static inline __m256 reduce8(const __m256* v) {
  // [x.lo + x.hi, y.lo + y.hi]: lane l + lane l+4 of two columns
  auto halves = [](__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  };
  // per 128-bit lane [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
  auto pairs = [](__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  // per 128-bit lane [x0 + x1, x2 + x3, y0 + y1, y2 + y3]
  auto neighbours = [](__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  // halves(v0, v4) holds column 0 in its low lane and 4 in its high one, and so on: columns come out in order
  return neighbours(pairs(halves(v[0], v[4]), halves(v[1], v[5])), pairs(halves(v[2], v[6]), halves(v[3], v[7])));
}

// s[c] = (q . K_c) * scale for the K rows rows[c], c < count <= 8. q: the query's 16 * NC floats.
template <int NC>
static inline void score_block(const float* q, const float* const* rows, int64_t count, float scale, float* s) {
  __m256 sums[8];
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    sums[c] = _mm256_setzero_ps();
    if (c < count) {
      const float* k = rows[c];
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int i = 0; i < NC; ++i) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i), _mm256_loadu_ps(k + 16 * i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i + 8), _mm256_loadu_ps(k + 16 * i + 8), acc1);
      }
      sums[c] = _mm256_add_ps(acc0, acc1);
    }
  }
  const __m256 scores = _mm256_mul_ps(reduce8(sums), _mm256_set1_ps(scale));
  if (count == 8) {
    _mm256_storeu_ps(s, scores);
  } else {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, scores);
    std::copy(lanes, lanes + count, s);
  }
}

// V rows serve up to kPvQueries queries a load: 16 elements at a time, 2 accumulators per query.
constexpr int kPvQueries = 4;

// out = inv * sum_j p[j] V_j over each query's dense list (the shared rows, then its own), one fma chain
// per element in order, for T queries, 16 elements at a time.
template <int NC, int T>
static void weighted_sums(Query* const* qs, const float* const* shared_v, int64_t shared) {
  for (int i = 0; i < NC; ++i) {
    __m256 acc[T][2];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < shared; ++j) {
      if (j + kPrefetchAhead < shared) prefetch_row(shared_v[j + kPrefetchAhead] + 16 * i, 16);
      const __m256 v0 = _mm256_loadu_ps(shared_v[j] + 16 * i), v1 = _mm256_loadu_ps(shared_v[j] + 16 * i + 8);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const __m256 w = _mm256_set1_ps(qs[t]->p[j]);
        acc[t][0] = _mm256_fmadd_ps(w, v0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w, v1, acc[t][1]);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {  // each query's own columns continue its chains (unrolled: acc stays in registers)
      const Query& query = *qs[t];
      const std::vector<const float*>& own_v = query.own->v;
      for (size_t j = 0; j < own_v.size(); ++j) {
        const __m256 w = _mm256_set1_ps(query.p[shared + j]);
        acc[t][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(own_v[j] + 16 * i), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(own_v[j] + 16 * i + 8), acc[t][1]);
      }
      const __m256 inv = _mm256_set1_ps(query.inv);
      _mm256_storeu_ps(query.out + 16 * i, _mm256_mul_ps(acc[t][0], inv));
      _mm256_storeu_ps(query.out + 16 * i + 8, _mm256_mul_ps(acc[t][1], inv));
    }
  }
}

// A unit's attention: its queries score the shared columns 8 at a time (a block's K rows read from memory
// once, then from L1 for the other queries), then their own; softmax; weighted sums of V in tiles of
// queries.
template <int NC>
static void run_unit(const Unit& u, const Request& req, const float* qp, int64_t q_row_stride, int64_t num_heads,
                     const Pool& pool, const int64_t* kv_slots, int64_t shared,
                     const std::vector<SlotSpan>& own_slots, float scale, float* op, UnitWork& w) {
  gather_unit(u, req, qp, q_row_stride, num_heads, pool, kv_slots, shared, own_slots, op, w);
  const int64_t queries = static_cast<int64_t>(w.qs.size());
  const int64_t stride = (shared + w.longest + 7) / 8 * 8;  // softmax_in_place reads whole 8-float blocks
  std::vector<float>& s = w.scores;  // every entry a query reads is written below first
  s.resize(queries * stride);
  for (int64_t j = 0; j < shared; j += 8) {
    const int64_t count = std::min<int64_t>(8, shared - j);
    for (int64_t c = j + 8; c < std::min<int64_t>(j + 16, shared); ++c) prefetch_row(w.shared_k[c], 16 * NC);
    for (int64_t t = 0; t < queries; ++t) score_block<NC>(w.qs[t].q, w.shared_k.data() + j, count, scale, s.data() + t * stride + j);
  }
  for (int64_t t = 0; t < queries; ++t) {
    Query& query = w.qs[t];
    float* st = s.data() + t * stride;
    const std::vector<const float*>& own_k = query.own->k;
    const int64_t own = static_cast<int64_t>(own_k.size()), n = shared + own;
    for (int64_t j = 0; j < own; j += 8)
      score_block<NC>(query.q, own_k.data() + j, std::min<int64_t>(8, own - j), scale, st + shared + j);
    std::fill(st + n, st + (n + 7) / 8 * 8, -std::numeric_limits<float>::infinity());
    query.inv = softmax_in_place(st, n);
    query.p = st;
  }
  std::vector<Query*>& order = w.order;
  order.resize(queries);
  for (int64_t t = 0; t < queries; ++t) order[t] = &w.qs[t];
  for (int64_t t0 = 0; t0 < queries; t0 += kPvQueries)
    with_tile<kPvQueries>(queries - t0, [&](auto tile) {
      weighted_sums<NC, decltype(tile)::value>(order.data() + t0, w.shared_v.data(), shared);
    });
}

}  // namespace attention_avx2
