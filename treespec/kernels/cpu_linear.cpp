// Linear layer for CPU decoding: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), AVX2 + FMA, fp32 or bf16.
//
// Weights are repacked once into panels of 16 output columns, [ceil(N/16), K, 16], so one panel
// streams contiguously from memory and each k step is one or two vector loads. A batch-1 decode reads
// every weight once per step, so how fast panels stream is the step time; the input rows (a few KB)
// stay in L1. bf16 weights are widened to fp32 in registers (a shift), so they stream at half the
// bytes; inputs are taken in fp32, products accumulate in fp32, outputs round once to the input's
// dtype (what F.linear does; fp32 inputs against bf16 panels give fp32 outputs). Every output element
// is one fused multiply-add chain over k in order, whatever the number of rows or how they are tiled:
// a row's result does not depend on what else is in the batch, so a tree verify computes bit for bit
// what a decode step would.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

constexpr int64_t kPanel = 16;  // output columns per panel: two ymm registers
constexpr int64_t kRowBlock = 96;  // input rows per pass: a pass's rows stay in L2 while panels stream

static bool supported(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
}

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && supported(w), "pack: expected a 2-D fp32 or bf16 weight");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// 16 consecutive weights of a panel row, as two fp32 vectors
static inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
static inline void load16(const at::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}

// Software prefetch of the panel stream this many bytes ahead, as the block-quant tiles do
// (kPrefetchBlocks): on the Intel VM the hardware prefetcher alone streamed the draft head's bf16
// panels slowly. A prefetch never faults, even past an allocation's end.
constexpr int64_t kPanelPrefetchBytes = 2560;

// ROWS input rows against one panel; ROWS <= 6 keeps 2*ROWS accumulators + 2 weight vectors in 16 ymm.
// W: the panel's weight type; O: the output's (and bias's) type.
template <int ROWS, typename W, typename O>
static inline void panel_kernel(const float* x, int64_t k_dim, const W* panel, O* y, int64_t ldy, const O* bias,
                                int64_t cols) {
  __m256 lo[ROWS], hi[ROWS];
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  constexpr int64_t kPerLine = 64 / (sizeof(W) * kPanel);  // panel rows per cache line: 1 (fp32), 2 (bf16)
  constexpr int64_t kAhead = kPanelPrefetchBytes / (sizeof(W) * kPanel);
  for (int64_t k = 0; k < k_dim; ++k) {
    // on past the panel's end into the next panel (and weight): see kPanelPrefetchBytes
    if (k % kPerLine == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_T0);
    __m256 w0, w1;
    load16(panel + k * kPanel, w0, w1);
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * k_dim + k);
      lo[m] = _mm256_fmadd_ps(xv, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, w1, hi[m]);
    }
  }
  alignas(32) float out[kPanel];
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) {
    _mm256_store_ps(out, lo[m]);
    _mm256_store_ps(out + 8, hi[m]);
    for (int64_t c = 0; c < cols; ++c)  // O(float) rounds to nearest even for bf16
      y[m * ldy + c] = bias ? O(out[c] + static_cast<float>(bias[c])) : O(out[c]);
  }
}

// The row-count dispatch of a tiled kernel: tile(integral_constant<MAX>, m) for every MAX rows from
// m = 0, then tile(integral_constant<R>, m) once for the R < MAX rows left, so each row count runs
// its own compile-time tile.
template <int R, typename Tile>
static inline void remainder_tile(int64_t left, int64_t m, Tile& tile) {
  if constexpr (R > 0) {
    if (left == R) tile(std::integral_constant<int, R>{}, m);
    else remainder_tile<R - 1>(left, m, tile);
  }
}
template <int MAX, typename Tile>
static inline void tile_rows(int64_t rows, Tile&& tile) {
  int64_t m = 0;
  for (; m + MAX <= rows; m += MAX) tile(std::integral_constant<int, MAX>{}, m);
  remainder_tile<MAX - 1>(rows - m, m, tile);
}

