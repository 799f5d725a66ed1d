"""SGLang compatibility of the in-process Engine (issue 27) on tiny random Llama targets:
min_new_tokens masks EOS and stop token ids (plain sampling and speculative verification alike), text
prompts get the tokenizer's BOS while chats do not get a second one, logprobs come as (logprob, id,
text) triples with SGLang's input logprobs, max_new_tokens 0 scores a prompt, and client rids, n,
stream=True and async_generate behave as SGLang's Engine."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from treespec.engine import Engine
from treespec.sampling_params import InvalidRequest
from treespec.tokenizer import chat_input_ids, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent / "speculative"))
from eagle_test_models import VOCAB, random_head, random_target  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 250, 7]
OTHER_PROMPTS = [[11, 12, 13], [200, 100, 50, 25, 12, 6], [9] * 9]
SPEC = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 5, "speculative_eagle_topk": 4,
        "speculative_num_draft_tokens": 16}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> dict:
    """A random target whose first greedy token after PROMPT is its EOS (so the model wants to stop at
    once), a random EAGLE head for it, and a tokenizer that adds a BOS."""
    root = tmp_path_factory.mktemp("sglang_compat")
    target = random_target(root / "target")
    probe = Engine(model_path=str(target), dtype="float32", max_total_tokens=2048)
    eos = probe.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 1})["output_ids"][0]
    probe.shutdown()
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = eos
    (target / "config.json").write_text(json.dumps(config))
    return {"target": target, "head": random_head(root / "eagle", "EAGLE", target), "eos": eos,
            "bos_tokenizer": bos_tokenizer(root / "bos_tokenizer")}


def bos_tokenizer(path: Path) -> Path:
    """Words t0..t255 as ids, a post-processor that adds BOS t1 (as Llama's tokenizers do), and a chat
    template that writes the BOS itself."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def plain(models_dir):
    eng = Engine(model_path=str(models_dir["target"]), dtype="float32", max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def spec(models_dir):
    eng = Engine(model_path=str(models_dir["target"]), dtype="float32", max_total_tokens=4096,
                 speculative_draft_model_path=str(models_dir["head"]), **SPEC)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def pool_balances(request):
    yield
    for name in ("plain", "spec"):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_pool_balance()


# ---------------------------------------------------------------------------------------- min_new_tokens
def test_min_new_tokens_masks_eos_in_plain_and_speculative_greedy(models_dir, plain, spec):
    eos = models_dir["eos"]
    base = {"temperature": 0, "max_new_tokens": 12}
    assert plain.generate(input_ids=PROMPT, sampling_params=base)["output_ids"] == [eos]  # EOS is the argmax
    assert spec.generate(input_ids=PROMPT, sampling_params=base)["output_ids"] == [eos]
    for minimum in (1, 4, 9):
        params = {**base, "min_new_tokens": minimum}
        ids = plain.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]
        assert len(ids) > minimum - 1 and eos not in ids[:minimum], (minimum, ids)
        # the speculative step masks each tree row at its depth: the same tokens, token for token
        assert spec.generate(input_ids=PROMPT, sampling_params=params)["output_ids"] == ids, minimum


def test_min_new_tokens_masks_stop_token_ids_in_a_mixed_batch(plain, spec):
    free = plain.generate(input_ids=OTHER_PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                                       "ignore_eos": True})
    params = [{"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "stop_token_ids": [out["output_ids"][1]],
               "min_new_tokens": m} for out, m in zip(free, (0, 3, 6), strict=True)]
    outs = plain.generate(input_ids=OTHER_PROMPTS, sampling_params=params)
    first_stop = free[0]["output_ids"].index(params[0]["stop_token_ids"][0])
    assert outs[0]["output_ids"] == free[0]["output_ids"][: first_stop + 1]  # no minimum: stops at the stop token
    for out, p in zip(outs, params, strict=True):
        assert not set(out["output_ids"][: p["min_new_tokens"]]) & set(p["stop_token_ids"])
    assert [o["output_ids"] for o in spec.generate(input_ids=OTHER_PROMPTS, sampling_params=params)] == \
        [o["output_ids"] for o in outs]


def test_min_new_tokens_holds_for_sampling(models_dir, plain, spec):
    eos = models_dir["eos"]
    for engine in (plain, spec):
        for seed in range(4):
            params = {"temperature": 1.0, "max_new_tokens": 8, "min_new_tokens": 5, "seed": seed}
            ids = engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]
            assert len(ids) >= 5 and eos not in ids[:5]


