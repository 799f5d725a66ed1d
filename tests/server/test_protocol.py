"""Request parsing and validation: every user mistake is an ApiError naming the parameter."""

import pytest

from treespec.request_checks import ModelLimits
from treespec.sampling_params import SamplingParams
from treespec.server.io_struct import GenerateReq
from treespec.server.metrics import Histogram, LatencyMetrics, render_metrics
from treespec.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
    parse_openai,
    sampling_dicts,
)
from treespec.server.protocol import (
    ApiError,
    check_input,
    parse_abort,
    parse_detokenize,
    parse_generate,
    parse_json_body,
    parse_sampling_params,
    parse_tokenize,
)

LIMITS = ModelLimits(context_len=100, max_total_num_tokens=80, vocab_size=1000)


class FakeTokenizer:
    """Characters as ids, and a BOS (id 1) when asked for the tokenizer's special tokens."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) % 1000 for c in text]


@pytest.mark.parametrize("raw", [b"", b"  ", b"{bad", b"[1, 2]", b'"text"'])
def test_bad_json_bodies(raw):
    with pytest.raises(ApiError) as e:
        parse_json_body(raw)
    assert e.value.status == 400


def test_parse_generate_forms():
    tok = FakeTokenizer()
    inputs, single, stream = parse_generate({"text": "ab", "sampling_params": {"max_new_tokens": 3}}, tok)
    # text is encoded with the tokenizer's own special tokens, as SGLang does (here a BOS)
    assert single and not stream and inputs[0].input_ids == [1, 97, 98] and inputs[0].sampling_params.max_new_tokens == 3
    assert not inputs[0].stream  # the scheduler reports a non-streamed request's first token and its end only
    inputs, single, _ = parse_generate({"text": ["a", "b"], "sampling_params": [{}, {"temperature": 0}]}, tok)
    assert not single and len(inputs) == 2 and inputs[1].sampling_params == SamplingParams(temperature=0)
    inputs, single, _ = parse_generate({"text": "a", "sampling_params": {"n": 2, "stop": "x"}}, tok)
    assert not single and len(inputs) == 2 and inputs[0].rid != inputs[1].rid
    assert inputs[0].sampling_params.stop == ("x",)
    inputs, single, _ = parse_generate({"input_ids": [[1, 2], [3]], "stream": True, "return_logprob": True}, tok)
    assert not single and inputs[1].input_ids == [3] and inputs[0].return_logprob
    assert all(g.stream for g in inputs)  # each step's tokens reported, for the stream
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
    ({"text": "a", "return_text_in_logprobs": "y"}, "return_text_in_logprobs"),
    ({"text": "a", "rid": 5}, "rid"),
    ({"text": "a", "rid": ""}, "rid"),
    ({"text": ["a", "b"], "rid": "x"}, "rid"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": "a", "rid": "x", "sampling_params": {"n": 2}}, "rid"),
])
def test_parse_generate_errors(body, param):
    with pytest.raises(ApiError) as e:
        parse_generate(body, FakeTokenizer())
    assert e.value.param == param and e.value.status == 400


@pytest.mark.parametrize("body,param,needle", [
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "top_p"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop", "stop"),
    ({"text": "a", "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos", "ignore_eos"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params", "unknown"),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params", "n must"),
])
def test_sampling_params_errors_name_the_field(body, param, needle):
    with pytest.raises(ApiError) as e:
        parse_generate(body, FakeTokenizer())
    assert e.value.param == param and needle in e.value.message and e.value.status == 400


def test_openai_sampling_params_errors_use_openai_names():
    with pytest.raises(ApiError) as e:
        parse_sampling_params({"max_new_tokens": 5, "min_new_tokens": 9}, openai=True)
    assert e.value.param == "min_tokens"
    with pytest.raises(ApiError) as e:
        parse_sampling_params({"top_k": -7}, openai=True)
    assert e.value.param == "top_k"


@pytest.mark.parametrize("req,param,needle", [
    (GenerateReq([]), "prompt", "empty"),
    (GenerateReq([1, 5000]), "input_ids", "token ids"),
    (GenerateReq(list(range(100)), SamplingParams(max_new_tokens=1)), "prompt", "context length"),
    (GenerateReq([1] * 50, SamplingParams(max_new_tokens=60)), "max_tokens", "context length"),
    (GenerateReq([1] * 50, SamplingParams(max_new_tokens=40)), "max_tokens", "KV slots"),
    (GenerateReq([1], SamplingParams(max_new_tokens=4), top_logprobs_num=-1), "top_logprobs_num", "top_logprobs_num"),
    (GenerateReq([1], SamplingParams(max_new_tokens=4), top_logprobs_num=21), "top_logprobs_num", "top_logprobs_num"),
    (GenerateReq([1, 2], SamplingParams(max_new_tokens=4), True, logprob_start_len=2), "logprob_start_len", "[0, 2)"),
    (GenerateReq([1, 2], SamplingParams(max_new_tokens=4), True, logprob_start_len=-2), "logprob_start_len", "-1"),
])
def test_check_input_errors(req, param, needle):
    with pytest.raises(ApiError) as e:
        check_input(req, LIMITS)
    assert needle in e.value.message and e.value.param == param and e.value.status == 400


def test_check_input_accepts_a_good_request():
    check_input(GenerateReq([1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0.5)), LIMITS)


def test_sampling_params_are_frozen_and_valid_by_construction():
    params = SamplingParams.from_dict({"stop": ["a", "b"], "stop_token_ids": 3, "sampling_seed": 5})
    assert params.stop == ("a", "b") and params.stop_token_ids == (3,) and params.seed == 5
    with pytest.raises(AttributeError):
        params.temperature = 0  # frozen
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


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
                                           "top_k": 5, "min_tokens": 1})
    a, b = sampling_dicts(req, 8)
    assert a["max_new_tokens"] == 8 and a["stop"] == "x" and a["top_k"] == 5 and a["min_new_tokens"] == 1
    assert (a["seed"], b["seed"]) == (7, 8)
    with pytest.raises(ApiError) as e:
        check_model("gpt-4", {"mine"})
    assert e.value.status == 404 and e.value.code == "model_not_found"
    check_model(None, {"mine"})


def test_metrics_text():
    text = render_metrics({"num_running_reqs": 2, "token_usage": 0.25, "generated_tokens": 10,
                           "avg_spec_accept_length": None, "spec_accepted_drafts_eagle": 7,
                           "spec_accepted_drafts_ngram": 3}, 'm"odel')
    assert 'treespec:num_running_reqs{model_name="m\\"odel"} 2' in text
    assert "# TYPE treespec:generated_tokens_total counter" in text
    assert "treespec:token_usage{" in text and "treespec:spec_accept_length{" in text
    assert 'treespec:spec_accepted_drafts_total{model_name="m\\"odel",source="ngram"} 3' in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.split(" ")) == 2


def test_parse_generate_rid_and_logprob_flags():
    tok = FakeTokenizer()
    (req,), single, _ = parse_generate({"text": "a", "rid": "mine", "return_logprob": True,
                                         "return_text_in_logprobs": True}, tok)
    assert single and req.rid == "mine" and req.return_logprob and req.return_text_in_logprobs
    inputs, _, _ = parse_generate({"input_ids": [[1], [2]], "rid": ["a", "b"]}, tok)
    assert [g.rid for g in inputs] == ["a", "b"]
    inputs, _, _ = parse_generate({"input_ids": [[1], [2]]}, tok)
    assert inputs[0].rid != inputs[1].rid and not inputs[0].return_text_in_logprobs


def test_max_new_tokens_zero_scores_the_prompt():
    (req,), _, _ = parse_generate({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 0},
                                   "return_logprob": True, "logprob_start_len": 0}, FakeTokenizer())
    check_input(req, LIMITS)
    assert req.sampling_params.max_new_tokens == 0


def test_parse_tokenize_and_detokenize():
    assert parse_tokenize({"prompt": "ab"}) == (["ab"], True, True)
    assert parse_tokenize({"prompt": ["a", "b"], "add_special_tokens": False}) == (["a", "b"], False, False)
    assert parse_detokenize({"tokens": [1, 2]}, 10) == ([[1, 2]], True, True)
    assert parse_detokenize({"tokens": [[1], [2, 3]], "skip_special_tokens": False}, 10) == ([[1], [2, 3]], False, False)
    assert parse_abort({"rid": "x"}) == ("x", False)
    assert parse_abort({"abort_all": True}) == (None, True)


@pytest.mark.parametrize("parse,body,param", [
    (parse_tokenize, {}, "prompt"),
    (parse_tokenize, {"text": "a"}, "prompt"),  # SGLang's field is prompt
    (parse_tokenize, {"prompt": 3}, "prompt"),
    (parse_tokenize, {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    (lambda b: parse_detokenize(b, 10), {"tokens": "12"}, "tokens"),
    (lambda b: parse_detokenize(b, 10), {"tokens": [1, 10]}, "tokens"),
    (lambda b: parse_detokenize(b, 10), {"tokens": [[1], 2]}, "tokens"),
    (lambda b: parse_detokenize(b, 10), {"tokens": [1], "skip_special_tokens": 0}, "skip_special_tokens"),
    (parse_abort, {}, "rid"),
    (parse_abort, {"rid": 3}, "rid"),
    (parse_abort, {"rid": "x", "abort_all": "yes"}, "abort_all"),
])
def test_tokenize_detokenize_abort_errors_name_the_field(parse, body, param):
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.param == param and e.value.status == 400


def test_latency_histograms_text():
    hist = Histogram((0.1, 1.0))
    hist.observe(0.05)
    hist.observe(0.5, times=3)
    hist.observe(7.0)
    lines = hist.render("p:x_seconds", "help", 'model_name="m"')
    assert 'p:x_seconds_bucket{le="0.1",model_name="m"} 1' in lines
    assert 'p:x_seconds_bucket{le="1",model_name="m"} 4' in lines  # cumulative
    assert 'p:x_seconds_bucket{le="+Inf",model_name="m"} 5' in lines
    assert 'p:x_seconds_count{model_name="m"} 5' in lines and 'p:x_seconds_sum{model_name="m"} 8.55' in lines
    text = LatencyMetrics().render("m")
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE treespec:{name} histogram" in text
