"""Incremental detokenization: UTF-8 safe, stop strings held back and trimmed, same text as the Engine."""

import pytest

from treespec.engine import finish_text, load_tokenizer
from treespec.model_loader import resolve_model_path
from treespec.sampling_params import SamplingParams
from treespec.server.detokenizer import IncrementalDetokenizer, process_batch, stop_holdback
from treespec.server.io_struct import BatchTokenOut, TokenOut


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def stream(tokenizer, text, stops=(), no_stop_trim=False, finish_reason=None, chunk=1):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.step("r", ids[i : i + chunk], True)
        deltas.append(detok.delta("r", list(stops), no_stop_trim))
    params = SamplingParams(stop=list(stops), no_stop_trim=no_stop_trim)
    last, full = detok.finish("r", params, finish_reason)
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
    for tid in ids[:-1]:
        detok.step("r", [tid], True)
        assert detok.delta("r", [], False) == ""
    detok.step("r", ids[-1:], True)
    assert detok.delta("r", [], False) == "🤖"


def test_stop_string_never_streamed_and_trimmed(tokenizer):
    text = "The answer is 42. END of story"
    reason = {"type": "stop", "matched": "END"}
    ids, deltas, full = stream(tokenizer, text, stops=["END"], finish_reason=reason)
    assert full == "The answer is 42. "
    assert "".join(deltas) == full
    assert all("E" not in d for d in deltas)
    assert full == finish_text(tokenizer, ids, SamplingParams(stop=["END"]), reason)


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    reason = {"type": "stop", "matched": "END"}
    _, deltas, full = stream(tokenizer, "abc END", stops=["END"], no_stop_trim=True, finish_reason=reason)
    assert full == "abc END" == "".join(deltas)


def test_stop_holdback():
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello", ["xyz"]) == 0
    assert stop_holdback("ab", ["abc", "b"]) == 2
    assert stop_holdback("", ["abc"]) == 0


def test_process_batch_forwards_meta_and_clears_state(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    meta = {"id": "r", "completion_tokens": len(ids)}
    out = process_batch(detok, BatchTokenOut([TokenOut("r", ids, True, {"type": "length", "length": 2}, meta)]))
    (item,) = out.items
    assert item.text == "Hi there" and item.delta == "Hi there" and item.meta_info == meta
    assert detok.states == {}
