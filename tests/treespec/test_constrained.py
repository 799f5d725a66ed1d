"""Grammar-constrained decoding (treespec.constrained on xgrammar) on the in-process Engine with a tiny
random Llama over the default tokenizer's full vocabulary (so the grammars' text tokenizes): regex, JSON
schema and EBNF outputs always match / parse, greedy and sampled, alone and batched with unconstrained
requests (whose outputs the masks never touch); bad grammars raise InvalidRequest naming the field;
grammars compile off the scheduler loop and are cached; stop rules and min_new_tokens; the KV pool
balances after every test."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

from treespec.engine import Engine
from treespec.sampling_params import InvalidRequest, SamplingParams

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from model_factory import TINY, copy_default_tokenizer  # noqa: E402

REGEX = r"(yes|no|maybe), [a-z]{2,6} [0-9]{1,3}(\.[0-9])?"
SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar 0.2.8's length-bounded string rule lets raw control
        # characters through (its plain string rule does not)
        "name": {"type": "string", "pattern": "[A-Za-z][a-z ]{0,7}"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
}
EBNF = r'''
root ::= "(" expr ")"
expr ::= num | num op num | "(" num op num ")" op num
op ::= "+" | "-" | "*"
num ::= [1-9] | [1-9] [0-9]
'''
EBNF_RE = re.compile(r"\((\d+|\d+[+*-]\d+|\(\d+[+*-]\d+\)[+*-]\d+)\)")
PROMPTS = ["Answer the question: is it raining?", "Describe a pet as JSON.", "Write an arithmetic expression."]
MAX_NEW = 96


def valid_schema_output(text: str) -> bool:
    obj = json.loads(text)
    return (list(obj) == ["name", "age", "kind", "tags"] and re.fullmatch("[A-Za-z][a-z ]{0,7}", obj["name"]) is not None
            and type(obj["age"]) is int and 0 <= obj["age"] <= 120 and obj["kind"] in ("cat", "dog", "bird")
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(type(t) is bool for t in obj["tags"]))


GRAMMARS = {
    "regex": ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    "json_schema": ({"json_schema": json.dumps(SCHEMA)}, valid_schema_output),
    "ebnf": ({"ebnf": EBNF}, lambda text: EBNF_RE.fullmatch(text) is not None),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**{**TINY, "vocab_size": 49152}, tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("tiny_constrained")
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    copy_default_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def engine(tiny_dir):
    torch.set_num_threads(1)
    eng = Engine(str(tiny_dir), dtype="float32", max_total_tokens=8192, max_running_requests=32,
                 num_threads=1, speculative_algorithm="NONE")
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def pool_balances(request):
    yield
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").check_pool_balance()


def assert_valid(name: str, out: dict) -> None:
    _, is_valid = GRAMMARS[name]
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert is_valid(out["text"]), out["text"]


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_and_sampled_outputs_match_the_grammar(engine, name):
    grammar, _ = GRAMMARS[name]
    for i, prompt in enumerate(PROMPTS):
        assert_valid(name, engine.generate(prompt, {**grammar, "temperature": 0, "max_new_tokens": MAX_NEW}))
        for seed in range(4):
            out = engine.generate(prompt, {**grammar, "temperature": 1.0, "max_new_tokens": MAX_NEW,
                                           "seed": 10 * i + seed})
            assert_valid(name, out)


def test_unconstrained_random_model_does_not_match_by_itself(engine):
    """The grammars above are not what this model writes anyway: the masks do the work."""
    for prompt in PROMPTS:
        text = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})["text"]
        assert not any(check(text) for name, (_, check) in GRAMMARS.items() if name != "json_schema")
        with pytest.raises(ValueError):
            valid_schema_output(text)


def test_mixed_batch_with_unconstrained_requests(engine):
    """Constrained (every grammar, greedy and sampled) and unconstrained requests in one batch: each
    constrained output is valid, and each unconstrained greedy output equals its output alone."""
    free = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    alone = [engine.generate(p, free)["output_ids"] for p in PROMPTS]
    prompts, params = [], []
    for grammar, _ in GRAMMARS.values():
        for j, prompt in enumerate(PROMPTS):
            prompts += [prompt, prompt]
            params += [{**grammar, "temperature": 0, "max_new_tokens": MAX_NEW},
                       {**grammar, "temperature": 0.9, "top_p": 0.95, "max_new_tokens": MAX_NEW, "seed": j}]
    prompts += PROMPTS
    params += [free] * len(PROMPTS)
    outs = engine.generate(prompts, params)
    names = [name for name in GRAMMARS for _ in range(2 * len(PROMPTS))]
    for name, out in zip(names, outs, strict=False):
        assert_valid(name, out)
    assert [o["output_ids"] for o in outs[len(names):]] == alone
    # batched constrained greedy equals constrained greedy alone
    grammar, _ = GRAMMARS["json_schema"]
    single = engine.generate(PROMPTS[0], {**grammar, "temperature": 0, "max_new_tokens": MAX_NEW})
    assert outs[2 * len(PROMPTS)]["output_ids"] == single["output_ids"]


def test_grammar_ends_the_request_with_eos_and_min_new_tokens_yields(engine):
    eos = engine.scheduler.eos_token_ids
    out = engine.generate(PROMPTS[0], {"regex": "(yes|no)", "temperature": 0, "max_new_tokens": 30})
    assert out["text"] in ("yes", "no") and out["output_ids"][-1] in eos
    # min_new_tokens blocks EOS, the complete grammar allows only EOS: the grammar wins
    out = engine.generate(PROMPTS[0], {"regex": "(yes|no)", "temperature": 0, "max_new_tokens": 30,
                                       "min_new_tokens": 10})
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_max_new_tokens_and_stop_strings_still_apply(engine):
    out = engine.generate(PROMPTS[1], {"regex": "[a-z]{40}", "temperature": 0, "max_new_tokens": 3})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert re.fullmatch("[a-z]+", out["text"])
    out = engine.generate(PROMPTS[1], {"regex": "abc,def,ghi", "temperature": 0, "max_new_tokens": 30,
                                       "stop": ",def"})
    assert out["text"] == "abc" and out["meta_info"]["finish_reason"]["matched"] == ",def"


@pytest.mark.parametrize("field,text,needle", [
    ("regex", "[a-", "Unclosed"),
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
])
def test_bad_grammar_raises_naming_the_field_and_queues_nothing(engine, field, text, needle):
    with pytest.raises(InvalidRequest) as e:
        engine.generate([PROMPTS[0], PROMPTS[1]], [{"max_new_tokens": 4}, {field: text, "max_new_tokens": 4}])
    assert e.value.param == field and needle in str(e.value) and isinstance(e.value, ValueError)
    assert not engine.scheduler.has_work()
    assert engine.generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": 0})["output_ids"]


def test_compiled_grammars_are_cached(engine):
    cache = engine.scheduler.grammars
    before = cache.num_compiled
    for _ in range(3):
        engine.generate(PROMPTS[2], {"regex": "[0-9]{4}", "temperature": 0, "max_new_tokens": 8})
    assert cache.num_compiled == before + 1
    assert cache.submit("regex", "[0-9]{4}").done()
    bad = cache.submit("regex", "(")
    assert bad is cache.submit("regex", "(")  # the error is cached too
    assert isinstance(bad.exception(), InvalidRequest)


def test_a_request_waits_for_its_grammar_while_others_decode(engine, monkeypatch):
    """Compilation runs on the cache's thread: a request whose grammar is still compiling stays in the
    queue while the running requests keep decoding, and joins once it is ready."""
    sched = engine.scheduler
    release = threading.Event()
    real_compile = sched.grammars._compile

    def slow_compile(field, text):
        assert threading.current_thread() is not threading.main_thread()
        release.wait(timeout=60)
        return real_compile(field, text)

    monkeypatch.setattr(sched.grammars, "_compile", slow_compile)
    ids = engine.tokenizer.encode(PROMPTS[0])
    free = sched.add_request("free", ids, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    held = sched.add_request("held", ids, SamplingParams(regex="(on|off) [0-9]{3}", temperature=0,
                                                         max_new_tokens=20))
    for _ in range(5):
        sched.step()
    assert len(free.output_ids) >= 4 and not held.output_ids and held in sched.waiting
    release.set()
    while sched.has_work():
        sched.step()
    assert free.finished and held.finished
    text = engine.tokenizer.decode(held.output_ids, skip_special_tokens=True)
    assert re.fullmatch("(on|off) [0-9]{3}", text), text


def test_scheduler_refuses_a_queued_request_whose_grammar_fails(engine):
    """The server path: the request is queued, its grammar fails on the compile thread, the scheduler
    drops it into take_refused() (the server answers 400) and keeps serving the others."""
    sched = engine.scheduler
    ids = engine.tokenizer.encode(PROMPTS[0])
    sched.add_request("bad", ids, SamplingParams(json_schema='{"type": "wrong"}', max_new_tokens=4))
    ok = sched.add_request("ok", ids, SamplingParams(temperature=0, max_new_tokens=4))
    while sched.has_work():
        sched.step()
    refused = sched.take_refused()
    assert [(rid, e.param) for rid, e in refused] == [("bad", "json_schema")]
    assert "wrong" in str(refused[0][1]) and ok.finished and sched.take_refused() == []


@pytest.mark.parametrize("algorithm", ["NONE", "NGRAM"])
def test_jump_forward_appends_forced_text_without_model_steps(tiny_dir, algorithm):
    """--enable-jump-forward: where the grammar forces text the request takes it without a model step
    (then one prefill over it); outputs stay valid, take fewer forward passes, and the pool balances."""
    regex = r"The answer is (yes|no)\. The reason: [a-z]{3,8} is the (cause|answer)\."
    params = {"regex": regex, "max_new_tokens": 80}
    passes = {}
    for jump in (False, True):
        eng = Engine(str(tiny_dir), dtype="float32", max_total_tokens=8192, num_threads=1,
                     speculative_algorithm=algorithm, enable_jump_forward=jump)
        forwards = 0
        real_forward = eng.scheduler.runner.forward

        def counting_forward(*args, _real=real_forward, **kwargs):
            nonlocal forwards
            forwards += 1
            return _real(*args, **kwargs)

        eng.scheduler.runner.forward = counting_forward
        for i, prompt in enumerate(PROMPTS):
            outs = eng.generate([prompt, prompt], [{**params, "temperature": 0},
                                                   {**params, "temperature": 1.0, "seed": i}])
            for out in outs:
                assert out["meta_info"]["finish_reason"]["type"] == "stop", out
                assert re.fullmatch(regex, out["text"]), out["text"]
        eng.check_pool_balance()
        assert (eng.get_stats()["jump_forward_tokens"] > 0) == jump
        passes[jump] = forwards
    assert passes[True] < passes[False], passes


def test_jump_forward_needs_the_radix_cache():
    from treespec.args import ArgError, ServerArgs

    with pytest.raises(ArgError, match="--enable-jump-forward"):
        ServerArgs(enable_jump_forward=True, disable_radix_cache=True).resolve()


def test_allowed_drafts_keep_the_paths_the_grammar_accepts(engine):
    """NGRAM drafts of a constrained request: nodes whose path the grammar rejects (and everything under
    them) are dropped, the rest renumbered breadth-first, at most max_drafts kept; the matcher's state
    does not move."""
    from treespec.constrained import GrammarState

    state = GrammarState(engine.scheduler.grammars.get("regex", "ab(c|d)e"))
    a, b, c, d, e, z = (engine.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcdez")
    # node 1 a, node 2 z (rejected), node 3 b under a, node 4 c under z (dropped), node 5 z under b
    # (rejected), node 6 d under b, node 7 e under d
    tokens, parents = [a, z, b, c, z, d, e], [0, 0, 1, 2, 3, 3, 6]
    assert state.allowed_drafts(tokens, parents, 8) == ([a, b, d, e], [0, 1, 2, 3])
    assert state.allowed_drafts(tokens, parents, 2) == ([a, b], [0, 1])
    assert state.accept(a) and state.accept(b) and state.accept(c)  # the state was left at the start
