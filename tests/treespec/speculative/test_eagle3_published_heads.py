"""EAGLE-3 heads in vLLM's speculators format and with more than one layer: they load, and compute what
vLLM / the speculators library compute (checked against a direct implementation from the raw tensors,
which would tell norm_before_residual and the layer-2 path apart); a bad d2t or a tensor the head has
no place for is refused with a message naming the problem."""

from __future__ import annotations

import json

import pytest
import torch
from draft_reference import attention, decoder_layer, layer_state, mlp, rand, rms
from eagle3_formats import NORMS_FIRST, NORMS_LATER, speculators_config, vocab_maps
from eagle_test_models import HIDDEN, draft_config, random_target, write_checkpoint

from treespec.attention.metadata import build_metadata
from treespec.model_runner import ModelRunner
from treespec.models.draft_config import DraftHeadError
from treespec.models.draft_loader import load_draft_model, save_draft
from treespec.speculative.draft_runner import DraftRunner, draft_extend_batch

VOCAB, INTER, T, DRAFT_VOCAB = 256, 96, 7, 100


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> ModelRunner:
    path = random_target(tmp_path_factory.mktemp("published") / "target")
    return ModelRunner(path, torch.float32, torch.device("cpu"), kv_pool_size=64)


def head_state(layers: int, first: str = "layers.0.", fc_bias: bool = False, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": rand(HIDDEN, 3 * HIDDEN, gen=gen), "norm.weight": 1 + rand(HIDDEN, gen=gen),
             "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, gen=gen)}
    if fc_bias:
        state["fc.bias"] = rand(HIDDEN, gen=gen)
    state.update(layer_state(first, 2 * HIDDEN, NORMS_FIRST, gen))
    for i in range(1, layers):
        state.update(layer_state(f"layers.{i}.", HIDDEN, NORMS_LATER, gen))
    ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    return {**state, **vocab_maps(ids, VOCAB)}


def reference(s: dict, embed: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor, *, layers: int,
              norm_before_residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's / speculators' EAGLE-3 forward: first layer over [norm(embed), norm(fc(aux))] with the
    residual taken before or after that norm, then plain decoder layers, final norm, own lm_head."""
    hidden = aux @ s["fc.weight"].T + s.get("fc.bias", 0)
    normed = rms(hidden, s["layers.0.hidden_norm.weight"])
    x = torch.cat([rms(embed[ids], s["layers.0.input_layernorm.weight"]), normed], -1)
    h = (normed if norm_before_residual else hidden) + attention(x, s, "layers.0.self_attn.")
    h = h + mlp(rms(h, s["layers.0.post_attention_layernorm.weight"]), s, "layers.0.mlp.")
    for i in range(1, layers):
        h = decoder_layer(h, s, f"layers.{i}.")
    return rms(h, s["norm.weight"]) @ s["lm_head.weight"].T, h


def draft_forward(runner: DraftRunner, ids: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.arange(1, T + 1)
    out = runner.forward(draft_extend_batch(ids, torch.arange(T), slots, build_metadata([T], [slots]), aux, None))
    return out.logits, out.hidden_states


def check_against_reference(runner: DraftRunner, state: dict, embed: torch.Tensor, layers: int, nbr: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    ids, aux = torch.randint(0, VOCAB, (T,), generator=gen), torch.randn(T, 3 * HIDDEN, generator=gen)
    want_logits, want_hidden = reference(state, embed, ids, aux, layers=layers, norm_before_residual=nbr)
    logits, hidden = draft_forward(runner, ids, aux)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    # the check can tell: dropping the feature under test changes the output
    other, _ = reference(state, embed, ids, aux, layers=1, norm_before_residual=not nbr)
    assert (other - want_logits).abs().max() > 1e-2


@pytest.mark.parametrize("nbr", [True, False, None], ids=["nbr", "no-nbr", "nbr-absent"])
def test_speculators_head_loads_and_computes(tmp_path, target, nbr) -> None:
    state = head_state(1)
    state["embed_tokens.weight"] = rand(VOCAB, HIDDEN, gen=torch.Generator().manual_seed(9))
    path = write_checkpoint(tmp_path / "spec", speculators_config(VOCAB, INTER, DRAFT_VOCAB, norm_before_residual=nbr,
                                                                  aux_input_ids=[1, 2, 3]), state)
    runner = DraftRunner(str(path), "EAGLE3", target)
    model = runner.model
    assert model.capture_layers(4) == [1, 2, 3]  # vLLM's ids are the layers whose input is captured
    assert model.own_embed and torch.equal(runner.hot_token_map, state["d2t"] + torch.arange(DRAFT_VOCAB))
    check_against_reference(runner, state, state["embed_tokens.weight"], 1, nbr is not False)  # absent: vLLM's True


@pytest.mark.parametrize("fmt", ["flat", "speculators"])
def test_two_layer_head_with_fc_bias_loads_and_computes(tmp_path, target, fmt) -> None:
    state = head_state(2, fc_bias=True, seed=1)
    if fmt == "flat":
        # vLLM's flat layout: top-level aux ids, the inputs of the captured layers
        config = draft_config("LlamaForCausalLMEagle3", VOCAB, INTER, num_hidden_layers=2, draft_vocab_size=DRAFT_VOCAB,
                              eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    else:
        config = speculators_config(VOCAB, INTER, DRAFT_VOCAB, layers=2, norm_before_residual=False)
    runner = DraftRunner(str(write_checkpoint(tmp_path / fmt, config, state)), "EAGLE3", target)
    assert len(runner.model.later_layers) == 1 and runner.kv_pool.num_layers == 2
    assert runner.model.capture_layers(4) == [1, 2, 3]
    check_against_reference(runner, state, target.model.embed_tokens.weight.detach(), 2, False)


def test_deep_head_round_trip_keeps_layers_and_norm_before_residual(tmp_path, target) -> None:
    """save_draft writes a deeper / norm_before_residual head in names and fields that load back the same."""
    state = head_state(2, fc_bias=True, seed=2)
    config = speculators_config(VOCAB, INTER, DRAFT_VOCAB, layers=2, norm_before_residual=True)
    save_draft(load_draft_model(write_checkpoint(tmp_path / "original", config, state), "EAGLE3", 512), tmp_path / "saved")
    saved_cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_cfg["num_hidden_layers"] == 2 and saved_cfg["norm_before_residual"] is True
    runner = DraftRunner(str(tmp_path / "saved"), "EAGLE3", target)
    check_against_reference(runner, state, target.model.embed_tokens.weight.detach(), 2, True)


BAD_D2T = {
    "duplicate": (lambda d2t: d2t.index_fill(0, torch.tensor([7]), int(d2t[6]) - 1),
                  r"maps draft ids 6 and 7 to the same target id"),
    "above_vocab": (lambda d2t: d2t.index_fill(0, torch.tensor([DRAFT_VOCAB - 1]), VOCAB),
                    rf"draft id {DRAFT_VOCAB - 1} to target id \d+, outside the target vocabulary \[0, {VOCAB}\)"),
    "negative": (lambda d2t: d2t.index_fill(0, torch.tensor([0]), -1), r"draft id 0 to target id -1"),
    "short": (lambda d2t: d2t[:-1], rf"d2t has shape \({DRAFT_VOCAB - 1},\); expected \({DRAFT_VOCAB},\)"),
    "float": (lambda d2t: d2t.float(), "d2t must hold integer offsets"),
}


@pytest.mark.parametrize("case", sorted(BAD_D2T))
def test_bad_d2t_is_refused_with_a_message(tmp_path, target, case) -> None:
    corrupt, message = BAD_D2T[case]
    state = head_state(1)
    state["d2t"] = corrupt(state["d2t"].clone())
    path = write_checkpoint(tmp_path / case, speculators_config(VOCAB, INTER, DRAFT_VOCAB), state)
    with pytest.raises(DraftHeadError, match=message) as err:
        DraftRunner(str(path), "EAGLE3", target)
    assert err.match(r"--speculative-draft-model-path .*" + case)


def test_full_vocab_d2t_permutation_is_applied(tmp_path, target) -> None:
    """A d2t over the whole vocabulary that is not the identity still maps ids (not silently dropped)."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
    state = {**head_state(1), **vocab_maps(perm, VOCAB),
             "lm_head.weight": rand(VOCAB, HIDDEN, gen=torch.Generator().manual_seed(4))}
    runner = DraftRunner(str(write_checkpoint(tmp_path / "perm", speculators_config(VOCAB, INTER, VOCAB), state)),
                         "EAGLE3", target)
    assert torch.equal(runner.hot_token_map, perm)
    state.update(vocab_maps(torch.arange(VOCAB), VOCAB))  # the identity: no map
    runner = DraftRunner(str(write_checkpoint(tmp_path / "identity", speculators_config(VOCAB, INTER, VOCAB), state)),
                         "EAGLE3", target)
    assert runner.hot_token_map is None


@pytest.mark.parametrize("case,edit,message", [
    ("extra_layer", lambda c, s: s.update(layer_state("layers.1.", HIDDEN, NORMS_LATER, torch.Generator())),
     r"weights this head does not use: \['layers.1."),
    ("missing_layer", lambda c, s: c["transformer_layer_config"].update(num_hidden_layers=2),
     r"missing weight 'layers.1.self_attn.q_proj.weight'"),
    ("model_type", lambda c, s: c["transformer_layer_config"].update(model_type="qwen3"),
     r"model_type 'qwen3' is not supported"),
    ("algorithm", lambda c, s: c.update(speculators_model_type="eagle"), r"speculators_model_type 'eagle'"),
    ("norm_before_fc", lambda c, s: c.update(norm_before_fc=True), "norm_before_fc heads are not supported"),
    ("aux_layers", lambda c, s: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 4]),
     r"needs 3 captured target layers in \[0, 4\); its config gives the inputs of layers \[2, 3, 4\]"),
])
def test_unusable_speculators_heads_are_refused(tmp_path, target, case, edit, message) -> None:
    state, config = head_state(1), speculators_config(VOCAB, INTER, DRAFT_VOCAB)
    edit(config, state)
    path = write_checkpoint(tmp_path / case, config, state)
    with pytest.raises(DraftHeadError, match=message):
        DraftRunner(str(path), "EAGLE3", target)
    if case == "extra_layer":
        with pytest.raises(DraftHeadError, match="--speculative-algorithm EAGLE does not match"):
            DraftRunner(str(path), "EAGLE", target)
