"""Model resolution: the embedded default, HF folders, .gguf files, and clear errors otherwise."""

from __future__ import annotations

import json
import shutil

import pytest

from treespec.model_loader import ModelPathError, find_default_gguf, resolve_model_path
from treespec.models.config import ModelConfig


def test_default_model_resolves_to_cached_hf_folder():
    path = resolve_model_path(None)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file()
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert resolve_model_path(None) == path  # converted once, then reused


def test_chat_template_survives_conversion():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")


def test_gguf_file_path_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "copy.gguf"
    shutil.copy(find_default_gguf(), gguf)
    out = resolve_model_path(str(gguf))
    assert (out / "model.safetensors").is_file() and out.is_relative_to(tmp_path / "cache")


@pytest.mark.parametrize("case", ["missing", "not_gguf_file", "no_config", "no_weights", "broken_gguf"])
def test_bad_model_paths_give_one_clear_error(tmp_path, case):
    if case == "missing":
        path = tmp_path / "nope"
    elif case == "not_gguf_file":
        path = tmp_path / "weights.txt"
        path.write_text("x")
    elif case == "no_config":
        path = tmp_path / "m"
        path.mkdir()
    elif case == "no_weights":
        path = tmp_path / "m"
        path.mkdir()
        (path / "config.json").write_text("{}")
    else:
        path = tmp_path / "bad.gguf"
        path.write_bytes(b"GGUF not really")
    with pytest.raises(ModelPathError, match="--model-path|GGUF"):
        resolve_model_path(str(path))


def test_unsupported_architecture_is_rejected():
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": 2})
