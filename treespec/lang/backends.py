"""Backends that execute frontend programs: the in-process Engine and a launch_server over HTTP."""

from __future__ import annotations

import json
import math
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

SELECT_PARAMS = {"max_new_tokens": 1, "temperature": 0.0}


def render_chat(tokenizer: Any, messages: list[dict], open_role: str | None, open_content: str) -> str:
    """Text of `messages` through the chat template, followed by the head of an open turn of `open_role`
    (its generation prompt for the assistant) and the open turn's content so far."""
    if open_role is None:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False) if messages else ""
    if open_role == "assistant":
        head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        sentinel = "\u2063treespec-open-turn\u2063"
        full = tokenizer.apply_chat_template([*messages, {"role": open_role, "content": sentinel}],
                                             tokenize=False, add_generation_prompt=False)
        head = full[:full.index(sentinel)]
    return head + open_content


def choice_scores(results: list[dict], n_prefix: int) -> list[float]:
    """Mean log-probability of each choice's tokens (the input logprobs from position n_prefix on)."""
    scores = []
    for r in results:
        lps = [lp for lp, *_ in r["meta_info"].get("input_token_logprobs") or [] if lp is not None]
        n_choice = r["meta_info"]["prompt_tokens"] - n_prefix
        lps = lps[-n_choice:] if n_choice > 0 else []
        scores.append(sum(lps) / len(lps) if lps else -math.inf)
    return scores


def pick(scores: list[float]) -> int:
    best = 0
    for i, s in enumerate(scores):
        if s > scores[best]:  # strict: ties go to the first choice
            best = i
    return best


class Backend:
    """What the interpreter needs from a backend."""

    tokenizer: Any

    def generate(self, prompt: str, params: dict, on_delta: Callable[[str], None] | None = None) -> dict:
        raise NotImplementedError

    def select(self, prefix: str, choices: list[str]) -> tuple[int, list[float], list[dict]]:
        """Tokenize prefix and choices separately (so every choice is scored after the same prefix ids)
        and score them; returns (index, normalised logprobs, meta_info of each choice request)."""
        tok = self.tokenizer
        prefix_ids = tok.encode(prefix, add_special_tokens=False)
        inputs = [prefix_ids + tok.encode(c, add_special_tokens=False) for c in choices]
        # start one token early: whichever convention the runtime uses, every choice token is covered
        results = self.score(inputs, max(len(prefix_ids) - 1, 0))
        scores = choice_scores(results, len(prefix_ids))
        return pick(scores), scores, [r["meta_info"] for r in results]

    def score(self, inputs: list[list[int]], logprob_start: int) -> list[dict]:
        raise NotImplementedError


class EngineBackend(Backend):
    """The in-process Engine. It is not thread-safe, so one worker thread owns it: calls arriving
    concurrently (run_batch threads, fork branches) are collected and submitted as one batched
    `generate` call per (return_logprob, logprob_start_len) group."""

    def __init__(self, engine: Any, gather_s: float = 0.003) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.gather_s = gather_s
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def _submit(self, ids: Any, params: dict | None, logprob_start: int | str | None) -> Future:
        fut: Future = Future()
        self._q.put((ids, params, logprob_start, fut))
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name="treespec-lang-engine", daemon=True)
                self._worker.start()
        return fut

    def _loop(self) -> None:
        while True:
            try:
                items = [self._q.get(timeout=5.0)]
            except queue.Empty:
                with self._lock:  # exit only if nothing came in meanwhile (_submit starts a new worker)
                    if self._q.empty():
                        self._worker = None
                        return
                continue
            while True:  # gather what arrives together
                try:
                    items.append(self._q.get(timeout=self.gather_s))
                except queue.Empty:
                    break
            groups: dict[int | str | None, list] = {}
            for it in items:
                groups.setdefault(it[2], []).append(it)
            for start, group in groups.items():
                if start == "call":  # a plain call on the engine, run by its owner thread
                    for fn, _, _, fut in group:
                        try:
                            fut.set_result(fn())
                        except Exception as e:  # noqa: BLE001
                            fut.set_exception(e)
                    continue
                self._run_group(start, group)

    def _run_group(self, start: int | None, group: list) -> None:
        kw = {"return_logprob": True, "logprob_start_len": start} if start is not None else {}
        try:
            outs = self.engine.generate(input_ids=[g[0] for g in group], sampling_params=[g[1] for g in group], **kw)
        except Exception as e:  # noqa: BLE001 - one bad request must not fail its batch-mates
            if len(group) == 1:
                group[0][3].set_exception(e)
                return
            for g in group:
                self._run_group(start, [g])
            return
        for g, out in zip(group, outs, strict=True):
            g[3].set_result(out)

    def flush_cache(self) -> bool:
        """Flush the engine's radix cache (run by the thread that owns the engine)."""
        return self._submit(self.engine.flush_cache, None, "call").result()

    def generate(self, prompt: str, params: dict, on_delta: Callable[[str], None] | None = None) -> dict:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self._submit(ids, params, None).result()

    def score(self, inputs: list[list[int]], logprob_start: int) -> list[dict]:
        futs = [self._submit(ids, dict(SELECT_PARAMS), logprob_start) for ids in inputs]
        return [f.result() for f in futs]


class RuntimeEndpoint(Backend):
    """A running `launch_server` over HTTP (SGLang-native /generate; SSE when streaming)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                   limits=httpx.Limits(max_connections=512, max_keepalive_connections=128))
        self._tokenizer: Any = None
        self._tok_lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:  # the server's tokenizer (for chat templates and select), loaded on first use
        with self._tok_lock:
            if self._tokenizer is None:
                from treespec.tokenizer import load_tokenizer  # the server's own wrapper: identical text

                info = self.get_model_info()
                self._tokenizer = load_tokenizer(info.get("tokenizer_path") or info["model_path"])
        return self._tokenizer

    def get_model_info(self) -> dict:
        resp = self.client.get("/get_model_info")
        resp.raise_for_status()
        return resp.json()

    def flush_cache(self) -> None:
        self.client.post("/flush_cache").raise_for_status()

    def _post(self, body: dict) -> Any:
        resp = self.client.post("/generate", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"/generate answered {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    def generate(self, prompt: str, params: dict, on_delta: Callable[[str], None] | None = None) -> dict:
        body = {"text": prompt, "sampling_params": params}
        if on_delta is None:
            return self._post(body)
        last: dict = {}
        seen = ""
        for event in self._stream({**body, "stream": True}):
            last = event
            text = event.get("text", "")
            if text.startswith(seen) and len(text) > len(seen):
                on_delta(text[len(seen):])
                seen = text
        return last

    def _stream(self, body: dict) -> Iterator[dict]:
        with self.client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"/generate answered {resp.status_code}: {resp.text[:500]}")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise RuntimeError(f"/generate stream error: {event['error']}")
                yield event

    def score(self, inputs: list[list[int]], logprob_start: int) -> list[dict]:
        return self._post({"input_ids": inputs, "sampling_params": dict(SELECT_PARAMS), "return_logprob": True,
                           "logprob_start_len": logprob_start})
