"""Draft heads shipped with treespec for the embedded default model (SmolLM2-135M-Instruct), trained by
`python -m treespec.train` (see docs/training.md): smollm2-135m-eagle3/ and smollm2-135m-eagle/; and the
NGRAM schedule tuned for that model (ngram/speculative_config.json), which `--speculative-algorithm auto`
uses there."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIPPED = {"EAGLE3": "smollm2-135m-eagle3", "EAGLE": "smollm2-135m-eagle"}
# (num_steps, topk, num_draft_tokens) for each shipped head at batch 1 (benchmarks/bench_speculative.py);
# a head folder's speculative_config.json, when present, sets them by batch size
TUNED = {"EAGLE3": (2, 1, 3), "EAGLE": (1, 1, 2)}
# n-gram nodes added to the shipped head's trees (--speculative-hybrid-ngram-tokens); measured with
# benchmarks/bench_spec_ab.py (docs/performance.md): on held-out chat and code editing the hybrid beat
# the head alone. The EAGLE head was not measured with it: off.
TUNED_HYBRID_NGRAM_TOKENS = {"EAGLE3": 6}


def shipped_draft_path(algorithm: str) -> Path | None:
    """The shipped head for the default model and `algorithm`, or None when there is none."""
    name = SHIPPED.get(algorithm.upper())
    if name is None:
        return None
    path = HERE / name
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None


def ngram_schedule_path() -> Path | None:
    """The NGRAM schedule tuned for the default model, or None. On CPU: up to 12 nodes whose estimated
    acceptance is >= 0.3 at batch 1 (on two cores every verified node costs ~0.1-0.2 of a decode step
    with the default int8 activations), 8 of >= 0.4 at batch 2-4 (each request verifies its own nodes
    only), 8 of >= 0.7 at batch 5-16 (a verified row costs ~0.7 of a batch-16 step's cost per token;
    this pays since the tries are C++: 0.92x on chat with the Python trie), plain above; where the
    kernels run their AVX2 code, 8 of >= 0.5 up to batch 4. On CUDA, where verified nodes cost almost
    nothing: 8 nodes up to batch 4, plain above."""
    path = HERE / "ngram" / "speculative_config.json"
    return path if path.is_file() else None


def ngram_corpus_path() -> Path | None:
    """The warm n-gram corpus for the default model (speculative/ngram_corpus.py), or None: its greedy
    replies to ShareGPT training-pool first turns, made by `python -m treespec.train.ngram_corpus`."""
    path = HERE / "ngram" / "corpus.json.gz"
    return path if path.is_file() else None
