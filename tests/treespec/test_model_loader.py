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


def test_registry_covers_exactly_the_architectures_the_config_reader_knows():
    from treespec.models.config import SUPPORTED_ARCHITECTURES
    from treespec.models.registry import MODEL_REGISTRY

    assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def test_registry_picks_the_first_supported_architecture():
    from treespec.models.llama import LlamaForCausalLM
    from treespec.models.registry import model_class_for

    assert model_class_for({"architectures": ["SomethingElse", "Qwen3ForCausalLM"]}) is LlamaForCausalLM


def test_runner_rejects_an_unsupported_architecture_naming_it_and_the_supported_ones(tmp_path):
    import torch

    from treespec.model_runner import ModelRunner
    from treespec.models.registry import UnsupportedArchitectureError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelRunner(tmp_path, torch.float32, torch.device("cpu"), kv_pool_size=8)


def test_runner_builds_the_class_the_registry_names(tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    import torch

    import treespec.models.registry as registry
    from treespec.forward_batch import ForwardContext
    from treespec.model_runner import ModelRunner
    from treespec.models.llama import LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from model_factory import make_tiny_model

    class RegisteredLlama(LlamaForCausalLM):
        pass

    monkeypatch.setitem(registry.MODEL_REGISTRY, "LlamaForCausalLM", RegisteredLlama)
    runner = ModelRunner(make_tiny_model("llama", tmp_path / "llama"), torch.float32, torch.device("cpu"),
                         kv_pool_size=8)
    assert type(runner.model) is RegisteredLlama
    # the model gets a typed context, not the runner
    assert runner.forward_context == ForwardContext(runner.kv_pool, runner.attn_backend)
