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

#include <algorithm>
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
  for (int64_t k = 0; k < k_dim; ++k) {
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

template <typename W, typename O>
static void panel_rows(const float* x, int64_t rows, int64_t k_dim, const W* panel, O* y, int64_t ldy,
                       const O* bias, int64_t cols) {
  int64_t m = 0;
  for (; m + 6 <= rows; m += 6) panel_kernel<6>(x + m * k_dim, k_dim, panel, y + m * ldy, ldy, bias, cols);
  const float* xr = x + m * k_dim;
  O* yr = y + m * ldy;
  switch (rows - m) {
    case 5: panel_kernel<5>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 4: panel_kernel<4>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 3: panel_kernel<3>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 2: panel_kernel<2>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 1: panel_kernel<1>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    default: break;
  }
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
// integer code and fp16 scale and min. Stored that way (uint8 codes, fp16 scale/min) a panel streams
// 1.06 bytes per weight instead of 4. Each weight is rebuilt in registers with one fma: scale * code
// is exact in fp32 (11 + 8 significant bits), so fma(scale, code, min) rounds once, to the very fp32
// value that dequantizing to fp32 gives; the fma chain over k is then `linear`'s, so results are bit
// for bit those of `linear` over the dequantized weight.
constexpr int64_t kQuantBlock = 32;
// Each output's fma chain over k is serial, so one row against one panel (two chains) waits on fma
// latency; a tile of ROWS x PANELS keeps 8 independent chains in flight (decode: 1 row x 4 panels).
constexpr int kQuantChains = 4;  // ROWS * PANELS per tile

// uint8 codes [N, K] -> [ceil(N/16), K, 16]; fp16 scales and mins [N, K/32] -> [ceil(N/16), K/32, 2, 16]
std::vector<torch::Tensor> pack_quant(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8 && codes.size(1) % kQuantBlock == 0,
              "pack_quant: expected uint8 codes [N, K] with K a multiple of 32");
  const int64_t n = codes.size(0), k = codes.size(1), blocks = k / kQuantBlock;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  for (const auto& t : {scales, mins})
    TORCH_CHECK(t.scalar_type() == torch::kHalf && t.dim() == 2 && t.size(0) == n && t.size(1) == blocks,
                "pack_quant: expected fp16 scales and mins [N, K/32]");
  auto padded = torch::zeros({panels * kPanel, k}, codes.options());
  padded.narrow(0, 0, n).copy_(codes);
  auto packed_codes = padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
  auto scale_min = torch::zeros({panels * kPanel, blocks, 2}, scales.options());
  scale_min.narrow(0, 0, n).select(2, 0).copy_(scales);
  scale_min.narrow(0, 0, n).select(2, 1).copy_(mins);
  auto packed_scale_min = scale_min.view({panels, kPanel, blocks, 2}).permute({0, 2, 3, 1}).contiguous();
  return {packed_codes, packed_scale_min};
}

// 8 uint8 codes as fp32 (the load folds into vpmovzxbd's memory operand)
static inline __m256 load_codes(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// ROWS input rows against PANELS consecutive panels (output columns col0 ...).
template <int ROWS, int PANELS>
static inline void quant_tile(const float* x, int64_t k_dim, const uint8_t* codes, const at::Half* scale_min,
                              float* y, int64_t ldy, const float* bias, int64_t cols_left) {
  __m256 lo[ROWS * PANELS], hi[ROWS * PANELS];  // [row * PANELS + panel]
#pragma GCC unroll 4
  for (int a = 0; a < ROWS * PANELS; ++a) {
    lo[a] = _mm256_setzero_ps();
    hi[a] = _mm256_setzero_ps();
  }
  const int64_t blocks = k_dim / kQuantBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 scale0[PANELS], scale1[PANELS], min0[PANELS], min1[PANELS];
#pragma GCC unroll 4
    for (int j = 0; j < PANELS; ++j) {  // per block and panel: 16 fp16 scales, then 16 fp16 mins
      const auto* sm = reinterpret_cast<const __m128i*>(scale_min + (j * blocks + b) * 2 * kPanel);
      scale0[j] = _mm256_cvtph_ps(_mm_loadu_si128(sm));
      scale1[j] = _mm256_cvtph_ps(_mm_loadu_si128(sm + 1));
      min0[j] = _mm256_cvtph_ps(_mm_loadu_si128(sm + 2));
      min1[j] = _mm256_cvtph_ps(_mm_loadu_si128(sm + 3));
    }
    for (int64_t k = b * kQuantBlock; k < (b + 1) * kQuantBlock; ++k) {
      __m256 w0[PANELS], w1[PANELS];
#pragma GCC unroll 4
      for (int j = 0; j < PANELS; ++j) {
        const uint8_t* c = codes + (j * k_dim + k) * kPanel;
        w0[j] = _mm256_fmadd_ps(scale0[j], load_codes(c), min0[j]);
        w1[j] = _mm256_fmadd_ps(scale1[j], load_codes(c + 8), min1[j]);
      }
#pragma GCC unroll 4
      for (int m = 0; m < ROWS; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * k_dim + k);
#pragma GCC unroll 4
        for (int j = 0; j < PANELS; ++j) {
          lo[m * PANELS + j] = _mm256_fmadd_ps(xv, w0[j], lo[m * PANELS + j]);
          hi[m * PANELS + j] = _mm256_fmadd_ps(xv, w1[j], hi[m * PANELS + j]);
        }
      }
    }
  }
  // Spill the accumulators with constant indices only: a runtime index would make the compiler keep
  // them in memory inside the k loop.
  alignas(32) float out[ROWS * PANELS][kPanel];
#pragma GCC unroll 4
  for (int a = 0; a < ROWS * PANELS; ++a) {
    _mm256_store_ps(out[a], lo[a]);
    _mm256_store_ps(out[a] + 8, hi[a]);
  }
  for (int m = 0; m < ROWS; ++m) {
    for (int j = 0; j < PANELS; ++j) {
      const int64_t cols = std::min(kPanel, cols_left - j * kPanel);
      const float* b = bias ? bias + j * kPanel : nullptr;
      const float* o = out[m * PANELS + j];
      float* yr = y + m * ldy + j * kPanel;
      for (int64_t c = 0; c < cols; ++c) yr[c] = b ? o[c] + b[c] : o[c];
    }
  }
}

