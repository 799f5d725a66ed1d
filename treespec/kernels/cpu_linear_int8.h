// Block-quant matmul with int8 activations (`--block-quant-activations int8`), included once by
// cpu_linear.cpp after the block-quant layout (pack_quant) and its constants.
//
// What it computes. Each input row is quantized per block of 32 k, as llama.cpp does for its quantized
// dot products: d = max|x| / 127, q = round(x / d) in [-127, 127] (int8), and s = d * sum(q). Against a
// weight block w = scale * code + min (per column):
//     sum_k x_k w_k  ~  sum_k d q_k (scale code_k + min)  =  (scale * d) * sum_k q_k code_k  +  min * s
// The inner sum is an exact integer (|.| < 2^21), so every ISA gets it alike whatever its order; per
// block and column the output then takes two fmas in a fixed order:
//     acc = fma(scale * d, float(isum), acc);  acc = fma(min, s, acc)
// Results are therefore the same bits on the AVX2 and the AVX-512 VNNI code, and a row's result does
// not depend on the other rows of the batch (a verify row equals a decode row, bit for bit). They are
// NOT the fp32 kernel's bits: int8 activations change the numerics (see docs/cpu_kernels.md).
//
// Why: an fp32 verify row costs one fma per weight; here 64 multiply-adds are one vpdpbusd (AVX-512
// VNNI), so a tree verify's extra rows and a prefill's cost a fraction of what they did.
//
// Quantized rows (quantize_rows): per row, per block, 32 int8 q in the order the codes' words hold k.
// 8-bit codes: a word holds 4 consecutive k, the first in the low byte: q in natural order. 4-bit codes:
// a word holds 8 consecutive k as nibbles; masking the low nibbles gives bytes (k0, k2, k4, k6), the
// high nibbles (k1, k3, k5, k7): so each 8 k are stored as q0 q2 q4 q6 q1 q3 q5 q7.

constexpr float kInt8Max = 127.0f;

// Per row and block of 32 k: q (permuted for `bits`-bit codes, see above), d and s. One AVX2 code for
// every host (IEEE fp32, no fast-math: max of |x|, one division, x * (1 / d) rounded to nearest even),
// so every ISA's tiles see the same q, d and s. Per row in three passes: every block's max |x|, then
// their d and 1 / d eight blocks a vector (the same IEEE divisions as one block at a time, but off each
// block's chain of dependent operations: 1.7x faster on Zen 4), then the quantizing.
static void quantize_rows(const float* x, int64_t rows, int64_t k_dim, int64_t bits, int8_t* q, float* d, float* s) {
  const int64_t blocks = k_dim / kQuantBlock, padded = (blocks + 7) / 8 * 8;
  const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(kInt8Max), neg_lim = _mm256_set1_ps(-kInt8Max);
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  // 4-bit codes: each 8 k as evens then odds; packs_epi32 / packs_epi16 interleave 128-bit lanes, undone last
  const __m256i nibble_order = bits == 4 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7) : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  std::vector<float> inverse(padded);  // per block of the row: max |x|, then 1 / d
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = x + m * k_dim;
    float* dm = d + m * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xm + b * kQuantBlock;
      __m256 amax = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
      for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
      // the largest lane by shuffles (a max is exact in any order)
      __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
      top4 = _mm_max_ss(top4, _mm_movehdup_ps(top4));
      inverse[b] = _mm_cvtss_f32(top4);
    }
    for (int64_t b = blocks; b < padded; ++b) inverse[b] = 0.0f;
    for (int64_t b = 0; b < padded; b += 8) {
      const __m256 scale = _mm256_div_ps(_mm256_loadu_ps(inverse.data() + b), lim);
      const __m256 nonzero = _mm256_cmp_ps(scale, zero, _CMP_NEQ_UQ);  // an all-zero block: 1 / d taken as 0 (NaN stays NaN)
      _mm256_storeu_ps(inverse.data() + b, _mm256_and_ps(nonzero, _mm256_div_ps(one, scale)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, scale);
      for (int64_t i = 0; i < 8 && b + i < blocks; ++i) dm[b + i] = lanes[i];
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xm + b * kQuantBlock;
      const __m256 inv = _mm256_set1_ps(inverse[b]);
      __m256i qi[4];
      __m256i sum = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(lim, _mm256_max_ps(neg_lim, r)));
        sum = _mm256_add_epi32(sum, qi[i]);
        qi[i] = _mm256_permutevar8x32_epi32(qi[i], nibble_order);
      }
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), lane_order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * k_dim + b * kQuantBlock), bytes);
      __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));  // exact
      sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(1, 0, 3, 2)));
      sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(2, 3, 0, 1)));
      s[m * blocks + b] = dm[b] * static_cast<float>(_mm_cvtsi128_si32(sum4));
    }
  }
}

// 4 int8 q as one 32-bit word, for a broadcast to every lane
static inline int32_t quad(const int8_t* q) {
  int32_t word;
  std::memcpy(&word, q, 4);
  return word;
}

// The int8 tiles for one ISA: cpu_linear_int8_tiles.h, included into each namespace below after its
// vector types and ops (the same pattern as cpu_linear_quant.h).

