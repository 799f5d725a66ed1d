// The decoder layers of a Llama-family model in one call, for fp32 inference on the CPU kernels.
//
// Why: a batch-1 decode step of the default model runs ~11 kernel calls per layer over 30 layers, and
// the Python around them (module dispatch, checks, slicing, ~40 small ops a layer) costs about as much
// as the attention itself. This loop makes the very same kernel calls, in the same order, from C++:
// the results are bit-identical to the Python loop (models/llama.py), only the glue is gone.
//
// Built as one extension with cpu_linear.cpp, cpu_norm.cpp and cpu_attention.cpp compiled without
// their own Python modules (TREESPEC_NO_MODULE), so the functions below are theirs.
#include <torch/extension.h>

#include <tuple>
#include <vector>

torch::Tensor pack(torch::Tensor w);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n);
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n,
                           bool avx512);
torch::Tensor linear_quant_int8(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n,
                                bool avx512);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                        const torch::Tensor& qo_indptr, const torch::Tensor& kv_indptr,
                        const torch::Tensor& kv_indices, const torch::Tensor& custom_mask,
                        const torch::Tensor& mask_indptr, double scale, bool avx512);
void rope_store(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& loc,
                torch::Tensor& k_buf, torch::Tensor& v_buf, int64_t num_heads);

// One packed matmul as models/packed_linear.py runs it. mode: 0 = fp32/bf16 panels (`linear`),
// 1 = block quant, AVX2 code, 2 = block quant, AVX-512 code, 3 / 4 = block quant with int8 activations
// (`linear_quant_int8`), AVX2 / AVX-512 VNNI code. An empty bias means none.
struct Linear {
  torch::Tensor data, bias;
  int64_t n, mode;
  torch::Tensor operator()(const torch::Tensor& x) const {
    c10::optional<torch::Tensor> b;
    if (bias.numel() > 0) b = bias;
    if (mode >= 3) return linear_quant_int8(x, data, b, n, mode == 4);
    return mode == 0 ? linear(x, data, b, n) : linear_quant(x, data, b, n, mode == 2);
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
  const int64_t q_size = num_heads * head_dim;
  std::vector<torch::Tensor> captured;
  size_t next_capture = 0;
  for (size_t i = 0; i < layers; ++i) {
    if (next_capture < capture.size() && capture[next_capture] == static_cast<int64_t>(i)) {
      captured.push_back(h);
      ++next_capture;
    }
    // models/llama.py's DecoderLayer.forward and Attention.forward (the rope_store path), call by call
    auto x = rms_norm(h, input_norm[i], eps);
    auto qkv_out = qkv[i](x);
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
    auto [residual, normed] = add_rms_norm(attn_out, h, post_norm[i], eps);
    h = residual + down[i](silu_mul(gate_up[i](normed)));
  }
  TORCH_CHECK(next_capture == capture.size(), "decoder_layers: capture ids must be ascending layer ids");
  return {h, captured};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "all decoder layers of a Llama-family model in one call (fp32)");
  m.def("pack", &pack, "cpu_linear.cpp's pack, for the load probe");
}
