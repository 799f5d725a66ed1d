// Linear layer for CPU decoding: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), AVX2 + FMA, fp32 or bf16.
//
// Weights are repacked once into panels of 16 output columns, [ceil(N/16), K, 16], so one panel
// streams contiguously from memory and each k step is one or two vector loads. A batch-1 decode reads
// every weight once per step, so how fast panels stream is the step time; the input rows (a few KB)
// stay in L1. bf16 weights are widened to fp32 in registers (a shift), so they stream at half the
// bytes; inputs are taken in fp32, products accumulate in fp32, outputs round once to the weight's
// dtype (what F.linear does). Every output element is one fused multiply-add chain over k in order,
// whatever the number of rows or how they are tiled: a row's result does not depend on what else is
// in the batch, so a tree verify computes bit for bit what a decode step would.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

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
template <int ROWS, typename T>
static inline void panel_kernel(const float* x, int64_t k_dim, const T* panel, T* y, int64_t ldy, const T* bias,
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
    for (int64_t c = 0; c < cols; ++c)  // T(float) rounds to nearest even for bf16
      y[m * ldy + c] = bias ? T(out[c] + static_cast<float>(bias[c])) : T(out[c]);
  }
}

template <typename T>
static void panel_rows(const float* x, int64_t rows, int64_t k_dim, const T* panel, T* y, int64_t ldy,
                       const T* bias, int64_t cols) {
  int64_t m = 0;
  for (; m + 6 <= rows; m += 6) panel_kernel<6>(x + m * k_dim, k_dim, panel, y + m * ldy, ldy, bias, cols);
  const float* xr = x + m * k_dim;
  T* yr = y + m * ldy;
  switch (rows - m) {
    case 5: panel_kernel<5>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 4: panel_kernel<4>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 3: panel_kernel<3>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 2: panel_kernel<2>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    case 1: panel_kernel<1>(xr, k_dim, panel, yr, ldy, bias, cols); break;
    default: break;
  }
}

template <typename T>
static void run(const float* x, int64_t rows, int64_t k_dim, const T* wp, int64_t panels, const T* bp, T* yp,
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

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == packed.scalar_type() && supported(x),
              "linear: expected a contiguous 2-D fp32 or bf16 input of the packed weight's dtype");
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
  if (x.scalar_type() == torch::kFloat32) {
    run(xp, rows, k_dim, packed.data_ptr<float>(), panels, bias ? bias->data_ptr<float>() : nullptr,
        out.data_ptr<float>(), n);
  } else {
    run(xp, rows, k_dim, packed.data_ptr<at::BFloat16>(), panels,
        bias ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(), n);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "fp32/bf16 [N, K] weight -> [ceil(N/16), K, 16] panels");
  m.def("linear", &linear, "x [M, K] @ panels^T (+ bias) -> [M, N] in the weight's dtype");
}
