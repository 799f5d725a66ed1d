"""ServerArgs: every engine and server flag (SGLang names), with validation that names the flag."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch


class ArgError(ValueError):
    """A bad flag value; the message names the flag."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ServerArgs:
    # model
    model_path: str | None = None  # None = the embedded default (SmolLM2-135M-Instruct)
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    context_length: int | None = None
    # memory and scheduling
    max_total_tokens: int | None = None  # KV pool size in tokens
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    schedule_policy: str = "lpm"  # lpm | fcfs
    disable_radix_cache: bool = False
    page_size: int = 1
    schedule_conservativeness: float = 1.0
    # speculative decoding
    # auto: EAGLE3 with the shipped head when serving the embedded default model, else NONE
    speculative_algorithm: str = "auto"  # auto | NONE | EAGLE | EAGLE3
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_config: str | None = None  # JSON schedule: settings by running batch size
    speculative_draft_dtype: str = "auto"  # auto (= the target's) | float32 | bfloat16 | float16
    # EAGLE heads: hot-token list (FR-Spec) the draft picks from; "none" turns off a shipped head's list
    speculative_token_map: str | None = None
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    num_threads: int | None = None  # torch intra-op threads (None = torch's default)
    disable_packed_linear: bool = False  # CPU: plain F.linear (MKL) instead of packed weights
    # CPU, GGUF models: stream the fp32 weights instead of their 32-block quant codes (same outputs, slower)
    disable_block_quant: bool = False
    random_seed: int = 0
    skip_warmup: bool = False

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            # CPU: fp32. bf16 decodes faster on CPUs with native bf16 (measured ~1.2-1.7x here with
            # benchmarks/bench_one_batch.py), but its rounding makes the tree-verify forward disagree
            # with plain decoding often enough that greedy speculation stops being token-exact
            # (measured: bench_speculative.py, exact=False in bf16). Lossless comes first.
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]

    def resolved_draft_dtype(self, target_dtype: torch.dtype) -> torch.dtype:
        if self.speculative_draft_dtype == "auto":
            return target_dtype
        return DTYPES[self.speculative_draft_dtype]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def validate(self) -> None:
        def check(ok: bool, flag: str, msg: str) -> None:
            if not ok:
                raise ArgError(f"{flag}: {msg}")

        check(self.dtype == "auto" or self.dtype in DTYPES, "--dtype", f"unknown dtype {self.dtype!r}")
        check(self.speculative_draft_dtype == "auto" or self.speculative_draft_dtype in DTYPES, "--speculative-draft-dtype",
              f"unknown dtype {self.speculative_draft_dtype!r}")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "--device", f"unknown device {self.device!r}")
        if self.device.startswith("cuda"):
            check(torch.cuda.is_available(), "--device", "CUDA was requested but is not available")
        check(self.context_length is None or self.context_length > 0, "--context-length", "must be positive")
        check(self.max_total_tokens is None or self.max_total_tokens > 0, "--max-total-tokens", "must be positive")
        check(self.max_running_requests > 0, "--max-running-requests", "must be positive")
        check(self.chunked_prefill_size > 0, "--chunked-prefill-size", "must be positive")
        check(self.max_prefill_tokens > 0, "--max-prefill-tokens", "must be positive")
        check(self.schedule_policy in ("lpm", "fcfs"), "--schedule-policy", "must be lpm or fcfs")
        check(self.page_size == 1, "--page-size", "only page size 1 is supported so far")
        check(0 < self.port < 65536, "--port", f"{self.port} is not a valid port")
        check(self.num_threads is None or self.num_threads > 0, "--num-threads", "must be positive")
        algo = (self.speculative_algorithm or "NONE").upper()
        if algo == "AUTO":
            from treespec.drafts import shipped_draft_path

            default_model = self.model_path is None and not self.speculative_draft_model_path
            algo = "EAGLE3" if default_model and shipped_draft_path("EAGLE3") is not None else "NONE"
        self.speculative_algorithm = algo
        check(algo in ("NONE", "EAGLE", "EAGLE3"), "--speculative-algorithm",
              f"must be auto, NONE, EAGLE or EAGLE3, got {algo!r}")
        spec = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        if algo == "NONE":
            return
        user_token_map = self.speculative_token_map
        asks_for_map = user_token_map is not None and user_token_map.lower() != "none"
        check(not asks_for_map or algo == "EAGLE", "--speculative-token-map",
              "applies to --speculative-algorithm EAGLE only (EAGLE-3 heads bring their own draft vocabulary)")
        if not self.speculative_draft_model_path and self.model_path is None:
            from treespec.drafts import TUNED, shipped_draft_path

            shipped = shipped_draft_path(algo)  # the head shipped for the default model
            if shipped is not None:
                self.speculative_draft_model_path = str(shipped)
                shipped_map = shipped / "token_map.pt"  # the hot-token list shipped with an EAGLE head
                if user_token_map is None and shipped_map.is_file():
                    self.speculative_token_map = str(shipped_map)
                if spec == (None, None, None):
                    spec = TUNED[algo]
                    self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens = spec
                    # the schedule tuned by benchmarks/bench_speculative.py: settings by batch size
                    tuned_schedule = shipped / "speculative_config.json"
                    if self.speculative_config is None and tuned_schedule.is_file():
                        self.speculative_config = str(tuned_schedule)
        if user_token_map is not None and not asks_for_map:  # "none": no list, not even a shipped one
            self.speculative_token_map = None
        elif self.speculative_token_map is not None:
            check(Path(self.speculative_token_map).is_file(), "--speculative-token-map",
                  f"{self.speculative_token_map!r} is not a file")
        if self.speculative_config:
            from treespec.speculative.shapes import ScheduleError, SpecSchedule

            try:
                SpecSchedule.from_file(self.speculative_config)
            except ScheduleError as e:
                raise ArgError(str(e)) from e
        if spec == (None, None, None):
            self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens = 5, 4, 8
        steps, topk, ndraft = self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens
        check(steps is not None and steps > 0, "--speculative-num-steps", "must be a positive integer")
        check(topk is not None and topk > 0, "--speculative-eagle-topk", "must be a positive integer")
        check(ndraft is not None and ndraft > 1, "--speculative-num-draft-tokens", "must be an integer >= 2")
        if topk == 1:
            check(ndraft == steps + 1, "--speculative-num-draft-tokens",
                  f"with --speculative-eagle-topk 1 the tree is a chain: must equal --speculative-num-steps + 1 = {steps + 1}")
        check(ndraft <= 1 + topk * steps, "--speculative-num-draft-tokens",
              f"must be <= 1 + topk * steps = {1 + topk * steps}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default)
                continue
            kind = str(f.type)
            conv = int if kind.startswith("int") else float if kind.startswith("float") else str
            parser.add_argument(flag, type=conv, default=f.default)

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        parser = argparse.ArgumentParser(prog="treespec-server", description="treespec LLM server")
        cls.add_cli_args(parser)
        ns = parser.parse_args(argv)
        args = cls(**vars(ns))
        try:
            args.validate()
        except ArgError as e:
            parser.error(str(e))
        return args
