// The decoder layers of a Llama-family model in one call, for fp32 inference on the CPU kernels.
//
// Why: a batch-1 decode step of the default model runs ~11 kernel calls per layer over 30 layers, and
// the Python around them (module dispatch, checks, slicing, ~40 small ops a layer) costs about as much
// as the attention itself. This loop computes what the Python loop's kernel calls compute, in the same
// order, from C++: the results are bit-identical to the Python loop (models/llama.py), only the glue is
// gone. The per-row ops before a matmul (norms, residual adds, the SiLU gate) run as that matmul's
// `fill`, inside its parallel region (Linear::filled), with cpu_norm.cpp's row code.
//
// Built as one extension with cpu_linear.cpp, cpu_norm.cpp and cpu_attention.cpp compiled without
// their own Python modules (TREESPEC_NO_MODULE), so the functions below are theirs.
#include <torch/extension.h>

#include <functional>
#include <tuple>
#include <vector>

torch::Tensor pack(torch::Tensor w);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n);
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n,
                           bool avx512);
torch::Tensor linear_quant_int8(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n,
                                bool avx512);
torch::Tensor linear_quant_int8_filled(torch::Tensor x, const std::function<void(int64_t, int64_t)>& fill,
                                       torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n, bool avx512);
void norm_row(const float* h, const float* w, float* y, int64_t d, float eps);
void add_norm_row(const float* x, const float* residual, float* h, const float* w, float* y, int64_t d, float eps);
void silu_mul_row(const float* g, float* out, int64_t inter);
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                        const torch::Tensor& qo_indptr, const torch::Tensor& kv_indptr,
                        const torch::Tensor& kv_indices, const torch::Tensor& custom_mask,
                        const torch::Tensor& mask_indptr, double scale, bool avx512);
void rope_store(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& loc,
                torch::Tensor& k_buf, torch::Tensor& v_buf, int64_t num_heads);

constexpr int64_t kFillGrainRows = 64;  // cpu_norm.cpp's kGrainRows

// One packed matmul as models/packed_linear.py runs it. mode: 0 = fp32/bf16 panels (`linear`),
// 1 = block quant, AVX2 code, 2 = block quant, AVX-512 code, 3 / 4 = block quant with int8 activations
// (`linear_quant_int8`), AVX2 / AVX-512 VNNI code. An empty bias means none.
struct Linear {
  torch::Tensor data, bias;
  int64_t n, mode;
  c10::optional<torch::Tensor> bias_or_none() const {
    c10::optional<torch::Tensor> b;
    if (bias.numel() > 0) b = bias;
    return b;
  }
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (mode >= 3) return linear_quant_int8(x, data, bias_or_none(), n, mode == 4);
    return mode == 0 ? linear(x, data, bias_or_none(), n) : linear_quant(x, data, bias_or_none(), n, mode == 2);
  }
  // x's rows written by fill(r0, r1) first (a per-row op: norm, SiLU gate), then the matmul. The int8
  // matmul runs fill inside its parallel region (linear_quant_int8_filled); the others after it, split
  // across the threads as the norm kernels split rows (kFillGrainRows).
  torch::Tensor filled(const torch::Tensor& x, const std::function<void(int64_t, int64_t)>& fill) const {
    if (mode >= 3) return linear_quant_int8_filled(x, fill, data, bias_or_none(), n, mode == 4);
    {
      pybind11::gil_scoped_release no_gil;
      at::parallel_for(0, x.size(0), kFillGrainRows, fill);
    }
    return (*this)(x);
  }
};

static std::vector<Linear> linears(const std::vector<torch::Tensor>& data, const std::vector<torch::Tensor>& bias,
                                   int64_t n, const std::vector<int64_t>& mode, size_t layers, const char* what) {
  TORCH_CHECK(data.size() == layers && bias.size() == layers && mode.size() == layers,
              "decoder_layers: one ", what, " weight, bias and mode per layer expected");
  std::vector<Linear> out;
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(mode[i] >= 0 && mode[i] <= 4, "decoder_layers: bad mode for ", what);
    out.push_back({data[i], bias[i], n, mode[i]});
  }
  return out;
}