template <typename W, typename O>
static void panel_rows(const float* x, int64_t rows, int64_t k_dim, const W* panel, O* y, int64_t ldy,
                       const O* bias, int64_t cols) {
  tile_rows<6>(rows, [&](auto n, int64_t m) {
    panel_kernel<decltype(n)::value>(x + m * k_dim, k_dim, panel, y + m * ldy, ldy, bias, cols);
  });
}

template <typename W, typename O>
static void run(const float* x, int64_t rows, int64_t k_dim, const W* wp, int64_t panels, const O* bp, O* yp,
                int64_t n) {
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - m0);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        panel_rows(x + m0 * k_dim, block, k_dim, wp + p * k_dim * kPanel, yp + m0 * n + p * kPanel, n,
                   bp ? bp + p * kPanel : nullptr, std::min(kPanel, n - p * kPanel));
    });
  }
}

// x fp32 or of the panels' dtype. bf16 panels with an fp32 x compute in fp32 throughout and return fp32:
// for fp32 weights whose values are all bf16 (a bf16 checkpoint run in fp32), the same results as fp32
// panels, at half the bytes.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && supported(x) && supported(packed) &&
              (x.scalar_type() == packed.scalar_type() || x.scalar_type() == torch::kFloat32),
              "linear: expected a contiguous 2-D fp32 input, or bf16 for bf16 panels");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
              packed.size(0) * kPanel >= n, "linear: packed weight does not match the input or n");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "linear: bias must be contiguous, of size n and of the input's dtype");
  const int64_t rows = x.size(0), k_dim = x.size(1), panels = packed.size(0);
  auto out = torch::empty({rows, n}, x.options());
  const auto x32 = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  const float* xp = x32.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  if (packed.scalar_type() == torch::kFloat32) {
    run(xp, rows, k_dim, packed.data_ptr<float>(), panels, bias ? bias->data_ptr<float>() : nullptr,
        out.data_ptr<float>(), n);
  } else if (x.scalar_type() == torch::kFloat32) {
    run(xp, rows, k_dim, packed.data_ptr<at::BFloat16>(), panels, bias ? bias->data_ptr<float>() : nullptr,
        out.data_ptr<float>(), n);
  } else {
    run(xp, rows, k_dim, packed.data_ptr<at::BFloat16>(), panels,
        bias ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(), n);
  }
  return out;
}

// --- Block-quantized fp32 weights ------------------------------------------------------------------
// GGUF's Q4_0/Q4_1/Q8_0 weights are w = scale * code + min per block of 32 consecutive k, with an
// integer code and fp16 scale and min. Stored that way a panel streams 0.56 (4-bit codes, two per
// byte) or 1.06 (8-bit codes) bytes per weight instead of 4. Each weight is rebuilt in registers with
// one fma: scale * code is exact in fp32 (11 + 8 significant bits), so fma(scale, code, min) rounds
// once, to the very fp32 value that dequantizing to fp32 gives; the fma chain over k is then
// `linear`'s, so results are bit for bit those of `linear` over the dequantized weight.
constexpr int64_t kQuantBlock = 32;
constexpr int64_t kGroupPanels = 2;  // panels per group: a thread's share of the columns is whole groups
constexpr int64_t kGroupCols = kGroupPanels * kPanel;  // code bytes per k step (8-bit) or k pair (4-bit)
constexpr int64_t kQuantHeader = kGroupPanels * kPanel * 2 * 2;  // per group and block: fp16 scales + mins
// Each output's fma chain over k is serial; a tile of ROWS x PANELS keeps up to 4 16-column chains in
// flight, and verify rows share each rebuilt weight (cpu_linear_quant.h's quant_rows).
constexpr int kQuantChains = 4;  // panels per chunk, rows per verify tile
constexpr int kFloatTwo23Bits = 0x4B000000;  // 2^23 as fp32: ORing an integer below 2^23 into it adds it
constexpr float kFloatTwo23 = 8388608.0f;
// A block-quant tile's epilogue: its ROWS x PANELS spilled 16-column accumulators `out` into y (row
// stride ldy), plus the bias, the columns past `cols_left` (the weight's padding) left out.
template <int ROWS, int PANELS>
static inline void write_tile(const float (*out)[kPanel], float* y, int64_t ldy, const float* bias, int64_t cols_left) {
  for (int m = 0; m < ROWS; ++m) {
    for (int j = 0; j < PANELS; ++j) {
      const int64_t cols = std::min(kPanel, cols_left - j * kPanel);
      const float* bj = bias ? bias + j * kPanel : nullptr;
      const float* o = out[m * PANELS + j];
      float* yr = y + m * ldy + j * kPanel;
      if (cols == kPanel) {  // a whole panel as vectors (the same adds); the loop below became memmove calls
        for (int64_t c = 0; c < kPanel; c += 8) {
          const __m256 v = _mm256_loadu_ps(o + c);
          _mm256_storeu_ps(yr + c, bj ? _mm256_add_ps(v, _mm256_loadu_ps(bj + c)) : v);
        }
        continue;
      }
      for (int64_t c = 0; c < cols; ++c) yr[c] = bj ? o[c] + bj[c] : o[c];
    }
  }
}

