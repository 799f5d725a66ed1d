"""Greedy speculative decoding on CUDA reproduces plain decoding on the default model, with its
shipped EAGLE-3 head and with n-gram drafts (NGRAM, an 8-node tree at every batch size), at batch 1
and batch 8.

float32 is the exactness check: the target and draft then run the torch attention backend on CUDA
(FlashInfer has no fp32 kernels) and the Triton tree kernels. In bfloat16 (FlashInfer) a verify row
and the decode of the same token round differently, so outputs may part late; a wrong tree mask
makes them part within a few tokens, which the bf16 test catches."""

from __future__ import annotations

import pytest

from tests.cuda.conftest import requires_cuda
from tests.treespec.test_engine import CHAT_PROMPTS

pytestmark = requires_cuda

PROMPTS = CHAT_PROMPTS  # the same short chat prompts as the CPU engine tests
MAX_NEW_TOKENS = 64
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}


# the default model's shipped EAGLE-3 head (+ n-gram nodes); n-gram drafts alone, a constant 8-node tree
# rather than the default batch-1 schedule, so batch 8 speculates too
SPECULATIVE = {"EAGLE3": {}, "NGRAM": {"speculative_num_draft_tokens": 8}}


def generate_both(dtype: str, batched: bool, algorithm: str = "EAGLE3"
                  ) -> tuple[list[list[int]], list[list[int]], object]:
    from treespec.engine import Engine
    from treespec.tokenizer import chat_input_ids

    outputs, engines = [], []
    for name, kwargs in (("NONE", {}), (algorithm, SPECULATIVE[algorithm])):
        engine = Engine(device="cuda", dtype=dtype, speculative_algorithm=name, **kwargs)
        ids = [chat_input_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
        if batched:
            results = engine.generate(input_ids=ids, sampling_params=GREEDY)
        else:
            results = [engine.generate(input_ids=one, sampling_params=GREEDY) for one in ids]
        engine.check_pool_balance()
        outputs.append([r["output_ids"] for r in results])
        engines.append(engine)
    plain, speculative = outputs
    assert engines[1].scheduler.spec_worker is not None  # the default engine did speculate
    for engine in engines:
        engine.shutdown()
    return plain, speculative, engines[1]


@pytest.mark.parametrize("algorithm", sorted(SPECULATIVE))
@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batch8"])
def test_greedy_speculative_equals_plain_float32(batched: bool, algorithm: str):
    plain, speculative, _ = generate_both("float32", batched, algorithm)
    assert speculative == plain


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batch8"])
def test_greedy_speculative_tracks_plain_bfloat16(batched: bool):
    pytest.importorskip("flashinfer")
    from treespec.attention.flashinfer_backend import FlashInferAttnBackend

    plain, speculative, engine = generate_both("bfloat16", batched)
    assert isinstance(engine.scheduler.runner.attn_backend, FlashInferAttnBackend)
    assert isinstance(engine.scheduler.spec_worker.draft.attn_backend, FlashInferAttnBackend)
    prefixes = [common_prefix(p, s) for p, s in zip(plain, speculative, strict=True)]
    # bf16 rounding may part the two late; a broken mask parts them within a few tokens
    assert sum(prefixes) / len(prefixes) >= MAX_NEW_TOKENS / 2, prefixes
    assert sum(p == s for p, s in zip(plain, speculative, strict=True)) >= len(PROMPTS) // 2, prefixes


def test_default_engine_takes_the_cuda_ngram_schedule():
    from treespec.engine import Engine

    engine = Engine(device="cuda")  # the default model, --speculative-algorithm auto: NGRAM
    schedule = engine.scheduler.spec_worker.schedule
    # the file's "schedule_cuda": 8 nodes up to batch 4 (the CPU's: batch 1 only), no threshold (the CPU's
    # is 0.4: rows cost more there), plain above
    assert schedule.shape_for(1).num_draft_tokens == 8
    assert schedule.shape_for(4).num_draft_tokens == 8
    assert schedule.shape_for(1).ngram_min_accept_prob == 0.0
    assert schedule.shape_for(5).num_steps == 0
    engine.shutdown()
