"""GGUF files written the way llama.cpp's converter lays them out, from the tiny HF test models, with a
small trained byte-level BPE vocabulary (the `gpt2` tokenizer model Qwen2/Qwen3 GGUFs carry)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["hello world, hello there.", "the tree speculates the next tokens", "one two three hello tree"] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def train_bpe():
    """A byte-level BPE tokenizer small enough for the tiny models' 300-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + 30, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, leaf = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{leaf}"


def _permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter stores llama q/k rows interleaved per rope pair
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, arch: str, quant: str = "F32") -> Path:
    """`hf_dir`'s tiny model as a GGUF of architecture `arch`: 2-D weights as `quant` (F32 or Q8_0), norms
    and biases F32, no output.weight when the embeddings are tied (as llama.cpp writes them)."""
    import gguf
    from gguf.quants import quantize

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    bpe = json.loads(train_bpe().to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get) + SPECIAL_TOKENS
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute_rope(w, heads if "q_proj" in name else kv_heads)
        if quant != "F32" and w.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(_gguf_name(name), quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantized_twin(hf_dir: Path, out: Path, quant: str) -> Path:
    """`hf_dir` with every 2-D weight replaced by its `quant` round trip: the HF folder a quantized GGUF
    of it encodes."""
    import shutil

    import gguf
    from gguf.quants import dequantize, quantize

    shutil.copytree(hf_dir, out)
    qtype = gguf.GGMLQuantizationType[quant]
    state = {name: torch.from_numpy(np.array(dequantize(quantize(t.float().numpy(), qtype), qtype),
                                             dtype=np.float32)).reshape(t.shape) if t.dim() == 2 else t
             for name, t in load_file(str(hf_dir / "model.safetensors")).items()}
    save_file(state, str(out / "model.safetensors"))
    return out