// Software prefetch of a tile's code stream this many blocks (~2.5 KB at 4 bits) ahead: on an Intel
// host (Sapphire Rapids) the hardware prefetcher alone left a 1-row decode at ~10 GB/s of a ~28 GB/s
// memory, and this took a step's matmuls 7.7 -> 6.0 ms; on Zen 4 it measured neutral. The prefetch runs
// on past the tile's group into what follows it in memory (the next group; past a weight's last group,
// the next weight, which models/weight_arena.py puts there), and a group's two panels are prefetched
// once, not twice. With the arena, plain decoding there went 137 -> 176-182 tokens/s; in one process,
// crossing beat stopping at the group's end in 2 of 2 paired runs (163 vs 153, 197 vs 155 tokens/s).
// Distance, in one process: 4 to 8 blocks alike, 2 and 3 ~5 % slower, none 1.5x slower. A prefetch
// never faults, even past an allocation's end.
constexpr int64_t kPrefetchBlocks = 4;

// The block bytes of one group (32 columns x 32 k) for `bits`-bit codes
static int64_t quant_block_bytes(int64_t bits) { return kQuantHeader + kQuantBlock * kGroupCols * bits / 8; }

// uint8 codes [N, K], fp16 scales and mins [N, K/32] -> uint8 [ceil(N/32), K/32, block bytes]: per
// group of 32 columns and block of 32 k, the fp16 scales and mins of each panel, then the codes in
// 32-bit words (cpu_linear_quant.h), 4 bits each where every code fits 4 bits, else 8.
torch::Tensor pack_quant(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8 && codes.size(1) % kQuantBlock == 0,
              "pack_quant: expected uint8 codes [N, K] with K a multiple of 32");
  const int64_t n = codes.size(0), k = codes.size(1), blocks = k / kQuantBlock;
  const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.scalar_type() == torch::kHalf && t.dim() == 2 && t.size(0) == n && t.size(1) == blocks,
                "pack_quant: expected fp16 scales and mins [N, K/32]");
  const int64_t bits = n == 0 || codes.max().item<uint8_t>() < 16 ? 4 : 8, per_word = 32 / bits;
  auto padded = torch::zeros({groups * kGroupCols, k}, codes.options());
  padded.narrow(0, 0, n).copy_(codes);
  // [group, column, block, word, code] -> [group, block, word, code, column]; then each word's codes
  // ORed into one int32, the first k in the low bits
  auto split = padded.view({groups, kGroupCols, blocks, kQuantBlock / per_word, per_word}).permute({0, 2, 3, 4, 1})
                   .to(torch::kInt64);  // no signed overflow in the shifts; the low 32 bits are the word
  auto words = torch::zeros({groups, blocks, kQuantBlock / per_word, kGroupCols}, split.options());
  for (int64_t t = 0; t < per_word; ++t) words.bitwise_or_(split.select(3, t).bitwise_left_shift(bits * t));
  words = words.to(torch::kInt32);
  auto scale_min = torch::zeros({groups * kGroupCols, blocks, 2}, scales.options());
  scale_min.narrow(0, 0, n).select(2, 0).copy_(scales);
  scale_min.narrow(0, 0, n).select(2, 1).copy_(mins);
  // [group, panel, column, block, scale|min] -> [group, block, panel, scale|min, column], as bytes
  auto header = scale_min.view({groups, kGroupPanels, kPanel, blocks, 2}).permute({0, 3, 1, 4, 2})
                    .contiguous().view(torch::kUInt8).reshape({groups, blocks, kQuantHeader});
  return torch::cat({header, words.view(torch::kUInt8).reshape({groups, blocks, -1})}, 2);
}

