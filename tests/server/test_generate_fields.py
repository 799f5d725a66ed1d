"""/generate answers a field it does not implement with a 400 naming it, never ignores it."""

import pytest

from treespec.server.protocol import GENERATE_FIELDS, ApiError, parse_generate


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [1] + [ord(c) % 1000 for c in text]


@pytest.mark.parametrize("field", ["lora_path", "image_data", "return_hidden_states", "custom_logit_processor",
                                   "input_embeds", "session_params", "regex", "max_new_tokens"])
def test_generate_refuses_fields_it_does_not_implement(field):
    """SGLang fields treespec does not implement, and sampling params misplaced outside sampling_params."""
    assert field not in GENERATE_FIELDS
    with pytest.raises(ApiError) as e:
        parse_generate({"text": "hi", field: "x"}, FakeTokenizer())
    assert e.value.status == 400 and e.value.param == field


def test_generate_takes_every_field_it_implements():
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": False, "rid": "r1",
            "return_logprob": True, "top_logprobs_num": 1, "logprob_start_len": 0, "return_text_in_logprobs": True}
    assert set(body) == set(GENERATE_FIELDS) - {"input_ids"}
    reqs, single, _ = parse_generate(body, FakeTokenizer())
    assert single and reqs[0].rid == "r1" and reqs[0].return_text_in_logprobs