// ROWS rows against panels [begin, end): PANELS at a time, then one by one.
template <int ROWS, int PANELS>
static void quant_tiles(const float* x, int64_t k_dim, const uint8_t* codes, const at::Half* scale_min, float* y,
                        int64_t ldy, const float* bias, int64_t n, int64_t begin, int64_t end) {
  const int64_t blocks = k_dim / kQuantBlock;
  int64_t p = begin;
  for (; p + PANELS <= end; p += PANELS)
    quant_tile<ROWS, PANELS>(x, k_dim, codes + p * k_dim * kPanel, scale_min + p * blocks * 2 * kPanel,
                             y + p * kPanel, ldy, bias ? bias + p * kPanel : nullptr, n - p * kPanel);
  for (; p < end; ++p)
    quant_tile<ROWS, 1>(x, k_dim, codes + p * k_dim * kPanel, scale_min + p * blocks * 2 * kPanel,
                        y + p * kPanel, ldy, bias ? bias + p * kPanel : nullptr, n - p * kPanel);
}

// All rows against panels [begin, end), a few panels at a time so each chunk's codes are read from
// memory once and stay in L1 for the remaining row tiles.
static void quant_rows(const float* x, int64_t rows, int64_t k_dim, const uint8_t* codes, const at::Half* scale_min,
                       float* y, int64_t ldy, const float* bias, int64_t n, int64_t begin, int64_t end) {
  for (int64_t p0 = begin; p0 < end; p0 += kQuantChains) {
    const int64_t p1 = std::min(end, p0 + kQuantChains);
    int64_t m = 0;
    for (; m + kQuantChains <= rows; m += kQuantChains)
      quant_tiles<kQuantChains, 1>(x + m * k_dim, k_dim, codes, scale_min, y + m * ldy, ldy, bias, n, p0, p1);
    const float* xr = x + m * k_dim;
    float* yr = y + m * ldy;
    switch (rows - m) {
      case 3: quant_tiles<3, 1>(xr, k_dim, codes, scale_min, yr, ldy, bias, n, p0, p1); break;
      case 2: quant_tiles<2, 2>(xr, k_dim, codes, scale_min, yr, ldy, bias, n, p0, p1); break;
      case 1: quant_tiles<1, 4>(xr, k_dim, codes, scale_min, yr, ldy, bias, n, p0, p1); break;
      default: break;
    }
  }
}

torch::Tensor linear_quant(torch::Tensor x, torch::Tensor codes, torch::Tensor scale_min,
                           c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "linear_quant: expected a contiguous 2-D fp32 input");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanel && codes.size(1) == x.size(1) &&
              codes.scalar_type() == torch::kUInt8 && codes.size(0) * kPanel >= n,
              "linear_quant: packed codes do not match the input or n");
  TORCH_CHECK(scale_min.dim() == 4 && scale_min.size(0) == codes.size(0) &&
              scale_min.size(1) * kQuantBlock == x.size(1) && scale_min.size(2) == 2 &&
              scale_min.size(3) == kPanel && scale_min.scalar_type() == torch::kHalf,
              "linear_quant: packed scales do not match the codes");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == torch::kFloat32,
                "linear_quant: bias must be contiguous fp32 of size n");
  const int64_t rows = x.size(0), k_dim = x.size(1), panels = codes.size(0);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scale_min.data_ptr<at::Half>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - m0);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      quant_rows(xp + m0 * k_dim, block, k_dim, cp, sp, yp + m0 * n, n, bp, n, begin, end);
    });
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "fp32/bf16 [N, K] weight -> [ceil(N/16), K, 16] panels");
  m.def("linear", &linear, "x [M, K] @ panels^T (+ bias) -> [M, N] in the weight's dtype");
  m.def("pack_quant", &pack_quant, "uint8 codes, fp16 scales and mins -> packed codes and scales");
  m.def("linear_quant", &linear_quant, "fp32 x [M, K] @ (scale * code + min)^T (+ bias) -> [M, N]");
}
