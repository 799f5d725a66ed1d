"""Compiled grammars, keyed by (field, grammar text), compiled on one worker thread.

The scheduler submits a request's grammar when the request arrives and admits the request once the
future is done, so a slow compile (a large JSON schema) holds back only that request. Compile errors
are cached too (the same bad schema sent twice fails at once) and come back as InvalidRequest naming
the field.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import xgrammar as xgr

from treespec.sampling_params import InvalidRequest

MAX_CACHED_GRAMMARS = 256
# JSON output in one line, as `json.dumps` writes it, at most this many blanks between elements: an
# unbounded run of whitespace is a way for a model to never finish (xgrammar allows any by default)
MAX_JSON_WHITESPACE = 4
# "[10:55:11] /project/cpp/regex_converter.cc:83: " in front of xgrammar's messages
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def load_tokenizer_info(tokenizer_path: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...]
                        ) -> xgr.TokenizerInfo:
    """xgrammar's view of the model's vocabulary: the tokenizer folder's tokenizer.json read through
    transformers (xgrammar detects the byte-level / sentencepiece encoding from it), sized to the
    model's logits (vocab_size may differ from the tokenizer's)."""
    import transformers

    hf_tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_path))
    stops = [t for t in stop_token_ids if t < vocab_size]
    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)


def compile_error_message(field: str, error: Exception) -> str:
    detail = _XGR_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
    return f"invalid {field}: {detail}"


class GrammarCache:
    """One GrammarCompiler (built on first use, on the worker thread) and the futures of its results."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...],
                 capacity: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer_path, self.vocab_size, self.stop_token_ids = tokenizer_path, vocab_size, stop_token_ids
        self.capacity = capacity
        self._compiler: xgr.GrammarCompiler | None = None
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()  # the executor's thread builds the compiler, callers read futures
        self._executor: ThreadPoolExecutor | None = None
        self.num_compiled = 0

    def submit(self, field: str, text: str) -> Future:
        """The future of a compiled grammar: xgr.CompiledGrammar, or InvalidRequest(param=field)."""
        key = (field, text)
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            future = self._executor.submit(self._compile, field, text)
            self._futures[key] = future
            while len(self._futures) > self.capacity:
                self._futures.popitem(last=False)
            return future

    def get(self, field: str, text: str) -> xgr.CompiledGrammar:
        """Compile (or look up) and wait; raises InvalidRequest for a bad grammar."""
        return self.submit(field, text).result()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            info = load_tokenizer_info(self.tokenizer_path, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, field: str, text: str) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if field == "regex":
                compiled = compiler.compile_regex(text)
            elif field == "json_schema":
                compiled = compiler.compile_json_schema(text, any_whitespace=True,
                                                        max_whitespace_cnt=MAX_JSON_WHITESPACE)
            elif field == "ebnf":
                compiled = compiler.compile_grammar(text)
            else:
                raise ValueError(f"unknown grammar field {field!r}")
        except (RuntimeError, ValueError, xgr.InvalidJSONError) as e:
            raise InvalidRequest(compile_error_message(field, e), param=field) from None
        self.num_compiled += 1
        return compiled
