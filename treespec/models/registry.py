"""Target model registry: the HF config.json `architectures` name -> the class that implements it."""

from __future__ import annotations

from treespec.models.llama import LlamaForCausalLM

# One implementation covers the Llama family today; ModelConfig.from_hf reads how each one differs
# (Qwen2: q/k/v bias; Qwen3: q/k RMSNorm; Mistral: a sliding window, up to which the runner caps
# the context). A family with its own class adds its entry here.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    """config.json names no architecture in MODEL_REGISTRY."""


def model_class_for(hf_config: dict) -> type[LlamaForCausalLM]:
    """The class for the first of `hf_config["architectures"]` that the registry holds."""
    architectures = hf_config.get("architectures") or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures} in config.json; supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
