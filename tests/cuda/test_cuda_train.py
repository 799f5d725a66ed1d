"""The draft trainer on a GPU (--device cuda): features and training steps match the CPU's, and a head
trained end to end on CUDA (self-distilled replies, features, steps) serves exactly in a CUDA engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cuda.conftest import requires_cuda
from tests.treespec.test_train import _examples, setup  # noqa: F401  (setup is a fixture)
from treespec.engine import Engine
from treespec.models.draft_loader import load_draft_model
from treespec.train.__main__ import main as train_main
from treespec.train.features import compute_features, load_target
from treespec.train.trainer import TrainConfig, train

pytestmark = requires_cuda


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_cuda_training_follows_the_cpu(setup, tmp_path: Path, algorithm: str) -> None:  # noqa: F811
    examples = _examples(setup)
    capture = [2, 2, 1] if algorithm == "EAGLE3" else []
    cfg = TrainConfig(algorithm=algorithm, steps=12, batch_size=4, lr=3e-3, warmup=3, ttt_steps=3,
                      draft_vocab_size=128, save_every=100)
    runs = {}
    for device in ("cpu", "cuda"):
        target = load_target(setup["target"], 256, device)
        feats = compute_features(target, examples, capture)
        result = train(cfg, target, examples, feats, tmp_path / f"{device}.pt", False, 256, progress=False)
        assert next(result.model.parameters()).device.type == device
        runs[device] = feats, result
    (f_cpu, r_cpu), (f_gpu, r_gpu) = runs["cpu"], runs["cuda"]
    assert f_gpu.final.device.type == "cpu"  # features are kept on the host
    assert torch.allclose(f_cpu.final.float(), f_gpu.final.float(), atol=2e-2)
    assert torch.equal(r_cpu.vocab_ids, r_gpu.vocab_ids)
    assert r_gpu.history[-1] < r_gpu.history[0]
    # same data order and init: the losses agree up to float rounding over 12 Adam steps
    assert torch.allclose(torch.tensor(r_cpu.history), torch.tensor(r_gpu.history), rtol=2e-2)


def test_cli_trains_on_cuda_and_the_head_serves_exactly(setup, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "head"
    train_main(["--device", "cuda", "--algorithm", "EAGLE3", "--target-model-path", str(setup["target"]),
                "--data", str(setup["data"]), "--num-conversations", "16", "--holdout", "7",
                "--max-new-tokens", "16", "--max-seq-len", "64", "--steps", "6", "--batch-size", "4",
                "--ttt-steps", "2", "--draft-vocab-size", "64", "--output", str(out),
                "--checkpoint-dir", str(tmp_path / "ck"), "--distill-batch", "8"])
    # self-distillation ran on CUDA too: its replies are bf16's (the CUDA default), named so
    assert [f.name.rsplit("-", 1)[1] for f in tmp_path.glob("distill-*.jsonl")] == ["bfloat16.jsonl"]
    head = load_draft_model(out, "EAGLE3", 256)
    assert head.draft_vocab_size == 64
    prompts = [[3, 5, 7, 9, 11], [40, 41, 42, 43, 44, 45]]
    params = {"max_new_tokens": 12, "temperature": 0}
    kw = {"dtype": "float32", "device": "cuda", "max_total_tokens": 2048}
    plain = Engine(str(setup["target"]), **kw)
    spec = Engine(str(setup["target"]), **kw, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(out),
                  speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    got = [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
