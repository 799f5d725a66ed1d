"""Our forward pass against transformers' forward (fp32): extend, chunked extend + decode, and tree
(custom-mask) inputs, on tiny random models of every family and on SmolLM2-135M."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from treespec.attention.metadata import build_metadata
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.model_loader import resolve_model_path
from treespec.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_factory import make_tiny_model  # noqa: E402

TOL = 1e-3
FAMILIES = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3"]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run(runner: ModelRunner, mode, ids, positions, out_loc, qo_lens, kv_lists, masks=None):
    batch = ForwardBatch(mode, torch.tensor(ids), torch.tensor(positions), torch.tensor(out_loc),
                         build_metadata(qo_lens, [torch.tensor(k) for k in kv_lists], masks))
    return runner.forward(batch).logits


def check_parity(model_dir: Path, prompt_len: int = 40, seed: int = 0) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), kv_pool_size=1100)  # tree slots 1001+
    vocab = runner.config.vocab_size
    ids = torch.randint(0, vocab, (prompt_len + 2,)).tolist()
    ref = hf_logits(hf, ids)

    # 1. one extend over the whole prompt (slots deliberately not contiguous)
    slots = (torch.randperm(1000)[: len(ids)] + 1).tolist()
    n = prompt_len
    got = run(runner, ForwardMode.EXTEND, ids[:n], range(n), slots[:n], [n], [slots[:n]])
    assert (got - ref[:n]).abs().max() < TOL

    # 2. chunked: extend 25, extend the rest, then decode two tokens
    m = 25
    run(runner, ForwardMode.EXTEND, ids[:m], range(m), slots[:m], [m], [slots[:m]])
    got = run(runner, ForwardMode.EXTEND, ids[m:n], range(m, n), slots[m:n], [n - m], [slots[:n]])
    assert (got - ref[m:n]).abs().max() < TOL
    for p in (n, n + 1):
        got = run(runner, ForwardMode.DECODE, [ids[p]], [p], [slots[p]], [1], [slots[: p + 1]])
        assert (got[0] - ref[p]).abs().max() < TOL

    # 3. tree: prefix = ids[:n]; 7 nodes with parents; each node sees prefix + ancestors + itself
    parents = [-1, 0, 0, 1, 1, 2, 4]
    tree_tokens = torch.randint(0, vocab, (len(parents),)).tolist()
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    mask = torch.zeros(len(parents), n + len(parents), dtype=torch.bool)
    mask[:, :n] = True
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, n + j] = True
            j = parents[j]
    tree_slots = (torch.arange(len(parents)) + 1001).tolist()
    run(runner, ForwardMode.EXTEND, ids[:n], range(n), slots[:n], [n], [slots[:n]])
    got = run(runner, ForwardMode.TARGET_VERIFY, tree_tokens, [n + d for d in depth], tree_slots,
              [len(parents)], [slots[:n] + tree_slots], [mask])
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tree_tokens[j])
            j = parents[j]
        expect = hf_logits(hf, ids[:n] + path)[-1]
        assert (got[i] - expect).abs().max() < TOL, f"tree node {i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_parity(family: str, tmp_path: Path) -> None:
    check_parity(make_tiny_model(family, tmp_path / family))


def test_smollm2_parity() -> None:
    check_parity(resolve_model_path(None), prompt_len=30)


def test_batched_extend_matches_single(tmp_path: Path) -> None:
    """Two requests of different lengths in one padded batch give the same logits as alone."""
    model_dir = make_tiny_model("qwen2", tmp_path / "m")
    runner = ModelRunner(model_dir, torch.float32, torch.device("cpu"), kv_pool_size=512)
    a, b = list(range(5, 25)), list(range(50, 57))
    la = run(runner, ForwardMode.EXTEND, a, range(20), range(1, 21), [20], [range(1, 21)])
    lb = run(runner, ForwardMode.EXTEND, b, range(7), range(31, 38), [7], [range(31, 38)])
    both = run(runner, ForwardMode.EXTEND, a + b, list(range(20)) + list(range(7)),
               list(range(101, 121)) + list(range(131, 138)), [20, 7],
               [list(range(101, 121)), list(range(131, 138))])
    assert (both[:20] - la).abs().max() < 1e-4
    assert (both[20:] - lb).abs().max() < 1e-4


def test_rope_tables_are_float64_cos_sin_rounded_to_fp32() -> None:
    """The cos/sin tables are math.cos/sin of the fp32 angles, rounded to fp32, in the rotate-half
    layout (sin's first half negated). torch's fp32 cos differs from that in ~10 % of entries (its
    1-ulp error), and on one Intel host its multi-threaded first call was off by ~1e-4 in some
    processes: each process then ran its own model."""
    import math

    from treespec.models.layers import RotaryEmbedding, rope_inv_freq

    head_dim, positions = 64, 2048
    rope = RotaryEmbedding(head_dim, positions, 100000.0, None)
    inv_freq = rope_inv_freq(head_dim, 100000.0, None).float()
    half = head_dim // 2
    for p in (0, 1, 7, 1000, positions - 1):
        angles = (torch.tensor(float(p)) * inv_freq).tolist()  # the fp32 products the table is built from
        want_cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float32)
        want_sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float32)
        assert torch.equal(rope.cos[p, :half], want_cos) and torch.equal(rope.cos[p, half:], want_cos)
        assert torch.equal(rope.sin[p, :half], -want_sin) and torch.equal(rope.sin[p, half:], want_sin)
