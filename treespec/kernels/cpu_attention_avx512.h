// AVX-512 paged attention for requests with few query rows: the arithmetic of cpu_attention.cpp's
// per-(row, head) code, bit for bit, with the work shared between the queries of one KV head.
//
// Why: the per-(row, head) code reduces each q.k dot to a scalar on its own (a horizontal sum per
// column) and reads every K and V row once per query; a tree verify of 9 rows at 250 cached tokens
// cost ~90 us a layer. Here a unit of work is the queries (rows x heads) of one request that share a
// KV head: K rows are read once per 16-column block while every query of the unit scores against it,
// the 16 dots of a block are reduced together by one shuffle tree, and a V row serves several queries a load.
//
// Same bits as the AVX2 code, element by element:
// - a dot q.k over head_dim (a multiple of 16, at most 128) is, per lane l of 16, one fma chain over the 16-float
//   chunks in order (the AVX2 code's two 8-lane chains are lanes 0-7 and 8-15 of it), then lanes are
//   summed l + (l+8), then + (l+4), + (l+2), + (l+1): hsum(acc0 + acc1) in cpu_attention.cpp;
// - softmax is cpu_attention.cpp's `softmax_in_place` (its exps 16 at a time: elementwise, same bits);
// - each output element is one fma chain over the row's visible columns in order (any vector width
//   computes each element alone).
// Every query still attends to its own dense list of visible columns (the shared prefix first, then its
// own visible columns after it), so a tree-verify row equals the decode of its path, as before.
// Included by cpu_attention.cpp after Pool, Request, Unit, SlotSpan, UnitWork, with_tile, prefetch_row and softmax_in_place.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace attention_avx512 {

// [x.lo + x.hi, y.lo + y.hi]: lane l + lane l+8 of two columns' partial sums
static inline __m512 add_halves(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
}
// two add_halves results (4 columns, one per 128-bit quarter): lane l + lane l+4 of each column
static inline __m512 add_quarters(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
// per 128-bit lane [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
static inline __m512 add_pairs(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
// per 128-bit lane [x0 + x1, x2 + x3, y0 + y1, y2 + y3]
static inline __m512 add_neighbours(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The 16 columns' lane sums, column c in lane c. Column c lands in quarter c / 4 at position c % 4: the
// inputs are grouped so (tracking the shuffles above) it comes out in order.
static inline __m512 reduce16(const __m512* a) {
  const __m512 u0 = add_quarters(add_halves(a[0], a[4]), add_halves(a[8], a[12]));
  const __m512 u1 = add_quarters(add_halves(a[1], a[5]), add_halves(a[9], a[13]));
  const __m512 u2 = add_quarters(add_halves(a[2], a[6]), add_halves(a[10], a[14]));
  const __m512 u3 = add_quarters(add_halves(a[3], a[7]), add_halves(a[11], a[15]));
  return add_neighbours(add_pairs(u0, u1), add_pairs(u2, u3));
}

// exp256 (avx2_math.h) on 16 floats, operation by operation: the same bits per element.
static inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3365447504f);
  const __mmask16 valid = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647f)), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(valid, _mm512_mul_ps(p, _mm512_castsi512_ps(pow2n)));
}

// softmax_in_place (cpu_attention.cpp) with its exps 16 at a time, for N queries at once: query t's
// scores s[t] over n[t] columns, 1 / their sum in inv[t]. Each query takes the same max, the same exps
// and the same 8-lane running sum in the same order as alone, so the same bits; the N queries' chains
// of dependent steps interleave, where one query at a time waited on each of its own (a prefill's
// queries see ~100 columns: their softmax was mostly those waits).
template <int N>
static inline void softmax_rows_zmm(float* const* s, const int64_t* n, float* inv) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int64_t padded[N], whole[N], longest = 0;  // whole: where the 16-float blocks end
  __m512 mv[N];
#pragma GCC unroll 4
  for (int t = 0; t < N; ++t) {
    padded[t] = (n[t] + 7) / 8 * 8;
    whole[t] = padded[t] / 16 * 16;
    longest = std::max(longest, whole[t]);
    mv[t] = _mm512_set1_ps(kNegInf);
  }
  for (int64_t j = 0; j < longest; j += 16) {
#pragma GCC unroll 4
    for (int t = 0; t < N; ++t)
      if (j < whole[t]) mv[t] = _mm512_max_ps(mv[t], _mm512_loadu_ps(s[t] + j));
  }
  __m512 mb[N];
  __m256 sum[N];
