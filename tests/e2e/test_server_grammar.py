"""End-to-end grammar-constrained decoding on a real server (default model, speculation off): /generate
with regex, json_schema and ebnf (batched with an unconstrained request, and streamed) gives valid
outputs equal to the in-process Engine's; a bad grammar is a 400 naming the field, streamed or not,
in a batch with a good request, and the server keeps serving with its KV pool balanced."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from server_e2e_helpers import SERVER_ARGS, engine_reference, sse_events, wait_idle

from treespec.server.testing import start_server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Z][a-z]{1,15}"},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"]}
REGEX = r"(Paris|London|Rome), [0-9]{4}"
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'
PROMPT = "What is the capital of France, and the year it was founded?"
REQUESTS = [
    {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(SCHEMA)}},
    {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "regex": REGEX}},
    {"text": "Is water wet?", "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ebnf": EBNF}},
    {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
]


def check_valid(i: int, text: str) -> None:
    if i == 0:
        obj = json.loads(text)
        assert set(obj) == {"city", "population"} and re.fullmatch("[A-Z][a-z]{1,15}", obj["city"]), text
        assert type(obj["population"]) is int and obj["population"] >= 0
    elif i == 1:
        assert re.fullmatch(REGEX, text), text
    elif i == 2:
        assert text in ("The answer is yes.", "The answer is no."), text


@pytest.fixture(scope="module")
def server_and_reference():
    srv = start_server(SERVER_ARGS)
    try:
        refs = engine_reference(REQUESTS)  # computed while the server loads
        srv.wait_healthy()
        yield srv, refs
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server_and_reference):
    with httpx.Client(base_url=server_and_reference[0].base_url, timeout=120) as c:
        yield c


def balanced(client) -> bool:
    return wait_idle(str(client.base_url).rstrip("/"))["kv_pool_balanced"] is True


def test_constrained_batch_is_valid_and_equals_the_engine(client, server_and_reference):
    refs = server_and_reference[1]
    resp = client.post("/generate", json={"text": [r["text"] for r in REQUESTS],
                                          "sampling_params": [r["sampling_params"] for r in REQUESTS]})
    assert resp.status_code == 200, resp.text
    for i, (out, ref) in enumerate(zip(resp.json(), refs, strict=True)):
        check_valid(i, out["text"])
        assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
    assert balanced(client)


def test_constrained_stream(client, server_and_reference):
    refs = server_and_reference[1]
    with client.stream("POST", "/generate", json={**REQUESTS[0], "stream": True}) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert events[-1] is None and events[-2]["text"] == refs[0]["text"]
    check_valid(0, events[-2]["text"])


BAD = [("regex", "(unclosed"), ("json_schema", '{"type": "frobnicate"}'), ("ebnf", "root ::= missing_rule"),
       ("json_schema", "{not json")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_grammar_is_a_400_naming_the_field(client, field, value, stream):
    good = {"max_new_tokens": 2, "temperature": 0}
    body = {"text": ["Hi", "Hi"], "sampling_params": [good, {"max_new_tokens": 2, field: value}], "stream": stream}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == f"sampling_params.{field}", resp.text
    # the server keeps serving, with its pool balanced
    ok = client.post("/generate", json={"text": "Hi", "sampling_params": good})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] >= 1
    assert balanced(client)
