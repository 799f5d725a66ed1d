"""Request parsing and validation: every user mistake is an ApiError naming the parameter."""

import pytest

from treespec.server.metrics import render_metrics
from treespec.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
    parse_openai,
    sampling_dicts,
)
from treespec.server.protocol import (
    ApiError,
    GenerateInput,
    ModelLimits,
    parse_generate,
    parse_json_body,
    validate_input,
)

LIMITS = ModelLimits(context_len=100, max_total_num_tokens=80, vocab_size=1000)


class FakeTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 1000 for c in text]


@pytest.mark.parametrize("raw", [b"", b"  ", b"{bad", b"[1, 2]", b'"text"'])
def test_bad_json_bodies(raw):
    with pytest.raises(ApiError) as e:
        parse_json_body(raw)
    assert e.value.status == 400


def test_parse_generate_forms():
    tok = FakeTokenizer()
    inputs, single, stream = parse_generate({"text": "ab", "sampling_params": {"max_new_tokens": 3}}, tok)
    assert single and not stream and inputs[0].input_ids == [97, 98] and inputs[0].sampling_params["max_new_tokens"] == 3
    inputs, single, _ = parse_generate({"text": ["a", "b"], "sampling_params": [{}, {"temperature": 0}]}, tok)
    assert not single and len(inputs) == 2 and inputs[1].sampling_params == {"temperature": 0}
    inputs, single, _ = parse_generate({"input_ids": [[1, 2], [3]], "stream": True, "return_logprob": True}, tok)
    assert not single and inputs[1].input_ids == [3] and inputs[0].return_logprob
    inputs, single, _ = parse_generate({"input_ids": [5, 6]}, tok)
    assert single and inputs[0].input_ids == [5, 6]


@pytest.mark.parametrize("body,param", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": "12"}, "input_ids"),
    ({"input_ids": [[1], "x"]}, "input_ids"),
    ({"text": "a", "sampling_params": 3}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "return_logprob": 1}, "return_logprob"),
])
def test_parse_generate_errors(body, param):
    with pytest.raises(ApiError) as e:
        parse_generate(body, FakeTokenizer())
    assert e.value.param == param and e.value.status == 400


@pytest.mark.parametrize("gen,needle", [
    (GenerateInput([], {}), "empty"),
    (GenerateInput([1, 5000], {}), "token ids"),
    (GenerateInput(list(range(100)), {"max_new_tokens": 1}), "context length"),
    (GenerateInput([1] * 50, {"max_new_tokens": 60}), "context length"),
    (GenerateInput([1] * 50, {"max_new_tokens": 40}), "KV slots"),
    (GenerateInput([1], {"max_new_tokens": 0}), "max_new_tokens"),
    (GenerateInput([1], {"temperature": -1}), "temperature"),
    (GenerateInput([1], {"top_p": 1.5}), "top_p"),
    (GenerateInput([1], {"bogus": 1}), "unknown"),
    (GenerateInput([1], {"max_new_tokens": 4}, top_logprobs_num=-1), "top_logprobs_num"),
])
def test_validate_input_errors(gen, needle):
    with pytest.raises(ApiError) as e:
        validate_input(gen, LIMITS)
    assert needle in e.value.message


def test_validate_input_accepts_a_good_request():
    validate_input(GenerateInput([1, 2, 3], {"max_new_tokens": 10, "temperature": 0.5}), LIMITS)


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [], "temperature": "hot"}, "temperature"),
    ({"messages": [], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [], "stream": "no"}, "stream"),
    ({"messages": [], "n": True}, "n"),
    ({}, "messages"),
])
def test_openai_type_errors(body, param):
    with pytest.raises(ApiError) as e:
        parse_openai(ChatCompletionRequest, body)
    assert e.value.param == param


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"), ({"n": 0}, "n"),
])
def test_openai_range_errors(extra, param):
    req = parse_openai(CompletionRequest, {"prompt": "x", **extra})
    with pytest.raises(ApiError) as e:
        sampling_dicts(req, req.max_tokens)
    assert e.value.param == param


def test_openai_sampling_translation():
    req = parse_openai(CompletionRequest, {"prompt": [1, 2], "n": 2, "seed": 7, "stop": "x", "temperature": 0,
                                           "top_k": 5, "min_tokens": 1, "unknown_field": 1})
    a, b = sampling_dicts(req, 8)
    assert a["max_new_tokens"] == 8 and a["stop"] == "x" and a["top_k"] == 5 and a["min_new_tokens"] == 1
    assert (a["seed"], b["seed"]) == (7, 8)
    with pytest.raises(ApiError) as e:
        check_model("gpt-4", {"mine"})
    assert e.value.status == 404 and e.value.code == "model_not_found"
    check_model(None, {"mine"})


def test_metrics_text():
    text = render_metrics({"num_running_reqs": 2, "token_usage": 0.25, "generated_tokens": 10,
                           "avg_spec_accept_length": None}, 'm"odel')
    assert 'treespec:num_running_reqs{model_name="m\\"odel"} 2' in text
    assert "# TYPE treespec:generated_tokens_total counter" in text
    assert "treespec:token_usage{" in text and "treespec:spec_accept_length{" in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.split(" ")) == 2