#pragma GCC unroll 4
  for (int t = 0; t < N; ++t) {
    float m = _mm512_reduce_max_ps(mv[t]);
    for (int64_t j = whole[t]; j < padded[t]; ++j) m = std::max(m, s[t][j]);
    if (n[t] == 0) m = 0.f;
    mb[t] = _mm512_set1_ps(m);
    sum[t] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < longest; j += 16) {
#pragma GCC unroll 4
    for (int t = 0; t < N; ++t) {
      if (j >= whole[t]) continue;
      const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(s[t] + j), mb[t]));
      _mm512_storeu_ps(s[t] + j, p);
      sum[t] = _mm256_add_ps(sum[t], _mm512_castps512_ps256(p));
      sum[t] = _mm256_add_ps(sum[t], _mm512_extractf32x8_ps(p, 1));
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < N; ++t) {
    if (whole[t] < padded[t]) {  // one block of 8 left
      const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s[t] + whole[t]), _mm512_castps512_ps256(mb[t])));
      _mm256_storeu_ps(s[t] + whole[t], p);
      sum[t] = _mm256_add_ps(sum[t], p);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < N; ++t) {
    const float denom = hsum(sum[t]);
    inv[t] = denom > 0.f ? 1.f / denom : 0.f;
  }
}

// s[c] = (q . K_c) * scale for the K rows rows[c], c < count <= 16 (columns past count are not stored).
// q: the query's 16 * NC floats. A column's score depends on q and its K row alone.
template <int NC, bool kFull>
static inline void score_block(const float* query, const float* const* rows, int64_t count, float scale, float* s) {
  __m512 q[NC], acc[16];
#pragma GCC unroll 8
  for (int i = 0; i < NC; ++i) q[i] = _mm512_loadu_ps(query + 16 * i);
#pragma GCC unroll 16
  for (int c = 0; c < 16; ++c) {
    acc[c] = _mm512_setzero_ps();
    if (kFull || c < count) {
      const float* k = rows[c];
#pragma GCC unroll 8
      for (int i = 0; i < NC; ++i) acc[c] = _mm512_fmadd_ps(q[i], _mm512_loadu_ps(k + 16 * i), acc[c]);
    }
  }
  const __m512 scores = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s, kFull ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1), scores);
}

// Two queries against the same up-to-8 K rows rows[c], c < count: s0[c] and s1[c] as score_block
// computes them (each (query, column) one fma chain over the chunks, then the same per-column lane
// tree: reduce16 sums each input alone, so which 16 (query, column) pairs share a call does not
// matter). A K row loaded once serves both queries: half score_block's loads per score.
template <int NC>
static inline void score_pair(const float* query0, const float* query1, const float* const* rows, int64_t count,
                              float scale, float* s0, float* s1) {
  __m512 q0[NC], q1[NC], acc[16];
#pragma GCC unroll 8
  for (int i = 0; i < NC; ++i) {
    q0[i] = _mm512_loadu_ps(query0 + 16 * i);
    q1[i] = _mm512_loadu_ps(query1 + 16 * i);
  }
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    acc[c] = _mm512_setzero_ps();
    acc[8 + c] = _mm512_setzero_ps();
    if (c < count) {
      const float* k = rows[c];
#pragma GCC unroll 8
      for (int i = 0; i < NC; ++i) {
        const __m512 kc = _mm512_loadu_ps(k + 16 * i);
        acc[c] = _mm512_fmadd_ps(q0[i], kc, acc[c]);
        acc[8 + c] = _mm512_fmadd_ps(q1[i], kc, acc[8 + c]);
      }
    }
  }
  const __m512 scores = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  const __mmask16 keep = count >= 8 ? __mmask16(0xFF) : __mmask16((1u << count) - 1);
  _mm512_mask_storeu_ps(s0, keep, scores);
  _mm512_mask_storeu_ps(s1 - 8, __mmask16(keep << 8), scores);
}

template <int NC>
static inline void score_columns(const float* q, const float* const* rows, int64_t n, float scale, float* s) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) score_block<NC, true>(q, rows + j, 16, scale, s + j);
  if (j < n) score_block<NC, false>(q, rows + j, n - j, scale, s + j);
}

// V rows serve T queries at a time, all NC chunks of each in registers: T * NC <= kPvRegisters.
constexpr int kPvRegisters = 24;

