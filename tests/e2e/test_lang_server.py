"""The frontend DSL against one live server (default model, speculation off) through RuntimeEndpoint:
multi-turn chat, gen with stop, select, fork + join, streaming, run_batch of 64 programs equal to
sequential runs (greedy), and a shared few-shot prefix served from the radix cache."""

from __future__ import annotations

import httpx
import pytest
from server_e2e_helpers import SERVER_ARGS, wait_idle

from treespec.lang import RuntimeEndpoint, assistant, function, gen, select, system, user
from treespec.server.testing import start_server

FEW_SHOT = "".join(f"Q: What is {a} + {b}?\nA: {a + b}\n\n" for a, b in
                   [(2, 3), (10, 7), (4, 4), (12, 30), (6, 9), (21, 13), (5, 8), (40, 2), (11, 11), (3, 14)])


@pytest.fixture(scope="module")
def server():
    srv = start_server(SERVER_ARGS)
    try:
        srv.wait_healthy(600)
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def backend(server) -> RuntimeEndpoint:
    return RuntimeEndpoint(server.base_url)


def raw_generate(server, text: str, **params) -> str:
    resp = httpx.post(f"{server.base_url}/generate", json={"text": text, "sampling_params": {"temperature": 0,
                                                                                            **params}}, timeout=300)
    resp.raise_for_status()
    return resp.json()["text"]


def test_multi_turn_chat(server, backend):
    @function
    def chat(s, q1, q2):
        s += system("You are a helpful assistant. Answer briefly.")
        s += user(q1)
        s += assistant(gen("a1", max_tokens=12))
        with s.user():
            s += q2
        with s.assistant():
            s += gen("a2", max_tokens=12)

    state = chat.run(q1="What is the capital of France?", q2="And of Italy?", backend=backend, temperature=0)
    tok = backend.tokenizer
    msgs = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]
    a1 = raw_generate(server, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                      max_new_tokens=12)
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And of Italy?"}]
    a2 = raw_generate(server, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                      max_new_tokens=12)
    msgs.append({"role": "assistant", "content": a2})
    assert state["a1"] == a1 and "Paris" in a1
    assert state["a2"] == a2
    assert state.messages() == msgs
    assert state.text() == tok.apply_chat_template(msgs, tokenize=False)
    assert state.get_meta_info("a2")["cached_tokens"] > 0  # the second turn reuses the first one's KV


def test_gen_with_stop(server, backend):
    @function
    def colors(s):
        s += "Here is a list of three colors, separated by commas: red,"
        s += gen("rest", max_tokens=10, stop=",")

    full = raw_generate(server, "Here is a list of three colors, separated by commas: red,", max_new_tokens=10)
    assert "," in full
    state = colors.run(backend=backend, temperature=0)
    assert state["rest"] == full[:full.index(",")]


def test_select(backend):
    @function
    def capital(s, country):
        s += f"Question: What is the capital of {country}?\nAnswer:"
        s += select("city", choices=[" London", " Paris", " Berlin", " Madrid"])

    states = capital.run_batch([{"country": c} for c in ("France", "Germany", "Spain")], backend=backend)
    assert [st["city"] for st in states] == [" Paris", " Berlin", " Madrid"]
    scores = states[0].get_meta_info("city")["normalized_logprobs"]
    assert max(scores) == scores[1] and len(scores) == 4


def test_fork_join_and_stream(server, backend):
    @function
    def tot(s, question):
        s += user(question)
        with s.assistant():
            s += "Let me think about it step by step."
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += user(f"Give idea number {i + 1} in one short sentence.")
            f += assistant(gen("idea", max_tokens=10))
        forks.join()
        s += user("Ideas: " + " | ".join(forks.values("idea")) + "\nPick the best one.")
        s += assistant(gen("best", max_tokens=10))

    state = tot.run(question="How can I sleep better?", backend=backend, temperature=0)
    ideas = [m["content"] for m in state.messages()][-2].removeprefix("Ideas: ").split("\nPick")[0].split(" | ")
    assert len(ideas) == 3 and all(ideas)
    stream = tot.run(question="How can I sleep better?", backend=backend, temperature=0, stream=True)
    deltas = list(stream.text_iter())
    assert len(deltas) > 5 and "".join(deltas) == stream.text() == state.text()


@function
def few_shot(s, a, b):
    s += FEW_SHOT + f"Q: What is {a} + {b}?\nA:"
    s += gen("answer", max_tokens=4, stop="\n")


def test_run_batch_equals_sequential_and_hits_cache(server, backend):
    kwargs = [{"a": i, "b": 2 * i + 1} for i in range(64)]
    batch = few_shot.run_batch(kwargs, backend=backend, temperature=0, num_threads=64)
    assert all(st.error is None for st in batch)
    seq = [few_shot.run(backend=backend, temperature=0, **kw) for kw in kwargs]
    assert [st["answer"] for st in batch] == [st["answer"] for st in seq]
    prompt_tokens = batch[0].get_meta_info("answer")["prompt_tokens"]
    cached = [st.get_meta_info("answer")["cached_tokens"] for st in seq]
    assert prompt_tokens > 150 and min(cached) > 100  # the few-shot prefix is served from the radix cache
    wait_idle(server.base_url)


def test_error_in_one_program_does_not_stop_others(backend):
    @function
    def maybe_bad(s, i):
        s += f"Count: {i},"
        s += gen("n", max_tokens=-1 if i == 2 else 2)

    states = maybe_bad.run_batch([{"i": i} for i in range(6)], backend=backend, temperature=0)
    assert states[2].error is not None and "400" in str(states[2].error)
    assert all(st.error is None and st["n"] for i, st in enumerate(states) if i != 2)
