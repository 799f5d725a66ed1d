"""End-to-end: one real server (three processes) with the default model, speculation off.

Every route, the official openai client, 32 concurrent mixed requests checked against the in-process
Engine, bad inputs answered with 4xx while the server keeps serving, and client disconnects aborting
their requests with the KV pool balanced afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat

import httpx
import openai
import pytest
from bench_loader import load_benchmark
from server_e2e_helpers import SERVER_ARGS, engine_reference, pid_alive, server_info, sse_events, wait_idle

from treespec.server.testing import start_server

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "My favourite programming language is",
    "In 1969, the first humans",
]
GREEDY = [{"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": 6 + i % 3}} for i, p in enumerate(PROMPTS)]
CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
CHAT_REQ = {"messages": CHAT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}


@pytest.fixture(scope="module")
def server_and_reference():
    srv = start_server(SERVER_ARGS)
    try:
        refs = engine_reference(GREEDY + [CHAT_REQ])  # computed while the server loads
        srv.wait_healthy()
        yield srv, (refs[:-1], refs[-1])
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def server(server_and_reference):
    return server_and_reference[0]


@pytest.fixture(scope="module")
def reference(server_and_reference):
    return server_and_reference[1]


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def rc_of(server) -> int | None:
    return server.terminate(timeout=30)


def check_normal_request(client) -> None:
    resp = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == 1


# ---------------------------------------------------------------------------------------------- routes
def test_health_info_models_metrics(client, server):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["is_generation"] and info["served_model_name"] == "SmolLM2-135M-Instruct"
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert [m.id for m in oai(server).models.list()] == ["SmolLM2-135M-Instruct"]
    sinfo = wait_idle(server.base_url)
    assert sinfo["max_total_tokens"] == 4096 and sinfo["context_len"] > 0
    assert set(sinfo["pids"]) == {"launcher", "scheduler", "detokenizer"}
    assert sinfo["kv_pool_balanced"] is True
    stats = sinfo["stats"]
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["max_total_num_tokens"]
    assert "avg_spec_accept_length" in sinfo
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("num_running_reqs", "num_waiting_reqs", "token_usage", "cache_hit_rate", "spec_accept_length",
                 "generated_tokens_total", "gen_throughput"):
        assert f"treespec:{name}{{" in metrics.text
    flushed = client.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["success"]


def test_generate_native(client, reference):
    refs, _ = reference
    resp = client.post("/generate", json=GREEDY[0]).json()
    assert resp["output_ids"] == refs[0]["output_ids"] and resp["text"] == refs[0]["text"]
    meta = resp["meta_info"]
    assert meta["prompt_tokens"] == len(refs[0]["input_ids"]) and meta["completion_tokens"] == len(resp["output_ids"])
    assert meta["finish_reason"]["type"] in ("length", "stop") and meta["id"]
    # a batch of input_ids lists with per-prompt sampling params
    batch = client.post("/generate", json={"input_ids": [r["input_ids"] for r in refs[1:3]],
                                           "sampling_params": [g["sampling_params"] for g in GREEDY[1:3]]})
    assert [b["output_ids"] for b in batch.json()] == [r["output_ids"] for r in refs[1:3]]


def test_generate_stream_and_logprobs(client, reference):
    refs, _ = reference
    with client.stream("POST", "/generate", json={**GREEDY[2], "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] is None and len(events) >= 2
    final = events[-2]
    assert final["text"] == refs[2]["text"] and final["output_ids"] == refs[2]["output_ids"]
    assert all(e["text"].startswith(p["text"]) for p, e in zip(events[:-2], events[1:-1], strict=True))
    body = {**GREEDY[3], "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    meta = client.post("/generate", json=body).json()["meta_info"]
    n_out = meta["completion_tokens"]
    assert len(meta["output_token_logprobs"]) == n_out and len(meta["output_top_logprobs"]) == n_out
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    # streamed with logprobs: every event carries the ids and logprobs so far, which only grow
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())[:-1]
    for prev, e in zip(events, events[1:], strict=False):
        assert e["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    for e in events:
        assert [t for _, t, _ in e["meta_info"]["output_token_logprobs"]] == e["output_ids"]
        assert len(e["meta_info"]["input_token_logprobs"]) == meta["prompt_tokens"]
    assert [t for _, t, _ in events[-1]["meta_info"]["output_token_logprobs"]] == \
        [t for _, t, _ in meta["output_token_logprobs"]]
    # a batch stream tags events with the prompt index; sampling_params.n runs n requests per prompt
    body = {"text": PROMPTS[:2], "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    with client.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
    assert {e["index"] for e in events[:-1]} == {0, 1}
    outs = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 2, "n": 2}}).json()
    assert isinstance(outs, list) and len(outs) == 2


# ---------------------------------------------------------------------------------------------- SGLang names
def test_info_routes_under_both_names(client):
    for new, old in (("/server_info", "/get_server_info"), ("/model_info", "/get_model_info")):
        a, b = client.get(new), client.get(old)
        assert a.status_code == b.status_code == 200 and set(a.json()) == set(b.json())
    assert client.get("/model_info").json() == client.get("/get_model_info").json()


def test_tokenize_and_detokenize(client, reference):
    refs, _ = reference
    resp = client.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert resp["tokens"] == refs[0]["input_ids"] and resp["count"] == len(resp["tokens"])  # as /generate encodes
    assert resp["max_model_len"] == client.get("/model_info").json()["context_length"]
    both = client.post("/v1/tokenize", json={"prompt": PROMPTS[:2], "add_special_tokens": False}).json()
    assert both["count"] == [len(t) for t in both["tokens"]] and len(both["tokens"]) == 2
    assert client.post("/detokenize", json={"tokens": refs[0]["output_ids"]}).json()["text"] == refs[0]["text"]
    texts = client.post("/detokenize", json={"tokens": [both["tokens"][0], both["tokens"][1]]}).json()["text"]
    assert texts == PROMPTS[:2]
    for path, body, param in (("/tokenize", {"text": "x"}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens")):
        resp = client.post(path, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_logprob_triples_text_and_prompt_scoring(client, reference):
    refs, _ = reference
    ids = refs[0]["input_ids"]
    body = {"input_ids": ids, "return_logprob": True, "return_text_in_logprobs": True, "top_logprobs_num": 2,
            "logprob_start_len": 1, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    meta = client.post("/generate", json=body).json()["meta_info"]
    assert [(t, text) for _, t, text in meta["input_token_logprobs"]] == \
        [(t, client.post("/detokenize", json={"tokens": [t], "skip_special_tokens": False}).json()["text"])
         for t in ids[1:]]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(len(top) == 2 and all(len(e) == 3 for e in top) for top in meta["input_top_logprobs"][1:])
    assert len(meta["output_top_logprobs"]) == 3 and all(isinstance(text, str) for _, _, text in
                                                         meta["output_token_logprobs"])
    scored = client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 0}}).json()
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    got, want = scored["meta_info"]["input_token_logprobs"], meta["input_token_logprobs"]
    assert [e[1:] for e in got] == [e[1:] for e in want] and got[0][0] is None
    assert [e[0] for e in got[1:]] == pytest.approx([e[0] for e in want[1:]], abs=1e-4)


def test_client_rid_echo_duplicate_and_abort_request(client, server):
    resp = client.post("/generate", json={"text": "Hi", "rid": "client-1", "sampling_params": {"max_new_tokens": 2}})
    assert resp.json()["meta_info"]["id"] == "client-1"
    before = wait_idle(server.base_url)
    long = {"text": PROMPTS[1], "rid": "long-1", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    with client.stream("POST", "/generate", json=long) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["meta_info"]["id"] == "long-1"
        dup = client.post("/generate", json={**long, "stream": False})
        assert dup.status_code == 400 and dup.json()["error"]["param"] == "rid"
        assert client.post("/abort_request", json={"rid": "long-1"}).json() == {"aborted": ["long-1"]}
        events = sse_events(lines)
    final = events[-2]
    assert final["meta_info"]["finish_reason"]["type"] == "abort" and len(final["output_ids"]) < 400
    after = wait_idle(server.base_url)
    assert after["kv_pool_balanced"] is True
    assert after["stats"]["num_aborted_reqs"] == before["stats"]["num_aborted_reqs"] + 1
    assert client.post("/abort_request", json={"rid": "gone"}).json() == {"aborted": []}


def test_latency_histograms_in_metrics(client):
    client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    text = client.get("/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE treespec:{name} histogram" in text
        count = next(line for line in text.splitlines() if line.startswith(f"treespec:{name}_count"))
        assert int(count.split(" ")[1]) > 0


def test_generate_stop_string(client, reference):
    refs, _ = reference
    text = refs[1]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("reference text too short for a stop string")
    params = {**GREEDY[1]["sampling_params"], "stop": [stop]}
    resp = client.post("/generate", json={"text": PROMPTS[1], "sampling_params": params}).json()
    assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert resp["text"] == text[: text.find(stop)]
    with client.stream("POST", "/generate", json={"text": PROMPTS[1], "sampling_params": params, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-2]["text"] == resp["text"]
    assert all(stop not in e["text"] for e in events[:-1])


# ---------------------------------------------------------------------------------------------- OpenAI
def test_openai_chat(server, reference):
    _, chat_ref = reference
    client = oai(server)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == chat_ref["text"]
    assert out.usage.prompt_tokens == len(chat_ref["input_ids"])
    assert out.usage.completion_tokens == len(chat_ref["output_ids"]) == len(choice.logprobs.content)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(chat_ref["output_ids"])
    many = client.chat.completions.create(messages=CHAT, model="SmolLM2-135M-Instruct", max_tokens=4,
                                          temperature=0.9, n=3, seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert 3 <= many.usage.completion_tokens <= 12
    assert many.usage.prompt_tokens == len(chat_ref["input_ids"])
    stream = client.chat.completions.create(messages=CHAT, model="SmolLM2-135M-Instruct", max_tokens=3, n=2,
                                            temperature=0, stream=True)
    texts = ["", ""]
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == texts[1] == chat_ref["text"][: len(texts[0])] and texts[0]


def test_openai_completions(server, reference):
    refs, _ = reference
    client = oai(server)
    n0 = len(refs[0]["output_ids"])
    max0 = GREEDY[0]["sampling_params"]["max_new_tokens"]
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], temperature=0,
                                    max_tokens=max0, logprobs=2)
    assert out.choices[0].text == refs[0]["text"]
    assert out.usage.completion_tokens == n0 and out.usage.prompt_tokens == len(refs[0]["input_ids"])
    assert len(out.choices[0].logprobs.tokens) == n0 and "".join(out.choices[0].logprobs.tokens) == refs[0]["text"]
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], temperature=0,
                                       max_tokens=max0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == refs[0]["text"]
    assert chunks[-1].usage.completion_tokens == n0
    multi = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[:2], temperature=0,
                                      max_tokens=3, echo=True)
    assert multi.choices[0].text == PROMPTS[0] + refs[0]["text"][: len(multi.choices[0].text) - len(PROMPTS[0])]
    assert multi.usage.completion_tokens == 6
    assert multi.choices[1].text.startswith(PROMPTS[1])
    assert multi.usage.prompt_tokens == len(refs[0]["input_ids"]) + len(refs[1]["input_ids"])


# ---------------------------------------------------------------------------------------------- load
def test_32_concurrent_mixed_requests(server, reference):
    refs, chat_ref = reference

    async def one(ac: httpx.AsyncClient, i: int) -> None:
        kind = i % 4
        k = (i // 4) % len(PROMPTS)
        if kind in (0, 1):  # greedy /generate, checked against the Engine
            body = {**GREEDY[k], "stream": kind == 1}
            if kind == 0:
                out = (await ac.post("/generate", json=body)).json()
            else:
                async with ac.stream("POST", "/generate", json=body) as r:
                    out = sse_events([line async for line in r.aiter_lines()])[-2]
            assert out["output_ids"] == refs[k]["output_ids"], (i, out)
            assert out["text"] == refs[k]["text"]
            assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
            assert out["meta_info"]["prompt_tokens"] == len(refs[k]["input_ids"])
        elif kind == 2:  # sampled chat, non-stream
            max_tokens = 2 + i % 7
            body = {"model": "SmolLM2-135M-Instruct", "messages": CHAT, "max_tokens": max_tokens,
                    "temperature": 0.8, "top_p": 0.9, "seed": i}
            out = (await ac.post("/v1/chat/completions", json=body)).json()
            usage = out["usage"]
            assert usage["prompt_tokens"] == len(chat_ref["input_ids"])
            assert 1 <= usage["completion_tokens"] <= max_tokens
            if out["choices"][0]["finish_reason"] == "length":
                assert usage["completion_tokens"] == max_tokens
        else:  # sampled completion, streamed with usage
            body = {"prompt": PROMPTS[k], "max_tokens": 6, "temperature": 1.0, "top_k": 20, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                events = sse_events([line async for line in r.aiter_lines()])
            usage = events[-2]["usage"]
            assert usage["prompt_tokens"] == len(refs[k]["input_ids"]) and 1 <= usage["completion_tokens"] <= 6

    async def run_all() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as ac:
            await asyncio.gather(*(one(ac, i) for i in range(32)))

    asyncio.run(run_all())
    info = wait_idle(server.base_url)
    assert info["kv_pool_balanced"] is True


# ---------------------------------------------------------------------------------------------- bad input
LONG_IDS = [1] * 9000  # longer than the 8192-token context
BAD_REQUESTS = [
    ("/generate", b"{not json", 400, None),
    ("/generate", b"[1, 2, 3]", 400, None),
    ("/generate", {"text": 123}, 400, "text"),
    ("/generate", {"text": ""}, 400, "prompt"),
    ("/generate", {"input_ids": LONG_IDS, "sampling_params": {"max_new_tokens": 1}}, 400, "prompt"),
    ("/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "x", "rid": ["a", "b"]}, 400, "rid"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, 400, "logprob_start_len"),
    ("/abort_request", {}, 400, "rid"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, 400, "max_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "8"}}, 400, None),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, 400, None),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, 400, None),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 1.5}}, 400, None),
    ("/generate", {"text": "x", "sampling_params": {"no_such_param": 1}}, 400, None),
    ("/v1/chat/completions", b"{", 400, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3, "stream": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "n": "two"}, 400, "n"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
]


@pytest.mark.parametrize("backend", ["treespec", "openai"])
def test_bench_serving_against_the_server(server, tmp_path, backend):
    """benchmarks/bench_serving.py end to end: fixed-length random prompts at two concurrencies."""
    bench = load_benchmark("bench_serving")
    out = tmp_path / "rows.jsonl"
    rc = bench.main(["--backend", backend, "--base-url", server.base_url, "--dataset-name", "random",
                     "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "5",
                     "--max-concurrency", "1,2", "--output-file", str(out), "--disable-tqdm"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0 and [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["output_tok_s"] == pytest.approx(4 * 5 / r["duration_s"])  # EOS ignored: exactly 5 each
        assert 0 < r["ttft_ms_mean"] <= r["e2e_ms_mean"] and r["accept_length"] is None  # speculation off



@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS, ids=[f"{i}-{r[0]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_input_is_answered_and_server_keeps_serving(client, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    check_normal_request(client)


# ---------------------------------------------------------------------------------------------- disconnects
def test_disconnect_mid_stream_aborts_and_frees_kv(client, server):
    before = wait_idle(server.base_url)["stats"]
    body = {"text": "Tell me a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    with httpx.Client(base_url=server.base_url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 2:
                break
    after = wait_idle(server.base_url)
    stats = after["stats"]
    assert after["kv_pool_balanced"] is True
    assert stats["num_aborted_reqs"] == before["num_aborted_reqs"] + 1
    assert stats["generated_tokens"] - before["generated_tokens"] < 400
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["max_total_num_tokens"]
    check_normal_request(client)


def test_disconnect_non_stream_aborts(client, server):
    before = wait_idle(server.base_url)["stats"]
    body = {"text": "Tell me another long story.", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/generate", json=body, timeout=1.5)
    after = wait_idle(server.base_url)
    assert after["kv_pool_balanced"] is True
    assert after["stats"]["num_aborted_reqs"] == before["num_aborted_reqs"] + 1
    assert after["stats"]["generated_tokens"] - before["generated_tokens"] < 400
    assert server_info(server.base_url)["num_pending_http_requests"] == 0


# ---------------------------------------------------------------------------------------------- shutdown (last)
def test_sigterm_stops_all_processes_and_removes_sockets(server):
    info = server_info(server.base_url)
    pids, ipc_dir = info["pids"], info["ipc_dir"]
    assert os.path.isdir(ipc_dir) and stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    assert rc_of(server) == 0, server.log_tail()
    assert not os.path.exists(ipc_dir)
    for name, pid in pids.items():
        assert not pid_alive(pid), f"{name} (pid {pid}) still running"
    assert server.log_tail().count("treespec ready on") == 1
