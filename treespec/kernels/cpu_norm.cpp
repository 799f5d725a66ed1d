// RMSNorm for CPU decoding, fp32, AVX2 + FMA: y = x / sqrt(mean(x^2) + eps) * weight per row, and the
// same after a residual add (h = x + residual; y = norm(h)), in one pass over the row; and the MLP's
// SiLU gate (silu(gate) * up), the other per-row op between a layer's matmuls; and the greedy token
// of each logits row (argmax_rows).
//
// Why: a decode step normalises one 576-wide row 61 times; torch's rms_norm dispatches several ops
// per call (~40 us each on the dev machine), this is one call of ~1 us of work. Each row is reduced
// in the same order whatever the number of rows, so results do not depend on the batch (a tree verify
// normalises a row bit for bit as a decode step does).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "avx2_math.h"

constexpr int64_t kGrainRows = 64;  // rows per thread task: small batches stay on one thread

static float sum_squares(const float* x, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
  float total = 0.f;
  for (float v : lanes) total += v;
  for (; i < d; ++i) total += x[i] * x[i];
  return total;
}

static void scale_row(const float* x, const float* w, float r, float* y, int64_t d) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < d; ++i) y[i] = x[i] * r * w[i];
}

static void add_rows(const float* a, const float* b, float* out, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  for (; i < d; ++i) out[i] = a[i] + b[i];
}

static void check(const torch::Tensor& x, const torch::Tensor& weight, const char* fn) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, fn,
              ": expected a contiguous 2-D fp32 input");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.scalar_type() == torch::kFloat32 &&
              weight.numel() == x.size(1), fn, ": weight must be a contiguous fp32 vector of the row width");
}

// One row of each per-row op, for the calls below and for cpu_layers.cpp's fused matmul prologues
// (cpu_linear.cpp's linear_quant_int8_filled): the same code wherever a row is computed, so the same bits.
void norm_row(const float* h, const float* w, float* y, int64_t d, float eps) {
  const float r = 1.f / std::sqrt(sum_squares(h, d) / static_cast<float>(d) + eps);
  scale_row(h, w, r, y, d);
}

void add_norm_row(const float* x, const float* residual, float* h, const float* w, float* y, int64_t d, float eps) {
  add_rows(x, residual, h, d);
  norm_row(h, w, y, d, eps);
}

void silu_mul_row(const float* g, float* out, int64_t inter) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < inter; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, x))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(g + inter + i)));
  }
}

static void norm_rows(const float* h, const float* w, float* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) norm_row(h + m * d, w, y + m * d, d, eps);
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, weight, "rms_norm");
  auto y = torch::empty_like(x);
  pybind11::gil_scoped_release no_gil;
  norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
            static_cast<float>(eps));
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == torch::kFloat32,
              "add_rms_norm: residual must be a contiguous fp32 tensor of the input's shape");
  auto h = torch::empty_like(x);
  auto y = torch::empty_like(x);
  const int64_t rows = x.size(0), d = x.size(1);
  {
    pybind11::gil_scoped_release no_gil;
    const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
    float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
    at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        add_norm_row(xp + m * d, rp + m * d, hp + m * d, wp, yp + m * d, d, static_cast<float>(eps));
    });
  }
  return {h, y};
}

// --- SiLU gate: out = silu(gate) * up for a fused [M, 2I] gate_up projection -----------------------
// torch spends ~20 us a decode row on split + silu + mul (three dispatches); this is one pass.

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat32 &&
              gate_up.size(1) % 16 == 0, "silu_mul: expected contiguous fp32 [M, 2I] with I a multiple of 8");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  pybind11::gil_scoped_release no_gil;
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) silu_mul_row(gp + m * 2 * inter, op + m * inter, inter);
  });
  return out;
}

// --- Greedy token: each row's first maximum, NaN counting as the maximum (torch.max(dim=-1)'s index) -----
// torch's max-with-index walks a 49k vocabulary at ~40 us a row on the AMD dev host (~0.3 ms for an
// 8-row tree verify, ~3 % of its step); a max pass then a first-equal pass takes ~4 us a row.

static int64_t argmax_row(const float* x, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = neg_inf, m1 = neg_inf, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // two chains: half the max latency
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float top = -std::numeric_limits<float>::infinity();
  for (float lane : lanes) top = std::max(top, lane);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) has_nan = true;
    else top = std::max(top, x[j]);
  }
  if (has_nan) {  // the first NaN (NaN never took part in `top`)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 want = _mm256_set1_ps(top);  // the first equal value (-0 == +0, as torch compares)
  for (i = 0; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
  for (; i < n; ++i)
    if (x[i] == top) return i;
  return 0;  // unreachable: top is one of the values
}

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat32 &&
              logits.size(1) > 0, "argmax_rows: expected contiguous fp32 [M, V] with V > 0");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  pybind11::gil_scoped_release no_gil;
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // a row a task: a decode row stays on the calling thread, a verify's rows split over the threads
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) op[m] = argmax_row(lp + m * vocab, vocab);
  });
  return out;
}

#ifndef TREESPEC_NO_MODULE  // compiled into cpu_layers.cpp's extension without its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "fp32 [M, D] -> x * rsqrt(mean(x^2) + eps) * weight, per row");
  m.def("add_rms_norm", &add_rms_norm, "(x + residual, rms_norm(x + residual)) for fp32 [M, D]");
  m.def("silu_mul", &silu_mul, "fp32 [M, 2I] -> silu(x[:, :I]) * x[:, I:]");
  m.def("argmax_rows", &argmax_rows, "fp32 [M, V] -> int64 [M]: each row's first maximum (NaN the maximum)");
}
#endif