# ---------------------------------------------------------------------------------------- BOS
def test_text_prompts_get_the_tokenizers_bos_and_chats_only_the_templates(models_dir):
    tok = load_tokenizer(models_dir["bos_tokenizer"])
    chat = chat_input_ids(tok, [{"role": "user", "content": "t5 t6"}])
    assert chat == [1, 5, 6]  # the template writes the BOS; encoding adds no second one
    engine = Engine(model_path=str(models_dir["target"]), tokenizer_path=str(models_dir["bos_tokenizer"]),
                    dtype="float32", max_total_tokens=2048)
    out = engine.generate("t5 t6", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == [1, 5, 6]  # what transformers encodes
    assert out["meta_info"]["prompt_tokens"] == 3
    engine.shutdown()


# ---------------------------------------------------------------------------------------- logprobs
def reference_prompt_logprobs(target: Path, ids: list[int]) -> torch.Tensor:
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_scoring_and_input_logprobs_match_transformers(models_dir, plain, spec):
    ref = reference_prompt_logprobs(models_dir["target"], PROMPT)
    for engine in (plain, spec):
        out = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              top_logprobs_num=2, logprob_start_len=0, return_text_in_logprobs=True)
        meta = out["meta_info"]
        assert out["output_ids"] == [] and out["text"] == "" and meta["finish_reason"] == {"type": "length", "length": 0}
        entries = meta["input_token_logprobs"]
        assert [t for _, t, _ in entries] == PROMPT and entries[0][0] is None
        assert [text for _, _, text in entries] == [f"t{t}" for t in PROMPT]
        for pos in range(1, len(PROMPT)):
            assert entries[pos][0] == pytest.approx(float(ref[pos - 1, PROMPT[pos]]), abs=1e-4)
        tops = meta["input_top_logprobs"]
        assert tops[0] is None and all(len(t) == 2 for t in tops[1:])
        assert [t for _, t, _ in tops[1]] == ref[0].topk(2).indices.tolist()
        assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []


def test_logprob_start_len_forms(plain):
    full = plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True, logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    start = 3
    part = plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True, logprob_start_len=start)["meta_info"]
    # SGLang: tokens logprob_start_len .. end, the first without a logprob
    assert [t for _, t, _ in part["input_token_logprobs"]] == PROMPT[start:]
    assert part["input_token_logprobs"][0][0] is None
    assert [lp for lp, _, _ in part["input_token_logprobs"][1:]] == pytest.approx([lp for lp, _, _ in full[start + 1:]])
    last = plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True)["meta_info"]
    assert last["input_token_logprobs"] == [(None, PROMPT[-1], None)]  # -1: the last prompt token
    assert [t for _, t, _ in last["output_token_logprobs"]] == \
        plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "temperature": 0})["output_ids"]
    assert "output_top_logprobs" not in last
    with pytest.raises(InvalidRequest) as e:
        plain.generate(input_ids=PROMPT, return_logprob=True, logprob_start_len=len(PROMPT))
    assert e.value.param == "logprob_start_len"


# ---------------------------------------------------------------------------------------- rid, n, stream, async
def test_rid_is_the_request_id(plain):
    out = plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, rid="my-request")
    assert out["meta_info"]["id"] == "my-request"
    outs = plain.generate(input_ids=OTHER_PROMPTS[:2], sampling_params={"max_new_tokens": 2}, rid=["a", "b"])
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    for bad in (["a", "a"], ["a"], 7):
        with pytest.raises(InvalidRequest) as e:
            plain.generate(input_ids=OTHER_PROMPTS[:2], sampling_params={"max_new_tokens": 2}, rid=bad)
        assert e.value.param == "rid"
    running = plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 3}, rid="busy", stream=True)
    with pytest.raises(InvalidRequest) as e:
        plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 3}, rid="busy")
    assert e.value.param == "rid"
    assert list(running)[-1]["meta_info"]["id"] == "busy"
    assert plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1}, rid="busy")["meta_info"]["id"] == "busy"


def test_n_copies(plain):
    outs = plain.generate(input_ids=PROMPT, sampling_params={"n": 3, "temperature": 0, "max_new_tokens": 4})
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3 and len({tuple(o["output_ids"]) for o in outs}) == 1
    with pytest.raises(InvalidRequest) as e:
        plain.generate(input_ids=PROMPT, sampling_params={"n": 0})
    assert e.value.param == "n"


def test_stream_chunks_grow_to_the_result(plain):
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    whole = plain.generate(input_ids=PROMPT, sampling_params=params)
    chunks = list(plain.generate(input_ids=PROMPT, sampling_params=params, stream=True))
    assert len(chunks) == 6
    assert (chunks[-1]["text"], chunks[-1]["output_ids"]) == (whole["text"], whole["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
    batch = list(plain.generate(input_ids=OTHER_PROMPTS, sampling_params=params, stream=True))
    finals = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert [finals[i]["output_ids"] for i in range(3)] == \
        [o["output_ids"] for o in plain.generate(input_ids=OTHER_PROMPTS, sampling_params=params)]


def test_a_closed_stream_aborts_its_request(plain):
    stream = plain.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 50, "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()
    assert not plain.scheduler.has_work()  # aborted: its KV is back (the pool check runs after the test)


def test_async_generate_batches_concurrent_calls(plain):
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    expected = [plain.generate(input_ids=p, sampling_params=params)["output_ids"] for p in OTHER_PROMPTS]

    async def main():
        results = await asyncio.gather(*[plain.async_generate(input_ids=p, sampling_params=params)
                                         for p in OTHER_PROMPTS])
        stream = await plain.async_generate(input_ids=PROMPT, sampling_params=params, stream=True)
        chunks = [c async for c in stream]
        return results, chunks

    results, chunks = asyncio.run(main())
    assert [r["output_ids"] for r in results] == expected
    whole = plain.generate(input_ids=PROMPT, sampling_params=params)
    assert (chunks[-1]["text"], chunks[-1]["output_ids"]) == (whole["text"], whole["output_ids"])