// 16 output columns in fp32 lanes, AVX2: two ymm registers
namespace quant_avx2 {
struct V {
  __m256 lo, hi;
};
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vbroadcast(const float* p) {
  const __m256 v = _mm256_broadcast_ss(p);
  return {v, v};
}
static inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vhalf(const uint8_t* p) {  // 16 fp16
  const auto* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
struct VI {
  __m256i lo, hi;
};
// Codes shifted down and converted: with 16 registers the in-place scales of the AVX-512 code spill,
// and the conversion measured faster here than the 2^23 trick (bench_cpu_linear, TREESPEC_CPU_QUANT_ISA=avx2)
constexpr bool kCodesInPlace = false;
constexpr int kWideRows = 0;  // no row tile past kQuantChains
// Verify tiles of 4 and 3 rows take one panel: 4 x 2 in 16 ymm registers measured mixed on the Intel
// host (3-4 rows 9-17 % faster, 8 rows 6 % slower) and was not measured on an AVX2-only host.
constexpr int kVerifyPanels = 1;
static inline VI vwords(const uint8_t* p) {  // 16 code words
  const auto* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
static inline VI vhigh16(VI w) { return {_mm256_srli_epi32(w.lo, 16), _mm256_srli_epi32(w.hi, 16)}; }
static inline VI vshift(VI w, int bits) { return {_mm256_srli_epi32(w.lo, bits), _mm256_srli_epi32(w.hi, bits)}; }
static inline __m256 code_at(__m256i w, int mask) {  // w & mask as fp32
  return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(mask)));
}
static inline V vcode(VI w, int mask) { return {code_at(w.lo, mask), code_at(w.hi, mask)}; }
static inline V vscale(V v, float f) {
  return {_mm256_mul_ps(v.lo, _mm256_set1_ps(f)), _mm256_mul_ps(v.hi, _mm256_set1_ps(f))};
}
static inline void vstore(float* p, V v) {
  _mm256_store_ps(p, v.lo);
  _mm256_store_ps(p + 8, v.hi);
}
#include "cpu_linear_quant.h"
}  // namespace quant_avx2

// The same in one zmm register, compiled for AVX-512 whatever the build flags; chosen at run time
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace quant_avx512 {
struct V {
  __m512 v;
};
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vbroadcast(const float* p) { return {_mm512_set1_ps(*p)}; }
static inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V vhalf(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
struct VI {
  __m512i v;
};
constexpr bool kCodesInPlace = true;
constexpr int kWideRows = 8;  // 8-row verify tiles: 8 accumulators beside the rebuild (12 spilled: 2x slower)
// Verify tiles of 4 and 3 rows span both panels of a group: 8 (6) fma chains in flight instead of 4 (3),
// enough to cover the fma latency on two ports, and one contiguous code stream. A step's matmuls on
// the Intel host: 3 rows 8.5 -> 6.5 ms, 4 rows 8.8 -> 7.2, 5-7 rows 11.8-14.1 -> 9.3-10.0; same bits.
constexpr int kVerifyPanels = 2;
static inline VI vwords(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
static inline VI vhigh16(VI w) { return {_mm512_srli_epi32(w.v, 16)}; }
static inline VI vshift(VI w, int bits) { return {_mm512_srli_epi32(w.v, bits)}; }
// w & mask as fp32, for a mask within the low 23 bits: ORed into the mantissa of 2^23 in one ternlog,
// then 2^23 subtracted (exact); this keeps integer-to-float conversions off the fma ports
static inline V vcode(VI w, int mask) {
  const __m512i bits = _mm512_ternarylogic_epi32(w.v, _mm512_set1_epi32(mask), _mm512_set1_epi32(kFloatTwo23Bits), 0xEA);
  return {_mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kFloatTwo23))};
}
static inline V vscale(V v, float f) { return {_mm512_mul_ps(v.v, _mm512_set1_ps(f))}; }
static inline void vstore(float* p, V v) { _mm512_store_ps(p, v.v); }
#include "cpu_linear_quant.h"
}  // namespace quant_avx512
#pragma GCC pop_options