// h [T, hidden] fp32 (the embeddings); per layer: norms, the four packed matmuls (qkv with optional
// bias), the layer's K and V buffers. attn: attention's index tensors (qo_indptr, kv_indptr,
// kv_indices, custom_mask, mask_indptr) as attention/torch_backend.py builds them, attn_avx512 its ISA. capture: layer ids
// whose input h is returned too (EAGLE-3's auxiliary hidden states), in order. out_rows: where only some rows'
// outputs are wanted (a prefill's last rows, for their logits), those row ids, and out_attn the five index tensors
// of attention for those rows alone; empty: every row. The last layer then stores every row's K and V but
// computes the rest of the layer for those rows only (as llama.cpp does): the same bits for them, since each
// row's attention, matmuls and norms depend on that row alone.
std::tuple<torch::Tensor, std::vector<torch::Tensor>> decoder_layers(
    torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& loc,
    const std::vector<torch::Tensor>& attn, bool attn_avx512, double scale, int64_t num_heads, int64_t head_dim, double eps,
    const std::vector<torch::Tensor>& input_norm, const std::vector<torch::Tensor>& post_norm,
    const std::vector<torch::Tensor>& qkv_data, const std::vector<torch::Tensor>& qkv_bias, int64_t qkv_n,
    const std::vector<int64_t>& qkv_mode, const std::vector<torch::Tensor>& o_data, int64_t o_n,
    const std::vector<int64_t>& o_mode, const std::vector<torch::Tensor>& gate_up_data, int64_t gate_up_n,
    const std::vector<int64_t>& gate_up_mode, const std::vector<torch::Tensor>& down_data, int64_t down_n,
    const std::vector<int64_t>& down_mode, std::vector<torch::Tensor> k_bufs, std::vector<torch::Tensor> v_bufs,
    const std::vector<int64_t>& capture, const torch::Tensor& out_rows, const std::vector<torch::Tensor>& out_attn) {
  const size_t layers = input_norm.size();
  TORCH_CHECK(post_norm.size() == layers && k_bufs.size() == layers && v_bufs.size() == layers,
              "decoder_layers: one norm pair and one K/V buffer pair per layer expected");
  TORCH_CHECK(attn.size() == 5, "decoder_layers: attn must hold the five attention index tensors");
  const bool prune = out_rows.numel() > 0;
  TORCH_CHECK(!prune || (out_attn.size() == 5 && out_rows.scalar_type() == torch::kInt64 && out_rows.dim() == 1),
              "decoder_layers: out_rows must be int64 row ids with the five attention index tensors for them");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == torch::kFloat32,
              "decoder_layers: h must be contiguous fp32 [T, hidden]");
  const std::vector<torch::Tensor> none(layers);
  const auto qkv = linears(qkv_data, qkv_bias, qkv_n, qkv_mode, layers, "qkv");
  const auto o = linears(o_data, none, o_n, o_mode, layers, "o");
  const auto gate_up = linears(gate_up_data, none, gate_up_n, gate_up_mode, layers, "gate_up");
  const auto down = linears(down_data, none, down_n, down_mode, layers, "down");
  const int64_t q_size = num_heads * head_dim, hidden = h.size(1);
  const float epsf = static_cast<float>(eps);
  std::vector<torch::Tensor> captured;
  size_t next_capture = 0;
  // The residual stream entering a layer is h, or, where `pending`, residual + y (the previous layer's
  // MLP output not added yet): the next layer's first matmul adds it row by row before its norm.
  torch::Tensor residual, y;
  bool pending = false;
  auto settle = [&] {
    if (pending) h = residual + y;
    pending = false;
  };
  for (size_t i = 0; i < layers; ++i) {
    if (next_capture < capture.size() && capture[next_capture] == static_cast<int64_t>(i)) {
      settle();
      captured.push_back(h);
      ++next_capture;
    }
    // models/llama.py's DecoderLayer.forward and Attention.forward (the rope_store path), op by op; each
    // norm, residual add and SiLU gate runs as its matmul's `fill`, row by row, the same code as
    // cpu_norm.cpp's calls (so the same bits)
    const int64_t rows = h.size(0);
    auto x = torch::empty({rows, hidden}, h.options());
    const float* in_w = input_norm[i].data_ptr<float>();
    float* xp = x.data_ptr<float>();
    // pending: this fill writes the summed residual stream into a new h as it norms it
    const torch::Tensor h_in = pending ? torch::empty({rows, hidden}, h.options()) : h;
    const float *yp = pending ? y.data_ptr<float>() : nullptr, *rp = pending ? residual.data_ptr<float>() : nullptr;
    float* h_in_p = h_in.data_ptr<float>();
    auto qkv_out = qkv[i].filled(x, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (yp != nullptr)
          add_norm_row(yp + r * hidden, rp + r * hidden, h_in_p + r * hidden, in_w, xp + r * hidden, hidden, epsf);
        else
          norm_row(h_in_p + r * hidden, in_w, xp + r * hidden, hidden, epsf);
      }
    });
    h = h_in;
    pending = false;
    rope_store(qkv_out, cos, sin, loc, k_bufs[i], v_bufs[i], num_heads);
    auto q = qkv_out.narrow(1, 0, q_size);
    const bool last_rows_only = prune && i + 1 == layers;  // every row's K and V are stored above
    if (last_rows_only) {
      q = q.index_select(0, out_rows);
      h = h.index_select(0, out_rows);
    }
    const auto& a = last_rows_only ? out_attn : attn;
    const int64_t tokens = q.size(0);
    auto att = attention(q.view({tokens, num_heads, head_dim}), k_bufs[i], v_bufs[i], a[0], a[1], a[2], a[3], a[4],
                         scale, attn_avx512);
    auto attn_out = o[i](att.view({tokens, q_size}));
    // post-attention: h + attn_out, normed, in gate_up's fill; the SiLU gate in down's
    auto summed = torch::empty({tokens, hidden}, h.options()), normed = torch::empty({tokens, hidden}, h.options());
    const float *ap = attn_out.data_ptr<float>(), *hp = h.data_ptr<float>(), *post_w = post_norm[i].data_ptr<float>();
    float *sp = summed.data_ptr<float>(), *np = normed.data_ptr<float>();
    auto gate_up_out = gate_up[i].filled(normed, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        add_norm_row(ap + r * hidden, hp + r * hidden, sp + r * hidden, post_w, np + r * hidden, hidden, epsf);
    });
    const int64_t inter = gate_up_out.size(1) / 2;
    auto act = torch::empty({tokens, inter}, h.options());
    const float* gp = gate_up_out.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    y = down[i].filled(act, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * 2 * inter, actp + r * inter, inter);
    });
    residual = summed;
    pending = true;
  }
  settle();
  TORCH_CHECK(next_capture == capture.size(), "decoder_layers: capture ids must be ascending layer ids");
  return {h, captured};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "all decoder layers of a Llama-family model in one call (fp32)");
  m.def("pack", &pack, "cpu_linear.cpp's pack, for the load probe");
}
