"""Grammar-constrained decoding under speculation is exact: greedy outputs with EAGLE-3 and NGRAM equal
plain constrained greedy decoding token for token (batch 1 and a batch mixed with unconstrained
requests), with a target the drafts agree with (long accepted runs, which the grammar breaks where it
forbids the target's favourite) and a random one. Constrained requests speculate (each tree node is
masked by the grammar state along its own path), and the KV pool balances after every run."""

from __future__ import annotations

import random

import pytest
from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target, random_head, random_target

from treespec.engine import Engine

# the grammar's tokens: "t1", "t2", "t4", ... (the vocabulary's strings are "t<id>"): no id with a digit 3,
# so no forbidden token is the prefix of an allowed one (the grammar never walks into a dead end)
ALLOWED = [t for t in range(1, 256) if "3" not in str(t)]
EBNF = "root ::= tok+\ntok ::= " + " | ".join(f'"t{t}"' for t in ALLOWED)
REGEX = "(t(" + "|".join(str(t) for t in ALLOWED) + "))+"


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 20))] for _ in range(count)]


PROMPTS = make_prompts(8, seed=3)


def params(i: int, grammar: dict | None) -> dict:
    return {"temperature": 0, "max_new_tokens": 16 + 3 * (i % 4), "ignore_eos": True, **(grammar or {})}


def mixed_params(grammar: dict) -> list[dict]:
    """Every other request constrained."""
    return [params(i, grammar if i % 2 == 0 else None) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("constrained_spec")
    lookup = Lookup(seed=0)
    random_dir = random_target(root / "random_target", seed=4)
    lookup_dir = lookup_target(root / "lookup_target", lookup, noise=0.07)
    return {("lookup", "target"): lookup_dir, ("lookup", "EAGLE3"): lookup_eagle3_head(root / "lookup_eagle3", lookup),
            ("random", "target"): random_dir, ("random", "EAGLE3"): random_head(root / "random_eagle3", "EAGLE3",
                                                                                random_dir)}


def run(engine: Engine, batch_size: int, plist: list[dict]) -> list[list[int]]:
    outs: list[list[int]] = []
    for i in range(0, len(PROMPTS), batch_size):
        res = engine.generate(input_ids=PROMPTS[i : i + batch_size], sampling_params=plist[i : i + batch_size])
        outs += [r["output_ids"] for r in res]
        engine.check_pool_balance()
    return outs


def make_engine(model_dirs, kind: str, algorithm: str) -> Engine:
    kw: dict = {"speculative_algorithm": algorithm}
    if algorithm == "EAGLE3":
        kw.update(speculative_draft_model_path=str(model_dirs[(kind, "EAGLE3")]), speculative_num_steps=4,
                  speculative_eagle_topk=2, speculative_num_draft_tokens=8)
    return Engine(model_path=str(model_dirs[(kind, "target")]), dtype="float32", max_total_tokens=4096, **kw)


GRAMMARS = {"ebnf": {"ebnf": EBNF}, "regex": {"regex": REGEX}}


@pytest.fixture(scope="module")
def references(model_dirs) -> dict:
    out = {}
    for kind in ("lookup", "random"):
        engine = make_engine(model_dirs, kind, "NONE")
        free = run(engine, 4, [params(i, None) for i in range(len(PROMPTS))])
        for name, grammar in GRAMMARS.items():
            constrained = run(engine, 1, [params(i, grammar) for i in range(len(PROMPTS))])
            assert all(t in ALLOWED for out_ids in constrained for t in out_ids)
            assert constrained != free  # the grammar changes what the target says: the test has power
            out[(kind, name)] = constrained
            out[(kind, name, "mixed")] = run(engine, 4, mixed_params(grammar))
            assert out[(kind, name, "mixed")][1::2] == free[1::2]
            assert out[(kind, name, "mixed")][0::2] == constrained[0::2]
    return out


@pytest.mark.parametrize("name", list(GRAMMARS))
@pytest.mark.parametrize("kind,algorithm", [("lookup", "EAGLE3"), ("random", "EAGLE3"), ("lookup", "NGRAM"),
                                            ("random", "NGRAM")])
def test_constrained_greedy_speculation_equals_plain(model_dirs, references, kind, algorithm, name):
    engine = make_engine(model_dirs, kind, algorithm)
    grammar = GRAMMARS[name]
    constrained_drafts: list[int] = []
    if algorithm == "NGRAM":  # a constrained request's n-gram drafts are cut to what its grammar allows
        worker = engine.scheduler.spec_worker
        real_draft = worker._draft

        def recording_draft(req, *args):
            tokens, parents = real_draft(req, *args)
            if req.grammar is not None:
                constrained_drafts.extend(tokens)
            return tokens, parents

        worker._draft = recording_draft
    assert run(engine, 1, [params(i, grammar) for i in range(len(PROMPTS))]) == references[(kind, name)]
    assert run(engine, 4, mixed_params(grammar)) == references[(kind, name, "mixed")]
    stats = engine.get_stats()
    assert stats["spec_verify_ct"] > 0
    if algorithm == "NGRAM":
        assert constrained_drafts and set(constrained_drafts) <= set(ALLOWED)
    if kind == "lookup":  # drafts are accepted under the grammar: constrained requests really speculate
        assert stats["avg_spec_accept_length"] > 1.5, stats["avg_spec_accept_length"]


SHORT = {"ebnf": "root ::= tok tok\ntok ::= " + " | ".join(f'"t{t}"' for t in ALLOWED)}
EOS = 30  # not a grammar token: the grammar allows it only once complete


@pytest.fixture(scope="module")
def eos_target(model_dirs, tmp_path_factory):
    """The lookup target with an EOS id (the test models have none)."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("eos_target") / "target"
    shutil.copytree(model_dirs[("lookup", "target")], out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    return out


def test_a_grammar_without_a_stop_token_ends_when_complete(model_dirs):
    engine = make_engine(model_dirs, "lookup", "NONE")
    assert engine.scheduler.eos_token_ids == ()
    out = engine.generate(input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 12, **SHORT})
    assert len(out["output_ids"]) == 2 and out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NGRAM"])
def test_a_complete_grammar_beats_min_new_tokens_under_speculation(model_dirs, eos_target, algorithm):
    """The grammar completes before min_new_tokens: plain decoding ends the request with EOS (the grammar
    wins over min_new_tokens), and speculation does the same, never verifying an all-masked row."""
    plist = [{"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 8, **SHORT},
             {"temperature": 0.9, "max_new_tokens": 12, "min_new_tokens": 8, "seed": 1, **SHORT}]
    outs = {}
    for algo in ("NONE", algorithm):
        kw: dict = {"speculative_algorithm": algo}
        if algo == "EAGLE3":
            kw.update(speculative_draft_model_path=str(model_dirs[("lookup", "EAGLE3")]), speculative_num_steps=4,
                      speculative_eagle_topk=2, speculative_num_draft_tokens=8)
        engine = Engine(model_path=str(eos_target), dtype="float32", max_total_tokens=4096, **kw)
        assert engine.scheduler.eos_token_ids == (EOS,)
        outs[algo] = engine.generate(input_ids=PROMPTS[:2], sampling_params=plist)
        engine.check_pool_balance()
    for out in outs["NONE"] + outs[algorithm]:
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}, out["meta_info"]
        assert len(out["output_ids"]) == 3 and out["output_ids"][-1] == EOS
    assert outs[algorithm][0]["output_ids"] == outs["NONE"][0]["output_ids"]
