"""The frontend DSL on the in-process Engine backend with a tiny random Llama that has the default
tokenizer's full vocabulary (so any text and the chat template tokenize): gen, stop, select against a
direct logprob computation, fork + join, roles through the chat template, run_batch == sequential runs,
per-program errors, streaming, and a cheap `import treespec`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import treespec
from treespec.engine import Engine
from treespec.lang import EngineBackend, ProgramState, assistant, function, gen, select, system, user

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from model_factory import TINY, copy_default_tokenizer  # noqa: E402

GREEDY = {"temperature": 0.0}
FEW_SHOT = "".join(f"Question: what is {i} plus {i}?\nAnswer: {2 * i}\n\n" for i in range(1, 9))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**{**TINY, "vocab_size": 49152}, tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("tiny_full_vocab")
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    copy_default_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def engine(tiny_dir):
    torch.set_num_threads(1)
    eng = Engine(str(tiny_dir), dtype="float32", max_total_tokens=8192, max_running_requests=64,
                 num_threads=1, speculative_algorithm="NONE")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def backend(engine) -> EngineBackend:
    return EngineBackend(engine)


@pytest.fixture(autouse=True)
def pool_balances(request):
    yield
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").check_pool_balance()


def direct(engine, prompt: str, **params) -> str:
    return engine.generate(prompt, {**GREEDY, **params})["text"]


def test_gen_and_stop(engine, backend):
    @function
    def prog(s, q):
        s += "Question: " + q + "\nAnswer:"
        s += gen("answer", max_tokens=12)

    prompt = "Question: what is the sky?\nAnswer:"
    full = direct(engine, prompt, max_new_tokens=12)
    state = prog.run(q="what is the sky?", backend=backend, temperature=0)
    assert state["answer"] == full and state.text() == prompt + full
    assert state.get_meta_info("answer")["completion_tokens"] >= 1
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop and stop in full
    state = prog.run(q="what is the sky?", backend=backend, temperature=0, stop=stop)
    assert state["answer"] == full[:full.find(stop)]


def test_select_matches_direct_logprobs(engine, tiny_dir, backend):
    from transformers import AutoModelForCausalLM

    choices = [" positive", " negative", " neutral", " it is hard to say"]

    @function
    def classify(s, review):
        s += "Review: " + review + "\nSentiment:"
        s += select("label", choices=choices)

    state = classify.run(review="great film, I loved it", backend=backend)
    prefix = "Review: great film, I loved it\nSentiment:"
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tok = engine.tokenizer
    p_ids = tok.encode(prefix, add_special_tokens=False)
    expected = []
    for c in choices:
        c_ids = tok.encode(c, add_special_tokens=False)
        with torch.no_grad():
            logits = hf(torch.tensor([p_ids + c_ids])).logits[0].log_softmax(-1)
        expected.append(sum(logits[len(p_ids) + i - 1, t].item() for i, t in enumerate(c_ids)) / len(c_ids))
    got = state.get_meta_info("label")["normalized_logprobs"]
    assert got == pytest.approx(expected, abs=2e-3)
    assert state["label"] == choices[max(range(len(choices)), key=lambda i: (expected[i], -i))]
    assert state.text() == prefix + state["label"]


def test_fork_and_join(engine, backend):
    @function
    def branches(s):
        s += FEW_SHOT + "Let us think in three ways.\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Way {i + 1}:" + gen("idea", max_tokens=5)
        forks.join()
        s += "Best: " + forks[0]["idea"]
        s.set_var("ideas", forks.values("idea"))

    state = branches.run(backend=backend, temperature=0)
    prefix = FEW_SHOT + "Let us think in three ways.\n"
    want = [direct(engine, prefix + f"Way {i + 1}:", max_new_tokens=5) for i in range(3)]
    assert state["ideas"] == want
    assert state.text() == prefix + "Best: " + want[0]


def test_roles_use_chat_template(engine, backend):
    tok = engine.tokenizer

    @function
    def chat(s, q1, q2):
        s += system("You are terse.")
        s += user(q1)
        s += assistant(gen("a1", max_tokens=6))
        with s.user():
            s += q2
        with s.assistant():
            s += gen("a2", max_tokens=6)

    state = chat.run(q1="Hi there", q2="And then?", backend=backend, temperature=0)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    a1 = direct(engine, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), max_new_tokens=6)
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And then?"}]
    a2 = direct(engine, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), max_new_tokens=6)
    msgs.append({"role": "assistant", "content": a2})
    assert (state["a1"], state["a2"]) == (a1, a2)
    assert state.messages() == msgs
    assert state.text() == tok.apply_chat_template(msgs, tokenize=False)


@function
def few_shot_qa(s, i):
    s += FEW_SHOT + f"Question: what is {i} plus one?\nAnswer:"
    s += gen("answer", max_tokens=4, stop="\n")


def test_run_batch_equals_sequential(backend):
    kwargs = [{"i": i} for i in range(64)]
    batch = few_shot_qa.run_batch(kwargs, backend=backend, temperature=0, num_threads=64)
    seq = [few_shot_qa.run(backend=backend, temperature=0, **kw) for kw in kwargs]
    assert all(st.error is None for st in batch)
    assert [st["answer"] for st in batch] == [st["answer"] for st in seq]
    assert [st.text() for st in batch] == [st.text() for st in seq]
    assert max(st.get_meta_info("answer")["cached_tokens"] for st in batch) > 0


def test_error_in_one_program_does_not_stop_others(backend):
    @function
    def maybe_fail(s, i):
        s += f"Item {i}:"
        if i == 3:
            raise ValueError("boom")
        s += gen("out", max_tokens=-5 if i == 5 else 3)  # i == 5: the runtime rejects the request

    states = maybe_fail.run_batch([{"i": i} for i in range(8)], backend=backend, temperature=0)
    assert isinstance(states[3].error, ValueError)
    assert states[5].error is not None
    ok = [i for i in range(8) if i not in (3, 5)]
    assert all(states[i].error is None for i in ok)
    for i in ok:
        assert states[i]["out"] == maybe_fail.run(i=i, backend=backend, temperature=0)["out"]
    with pytest.raises(RuntimeError, match="failed"):
        states[5]["out"]


def test_stream_text_deltas(backend):
    state = few_shot_qa.run(i=7, backend=backend, temperature=0, stream=True)
    assert isinstance(state, ProgramState)
    deltas = list(state.text_iter())
    assert len(deltas) >= 2 and "".join(deltas) == state.text()


def test_import_is_cheap_and_reexports():
    code = "import sys, treespec; assert 'torch' not in sys.modules; treespec.gen; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert treespec.function is function and treespec.select is select


def test_engine_backend_batches_concurrent_programs(engine):
    calls: list[int] = []
    real = engine.generate

    def counting(*args, **kwargs):
        calls.append(len(kwargs.get("input_ids") or []))
        return real(*args, **kwargs)

    backend = EngineBackend(engine)
    engine.generate = counting
    try:
        states = few_shot_qa.run_batch([{"i": i} for i in range(32)], backend=backend, temperature=0)
    finally:
        del engine.generate
    assert all(st.error is None for st in states)
    assert sum(calls) == 32 and len(calls) < 16 and max(calls) > 4  # gathered into a few batched calls


def test_select_ties_go_to_the_first_choice():
    from treespec.lang.backends import pick

    assert pick([-1.0, -0.5, -0.5]) == 1 and pick([-2.0, -2.0]) == 0


PHONE = r"\(\d{3}\) \d{3}-\d{4}"
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
        "required": ["ok", "n"], "additionalProperties": False}


@function
def constrained(s):
    s += "Call me at "
    s += gen("phone", regex=PHONE, max_tokens=24)
    s += "\nStatus: "
    s += gen("status", json_schema=FLAG, max_tokens=48)
    s += "\nVerdict:"
    s += gen("verdict", choices=[" guilty", " not guilty"])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_gen_grammars_and_choices_on_the_engine(engine, backend, sampling):
    """A random model left to itself writes noise; under the grammar it writes a phone number and a valid
    object, and gen(choices=) picks exactly what select picks."""
    import json
    import re

    import jsonschema

    for state in constrained.run_batch([{}] * 3, backend=backend, **sampling):
        assert state.error is None, state.error
        assert re.fullmatch(PHONE, state["phone"]), state["phone"]
        jsonschema.validate(json.loads(state["status"]), FLAG)
        assert state["verdict"] in (" guilty", " not guilty")
    direct_out = engine.generate("Call me at ", {**sampling, "regex": PHONE, "max_new_tokens": 24})["text"]
    if sampling["temperature"] == 0:
        assert direct_out == state["phone"]

    @function
    def by_select(s):
        s += state.text()[:state.text().rindex("Verdict:") + len("Verdict:")]
        s += select("verdict", choices=[" guilty", " not guilty"])

    assert by_select.run(backend=backend)["verdict"] == state["verdict"]


def test_gen_grammar_arguments():
    from treespec.lang.ir import Gen, Select

    g = gen("x", json_schema={"type": "object"}, max_tokens=5)
    assert isinstance(g, Gen) and g.sampling_params({"temperature": 0}) == {
        "temperature": 0, "max_new_tokens": 5, "json_schema": '{"type": "object"}'}
    assert gen("x", regex="a+").sampling_params({})["regex"] == "a+"
    assert gen("x", ebnf='root ::= "a"').sampling_params({})["ebnf"] == 'root ::= "a"'
    s = gen("x", choices=["a", "b"])
    assert isinstance(s, Select) and s.choices == ["a", "b"] and s.name == "x"
    with pytest.raises(ValueError, match="at most one"):
        gen("x", regex="a", json_schema="{}")
    with pytest.raises(ValueError, match="takes no max_tokens, temperature"):
        gen("x", choices=["a"], temperature=0.5, max_tokens=3)


def test_bad_grammar_fails_its_program_only(backend):
    @function
    def bad(s, i):
        s += f"Item {i}:"
        s += gen("out", regex="(" if i == 1 else "[0-9]", max_tokens=4)

    states = bad.run_batch([{"i": i} for i in range(3)], backend=backend, temperature=0)
    assert "regex" in str(states[1].error)
    assert all(states[i].error is None and states[i]["out"].isdigit() for i in (0, 2))
