"""The in-process Engine on the embedded default model: exactness against transformers, batching,
sampling parameters, stop rules, and a balanced KV pool after every test."""

from __future__ import annotations

import pytest
import torch

from treespec.engine import Engine
from treespec.sampling_params import InvalidRequest
from treespec.tokenizer import chat_input_ids

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits and their colors.",
    "How do I reverse a list in Python?",
    "Give me a tip for learning to cook.",
    "What is 17 times 23?",
    "Describe a sunset to someone who has never seen one.",
]
GREEDY_128 = {"temperature": 0, "max_new_tokens": 128}


@pytest.fixture(scope="module")
def engine():
    # plain decoding (the default model speculates by default; the speculative paths have their own tests)
    # in fp32 throughout, the numerics transformers computes (the CPU default quantizes the GGUF matmuls'
    # inputs to int8: tests/treespec/test_block_quant_int8.py)
    eng = Engine(dtype="float32", block_quant_activations="fp32", max_total_tokens=8192, max_running_requests=16,
                 speculative_algorithm="NONE")
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def pool_balances(request):
    yield
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").check_pool_balance()


@pytest.fixture(scope="module")
def chat_ids(engine):
    return [chat_input_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def batched_greedy(engine, chat_ids):
    return engine.generate(input_ids=chat_ids, sampling_params=GREEDY_128)


def test_greedy_matches_transformers(engine, chat_ids, batched_greedy):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.scheduler.model_dir, dtype=torch.float32).eval()
    eos = engine.scheduler.eos_token_ids
    for ids, ours in zip(chat_ids, batched_greedy, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=128, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
        assert ours["output_ids"] == ref[0, len(ids):].tolist()


def test_batch_equals_each_alone(engine, chat_ids, batched_greedy):
    for ids, batched in zip(chat_ids, batched_greedy, strict=True):
        alone = engine.generate(input_ids=ids, sampling_params=GREEDY_128)
        assert alone["output_ids"] == batched["output_ids"]


def test_meta_info_and_finish_reasons(engine, chat_ids, batched_greedy):
    for ids, out in zip(chat_ids, batched_greedy, strict=True):
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == len(out["output_ids"])
        reason = meta["finish_reason"]
        if reason["type"] == "length":
            assert len(out["output_ids"]) == 128
        else:
            assert reason["type"] == "stop" and out["output_ids"][-1] == reason["matched"]
    out = engine.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
    assert len(out["output_ids"]) == 5 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_string_and_stop_token(engine):
    base = engine.generate("The numbers from one to ten are: one, two,", {"temperature": 0, "max_new_tokens": 30})
    text = base["text"]
    assert "," in text
    stop = text[text.index(",") + 1 : text.index(",") + 4].strip() or ","
    out = engine.generate("The numbers from one to ten are: one, two,", {"temperature": 0, "max_new_tokens": 30, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    tok = base["output_ids"][3]
    out = engine.generate("The numbers from one to ten are: one, two,", {"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [tok]})
    assert out["output_ids"] == base["output_ids"][: base["output_ids"].index(tok) + 1]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "min_p": 0.02, "max_new_tokens": 20, "seed": 1234}
    a = engine.generate("Tell me a story:", params)
    b = engine.generate(["Tell me a story:", "Another prompt here", "x"], [params, {**params, "seed": 1}, params])
    assert a["output_ids"] == b[0]["output_ids"]
    c = engine.generate("Tell me a story:", {**params, "seed": 99})
    assert c["output_ids"] != a["output_ids"]


def test_seeded_sampling_with_a_constant_speculative_shape_is_batch_independent():
    """With speculation the sample a seed gives depends on the tree shape (lossless in distribution,
    not in realisation); with the shape pinned it must not depend on the batch."""
    eng = Engine(dtype="float32", max_total_tokens=8192, speculative_algorithm="EAGLE3", speculative_num_steps=2,
                 speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    try:
        params = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 20, "seed": 1234}
        a = eng.generate("Tell me a story:", params)
        b = eng.generate(["Tell me a story:", "Another prompt here", "x"], [params, {**params, "seed": 1}, params])
        assert a["output_ids"] == b[0]["output_ids"]
        assert eng.scheduler.stats["spec_verify_ct"] > 0
        eng.check_pool_balance()
    finally:
        eng.shutdown()


def test_penalties_change_output(engine):
    prompt = "Repeat after me: la la la la la la la"
    plain = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    for key, val in [("frequency_penalty", 1.5), ("repetition_penalty", 1.8)]:
        pen = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, key: val})
        assert pen["output_ids"] != plain["output_ids"], key
        # a penalised run repeats its most common token less often than the plain one
        most = max(set(plain["output_ids"]), key=plain["output_ids"].count)
        assert pen["output_ids"].count(most) <= plain["output_ids"].count(most), key


def test_penalty_semantics():
    from treespec.sampling import apply_penalties
    from treespec.sampling_params import SamplingParams

    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    counts = torch.tensor([3.0, 1.0, 0.0, 0.0])
    out = apply_penalties(logits, counts, SamplingParams(frequency_penalty=0.5))
    assert torch.allclose(out, torch.tensor([0.5, -2.5, 1.0, 0.5]))
    out = apply_penalties(logits, counts, SamplingParams(presence_penalty=0.5))
    assert torch.allclose(out, torch.tensor([1.5, -2.5, 1.0, 0.5]))
    out = apply_penalties(logits, counts, SamplingParams(repetition_penalty=2.0))
    assert torch.allclose(out, torch.tensor([1.0, -4.0, 1.0, 0.5]))
    # repetition also covers prompt tokens (token 2 seen in the prompt only); frequency still counts output
    prompt_or_output = torch.tensor([True, True, True, False])
    out = apply_penalties(logits, counts, SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5),
                          repetition_seen=prompt_or_output)
    assert torch.allclose(out, torch.tensor([-0.5, -4.5, 0.5, 0.5]))


def test_logprobs(engine):
    out = engine.generate("The sky is", {"temperature": 0, "max_new_tokens": 4}, return_logprob=True,
                          top_logprobs_num=3, logprob_start_len=0)
    meta = out["meta_info"]
    # SGLang's (logprob, token id, text) triples; text None without return_text_in_logprobs
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    for (lp, tok, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy = argmax
        assert text is None
    prompt_ids = engine.tokenizer.encode("The sky is")
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt_ids
    assert meta["input_token_logprobs"][0][0] is None


@pytest.mark.parametrize("bad", [
    {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_new_tokens": -1}, {"top_k": -5},
    {"min_p": 2}, {"unknown_field": 1}, {"stop": [""]}, {"max_new_tokens": "ten"},
])
def test_invalid_sampling_params(engine, bad):
    with pytest.raises(InvalidRequest):
        engine.generate("hi", bad)


def test_invalid_prompts(engine):
    """The same checks (treespec.request_checks) as the server's, naming the field."""
    with pytest.raises(InvalidRequest):
        engine.generate(input_ids=[], sampling_params={})
    with pytest.raises(InvalidRequest) as e:
        engine.generate(input_ids=[10**9], sampling_params={})
    assert e.value.param == "input_ids"
    with pytest.raises(InvalidRequest, match="context length") as e:
        engine.generate(input_ids=[5] * 100, sampling_params={"max_new_tokens": 10**6})
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):  # a bad request in a batch queues none of the batch
        engine.generate(input_ids=[[5, 6], [10**9]], sampling_params={})
    assert not engine.scheduler.has_work()


def test_continuous_batching_requests_join_and_leave(engine):
    """Requests added while others run join the running batch between steps; all finish correctly."""
    sched = engine.scheduler
    alone = [engine.generate(f"Count to {n}:", {"temperature": 0, "max_new_tokens": 6 + 3 * n})["output_ids"]
             for n in range(4)]
    ids = [engine.tokenizer.encode(f"Count to {n}:") for n in range(4)]
    from treespec.sampling_params import SamplingParams

    done, max_running = {}, 0
    for n in range(4):
        sched.add_request(f"cb-{n}", ids[n], SamplingParams(temperature=0, max_new_tokens=6 + 3 * n))
        for _ in range(3):
            for out in sched.step():
                done.setdefault(out.rid, []).extend(out.new_token_ids)
            max_running = max(max_running, len(sched.running))
    while sched.has_work():
        for out in sched.step():
            done.setdefault(out.rid, []).extend(out.new_token_ids)
    assert max_running >= 2
    assert [done[f"cb-{n}"] for n in range(4)] == alone
