"""Tiny randomly initialised HF checkpoints of every supported architecture, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=2048)


def tiny_config(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=False)
    if family == "llama3_rope":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=True, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=None)
    if family == "qwen2":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    raise ValueError(family)


def make_tiny_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Save a random tiny model of `family` as an HF folder and return it."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(family)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # make biases / norms non-trivial so a dropped term shows up
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    copy_default_tokenizer(out_dir)
    return out_dir


def copy_default_tokenizer(out_dir: Path) -> None:
    """Give a tiny model the default model's tokenizer (ids < the tiny vocab still decode)."""
    import shutil

    from treespec.model_loader import resolve_model_path

    src = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, Path(out_dir) / name)


def prefill_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """fp32 logits of one prefill of `ids` on the model in `model_dir` (CPU)."""
    from treespec.attention.metadata import build_metadata
    from treespec.forward_batch import ForwardBatch, ForwardMode
    from treespec.model_runner import ModelRunner

    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), kv_pool_size=64)
    n = len(ids)
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids), torch.arange(n), torch.arange(1, n + 1),
                         build_metadata([n], [torch.arange(1, n + 1)]))
    return runner.forward(batch).logits