// --- Many rows (prefill chunks, large batches): rebuild a group's weights once into fp32 panels ---------
// A block-quant tile rebuilds every weight for each 4 rows it serves: one fma per 16 weights beside
// the 4 that use them, a fifth of the fma pipe. A row block of at least kRebuiltRows rows instead
// rebuilds a group's two panels (every k) into fp32 scratch once and runs the fp32 panel kernel over
// it (6-row ymm tiles; on AVX-512 hosts 12-row zmm tiles over both panels, from kRebuiltRowsAvx512
// rows): the same fp32 weights (fma(scale, code, min), rounded once) and the same fma chains over k in
// order, so the same bits as the quant tiles and as `linear` on the dequantized weight.
constexpr int64_t kRebuiltRows = 32;
// With the zmm tile (fp32_avx512) the rebuilt path wins from ~20 rows (bench_cpu_linear, Sapphire Rapids:
// 24 rows 32 vs 37 ms a step's matmuls, 16 rows 28 vs 26)
constexpr int64_t kRebuiltRowsAvx512 = 20;

// The fp32 [k_dim, 16] panels of group `group` (both of them; panels past the weight's last are
// zeros' rebuilds and never read back). AVX2: 8 columns a vector, each weight fma(scale, code, min) as
// in the tiles, so the same fp32 values.
template <int BITS>
static void rebuild_group(const uint8_t* data, int64_t group, int64_t k_dim, int64_t block_bytes, float* panels) {
  constexpr int kPerWord = 32 / BITS;
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const int64_t blocks = k_dim / kQuantBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = data + (group * blocks + b) * block_bytes;
    for (int64_t h = 0; h < kGroupPanels; ++h) {
      const auto* header = reinterpret_cast<const __m128i*>(block + h * kPanel * 4);  // 16 scales, 16 mins
      const __m256 scale[2] = {_mm256_cvtph_ps(_mm_loadu_si128(header)), _mm256_cvtph_ps(_mm_loadu_si128(header + 1))};
      const __m256 min[2] = {_mm256_cvtph_ps(_mm_loadu_si128(header + 2)), _mm256_cvtph_ps(_mm_loadu_si128(header + 3))};
      float* out = panels + (h * k_dim + b * kQuantBlock) * kPanel;
      for (int64_t r = 0; r < kQuantBlock / kPerWord; ++r) {
        const auto* words = reinterpret_cast<const __m256i*>(block + kQuantHeader + (r * kGroupCols + h * kPanel) * 4);
        const __m256i w[2] = {_mm256_loadu_si256(words), _mm256_loadu_si256(words + 1)};
#pragma GCC unroll 8
        for (int t = 0; t < kPerWord; ++t) {
          float* row = out + (r * kPerWord + t) * kPanel;
#pragma GCC unroll 2
          for (int v = 0; v < 2; ++v) {
            const __m256 code = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w[v], t * BITS), mask));
            _mm256_storeu_ps(row + 8 * v, _mm256_fmadd_ps(scale[v], code, min[v]));
          }
        }
      }
    }
  }
}

// The fp32 tile over a rebuilt group in zmm registers: ROWS rows x the group's 32 columns (both panels),
// 2 x ROWS accumulators. Each output is still one fma chain over k in order, so the bits are
// panel_kernel's; on an Intel core with two 512-bit fma ports this does ~1.8x the ymm kernel's fmas
// per cycle (Zen 4 splits a zmm fma in two: the same rate). Compiled for AVX-512 whatever the flags.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace fp32_avx512 {
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weights + a broadcast within 32 zmm

