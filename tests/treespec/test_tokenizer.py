"""treespec.tokenizer.Tokenizer gives transformers' AutoTokenizer results token for token and character
for character: encode, decode (with and without special tokens), chat templates."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from treespec.model_loader import resolve_model_path
from treespec.tokenizer import chat_input_ids, load_tokenizer

TEXTS = ["Hello, world! How are you?", "naïve café — 日本語のテキスト 🤖🎉 done", "  leading spaces\n\nand\ttabs  ",
         "I'm sure it's fine , isn't it ? yes .", "<|im_start|>user\nhi<|im_end|>", ""]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Name a colour."}],
]
# a template in tokenizer_config.json that reads a special token and uses loop controls and raise_exception
CONFIG_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                   "{% endif %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n{% continue %}{% endif %}"
                   "{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")


def word_level_tokenizer(path: Path, chat: bool) -> Path:
    vocab = {f"t{i}": i for i in range(40)} | {w: 40 + i for i, w in enumerate(["I", "'m", "sure", ",", "?", "."])}
    vocab |= {"<s>": 50}
    tok = RustTokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"chat_template": CONFIG_TEMPLATE, "bos_token": "<s>"} if chat else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", clean_up_tokenization_spaces=chat,
                            **extra).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["default", "word_level", "word_level_chat"])
def pair(request, tmp_path_factory):
    if request.param == "default":
        path = resolve_model_path(None)
    else:
        path = word_level_tokenizer(tmp_path_factory.mktemp(request.param), chat=request.param.endswith("chat"))
    return AutoTokenizer.from_pretrained(str(path)), load_tokenizer(path), request.param


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches(pair, add_special_tokens):
    hf, ours, _ = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == \
            hf.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches(pair, skip_special_tokens):
    hf, ours, _ = pair
    id_lists = [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    id_lists += [list(range(0, 50)), [hf.eos_token_id or 0, 5, 6]]
    for ids in id_lists:
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == \
            hf.decode(ids, skip_special_tokens=skip_special_tokens), ids


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches(pair, add_generation_prompt):
    hf, ours, name = pair
    if name == "word_level":
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template(CHATS[0])
        return
    for chat in CHATS:
        text = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert text == hf.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert chat_input_ids(ours, chat, add_generation_prompt) == chat_input_ids(hf, chat, add_generation_prompt)


def test_template_raise_exception_and_special_tokens(tmp_path):
    ours = load_tokenizer(word_level_tokenizer(tmp_path, chat=True))
    assert ours.apply_chat_template(CHATS[0], tokenize=False).startswith("<s>user: ")
    assert ours.decode(ours.encode("I 'm sure , t1 ?")) == "I'm sure, t1?"  # clean_up_tokenization_spaces
    with pytest.raises(Exception, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_default_tokenizer_ids():
    path = resolve_model_path(None)
    hf, ours = AutoTokenizer.from_pretrained(str(path)), load_tokenizer(path)
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.vocab_size == len(hf)
