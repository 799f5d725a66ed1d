"""A draft head folder's config.json, read into one flat Llama-style dict whatever its published
format, with the architecture check; and DraftHeadError, the error every unusable head raises.

Formats read:
* flat (SGLang, SafeAILab, treespec's own): the Llama fields at top level, `architectures` naming the
  head (`LlamaForCausalLMEagle`, `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM`, or a plain
  `LlamaForCausalLM` read as the layout of --speculative-algorithm);
* vLLM "speculators" (`speculators_config` + `speculators_model_type: eagle3`): the draft's layer config
  nested under `transformer_layer_config`, head fields (`draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual`, `eagle_aux_hidden_state_layer_ids`) at top level. Flattened here as vLLM does:
  `norm_before_residual` absent means true, and the aux layer ids keep vLLM's meaning (the target
  layers whose *input* is captured), stored under `eagle_aux_hidden_state_input_layer_ids`.
"""

from __future__ import annotations

from pathlib import Path

from treespec.model_loader import ModelPathError, load_config

FLAG = "--speculative-draft-model-path"
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DRAFT_ARCHITECTURES = {EAGLE_ARCHITECTURE: "EAGLE", **{a: "EAGLE3" for a in EAGLE3_ARCHITECTURES}}
# vLLM's key for the speculators format's aux ids after flattening would clash with SGLang's meaning
# (eagle_config's ids are layer *outputs*); this key says which one it is.
INPUT_LAYER_IDS = "eagle_aux_hidden_state_input_layer_ids"


class DraftHeadError(ModelPathError):
    """A draft head that cannot be used; the message names --speculative-draft-model-path and the problem
    (a ModelPathError, so a server start reports it as a bad flag, without a traceback)."""


def flatten_speculators_config(raw: dict, where: str) -> dict:
    """The flat config of a speculators-format EAGLE-3 head."""
    kind = raw.get("speculators_model_type") or (raw.get("speculators_config") or {}).get("algorithm")
    if kind != "eagle3":
        raise DraftHeadError(f"{where}: speculators_model_type {kind!r} is not supported (only eagle3)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftHeadError(f"{where}: a speculators config needs a transformer_layer_config object")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise DraftHeadError(f"{where}: transformer_layer_config model_type {model_type!r} is not supported "
                             f"(only llama decoder layers)")
    if raw.get("norm_before_fc"):
        raise DraftHeadError(f"{where}: norm_before_fc heads are not supported")
    flat = {key: value for key, value in layer.items() if key != "architectures"}
    flat["architectures"] = [EAGLE3_ARCHITECTURES[0]]
    flat["draft_vocab_size"] = raw.get("draft_vocab_size") or layer.get("vocab_size")
    flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))  # vLLM's default
    if raw.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = raw["target_hidden_size"]
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        flat[INPUT_LAYER_IDS] = list(raw["eagle_aux_hidden_state_layer_ids"])
    return flat


def read_draft_config(path: Path, algorithm: str) -> dict:
    """config.json of the head at `path` as a flat dict; `algorithm` (EAGLE | EAGLE3) must agree with it."""
    where = f"{FLAG} {str(path)!r}"
    if not (path / "config.json").is_file():
        raise DraftHeadError(f"{where} has no config.json")
    raw = load_config(path)
    if "speculators_config" in raw or "speculators_model_type" in raw:
        hf = flatten_speculators_config(raw, where)
    else:
        hf = dict(raw)
        if hf.get("eagle_aux_hidden_state_layer_ids") and not (hf.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids"):
            hf[INPUT_LAYER_IDS] = list(hf["eagle_aux_hidden_state_layer_ids"])  # vLLM's top-level key
    archs = hf.get("architectures") or []
    named = {DRAFT_ARCHITECTURES[a] for a in archs if a in DRAFT_ARCHITECTURES}
    if named and algorithm not in named:
        raise DraftHeadError(f"--speculative-algorithm {algorithm} does not match the draft checkpoint "
                             f"{str(path)!r}, whose architectures are {archs}")
    if not named and "LlamaForCausalLM" not in archs:
        raise DraftHeadError(f"{where}: unsupported architectures {archs}; expected one of "
                             f"{sorted(DRAFT_ARCHITECTURES)} or a speculators eagle3 config")
    return hf