template <int ROWS>
static inline void group_tile(const float* x, int64_t k_dim, const float* panels, float* y, int64_t ldy,
                              const float* bias, int64_t cols) {
  const float* p0 = panels;  // [k_dim, 16] each, one after the other
  const float* p1 = panels + k_dim * kPanel;
  __m512 lo[ROWS], hi[ROWS];
#pragma GCC unroll 16
  for (int m = 0; m < ROWS; ++m) {
    lo[m] = _mm512_setzero_ps();
    hi[m] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m512 w0 = _mm512_loadu_ps(p0 + k * kPanel), w1 = _mm512_loadu_ps(p1 + k * kPanel);
#pragma GCC unroll 16
    for (int m = 0; m < ROWS; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * k_dim + k]);
      lo[m] = _mm512_fmadd_ps(xv, w0, lo[m]);
      hi[m] = _mm512_fmadd_ps(xv, w1, hi[m]);
    }
  }
  alignas(64) float out[2 * kPanel];
#pragma GCC unroll 16
  for (int m = 0; m < ROWS; ++m) {
    _mm512_store_ps(out, lo[m]);
    _mm512_store_ps(out + kPanel, hi[m]);
    float* yr = y + m * ldy;
    for (int64_t c = 0; c < cols; ++c) yr[c] = bias ? out[c] + bias[c] : out[c];
  }
}

// rows x one rebuilt group (`cols` of its 32 columns are real)
static void group_rows(const float* x, int64_t rows, int64_t k_dim, const float* panels, float* y, int64_t ldy,
                       const float* bias, int64_t cols) {
  tile_rows<kMaxRows>(rows, [&](auto n, int64_t m) {
    group_tile<decltype(n)::value>(x + m * k_dim, k_dim, panels, y + m * ldy, ldy, bias, cols);
  });
}
}  // namespace fp32_avx512
#pragma GCC pop_options

// rows x all panels, through rebuilt fp32 panels: threads split whole groups, each rebuilt once.
// avx512: the zmm tile over both of a group's panels at once; else the ymm panel kernel per panel.
static void rebuilt_rows(const float* x, int64_t rows, int64_t k_dim, const uint8_t* data, int64_t block_bytes,
                         int64_t bits, float* y, int64_t n, const float* bias, bool avx512) {
  const int64_t panels = (n + kPanel - 1) / kPanel, groups = (n + kGroupCols - 1) / kGroupCols;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kGroupPanels * k_dim * kPanel);
    for (int64_t g = begin; g < end; ++g) {
      if (bits == 4) rebuild_group<4>(data, g, k_dim, block_bytes, scratch.data());
      else rebuild_group<8>(data, g, k_dim, block_bytes, scratch.data());
      if (avx512) {
        const int64_t col0 = g * kGroupCols;
        fp32_avx512::group_rows(x, rows, k_dim, scratch.data(), y + col0, n, bias ? bias + col0 : nullptr,
                                std::min(kGroupCols, n - col0));
        continue;
      }
      for (int64_t h = 0; h < kGroupPanels && g * kGroupPanels + h < panels; ++h) {
        const int64_t p = g * kGroupPanels + h;
        panel_rows(x, rows, k_dim, scratch.data() + h * k_dim * kPanel, y + p * kPanel, n,
                   bias ? bias + p * kPanel : nullptr, std::min(kPanel, n - p * kPanel));
      }
    }
  });
}

// Whether this CPU runs the AVX-512 block-quant path (F, BW, VL, DQ), checked by the CPU itself
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// The checks both block-quant matmuls make on their arguments (`name` in the messages); returns the
// codes' bits (4 or 8).
static int64_t check_quant_args(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              name, ": expected a contiguous 2-D fp32 input");
  const int64_t block_bytes = packed.dim() == 3 ? packed.size(2) : -1;
  const int64_t bits = block_bytes == quant_block_bytes(4) ? 4 : block_bytes == quant_block_bytes(8) ? 8 : 0;
  TORCH_CHECK(bits && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(1) * kQuantBlock == x.size(1) && packed.size(0) * kGroupCols >= n &&
              (packed.size(0) - 1) * kGroupCols < n,
              name, ": packed weight does not match the input or n");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == torch::kFloat32,
                name, ": bias must be contiguous fp32 of size n");
  return bits;
}

