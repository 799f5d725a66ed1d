"""A warm corpus for NGRAM's shared trie: token texts inserted when the worker starts and after every
`/flush_cache`, before any request's text (`--speculative-ngram-corpus`).

Why: a chat reply rarely repeats its own prompt, so at batch 1 most chat steps find no draft in the
request's own text, and the shared trie holds only what this server has said since it started. A model
says the same phrases across conversations (openings, list scaffolding, closing offers); its own replies
to other people's questions predict them. The shipped corpus for the default model
(`drafts/ngram/corpus.json.gz`, made by `python -m treespec.train.ngram_corpus`) is its greedy replies to
ShareGPT first turns of the training pool, none from the held-out conversations the benchmarks use.
Drafts from it are verified like any other, so it changes drafts, never outputs; the shared trie's
capacity bounds it like any other text, and requests' text may evict it.

File: gzipped JSON {"vocab_size": V, "texts": [[token ids], ...], ...}; other keys describe its making.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path


class CorpusError(ValueError):
    """The corpus file is unreadable or does not fit the model (the message names the problem)."""


def load_corpus(path: str | Path, vocab_size: int) -> list[list[int]]:
    """The texts of the corpus file at `path`, checked: every token id in [0, vocab_size), and the file's
    vocab_size equal to the model's (a corpus made for another tokenizer would draft nonsense)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise CorpusError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("texts"), list):
        raise CorpusError(f"{path}: expected a JSON object with a 'texts' list")
    if data.get("vocab_size") != vocab_size:
        raise CorpusError(f"{path} was made for a vocabulary of {data.get('vocab_size')} tokens, the model has {vocab_size}")
    texts = data["texts"]
    for text in texts:
        if not isinstance(text, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in text):
            raise CorpusError(f"{path}: every text must be a list of token ids in [0, {vocab_size})")
    return texts


def save_corpus(path: str | Path, texts: list[list[int]], vocab_size: int, **about) -> None:
    """Write `texts` as a corpus file (`about`: how it was made, kept beside them)."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({**about, "vocab_size": vocab_size, "texts": texts}, f, separators=(",", ":"))
