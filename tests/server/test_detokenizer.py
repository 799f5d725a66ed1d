"""Incremental detokenization: UTF-8 safe, stop strings held back and trimmed, same text as the Engine."""

import pytest

from treespec.model_loader import resolve_model_path
from treespec.request_output import RequestOutput
from treespec.sampling_params import SamplingParams
from treespec.server.detokenizer import IncrementalDetokenizer
from treespec.server.io_struct import DetokenizeSettings
from treespec.stop_strings import finish_text
from treespec.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def stream(tokenizer, text, stops=(), no_stop_trim=False, finish_reason=None, chunk=1):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    detok.start(DetokenizeSettings("r", tuple(stops), True, no_stop_trim))
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.step("r", ids[i : i + chunk])
        deltas.append(detok.delta("r"))
    last, full = detok.finish("r", finish_reason)
    return ids, deltas + [last], full


@pytest.mark.parametrize("text", ["Hello, world! How are you?", "naïve café — 日本語のテキスト 🤖🎉 done",
                                  "  leading spaces\n\nand\ttabs  "])
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_text(tokenizer, text, chunk):
    ids, deltas, full = stream(tokenizer, text, chunk=chunk)
    assert full == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer)
    detok.start(DetokenizeSettings("r"))
    for tid in ids[:-1]:
        detok.step("r", [tid])
        assert detok.delta("r") == ""
    detok.step("r", ids[-1:])
    assert detok.delta("r") == "🤖"


def test_stop_string_never_streamed_and_trimmed(tokenizer):
    text = "The answer is 42. END of story"
    reason = {"type": "stop", "matched": "END"}
    ids, deltas, full = stream(tokenizer, text, stops=["END"], finish_reason=reason)
    assert full == "The answer is 42. "
    assert "".join(deltas) == full
    assert all("E" not in d for d in deltas)
    assert full == finish_text(tokenizer, ids, SamplingParams(stop=("END",)), reason)


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    reason = {"type": "stop", "matched": "END"}
    _, deltas, full = stream(tokenizer, "abc END", stops=["END"], no_stop_trim=True, finish_reason=reason)
    assert full == "abc END" == "".join(deltas)


def test_settings_are_kept_per_request_until_it_finishes(tokenizer):
    """Settings arrive once; later outputs carry token ids only. skip_special_tokens=False keeps <|im_end|>."""
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer)
    detok.start(DetokenizeSettings("keep", (), skip_special_tokens=False))
    detok.start(DetokenizeSettings("skip", (), skip_special_tokens=True))
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    outs = {}
    for rid in ("keep", "skip"):
        first = detok.add_text(RequestOutput(rid, ids, False, None, {"id": rid}))
        last = detok.add_text(RequestOutput(rid, [eos], True, {"type": "stop", "matched": eos}, {"id": rid}))
        outs[rid] = (first, last)
    assert outs["skip"][0].text_delta == "Hi there" and outs["skip"][1].text == "Hi there"
    assert outs["keep"][1].text == "Hi there<|im_end|>"
    assert outs["keep"][1].meta_info == {"id": "keep"} and outs["keep"][1].new_token_ids == [eos]
    assert detok.states == {}