// packed: pack_quant's output. avx512: run the AVX-512 code (only where cpu_has_avx512); the AVX2 code
// otherwise. Both give the same bits.
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n,
                           bool avx512) {
  const int64_t bits = check_quant_args("linear_quant", x, packed, bias, n), block_bytes = packed.size(2);
  TORCH_CHECK(!avx512 || cpu_has_avx512(), "linear_quant: this CPU has no AVX-512");
  const int64_t rows = x.size(0), k_dim = x.size(1), panels = (n + kPanel - 1) / kPanel;
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* data = packed.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - m0);
    const float* xb = xp + m0 * k_dim;
    float* yb = yp + m0 * n;
    if (block >= (avx512 ? kRebuiltRowsAvx512 : kRebuiltRows)) {
      rebuilt_rows(xb, block, k_dim, data, block_bytes, bits, yb, n, bp, avx512);
      continue;
    }
    // threads split whole groups: no two share a cache line of codes
    at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
      const int64_t p0 = begin * kGroupPanels, p1 = std::min(panels, end * kGroupPanels);
      if (avx512 && bits == 4) quant_avx512::quant_rows<4>(xb, block, k_dim, data, block_bytes, yb, n, bp, n, p0, p1);
      else if (avx512) quant_avx512::quant_rows<8>(xb, block, k_dim, data, block_bytes, yb, n, bp, n, p0, p1);
      else if (bits == 4) quant_avx2::quant_rows<4>(xb, block, k_dim, data, block_bytes, yb, n, bp, n, p0, p1);
      else quant_avx2::quant_rows<8>(xb, block, k_dim, data, block_bytes, yb, n, bp, n, p0, p1);
    });
  }
  return out;
}

// --- Int8 activations (`--block-quant-activations int8`): cpu_linear_int8.h --------------------------
#include "cpu_linear_int8.h"

// Whether this CPU runs linear_quant_int8's AVX-512 code (AVX-512 F, BW, VL, DQ and VNNI)
bool cpu_has_avx512_vnni() { return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni"); }

// The groups [g0, g1) of an int8 matmul over every row of quantized x (q, d, s), a row block at a time
static void int8_groups(const int8_t* qp, const float* dp, const float* sp, int64_t rows, int64_t k_dim,
                        int64_t bits, bool avx512, const uint8_t* data, int64_t block_bytes, const float* bp, float* yp,
                        int64_t n, int64_t g0, int64_t g1) {
  const int64_t blocks = k_dim / kQuantBlock;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - m0);
    const int8_t* qb = qp + m0 * k_dim;
    const float *db = dp + m0 * blocks, *sb = sp + m0 * blocks;
    float* yb = yp + m0 * n;
    if (avx512 && bits == 4) int8_avx512::group_rows<4>(qb, db, sb, block, k_dim, data, block_bytes, yb, n, bp, n, g0, g1);
    else if (avx512) int8_avx512::group_rows<8>(qb, db, sb, block, k_dim, data, block_bytes, yb, n, bp, n, g0, g1);
    else if (bits == 4) int8_avx2::group_rows<4>(qb, db, sb, block, k_dim, data, block_bytes, yb, n, bp, n, g0, g1);
    else int8_avx2::group_rows<8>(qb, db, sb, block, k_dim, data, block_bytes, yb, n, bp, n, g0, g1);
  }
}

