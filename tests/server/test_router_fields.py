"""The bodies sglang-router 0.3.2 forwards (captured from it: it re-serializes each request with SGLang's
defaults filled in) parse as the client's own body does; a router-added field at another value is a 400
naming it."""

import pytest

from treespec.server.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_openai
from treespec.server.protocol import ApiError, parse_generate

# what the client sent -> what the worker received through the router
GENERATE_SENT = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
                 "top_logprobs_num": 2, "logprob_start_len": 0, "rid": "abc"}
GENERATE_FORWARDED = {
    "model": None, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
    "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": False, "stream": False,
    "log_metrics": True, "return_hidden_states": False, "background": False, "no_logs": False,
    "return_bytes": False, "return_entropy": False, "rid": "abc"}
CHAT_SENT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CHAT_FORWARDED = {
    "messages": [{"role": "user", "content": "hi"}], "model": "unknown", "logprobs": False,
    "max_completion_tokens": 4, "stream": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False}
COMPLETION_SENT = {"model": "m", "prompt": "hi", "max_tokens": 4}
COMPLETION_FORWARDED = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": False, "echo": False,
                        "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                        "return_hidden_states": False}


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [1] + [ord(c) % 1000 for c in text]


def test_forwarded_generate_parses_as_sent():
    sent, _, _ = parse_generate(GENERATE_SENT, FakeTokenizer())
    forwarded, single, stream = parse_generate(GENERATE_FORWARDED, FakeTokenizer())
    assert single and not stream and forwarded == sent


def test_forwarded_openai_bodies_parse_as_sent():
    chat = parse_openai(ChatCompletionRequest, CHAT_FORWARDED)
    assert chat.model is None  # the router's placeholder for "no model named"
    assert chat.max_completion_tokens == 4 and chat.messages == parse_openai(ChatCompletionRequest, CHAT_SENT).messages
    completion = parse_openai(CompletionRequest, COMPLETION_FORWARDED)
    assert completion == parse_openai(CompletionRequest, COMPLETION_SENT)


@pytest.mark.parametrize("field,value", [("return_hidden_states", True), ("log_metrics", False), ("model", "m"),
                                         ("background", True), ("return_entropy", 1), ("no_logs", True)])
def test_generate_router_field_other_than_default_is_a_400(field, value):
    with pytest.raises(ApiError) as e:
        parse_generate({**GENERATE_FORWARDED, field: value}, FakeTokenizer())
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize("field,value", [("return_hidden_states", True), ("continue_final_message", True),
                                         ("separate_reasoning", False), ("stream_reasoning", 1)])
def test_openai_router_field_other_than_default_is_a_400(field, value):
    for cls, body in ((ChatCompletionRequest, CHAT_FORWARDED), (CompletionRequest, COMPLETION_FORWARDED)):
        with pytest.raises(ApiError) as e:
            parse_openai(cls, {**body, field: value})
        assert e.value.status == 400 and e.value.param == field


def test_unknown_model_placeholder_only_on_chat():
    """A completions request naming "unknown" keeps it (the router requires a model there: the client
    wrote it), so the model check can refuse it."""
    assert parse_openai(CompletionRequest, {**COMPLETION_SENT, "model": "unknown"}).model == "unknown"
