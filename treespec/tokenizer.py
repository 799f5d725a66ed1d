"""The one tokenizer every process uses: `tokenizers` plus the chat template rendered with jinja2.

Torch-free (transformers' AutoTokenizer imports torch), so the HTTP and detokenizer processes stay light.
It reproduces what transformers does for a fast tokenizer: encode / decode through tokenizer.json,
`clean_up_tokenization_spaces` when tokenizer_config.json asks for it, and chat templates rendered in a
sandboxed jinja2 environment with the special tokens as template variables. The Engine, the scheduler's
stop-string check, the detokenizer and the HTTP routes all use this class, so in-process and served
text are the same.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # as transformers: jinja's own tojson escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (templates from the Hub are untrusted)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: drop the space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


class Tokenizer:
    """encode / decode / apply_chat_template with transformers' signatures and results."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
        self.path = str(folder)
        self.backend = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        map_file = folder / "special_tokens_map.json"
        special_map = json.loads(map_file.read_text(encoding="utf-8")) if map_file.exists() else {}
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_str(config.get(name)) or _token_str(special_map.get(name))
            if token is not None:
                self.special_tokens[name] = token
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        source = _read_chat_template(folder, config)
        self.chat_template_source = source  # read by the OpenAI route to see what the template renders (tools)
        self.chat_template = compile_chat_template(source) if source is not None else None

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.backend.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int] | str:
        """The rendered chat (tokenize=False) or its token ids, encoded without added special tokens
        (the template writes them itself). `tools` (OpenAI tool definitions) are passed to the template
        as transformers passes them."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer in {self.path} has no chat template")
        extra = {"tools": tools} if tools is not None else {}
        text = self.chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **extra, **self.special_tokens)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer(path)


def chat_input_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat through the model's chat template. Also takes a transformers tokenizer (the
    training code passes one), which may return an encoding rather than a list."""
    extra = {"tools": tools} if tools is not None else {}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **extra)
    if not isinstance(out, list):
        out = out["input_ids"]
    return list(out)