// x @ (scale * code + min)^T (+ bias) with x quantized to int8 per row and block of 32 k (the numerics
// of cpu_linear_int8.h, not linear_quant's). avx512: the VNNI code (only where cpu_has_avx512_vnni);
// the AVX2 code otherwise. Both give the same bits, and a row's result does not depend on the others.
//
// `fill(r0, r1)`, where given, first writes x's rows [r0, r1) (the per-row op before the matmul: a norm,
// the SiLU gate; cpu_layers.cpp). It runs in the matmul's own parallel region: each thread fills and
// quantizes its share of the rows, waits for the others, then runs its share of the groups over every
// row. So a verify's few rows are no longer filled and quantized on one thread while the other waits,
// and no extra fork and join is paid for it. Which thread computes a row never changes its bits.
torch::Tensor linear_quant_int8_filled(torch::Tensor x, const std::function<void(int64_t, int64_t)>& fill,
                                       torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n, bool avx512) {
  const int64_t bits = check_quant_args("linear_quant_int8", x, packed, bias, n), block_bytes = packed.size(2);
  TORCH_CHECK(!avx512 || cpu_has_avx512_vnni(), "linear_quant_int8: this CPU has no AVX-512 VNNI");
  const int64_t rows = x.size(0), k_dim = x.size(1), blocks = k_dim / kQuantBlock, groups = packed.size(0);
  auto out = torch::empty({rows, n}, x.options());
  auto q = torch::empty({rows, k_dim}, x.options().dtype(torch::kInt8));
  auto scales = torch::empty({2, rows, blocks}, x.options());  // d, then s, per row and block
  float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = scales.data_ptr<float>();
  float* sp = dp + rows * blocks;
  const uint8_t* data = packed.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups)));
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    // the first thread takes the larger share: a decode's one row stays on the calling thread, in
    // whose cache the previous op left it
    const int64_t r0 = (rows * t + nt - 1) / nt, r1 = (rows * (t + 1) + nt - 1) / nt;
    if (r1 > r0) {
      if (fill) fill(r0, r1);
      quantize_rows(xp + r0 * k_dim, r1 - r0, k_dim, bits, qp + r0 * k_dim, dp + r0 * blocks, sp + r0 * blocks);
    }
#pragma omp barrier
    // threads split whole groups, contiguous runs as at::parallel_for splits them: no two share a cache
    // line of codes
    const int64_t chunk = (groups + nt - 1) / nt, g0 = std::min(groups, t * chunk), g1 = std::min(groups, g0 + chunk);
    if (g1 > g0) int8_groups(qp, dp, sp, rows, k_dim, bits, avx512, data, block_bytes, bp, yp, n, g0, g1);
  }
  return out;
}

torch::Tensor linear_quant_int8(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n,
                                bool avx512) {
  return linear_quant_int8_filled(x, nullptr, packed, bias, n, avx512);
}

// linear_quant_int8's quantization of x's rows alone: (q int8 [rows, K] in the codes' k order for
// `bits`-bit codes, d and s fp32 [rows, K / 32]), for tests to check it against IEEE fp32 arithmetic
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_int8(torch::Tensor x, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.size(1) % kQuantBlock == 0,
              "quantize_int8: x must be contiguous fp32 [M, K] with K a multiple of ", kQuantBlock);
  TORCH_CHECK(bits == 4 || bits == 8, "quantize_int8: bits must be 4 or 8");
  const int64_t rows = x.size(0), k_dim = x.size(1), blocks = k_dim / kQuantBlock;
  auto q = torch::empty({rows, k_dim}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({rows, blocks}, x.options()), s = torch::empty({rows, blocks}, x.options());
  quantize_rows(x.data_ptr<float>(), rows, k_dim, bits, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  return {q, d, s};
}

#ifndef TREESPEC_NO_MODULE  // compiled into cpu_layers.cpp's extension without its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "fp32/bf16 [N, K] weight -> [ceil(N/16), K, 16] panels");
  m.def("linear", &linear, "x [M, K] @ panels^T (+ bias) -> [M, N] in the weight's dtype");
  m.def("pack_quant", &pack_quant, "uint8 codes, fp16 scales and mins [N, K/32] -> packed blocks");
  m.def("linear_quant", &linear_quant, "fp32 x [M, K] @ (scale * code + min)^T (+ bias) -> [M, N]");
  m.def("cpu_has_avx512", &cpu_has_avx512, "whether linear_quant's AVX-512 code runs on this CPU");
  m.def("linear_quant_int8", &linear_quant_int8, "fp32 x, quantized to int8 per 32 k, @ block-quant weights^T");
  m.def("quantize_int8", &quantize_int8, "linear_quant_int8's int8 rows (q, d, s) of fp32 x for `bits`-bit codes");
  m.def("cpu_has_avx512_vnni", &cpu_has_avx512_vnni, "whether linear_quant_int8's AVX-512 code runs on this CPU");
}
#endif
