"""End-to-end with EAGLE-3 speculation on: speculative stats reach meta_info, /get_server_info and /metrics;
structured output through the openai client equals the plain (speculation off) Engine's constrained output.

Uses the shipped EAGLE-3 head when there is one; otherwise a randomly initialised head for the default
target (acceptance near the minimum: this checks the plumbing, not the speed-up)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_e2e_helpers import SERVER_ARGS, engine_reference, sse_events, wait_idle

from treespec.server.testing import popen_launch_server


def eagle3_args(path) -> list[str]:
    """The shipped EAGLE-3 head with its tuned settings if there is one, else a random head."""
    try:
        from treespec.drafts import shipped_draft_path

        if shipped_draft_path("EAGLE3") is not None:
            return ["--speculative-algorithm", "EAGLE3"]
    except ImportError:
        pass
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", random_eagle3_head(path),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]


def random_eagle3_head(path) -> str:
    try:
        from treespec.model_loader import resolve_model_path
        from treespec.models.config import ModelConfig
        from treespec.models.draft_loader import create_draft_model, save_draft
        from treespec.speculative.eagle_worker import EagleWorker  # noqa: F401
    except ImportError as e:
        pytest.skip(f"EAGLE-3 speculation is not available yet: {e}")
    target = resolve_model_path(None)
    cfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    save_draft(create_draft_model("EAGLE3", cfg, 2048, intermediate_size=256, init_std=0.02, seed=0), path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = eagle3_args(tmp_path_factory.mktemp("eagle3_head"))
    srv = popen_launch_server([*SERVER_ARGS, "--skip-warmup", *spec])
    yield srv
    assert srv.terminate() == 0, srv.log_tail()


def test_speculative_stats_flow_through_the_server(server):
    url = server.base_url
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    out = httpx.post(f"{url}/generate", json=body, timeout=300).json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) >= 1
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=300) as r:
        events = sse_events(r.iter_lines())
    assert events[-2]["output_ids"] == out["output_ids"] and events[-2]["text"] == out["text"]
    info = wait_idle(url)
    assert info["kv_pool_balanced"] is True
    assert info["speculative_algorithm"] == "EAGLE3" and info["avg_spec_accept_length"] >= 1
    metrics = httpx.get(f"{url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("treespec:spec_accept_length{"))
    assert float(line.split()[-1]) >= 1


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                          "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Name the largest city in Japan and its population, as JSON."}]


def test_structured_output_under_speculation_equals_plain(server):
    """response_format and a forced tool call, with speculation on, give exactly the tokens the Engine gives
    with speculation off under the same grammar (greedy), streamed and not."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    (ref,) = engine_reference([{"messages": ASK, "sampling_params": {"temperature": 0, "max_new_tokens": 64,
                                                                     "json_schema": json.dumps(SCHEMA)}}])
    assert json.loads(ref["text"])  # the reference itself is valid
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model="default", messages=ASK, response_format=fmt, temperature=0,
                                         max_tokens=64)
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.completion_tokens == len(ref["output_ids"])
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="default", messages=ASK, response_format=fmt, temperature=0, max_tokens=64, stream=True) if c.choices)
    assert streamed == ref["text"]
    tools = [{"type": "function", "function": {"name": "record_city", "parameters": SCHEMA}}]
    call = client.chat.completions.create(model="default", messages=ASK, tools=tools, temperature=0, max_tokens=64,
                                          tool_choice={"type": "function", "function": {"name": "record_city"}})
    assert call.choices[0].finish_reason == "tool_calls"
    assert call.choices[0].message.tool_calls[0].function.arguments == ref["text"]
    assert wait_idle(server.base_url)["kv_pool_balanced"] is True
