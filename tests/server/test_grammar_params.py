"""The grammar fields of SamplingParams (regex, json_schema, ebnf; SGLang's names) and how /generate and the
Engine take them: at most one per request, each a non-empty string, a JSON schema valid JSON; errors name
the field."""

import pytest

from treespec.sampling_params import InvalidRequest, SamplingParams
from treespec.server.protocol import ApiError, parse_generate


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [1] + [ord(c) % 1000 for c in text]


@pytest.mark.parametrize("field,value", [("regex", "[0-9]+"), ("json_schema", '{"type": "object"}'),
                                         ("ebnf", 'root ::= "yes" | "no"')])
def test_one_grammar_field(field, value):
    params = SamplingParams.from_dict({field: value})
    assert params.grammar == (field, value)
    reqs, _, _ = parse_generate({"text": "hi", "sampling_params": {field: value}}, FakeTokenizer())
    assert reqs[0].sampling_params.grammar == (field, value)


def test_no_grammar():
    assert SamplingParams().grammar is None


def test_json_schema_as_a_dict_becomes_json_text():
    params = SamplingParams.from_dict({"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    assert params.grammar == ("json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}')


@pytest.mark.parametrize("d,param,needle", [
    ({"regex": "a", "json_schema": "{}"}, "json_schema", "at most one of regex, json_schema, ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one"),
    ({"regex": ""}, "regex", "non-empty string"),
    ({"regex": 5}, "regex", "non-empty string"),
    ({"ebnf": ["x"]}, "ebnf", "non-empty string"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema", "JSON object"),
])
def test_bad_grammar_fields_name_the_field(d, param, needle):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(d)
    assert e.value.param == param and needle in str(e.value)
    with pytest.raises(ApiError) as e:
        parse_generate({"text": "hi", "sampling_params": d}, FakeTokenizer())
    assert e.value.status == 400 and e.value.param == f"sampling_params.{param}"
