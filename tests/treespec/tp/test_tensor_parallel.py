"""Tensor parallelism in process: two gloo ranks (torch.multiprocessing spawn, one thread each) against
TP 1 in this process, on tiny models.

- the model split: TP 2 logits equal TP 1 logits up to summation order, for Llama (untied head, vocab
  split evenly), Qwen2 (q/k/v bias, tied head) and a Llama with an odd vocabulary (padded) and 3 KV
  heads (split unevenly, 2 + 1 groups); the packed CPU matmul path and plain F.linear alike; the
  collectives through shared memory (the default here) and through gloo, with equal results; the hidden
  states are bit-identical on both ranks (what keeps a replicated draft head and every scheduling
  decision in lock step);
- schedulers fed the same requests on both ranks: greedy outputs equal TP 1's, speculative (EAGLE-3)
  and NGRAM greedy outputs equal plain ones within TP 2, grammar-constrained requests (whose compile
  time differs by rank) equal TP 1's, seeded sampling agrees across ranks, an abort, and the KV pool
  balances on every rank after every scenario.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target  # noqa: E402
from model_factory import TINY, copy_default_tokenizer, make_tiny_model  # noqa: E402
from tp_ranks import prefill_logits, rank_main, run_requests  # noqa: E402

from treespec.args import ServerArgs  # noqa: E402
from treespec.distributed.shm_comm import shm_available  # noqa: E402
from treespec.server.testing import free_port  # noqa: E402

LOGIT_TOL = 1e-4  # fp32, a 3-layer model: only the order of the row-parallel sums differs


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(12)]  # half the prompts share a prefix (radix cache hits)
    return [(shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(3, 16))]
            for i in range(count)]


PROMPTS = make_prompts(8, seed=0)
GREEDY = [{"temperature": 0, "max_new_tokens": 6 + i % 7, "ignore_eos": True} for i in range(len(PROMPTS))]
# grammars compile on a thread, finishing at a different time on each rank: under TP every rank waits
REGEX = r"(yes|no|maybe), [a-z]{2,6} [0-9]{1,3}"
CONSTRAINED = [{"temperature": 0, "max_new_tokens": 24, **({"regex": REGEX} if i % 2 else {"ignore_eos": True})}
               for i in range(4)]
FULL_VOCAB_PROMPTS = [[(7919 * (i + 1) * (j + 3)) % 49152 for j in range(6 + i)] for i in range(4)]
SAMPLED = [{"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True, "seed": i}
           for i in range(len(PROMPTS))]


def full_vocab_llama(out_dir: Path) -> Path:
    """The default tokenizer's whole vocabulary, so grammar text tokenizes (tests/treespec/test_constrained.py)."""
    import transformers as tf

    torch.manual_seed(4)
    cfg = tf.LlamaConfig(**{**TINY, "vocab_size": 49152}, tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    copy_default_tokenizer(out_dir)
    return out_dir


def odd_llama(out_dir: Path) -> Path:
    """A vocabulary that does not divide by 2 (padded) and 3 KV heads (split 2 + 1, with their query
    heads), as the default model's 9 heads in 3 groups split."""
    import transformers as tf

    torch.manual_seed(3)
    cfg = tf.LlamaConfig(**{**TINY, "vocab_size": 301, "hidden_size": 96, "num_attention_heads": 6,
                            "num_key_value_heads": 3}, tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    copy_default_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """Run every scenario once on two ranks; returns (scenarios, rank 0's results, rank 1's)."""
    root = tmp_path_factory.mktemp("tp")
    lookup = Lookup(seed=0)
    target = lookup_target(root / "lookup_target", lookup, noise=0.07)
    head = lookup_eagle3_head(root / "eagle3", lookup)
    llama = make_tiny_model("llama", root / "llama")
    qwen2 = make_tiny_model("qwen2", root / "qwen2")
    odd = odd_llama(root / "odd")
    full_vocab = full_vocab_llama(root / "full_vocab")
    base = dict(model_path=str(target), device="cpu", max_total_tokens=1024, max_running_requests=8,
                speculative_algorithm="NONE")
    eagle3 = dict(base, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head),
                  speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    scenarios = {
        "logits_llama": ("logits", (llama,)),
        "logits_llama_dense": ("logits", (llama, False)),
        "logits_llama_gloo": ("logits_gloo", (llama,)),
        "logits_qwen2": ("logits", (qwen2,)),
        "logits_odd": ("logits", (odd,)),
        "plain": ("requests", (ServerArgs(**base), PROMPTS, GREEDY)),
        "eagle3": ("requests", (ServerArgs(**eagle3), PROMPTS, GREEDY)),
        "eagle3_sampled": ("requests", (ServerArgs(**eagle3), PROMPTS, SAMPLED)),
        "plain_abort": ("requests", (ServerArgs(**base), PROMPTS, GREEDY, "r3")),
        "ngram": ("requests", (ServerArgs(**dict(base, speculative_algorithm="NGRAM")), PROMPTS, GREEDY)),
        "grammar": ("requests", (ServerArgs(**dict(base, model_path=str(full_vocab))), FULL_VOCAB_PROMPTS,
                                 CONSTRAINED)),
    }
    out = root / "out"
    out.mkdir()
    mp.start_processes(rank_main, args=(free_port(), scenarios, str(out)), nprocs=2, start_method="spawn")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return scenarios, ranks[0], ranks[1]


@pytest.mark.parametrize("name", ["logits_llama", "logits_llama_dense", "logits_llama_gloo", "logits_qwen2",
                                  "logits_odd"])
def test_tp2_logits_match_tp1(tp_results, name):
    scenarios, rank0, rank1 = tp_results
    ref_logits, ref_hidden = prefill_logits(*scenarios[name][1], tp=None)
    for logits, hidden in (rank0[name], rank1[name]):
        assert logits.shape == ref_logits.shape  # the vocab padding is cut off
        torch.testing.assert_close(logits, ref_logits, atol=LOGIT_TOL, rtol=LOGIT_TOL)
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
        torch.testing.assert_close(hidden, ref_hidden, atol=LOGIT_TOL, rtol=LOGIT_TOL)
    # the collectives hand both ranks the same bits: their decisions cannot drift apart
    assert torch.equal(rank0[name][0], rank1[name][0]) and torch.equal(rank0[name][1], rank1[name][1])
    if name == "logits_llama_gloo":  # shared memory and gloo sum the two partials alike: a + b
        assert torch.equal(rank0[name][0], rank0["logits_llama"][0])
    if shm_available(torch.device("cpu"), 1):  # x86-64 CPU ranks of one machine
        assert rank0["uses_shm"] and rank1["uses_shm"]


def test_tp2_greedy_equals_tp1_and_speculation_equals_plain(tp_results):
    scenarios, rank0, rank1 = tp_results
    tp1_plain, tp1_balanced = run_requests(*scenarios["plain"][1])
    assert tp1_balanced
    for results in (rank0, rank1):
        for name in ("plain", "eagle3", "ngram"):
            outputs, balanced = results[name]
            assert balanced, f"{name}: KV pool out of balance on a rank"
            assert outputs == tp1_plain, name
    assert rank0["plain"] == rank1["plain"] and rank0["eagle3"] == rank1["eagle3"]
    assert all(len(tp1_plain[f"r{i}"]) == p["max_new_tokens"] for i, p in enumerate(GREEDY))


def test_tp2_grammar_outputs_equal_tp1(tp_results):
    scenarios, rank0, rank1 = tp_results
    tp1, balanced = run_requests(*scenarios["grammar"][1])
    assert balanced and rank0["grammar"] == (tp1, True) and rank1["grammar"] == (tp1, True)
    assert any(len(tp1[f"r{i}"]) < 24 for i in (1, 3))  # the grammar ended a constrained request


def test_tp2_sampling_and_abort_agree_across_ranks(tp_results):
    _, rank0, rank1 = tp_results
    for name in ("eagle3_sampled", "plain_abort"):
        assert rank0[name][1] and rank1[name][1], f"{name}: KV pool out of balance"
        assert rank0[name][0] == rank1[name][0], name
    sampled = rank0["eagle3_sampled"][0]
    assert all(len(sampled[f"r{i}"]) == 8 for i in range(len(PROMPTS)))
    aborted = rank0["plain_abort"][0]
    assert len(aborted["r3"]) < GREEDY[3]["max_new_tokens"]
