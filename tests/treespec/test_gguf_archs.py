"""GGUF files of each supported architecture (llama, qwen2, qwen3), written as llama.cpp lays them out,
load and run exactly like their HF twins; their gpt2-style BPE tokenizer and chat template survive."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from treespec.model_loader import ModelPathError, resolve_model_path
from treespec.models.block_quant import FILE_NAME as BLOCK_QUANT_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_factory import SPECIAL_TOKENS, quantized_twin, train_bpe, write_gguf  # noqa: E402
from model_factory import make_tiny_model, prefill_logits  # noqa: E402


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))


def with_rope_theta(hf_dir: Path, theta: float) -> Path:
    """Give the model a rope base other than the default, so a file whose base were not read would fail."""
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"]["rope_theta"] = theta
    path.write_text(json.dumps(config))
    return hf_dir


@pytest.mark.parametrize("arch,quant", [("qwen2", "F32"), ("qwen2", "Q8_0"), ("qwen3", "F32"), ("llama", "F32")])
def test_gguf_loads_and_matches_its_hf_twin(arch, quant, tmp_path):
    hf_dir = with_rope_theta(make_tiny_model(arch, tmp_path / "hf"), 1_000_000.0)
    twin = hf_dir if quant == "F32" else quantized_twin(hf_dir, tmp_path / "twin", quant)
    converted = resolve_model_path(str(write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", arch, quant)))
    got_cfg = json.loads((converted / "config.json").read_text())
    want_cfg = json.loads((hf_dir / "config.json").read_text())
    assert got_cfg["architectures"] == want_cfg["architectures"]
    assert got_cfg["rope_theta"] == 1_000_000.0
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "tie_word_embeddings"):
        assert got_cfg[key] == want_cfg[key], key
    assert got_cfg["head_dim"] == (want_cfg.get("head_dim") or want_cfg["hidden_size"] // want_cfg["num_attention_heads"])
    assert (converted / BLOCK_QUANT_FILE).is_file()
    ids = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    assert torch.equal(prefill_logits(converted, ids), prefill_logits(twin, ids))


def test_qwen2_gguf_greedy_tokens_equal_the_hf_twin_through_the_engine(tmp_path):
    from treespec.engine import Engine

    hf_dir = make_tiny_model("qwen2", tmp_path / "hf")
    gguf_path = write_gguf(hf_dir, tmp_path / "tiny-qwen2.gguf", "qwen2")
    params = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    outputs = []
    for path in (gguf_path, hf_dir):
        engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=512, speculative_algorithm="NONE")
        outputs.append(engine.generate(input_ids=[3, 141, 59, 26, 5], sampling_params=params)["output_ids"])
        engine.check_pool_balance()
        engine.shutdown()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 10


def test_qwen2_gguf_tokenizer_and_chat_template_survive_conversion(tmp_path):
    from treespec.tokenizer import load_tokenizer

    hf_dir = make_tiny_model("qwen2", tmp_path / "hf")
    converted = resolve_model_path(str(write_gguf(hf_dir, tmp_path / "tiny-qwen2.gguf", "qwen2")))
    tok, trained = load_tokenizer(converted), train_bpe()
    text = "hello world, hello there. the tree"
    ids = tok.encode(text)
    assert ids == trained.encode(text).ids and len(ids) < len(text) // 2  # merges applied, not bytes
    assert tok.decode(ids) == text
    end = tok.encode("<|im_end|>")
    assert len(end) == 1 and end[0] == 256 + 30 + SPECIAL_TOKENS.index("<|im_end|>")
    config = json.loads((converted / "config.json").read_text())
    assert config["eos_token_id"] == end[0]
    messages = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=True)[0] == end[0] - 1  # <|im_start|> whole


def test_gguf_of_an_unsupported_architecture_is_refused_naming_it(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelPathError, match="GGUF architecture 'phi2' is not supported .*llama, qwen2, qwen3"):
        resolve_model_path(str(path))


@pytest.mark.parametrize("scaling,expect", [("none", None), ("linear", {"rope_type": "linear", "factor": 4.0}),
                                            ("yarn", "rope scaling 'yarn' is not supported")])
def test_gguf_rope_scaling_is_kept_or_refused(scaling, expect):
    from treespec.gguf_arch import UnsupportedGGUFError, hf_config_from_gguf

    meta = {"general.architecture": "qwen2", "qwen2.attention.head_count": 4, "qwen2.embedding_length": 64,
            "qwen2.feed_forward_length": 128, "qwen2.block_count": 2, "qwen2.rope.scaling.type": scaling,
            "qwen2.rope.scaling.factor": 4.0}
    if isinstance(expect, str):
        with pytest.raises(UnsupportedGGUFError, match=expect):
            hf_config_from_gguf(meta, 300, tied=True)
    else:
        assert hf_config_from_gguf(meta, 300, tied=True)["rope_scaling"] == expect
