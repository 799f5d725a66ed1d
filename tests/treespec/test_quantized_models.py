"""Quantized HF folders: FP8 checkpoints in each published layout load to exactly the weights they
encode (logits equal to the dequantized fp32 twin's), and every other quantization is refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from treespec.model_loader import ModelPathError, load_hf_weights, resolve_model_path
from treespec.models.quant_config import UnsupportedQuantizationError, dequantize_fp8_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_factory import LAYOUTS, make_fp8_twins  # noqa: E402
from model_factory import make_tiny_model, prefill_logits  # noqa: E402


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_folder_matches_its_dequantized_reference(layout, tiny_qwen2, tmp_path):
    fp8_dir, ref_dir = make_fp8_twins(tiny_qwen2, tmp_path, LAYOUTS[layout])
    assert resolve_model_path(str(fp8_dir)) == fp8_dir
    state, ref = load_hf_weights(fp8_dir), load_hf_weights(ref_dir)
    assert set(state) == set(ref)  # scales and activation scales consumed
    name = "model.layers.1.mlp.down_proj.weight"
    assert state[name].dtype == torch.float32 and torch.equal(state[name], ref[name])
    ids = torch.randint(0, 300, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(prefill_logits(fp8_dir, ids), prefill_logits(ref_dir, ids))
    # ignoring the scales would have loaded different weights: the check above can fail
    unscaled = load_hf_weights(tiny_qwen2)  # (original fp32: the FP8 rounding is visible too)
    assert not torch.equal(state[name], unscaled[name])


def test_fp8_folder_greedy_tokens_equal_the_reference_through_the_engine(tiny_qwen2, tmp_path):
    from treespec.engine import Engine

    fp8_dir, ref_dir = make_fp8_twins(tiny_qwen2, tmp_path, LAYOUTS["hf_fp8_block"])
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    outputs = []
    for model_dir in (fp8_dir, ref_dir):
        engine = Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=512,
                        speculative_algorithm="NONE")
        out = engine.generate(input_ids=[5, 17, 42, 99, 7], sampling_params=params)
        engine.check_pool_balance()
        engine.shutdown()
        outputs.append(out["output_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12


def test_block_scales_broadcast_over_partial_tiles():
    weight = torch.ones(5, 7).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = dequantize_fp8_weight(weight, scale, (3, 4), "w")
    want = torch.tensor([[1.0] * 4 + [2.0] * 3] * 3 + [[3.0] * 4 + [4.0] * 3] * 2)
    assert torch.equal(got, want)


def write_folder(path: Path, quantization_config, state=None) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    save_file(state or {"x": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


REFUSED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "'gptq'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    "bitsandbytes_legacy": ({"load_in_8bit": True}, "'bitsandbytes'"),
    "unknown": ({"quant_method": "mystery"}, "'mystery'"),
    "no_method": ({"bits": 4}, "quant_method None"),
    "ct_int4": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
        "'compressed-tensors' \\(format 'pack-quantized', int 4-bit"),
    "ct_int8": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
        "'compressed-tensors' \\(format 'int-quantized'"),
    "ct_nvfp4": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
        "nvfp4-pack-quantized"),
    "ct_sparse": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                   "sparsity_config": {"format": "sparse-24-bitmask"}, "config_groups": {}}, "sparse-24-bitmask"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_quantization_is_refused_by_name_at_resolution_and_load(case, tmp_path):
    config, name = REFUSED[case]
    folder = write_folder(tmp_path / case, config)
    with pytest.raises(ModelPathError, match=f"--model-path .*quantized model format .*{name}"):
        resolve_model_path(str(folder))
    with pytest.raises(UnsupportedQuantizationError, match=name):
        load_hf_weights(folder)


def test_engine_start_fails_naming_the_format(tmp_path):
    from treespec.engine import Engine

    folder = write_folder(tmp_path / "awq", REFUSED["awq"][0])
    with pytest.raises(ModelPathError, match="quant_method 'awq' is not supported"):
        Engine(model_path=str(folder), dtype="float32", speculative_algorithm="NONE")


@pytest.mark.parametrize("case", ["fp8_without_config", "fp8_without_scale", "scale_without_weight", "bad_scale"])
def test_inconsistent_fp8_checkpoints_are_refused(case, tmp_path):
    fp8 = torch.ones(4, 8).to(torch.float8_e4m3fn)
    config = {"quant_method": "fp8", "weight_block_size": [2, 4]}
    state = {
        "fp8_without_config": {"a.weight": fp8},
        "fp8_without_scale": {"a.weight": fp8},
        "scale_without_weight": {"a.weight_scale_inv": torch.ones(2, 2)},
        "bad_scale": {"a.weight": fp8, "a.weight_scale_inv": torch.ones(3, 3)},
    }[case]
    folder = write_folder(tmp_path / case, None if case == "fp8_without_config" else config, state)
    message = {"fp8_without_config": "no quantization_config", "fp8_without_scale": "has no weight_scale_inv",
               "scale_without_weight": "no a.weight", "bad_scale": r"scale of shape \(3, 3\)"}[case]
    with pytest.raises(UnsupportedQuantizationError, match=message):
        load_hf_weights(folder)
