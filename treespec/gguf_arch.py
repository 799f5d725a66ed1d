"""The GGUF architectures treespec converts to HF folders (llama, qwen2, qwen3): tensor names, which
q/k rows llama.cpp permuted, and the HF config.json built from a file's metadata.

llama.cpp's converter permutes the q/k rows of the llama family only (its rope kernel pairs adjacent
dims there); qwen2 / qwen3 keep HF's rotate-half layout (NEOX rope), so their rows are taken as they
are. Qwen2 adds q/k/v biases; Qwen3 adds a per-head RMSNorm on q and k (`attn_q_norm` / `attn_k_norm`)
and writes its head size as `attention.key_length`, which may differ from hidden / heads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFArch:
    """One `general.architecture` value and how it maps onto an HF config."""

    name: str
    hf_architecture: str
    model_type: str
    rope_permuted: bool  # q/k rows stored interleaved per rope pair (undone at conversion)
    attention_bias: bool
    qk_norm: bool


GGUF_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", "llama", rope_permuted=True, attention_bias=False, qk_norm=False),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2", rope_permuted=False, attention_bias=True, qk_norm=False),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3", rope_permuted=False, attention_bias=False, qk_norm=True),
}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class UnsupportedGGUFError(ValueError):
    """A GGUF file of an architecture or rope variant the model code cannot run exactly."""


def gguf_arch(meta: dict) -> GGUFArch:
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHS:
        raise UnsupportedGGUFError(f"GGUF architecture {name!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    return GGUF_ARCHS[name]


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor (e.g. blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias), or
    None for tensors the model does not read."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise UnsupportedGGUFError(f"GGUF rope scaling {kind!r} is not supported (supported: none, linear)")


def hf_config_from_gguf(meta: dict, vocab_size: int, tied: bool) -> dict:
    """config.json for a GGUF's metadata (`meta`, GGUFReader field contents by key)."""
    arch = gguf_arch(meta)
    a = arch.name

    def key(name: str, default=None):
        return meta.get(f"{a}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    config = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, a),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": arch.attention_bias,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for field, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                            ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if gguf_key in meta:
            config[field] = int(meta[gguf_key])
    return config