// AVX2: 16 lanes as two ymm. Without VNNI a 4-lane dot is maddubs (u8 x s8 -> pairs summed in int16)
// then madd with ones (-> int32). The int16 partial sums stay exact: a 4-bit code block adds 16
// products per int16 lane, at most 16 * 15 * 127 = 30480 < 32767; 8-bit codes are split into their
// two nibbles (code = 16 * high + low), each summed the same way.
namespace int8_avx2 {
// the fp32 lanes, code words and their ops of the fp32-activation tiles (cpu_linear.cpp's quant_avx2)
using quant_avx2::V, quant_avx2::VI, quant_avx2::vbroadcast, quant_avx2::vfma, quant_avx2::vhalf,
    quant_avx2::vscale, quant_avx2::vstore, quant_avx2::vwords, quant_avx2::vzero;
struct Dot {  // int16 pair sums of the low (and, 8-bit codes, high) nibbles
  __m256i low_lo, low_hi, high_lo, high_hi;
};
constexpr int kRowTile = 2;
// never unpack 4-bit codes (group_rows): this ISA's 8-bit dot splits the bytes into nibbles again
constexpr int64_t kUnpackMinRows = std::numeric_limits<int64_t>::max();
static inline Dot dot_zero() {
  const __m256i z = _mm256_setzero_si256();
  return {z, z, z, z};
}
static inline __m256i bq(const int8_t* q) { return _mm256_set1_epi32(quad(q)); }
template <int BITS>
static inline void dot_add(Dot& dot, VI w, const int8_t* q) {
  const __m256i nib = _mm256_set1_epi32(0x0F0F0F0F);
  if constexpr (BITS == 4) {  // low nibbles are k 0, 2, 4, 6 (q[0..3]); high nibbles k 1, 3, 5, 7 (q[4..7])
    const __m256i q_even = bq(q), q_odd = bq(q + 4);
    dot.low_lo = _mm256_add_epi16(dot.low_lo, _mm256_maddubs_epi16(_mm256_and_si256(w.lo, nib), q_even));
    dot.low_hi = _mm256_add_epi16(dot.low_hi, _mm256_maddubs_epi16(_mm256_and_si256(w.hi, nib), q_even));
    dot.low_lo = _mm256_add_epi16(dot.low_lo, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi32(w.lo, 4), nib), q_odd));
    dot.low_hi = _mm256_add_epi16(dot.low_hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi32(w.hi, 4), nib), q_odd));
  } else {  // 8-bit codes: 4 consecutive k a word; the nibbles summed apart (code = 16 high + low)
    const __m256i qv = bq(q);
    dot.low_lo = _mm256_add_epi16(dot.low_lo, _mm256_maddubs_epi16(_mm256_and_si256(w.lo, nib), qv));
    dot.low_hi = _mm256_add_epi16(dot.low_hi, _mm256_maddubs_epi16(_mm256_and_si256(w.hi, nib), qv));
    dot.high_lo = _mm256_add_epi16(dot.high_lo, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi32(w.lo, 4), nib), qv));
    dot.high_hi = _mm256_add_epi16(dot.high_hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi32(w.hi, 4), nib), qv));
  }
}
template <int BITS>
static inline V dot_float(const Dot& dot) {  // int16 pairs -> int32 lanes (x16 for high nibbles) -> fp32
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4)
    return {_mm256_cvtepi32_ps(_mm256_madd_epi16(dot.low_lo, ones)), _mm256_cvtepi32_ps(_mm256_madd_epi16(dot.low_hi, ones))};
  const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(dot.low_lo, ones),
                                      _mm256_slli_epi32(_mm256_madd_epi16(dot.high_lo, ones), 4));
  const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(dot.low_hi, ones),
                                      _mm256_slli_epi32(_mm256_madd_epi16(dot.high_hi, ones), 4));
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
}
#include "cpu_linear_int8_tiles.h"
}  // namespace int8_avx2

// AVX-512 VNNI: one vpdpbusd is 16 lanes x 4 u8 x s8 products added into int32, exact.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace int8_avx512 {
// the fp32 lanes, code words and their ops of the fp32-activation tiles (cpu_linear.cpp's quant_avx512;
// its target is a subset of this one's, so they inline here)
using quant_avx512::V, quant_avx512::VI, quant_avx512::vbroadcast, quant_avx512::vfma, quant_avx512::vhalf,
    quant_avx512::vscale, quant_avx512::vstore, quant_avx512::vwords, quant_avx512::vzero;
struct Dot {  // one chain: a tile's 8+ independent entries cover vpdpbusd's latency
  __m512i v;
};
constexpr int kRowTile = 8;  // 8 rows x 2 panels: 16 integer sums in registers beside the codes
// From this many rows group_rows rewrites a group's 4-bit codes as bytes once for all its tiles: one
// vpdpbusd a word either way, without the tiles' nibble masks and shifts (~10 % of their ops). The
// rewrite runs before the tiles, not under the codes' streaming, so it pays only where the tiles are
// compute-bound for long (the default model's layers: 12-32 rows 3-25 % slower, 48 even, 96 rows 15-20 %
// faster, a 208-token prefill 117 -> 98 ms).
constexpr int64_t kUnpackMinRows = 48;
static inline Dot dot_zero() { return {_mm512_setzero_si512()}; }
static inline __m512i bq(const int8_t* q) { return _mm512_set1_epi32(quad(q)); }
template <int BITS>
static inline void dot_add(Dot& dot, VI w, const int8_t* q) {
  if constexpr (BITS == 4) {  // low nibbles: k 0, 2, 4, 6 (q[0..3]); high nibbles: k 1, 3, 5, 7 (q[4..7])
    const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
    dot.v = _mm512_dpbusd_epi32(dot.v, _mm512_and_si512(w.v, nib), bq(q));
    dot.v = _mm512_dpbusd_epi32(dot.v, _mm512_and_si512(_mm512_srli_epi32(w.v, 4), nib), bq(q + 4));
  } else {  // codes are bytes already
    dot.v = _mm512_dpbusd_epi32(dot.v, w.v, bq(q));
  }
}
template <int BITS>
static inline V dot_float(const Dot& dot) { return {_mm512_cvtepi32_ps(dot.v)}; }
#include "cpu_linear_int8_tiles.h"
}  // namespace int8_avx512
#pragma GCC pop_options
