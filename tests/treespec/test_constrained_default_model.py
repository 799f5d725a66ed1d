"""Grammar-constrained decoding on the default model (a real tokenizer and a model that writes
sensible JSON): outputs are valid, and greedy outputs with the default speculation (NGRAM and its
schedule) and with the shipped EAGLE-3 head (its steps mix speculative and plain ones) equal plain
decoding's."""

from __future__ import annotations

import json
import re

import pytest

from treespec.engine import Engine
from treespec.tokenizer import chat_input_ids

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "[A-Z][A-Za-z ]{0,30}"},
    "year": {"type": "integer", "minimum": 0, "maximum": 2100},
    "tags": {"type": "array", "items": {"enum": ["science", "art", "sport", "politics"]}, "maxItems": 3}},
    "required": ["name", "year", "tags"]}
REGEX = r"(Yes|No)\. [A-Z][a-z ,]{10,60}\."
QUESTIONS = [
    ("json_schema", "Marie Curie won the Nobel Prize in Physics in 1903. Describe her as JSON."),
    ("json_schema", "The 1998 football World Cup was held in France. Describe the event as JSON."),
    ("regex", "Is the Pacific the largest ocean? Answer and explain briefly."),
    ("regex", "Can penguins fly? Answer and explain briefly."),
]


def sampling(field: str) -> dict:
    grammar = json.dumps(SCHEMA) if field == "json_schema" else REGEX
    return {"temperature": 0, "max_new_tokens": 64, field: grammar}


def valid(field: str, text: str) -> bool:
    if field == "regex":
        return re.fullmatch(REGEX, text) is not None
    obj = json.loads(text)
    return set(obj) == {"name", "year", "tags"} and type(obj["year"]) is int and isinstance(obj["tags"], list)


def run(engine: Engine, also_alone: bool = False) -> list[list[int]]:
    ids = [chat_input_ids(engine.tokenizer, [{"role": "user", "content": q}]) for _, q in QUESTIONS]
    params = [sampling(f) for f, _ in QUESTIONS]
    batched = engine.generate(input_ids=ids, sampling_params=params)
    if also_alone:
        alone = [engine.generate(input_ids=i, sampling_params=p) for i, p in zip(ids, params, strict=True)]
        assert [o["output_ids"] for o in batched] == [o["output_ids"] for o in alone]
    for (field, _), out in zip(QUESTIONS, batched, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop" and valid(field, out["text"]), out["text"]
    engine.check_pool_balance()
    return [o["output_ids"] for o in batched]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return run(Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm="NONE"), also_alone=True)


@pytest.mark.parametrize("algorithm", ["default", "EAGLE3"])  # the default: NGRAM with its tuned schedule
def test_constrained_speculation_equals_plain_on_the_default_model(plain, algorithm):
    kw = {} if algorithm == "default" else {"speculative_algorithm": algorithm}
    engine = Engine(dtype="float32", max_total_tokens=4096, **kw)
    assert engine.server_args.speculative_algorithm != "NONE"
    assert run(engine) == plain
    assert engine.get_stats()["spec_verify_ct"] > 0
