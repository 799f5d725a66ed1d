"""Draft heads in the published checkpoint layouts: they load (names, shapes, config fields), compute
what the published architecture computes (checked against a direct implementation from the raw
tensors), and save_draft writes the same layout back."""

from __future__ import annotations

import json

import pytest
import torch
from draft_reference import attention, layer_state, mlp, rand, rms
from eagle_test_models import HIDDEN, draft_config, random_target, write_checkpoint
from safetensors.torch import load_file

from treespec.attention.metadata import build_metadata
from treespec.model_runner import ModelRunner
from treespec.models.draft_loader import load_draft_model, save_draft
from treespec.speculative.draft_runner import DraftRunner, draft_extend_batch

VOCAB, INTER, T = 256, 96, 7


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> ModelRunner:
    path = random_target(tmp_path_factory.mktemp("heads") / "target")
    return ModelRunner(path, torch.float32, torch.device("cpu"), kv_pool_size=64)


def eagle_state(seed: int = 0, bias: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": rand(HIDDEN, 2 * HIDDEN, gen=gen)}
    if bias:
        state["fc.bias"] = rand(HIDDEN, gen=gen)
    state.update(layer_state("layers.0.", HIDDEN, ["post_attention_layernorm"], gen))
    return state


def eagle3_state(draft_vocab: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": rand(HIDDEN, 3 * HIDDEN, gen=gen), "norm.weight": 1 + rand(HIDDEN, gen=gen)}
    state.update(layer_state("midlayer.", 2 * HIDDEN, ["input_layernorm", "hidden_norm", "post_attention_layernorm"], gen))
    if draft_vocab is not None:
        ids = torch.randperm(VOCAB, generator=gen)[:draft_vocab].sort().values
        state["lm_head.weight"] = rand(draft_vocab, HIDDEN, gen=gen)
        state["d2t"] = ids - torch.arange(draft_vocab)
        state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, ids, True)
    return state


# ---------------------------------------------------------------------------- direct implementations
def eagle_reference(s: dict, embed: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor):
    h = torch.cat([embed[ids], feats], -1) @ s["fc.weight"].T + s.get("fc.bias", 0)
    h = h + attention(h, s, "layers.0.self_attn.")  # layer 0: no input norm
    h = h + mlp(rms(h, s["layers.0.post_attention_layernorm.weight"]), s, "layers.0.mlp.")
    return h @ lm_head.T, h  # no final norm; the target's lm_head


def eagle3_reference(s: dict, embed: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor):
    hidden = aux @ s["fc.weight"].T
    x = torch.cat([rms(embed[ids], s["midlayer.input_layernorm.weight"]),
                   rms(hidden, s["midlayer.hidden_norm.weight"])], -1)
    h = hidden + attention(x, s, "midlayer.self_attn.")
    h = h + mlp(rms(h, s["midlayer.post_attention_layernorm.weight"]), s, "midlayer.mlp.")
    return rms(h, s["norm.weight"]) @ s.get("lm_head.weight", lm_head).T, h


def run_draft(runner: DraftRunner, ids: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.arange(1, T + 1)
    batch = draft_extend_batch(ids, torch.arange(T), slots, build_metadata([T], [slots]), feats, None)
    out = runner.forward(batch)
    return out.logits, out.hidden_states


def check_forward(runner: DraftRunner, state: dict, target: ModelRunner, reference) -> None:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (T,), generator=gen)
    feats = torch.randn(T, runner.model.input_hidden_size, generator=gen)
    embed, head = target.model.embed_tokens.weight.detach(), target.model.lm_head_weight.detach()
    want_logits, want_hidden = reference(state, embed, head, ids, feats)
    logits, hidden = run_draft(runner, ids, feats)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("variant", ["sglang", "model_prefix", "safeailab_no_bias"])
def test_published_eagle_checkpoint(tmp_path, target, variant) -> None:
    state = eagle_state(bias=variant != "safeailab_no_bias")
    arch = "LlamaForCausalLM" if variant == "safeailab_no_bias" else "LlamaForCausalLMEagle"
    stored = {("model." + k if variant == "model_prefix" else k): v for k, v in state.items()}
    path = write_checkpoint(tmp_path / "eagle", draft_config(arch, VOCAB, INTER, bias=variant != "safeailab_no_bias"), stored)
    runner = DraftRunner(str(path), "EAGLE", target)
    assert (runner.model.fc.bias is not None) == ("fc.bias" in state)
    check_forward(runner, state, target, eagle_reference)


@pytest.mark.parametrize("variant", ["reduced_vocab", "speculators_names", "same_vocab_no_d2t_no_lm_head"])
def test_published_eagle3_checkpoint(tmp_path, target, variant) -> None:
    reduced = variant != "same_vocab_no_d2t_no_lm_head"
    state = eagle3_state(100 if reduced else None)
    stored = {k.replace("midlayer.", "layers.0.") if variant == "speculators_names" else k: v for k, v in state.items()}
    extra = {"draft_vocab_size": 100 if reduced else None,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    path = write_checkpoint(tmp_path / "eagle3", draft_config("LlamaForCausalLMEagle3", VOCAB, INTER, **extra), stored)
    runner = DraftRunner(str(path), "EAGLE3", target)
    check_forward(runner, state, target, eagle3_reference)
    model = runner.model
    assert model.capture_layers(4) == [1, 2, 3]  # inputs of the layers after the listed outputs
    if reduced:
        want = state["d2t"] + torch.arange(100)
        assert torch.equal(runner.hot_token_map, want) and torch.equal(model.t2d, state["t2d"])
    else:
        assert runner.hot_token_map is None and model.lm_head is None


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_save_load_round_trip(tmp_path, target, algorithm) -> None:
    if algorithm == "EAGLE":
        state, cfg = eagle_state(seed=3), draft_config("LlamaForCausalLMEagle", VOCAB, INTER, bias=True)
    else:
        state = eagle3_state(64, seed=3)
        cfg = draft_config("LlamaForCausalLMEagle3", VOCAB, INTER, draft_vocab_size=64,
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    original = write_checkpoint(tmp_path / "original", cfg, state)
    model = load_draft_model(original, algorithm, 512)
    save_draft(model, tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(saved[name], value), name
    saved_cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key in ("architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "draft_vocab_size"):
        if key in cfg:
            assert saved_cfg[key] == cfg[key], key
    if "eagle_config" in cfg:
        assert saved_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    runner = DraftRunner(str(tmp_path / "saved"), algorithm, target)
    check_forward(runner, state, target, eagle_reference if algorithm == "EAGLE" else eagle3_reference)


def test_clear_errors(tmp_path, target) -> None:
    eagle3 = write_checkpoint(tmp_path / "e3", draft_config("LlamaForCausalLMEagle3", VOCAB, INTER, draft_vocab_size=100),
                              {k: v for k, v in eagle3_state(100).items() if k != "d2t"})
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE does not match"):
        DraftRunner(str(eagle3), "EAGLE", target)
    with pytest.raises(ValueError, match="missing weight 'd2t'"):
        DraftRunner(str(eagle3), "EAGLE3", target)


def test_token_map_restricts_the_eagle_head(tmp_path, target) -> None:
    """FR-Spec: with a hot-token list the EAGLE head's logits are the full head's logits at those ids
    (same hidden state), and the runner maps draft ids back to target ids."""
    from treespec.models.draft_loader import save_token_map

    state = eagle_state(seed=4)
    path = write_checkpoint(tmp_path / "eagle", draft_config("LlamaForCausalLMEagle", VOCAB, INTER, bias=True), state)
    hot = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:40]
    save_token_map(hot, tmp_path / "map.pt")
    full, restricted = DraftRunner(str(path), "EAGLE", target), DraftRunner(str(path), "EAGLE", target,
                                                                          token_map_path=str(tmp_path / "map.pt"))
    assert full.hot_token_map is None and torch.equal(restricted.hot_token_map, hot)
    gen = torch.Generator().manual_seed(2)
    ids, feats = torch.randint(0, VOCAB, (T,), generator=gen), torch.randn(T, HIDDEN, generator=gen)
    full_logits, full_hidden = run_draft(full, ids, feats)
    logits, hidden = run_draft(restricted, ids, feats)
    assert logits.shape == (T, 40)
    torch.testing.assert_close(hidden, full_hidden)
    torch.testing.assert_close(logits, full_logits[:, hot], rtol=1e-5, atol=1e-5)
    # the target's own lm_head is untouched (the draft restricted a copy)
    assert target.model.lm_head_weight.shape[0] == VOCAB


@pytest.mark.parametrize("content,match", [
    ("[1, 2, 2]", "distinct"), ("[1, 2, 999]", r"\[0, 256\)"), ("[[1, 2]]", "1-D"), ("[]", "1-D"),
    ("[0.5, 1.5]", "1-D"), ("not json", "could not be read"),
])
def test_token_map_errors_name_the_flag(tmp_path, target, content, match) -> None:
    from treespec.models.draft_loader import load_token_map

    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--speculative-token-map") as err:
        load_token_map(path, VOCAB)
    assert err.match(match)


def test_token_map_missing_file_and_eagle3_head_name_the_flag(tmp_path, target) -> None:
    from treespec.models.draft_loader import load_token_map

    with pytest.raises(ValueError, match="--speculative-token-map .* is not a file"):
        load_token_map(tmp_path / "missing.pt", VOCAB)
    eagle3 = write_checkpoint(tmp_path / "e3", draft_config("LlamaForCausalLMEagle3", VOCAB, INTER, draft_vocab_size=100),
                              eagle3_state(100))
    (tmp_path / "ok.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="--speculative-token-map applies to EAGLE heads"):
        DraftRunner(str(eagle3), "EAGLE3", target, token_map_path=str(tmp_path / "ok.json"))


def test_q8_0_rounding_bounds_each_weight_and_reproduces_exactly() -> None:
    from treespec.models.block_quant import quantize_q8_0

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(5, 96, generator=gen) * torch.logspace(-3, 1, 96)  # blocks of very different sizes
    w[2, 32:64] = 0.0  # an all-zero block: scale 0, weights stay 0
    quant = quantize_q8_0(w)
    back = quant.dequantize()
    step = quant.scales.float().repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= step * 0.5 + 1e-6 * w.abs()).all())
    assert torch.equal(back[2, 32:64], torch.zeros(32)) and quant.reproduces(back)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.ones(2, 40))


def test_q8_0_draft_head_streams_blocks_and_computes_its_rounded_weights(tmp_path, target) -> None:
    """--speculative-draft-model-quantization q8_0: the head's linears and own lm_head are packed as 8-bit
    blocks (where the block-quant kernels run), and the head computes what the published architecture
    computes with each of those weights rounded to Q8_0."""
    from treespec.models.block_quant import quantize_q8_0
    from treespec.models.packed_linear import PackedLinear, packing_layout

    state = eagle3_state(64, seed=4)
    cfg = draft_config("LlamaForCausalLMEagle3", VOCAB, INTER, draft_vocab_size=64,
                       eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    path = write_checkpoint(tmp_path / "eagle3", cfg, state)
    runner = DraftRunner(str(path), "EAGLE3", target, quantization="q8_0")
    rounded = {k: quantize_q8_0(v).dequantize() if k.endswith("proj.weight") or k in ("fc.weight", "lm_head.weight")
               else v for k, v in state.items()}
    assert sum(not torch.equal(rounded[k], state[k]) for k in state) == 9  # fc, 7 projections, lm_head
    check_forward(runner, rounded, target, eagle3_reference)
    if packing_layout(torch.device("cpu"), torch.float32) == "panel":
        layouts = {m.packed.layout for m in runner.model.modules() if isinstance(m, PackedLinear)}
        assert layouts == {"panel_quant"} and runner.model.packed_head.layout == "panel_quant"
