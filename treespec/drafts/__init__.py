"""Draft heads shipped with treespec for the embedded default model (SmolLM2-135M-Instruct), trained by
`python -m treespec.train` (see docs/training.md): smollm2-135m-eagle3/ and smollm2-135m-eagle/."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIPPED = {"EAGLE3": "smollm2-135m-eagle3", "EAGLE": "smollm2-135m-eagle"}
# (num_steps, topk, num_draft_tokens) tuned for each shipped head with benchmarks/eval_accept_length.py
TUNED = {"EAGLE3": (5, 4, 8), "EAGLE": (5, 4, 8)}


def shipped_draft_path(algorithm: str) -> Path | None:
    """The shipped head for the default model and `algorithm`, or None when there is none."""
    name = SHIPPED.get(algorithm.upper())
    if name is None:
        return None
    path = HERE / name
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None