// out = inv * sum_j p[j] V_j over each query's dense list, in order (one fma chain per element).
template <int NC, int T>
static void weighted_sums(Query* const* qs, const float* const* shared_v, int64_t shared) {
  __m512 acc[T][NC];
  const float* p[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    p[t] = qs[t]->p;
#pragma GCC unroll 8
    for (int i = 0; i < NC; ++i) acc[t][i] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < shared; ++j) {
    if (j + kPrefetchAhead < shared) prefetch_row(shared_v[j + kPrefetchAhead], 16 * NC);
    __m512 v[NC];
#pragma GCC unroll 8
    for (int i = 0; i < NC; ++i) v[i] = _mm512_loadu_ps(shared_v[j] + 16 * i);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512 w = _mm512_set1_ps(p[t][j]);
#pragma GCC unroll 8
      for (int i = 0; i < NC; ++i) acc[t][i] = _mm512_fmadd_ps(w, v[i], acc[t][i]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {  // each query's own columns continue its chains
    const Query& query = *qs[t];
    const float* own_p = query.p + shared;
    const std::vector<const float*>& own_v = query.own->v;
    for (size_t j = 0; j < own_v.size(); ++j) {
      const __m512 w = _mm512_set1_ps(own_p[j]);
#pragma GCC unroll 8
      for (int i = 0; i < NC; ++i) acc[t][i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(own_v[j] + 16 * i), acc[t][i]);
    }
    const __m512 inv = _mm512_set1_ps(query.inv);
#pragma GCC unroll 8
    for (int i = 0; i < NC; ++i) _mm512_storeu_ps(query.out + 16 * i, _mm512_mul_ps(acc[t][i], inv));
  }
}

// A unit's attention: its queries score the shared columns block by block (a block's K rows read from
// memory once, then from L1 for the other queries), then their own; softmax; weighted sums of V in
// tiles of queries.
template <int NC>
static void run_unit(const Unit& u, const Request& req, const float* qp, int64_t q_row_stride, int64_t num_heads,
                     const Pool& pool, const int64_t* kv_slots, int64_t shared,
                     const std::vector<SlotSpan>& own_slots, float scale, float* op, UnitWork& w) {
  gather_unit(u, req, qp, q_row_stride, num_heads, pool, kv_slots, shared, own_slots, op, w);
  std::vector<Query>& qs = w.qs;
  const std::vector<const float*>&shared_k = w.shared_k, &shared_v = w.shared_v;
  const int64_t longest = w.longest;
  const int64_t queries = static_cast<int64_t>(qs.size());
  const int64_t stride = (shared + longest + 7) / 8 * 8;  // softmax_in_place reads whole 8-float blocks
  std::vector<float>& s = w.scores;  // every entry a query reads is written below first
  s.resize(queries * stride);
  for (int64_t j = 0; j < shared; j += 16) {
    const int64_t count = std::min<int64_t>(16, shared - j);
    for (int64_t c = j + 16; c < std::min<int64_t>(j + 32, shared); ++c) prefetch_row(shared_k[c], 16 * NC);
    int64_t t = 0;
    if constexpr (NC <= 4) {  // pairs of queries while their q and 16 sums fit the registers
      for (; t + 2 <= queries; t += 2) {
        float *s0 = s.data() + t * stride + j, *s1 = s0 + stride;
        score_pair<NC>(qs[t].q, qs[t + 1].q, shared_k.data() + j, count, scale, s0, s1);
        if (count > 8) score_pair<NC>(qs[t].q, qs[t + 1].q, shared_k.data() + j + 8, count - 8, scale, s0 + 8, s1 + 8);
      }
    }
    for (; t < queries; ++t) {
      float* st = s.data() + t * stride + j;
      if (count == 16) score_block<NC, true>(qs[t].q, shared_k.data() + j, 16, scale, st);
      else score_block<NC, false>(qs[t].q, shared_k.data() + j, count, scale, st);
    }
  }
  std::vector<int64_t>& lengths = w.lengths;
  std::vector<float*>& rows = w.score_rows;
  lengths.resize(queries);
  rows.resize(queries);
  for (int64_t t = 0; t < queries; ++t) {
    Query& query = qs[t];
    float* st = s.data() + t * stride;
    const std::vector<const float*>& own_k = query.own->k;
    const int64_t n = shared + static_cast<int64_t>(own_k.size());
    score_columns<NC>(query.q, own_k.data(), static_cast<int64_t>(own_k.size()), scale, st + shared);
    std::fill(st + n, st + (n + 7) / 8 * 8, -std::numeric_limits<float>::infinity());
    lengths[t] = n;
    rows[t] = st;
    query.p = st;
  }
  constexpr int kSoftmaxRows = 4;  // queries whose softmax chains interleave
  float inv[kSoftmaxRows];
  for (int64_t t0 = 0; t0 < queries; t0 += kSoftmaxRows)
    with_tile<kSoftmaxRows>(queries - t0, [&](auto tile) {
      constexpr int T = decltype(tile)::value;
      softmax_rows_zmm<T>(rows.data() + t0, lengths.data() + t0, inv);
      for (int t = 0; t < T; ++t) qs[t0 + t].inv = inv[t];
    });
  std::vector<Query*>& order = w.order;
  order.resize(queries);
  for (int64_t t = 0; t < queries; ++t) order[t] = &qs[t];
  constexpr int64_t kTile = kPvRegisters / NC;
  for (int64_t t0 = 0; t0 < queries; t0 += kTile)
    with_tile<kTile>(queries - t0, [&](auto tile) {
      weighted_sums<NC, decltype(tile)::value>(order.data() + t0, shared_v.data(), shared);
    });
}

}  // namespace attention_avx512
#pragma GCC pop_options
