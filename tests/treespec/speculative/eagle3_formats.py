"""EAGLE-3 heads in the other published layouts, for the tests: vLLM's "speculators" format
(config.json with speculators_config and the layer config nested under transformer_layer_config,
weights `layers.0.*`, top-level eagle_aux_hidden_state_layer_ids = target layers whose *input* is
captured), and deeper heads (`layers.{i}.*`, num_hidden_layers > 1). Lookup variants of these heads
draft well only if the loader honours what makes them different (norm_before_residual, layer 2)."""

from __future__ import annotations

from pathlib import Path

import torch
from eagle_test_models import AUX_LAYER_IDS, HIDDEN, Lookup, _layer_weights, draft_config, write_checkpoint

NORMS_FIRST = ["input_layernorm", "hidden_norm", "post_attention_layernorm"]
NORMS_LATER = ["input_layernorm", "post_attention_layernorm"]
# the same target layers as AUX_LAYER_IDS (outputs of 0, 1, 2), in vLLM's meaning (inputs of 1, 2, 3)
AUX_INPUT_LAYER_IDS = [i + 1 for i in AUX_LAYER_IDS]


def speculators_config(vocab: int, intermediate: int, draft_vocab: int, *, layers: int = 1,
                       norm_before_residual: bool | None = True, aux_input_ids: list[int] | None = None) -> dict:
    """A speculators eagle3 config.json as the speculators library writes it (norm_before_residual None:
    the key left out)."""
    layer_cfg = {key: value for key, value in draft_config("LlamaForCausalLM", vocab, intermediate).items()
                 if key not in ("architectures", "torch_dtype")}
    layer_cfg["num_hidden_layers"] = layers
    config = {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": aux_input_ids or AUX_INPUT_LAYER_IDS,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": "tests/lookup-target", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer_cfg,
        "torch_dtype": "float32",
    }
    if norm_before_residual is not None:
        config["norm_before_residual"] = norm_before_residual
    return config


def vocab_maps(ids: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)}


def lookup_speculators_head(path: Path, lookup: Lookup, norm_before_residual: bool = True, seed: int = 1) -> Path:
    """Speculators-format lookup head whose fc triples the captured state: the residual stream starts at
    e(v) only when it is taken after hidden_norm (norm_before_residual); from 3·e(v) the MLP's
    e(succ v) - e(v) leaves v the top token, and the head repeats itself instead of drafting succ."""
    gen = torch.Generator().manual_seed(seed)
    vocab, ids = lookup.embed.shape[0], lookup.draft_ids
    state = {"fc.weight": torch.cat([3 * torch.eye(HIDDEN), torch.zeros(HIDDEN, 2 * HIDDEN)], 1),
             "norm.weight": torch.ones(HIDDEN), "lm_head.weight": lookup.embed[ids].clone(),
             "embed_tokens.weight": lookup.embed.clone(), **vocab_maps(ids, vocab)}
    state.update(_layer_weights("layers.0.", 2 * HIDDEN, lookup.mlp(), NORMS_FIRST, gen))
    config = speculators_config(vocab, vocab, int(ids.numel()), norm_before_residual=norm_before_residual)
    return write_checkpoint(path, config, state)


def lookup_two_layer_head(path: Path, lookup: Lookup, seed: int = 1) -> Path:
    """Two-layer lookup head (flat config, vLLM names, fc.bias): layer 0 passes the captured state
    through unchanged (its MLP adds nothing), layer 1 applies succ. Without layer 1 the head would
    draft the token it was given."""
    gen = torch.Generator().manual_seed(seed)
    vocab, ids = lookup.embed.shape[0], lookup.draft_ids
    bias = torch.zeros(HIDDEN)
    bias[1] = 0.05  # small: the lookup's gates have a wide margin
    state = {"fc.weight": torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, 2 * HIDDEN)], 1), "fc.bias": bias,
             "norm.weight": torch.ones(HIDDEN), "lm_head.weight": lookup.embed[ids].clone(), **vocab_maps(ids, vocab)}
    idle = {name: torch.zeros_like(w) if name == "down_proj" else w for name, w in lookup.mlp().items()}
    state.update(_layer_weights("layers.0.", 2 * HIDDEN, idle, NORMS_FIRST, gen))
    state.update(_layer_weights("layers.1.", HIDDEN, lookup.mlp(), NORMS_LATER, gen))
    extra = {"draft_vocab_size": int(ids.numel()), "num_hidden_layers": 2, "bias": True,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True}}
    return write_checkpoint(path, draft_config("LlamaForCausalLMEagle3", vocab, vocab, **extra), state)
