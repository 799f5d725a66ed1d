"""ServerArgs: every engine and server flag (SGLang names) as given; `resolve()` checks them once, naming
the flag, and returns ResolvedArgs: the same flags with every "auto" replaced by what it means here.

The entry points (Engine, the server launcher) resolve once and pass ResolvedArgs down. torch is
imported only where a value needs it (CUDA availability, torch.dtype objects), so the HTTP process can
import this module without loading torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from treespec import drafts

if TYPE_CHECKING:
    import torch

    from treespec.speculative.shapes import SpecSchedule


class ArgError(ValueError):
    """A bad flag value; the message names the flag."""


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model (model_path None)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
SPECULATIVE_ALGORITHMS = ("NONE", "EAGLE", "EAGLE3", "NGRAM")
# the tree shape for a draft model other than a shipped head when none of the three flags is given
GENERIC_SPECULATIVE_SHAPE = (5, 4, 8)  # (num_steps, eagle_topk, num_draft_tokens)
# NGRAM's tree size when --speculative-num-draft-tokens is not given. Measured on 20 held-out chat
# prompts (docs/performance.md): 4 nodes 1.18x plain, 8 nodes 0.92x: on two CPU cores a verify of 5-8
# nodes costs about two decode steps.
NGRAM_DEFAULT_DRAFT_TOKENS = 4
# flags that configure a draft model or its EAGLE tree; NGRAM has neither and refuses them (it takes
# --speculative-config, whose entries for NGRAM are chains: num_draft_tokens = num_steps + 1)
EAGLE_ONLY_FLAGS = {"speculative_draft_model_path": "--speculative-draft-model-path",
                    "speculative_num_steps": "--speculative-num-steps",
                    "speculative_eagle_topk": "--speculative-eagle-topk",
                    "speculative_draft_model_quantization": "--speculative-draft-model-quantization"}
DRAFT_QUANTIZATIONS = ("none", "q8_0")  # --speculative-draft-model-quantization (treespec/models/block_quant.py)


BLOCK_QUANT_ACTIVATIONS = ("fp32", "int8")  # what a block-quant matmul takes; models/packed_linear.py checks it too
# --block-quant-activations: auto = int8 wherever the block-quant kernel streams a GGUF model's weights
BLOCK_QUANT_ACTIVATION_CHOICES = ("auto", *BLOCK_QUANT_ACTIVATIONS)
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")  # sglang-router's --policy


def router_installed() -> bool:
    """sglang-router with its Rust router (the `treespec[router]` extra), found without importing it."""
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None and \
        importlib.util.find_spec("sglang_router.sglang_router_rs") is not None


def _check(ok: bool, flag: str, msg: str) -> None:
    if not ok:
        raise ArgError(f"{flag}: {msg}")


def _read_schedule(path: str) -> list[SpecSchedule]:
    """A --speculative-config file's schedules (its "schedule", and "schedule_cuda" if given), read and
    checked (a bad one is an ArgError naming the flag)."""
    from treespec.speculative import shapes  # here: this module stays torch-free

    try:
        return list(shapes.SpecSchedule.all_from_file(path).values())
    except shapes.ScheduleError as e:
        raise ArgError(str(e)) from e


@dataclass(frozen=True)
class ServerArgs:
    """The flags as given ("auto" where not); resolve() gives the ResolvedArgs the engine runs with."""

    # model
    model_path: str | None = None  # None = the embedded default (SmolLM2-135M-Instruct)
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
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
    enable_jump_forward: bool = False
    stream_interval: int = 1  # a streamed request's tokens go out once this many are new (SGLang's flag)
    # speculative decoding
    # auto: NGRAM with its tuned schedule when serving the embedded default model, else NONE
    speculative_algorithm: str = "auto"  # auto | NONE | EAGLE | EAGLE3 | NGRAM
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_config: str | None = None  # JSON schedule: settings by running batch size
    speculative_draft_dtype: str = "auto"  # auto (= the target's) | float32 | bfloat16 | float16
    # q8_0: the head's matmul weights in 8-bit blocks; None: q8_0 with a shipped head, else "none"
    speculative_draft_model_quantization: str | None = None
    # EAGLE heads: hot-token list (FR-Spec) the draft picks from; "none" turns off a shipped head's list
    speculative_token_map: str | None = None
    # NGRAM: drafts from a trie of the n-grams in all requests' text (treespec/speculative/ngram_cache.py)
    # None: 1 (SGLang's) where drafts join the tree only above an estimated acceptance (the tuned
    # schedule's thresholds, or --speculative-ngram-min-accept-prob > 0): then a one-token match drafts
    # only where its continuation dominates, and those paid on three of four held-out workloads (in
    # process, 24 prompts, against 2: code editing +1.9 %, summarising +1.4 %, multi-turn +1.7 %, chat
    # -1.0 %; docs/performance.md). 2 where a tree fills its node budget (a shape without a threshold):
    # there drafts after a one-token match are mostly wrong (4 nodes: chat 1.18x plain with 2, 1.07x with 1)
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 1_000_000  # trie nodes (SGLang: 10M, in C++)
    # draft nodes below this estimated chance of acceptance stay out (None: the --speculative-config
    # entry's ngram_min_accept_prob, 0 = fill the budget as SGLang does, without one)
    speculative_ngram_min_accept_prob: float | None = None
    # the shared trie's warm corpus (speculative/ngram_corpus.py): None = the one shipped for the default
    # model (none for others), "none" = no corpus, else a corpus file
    speculative_ngram_corpus: str | None = None
    # EAGLE / EAGLE3 + n-gram hybrid: n-gram nodes added to each draft tree (0 = off)
    speculative_hybrid_ngram_tokens: int | None = None  # None: the tuned value with a shipped head, else 0
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    num_threads: int | None = None  # torch intra-op threads (None = torch's default)
    disable_packed_linear: bool = False  # CPU: plain F.linear (MKL) instead of packed weights
    # CPU, GGUF models: stream the fp32 weights instead of their 32-block quant codes (same outputs, slower)
    disable_block_quant: bool = False
    # CPU, GGUF models: what the block-quant matmuls take their input rows as (int8: quantized per 32 k,
    # as llama.cpp does; faster decode, verify rows and prefill, other numerics than fp32's, speculation
    # still exact). auto: int8 where the block-quant kernel runs (ModelRunner resolves it), else fp32
    block_quant_activations: str = "auto"
    random_seed: int = 0
    skip_warmup: bool = False
    # data parallel: replicas behind sglang-router (server/dp_launcher.py)
    dp_size: int = 1
    router_policy: str = "cache_aware"
    # tensor parallelism: one scheduler + model shard per rank over torch.distributed (treespec/distributed)
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0's node (default: a free local port)

    def resolve(self) -> ResolvedArgs:
        """Check every flag (each error names its flag) and resolve every "auto". `self` is not changed:
        resolving twice gives equal results."""
        _check(self.dtype == "auto" or self.dtype in DTYPE_NAMES, "--dtype", f"unknown dtype {self.dtype!r}")
        _check(self.speculative_draft_dtype == "auto" or self.speculative_draft_dtype in DTYPE_NAMES,
               "--speculative-draft-dtype", f"unknown dtype {self.speculative_draft_dtype!r}")
        _check(self.speculative_draft_model_quantization in (None, *DRAFT_QUANTIZATIONS),
               "--speculative-draft-model-quantization", f"must be one of {', '.join(DRAFT_QUANTIZATIONS)}")
        _check(self.context_length is None or self.context_length > 0, "--context-length", "must be positive")
        _check(self.max_total_tokens is None or self.max_total_tokens > 0, "--max-total-tokens", "must be positive")
        _check(self.max_running_requests > 0, "--max-running-requests", "must be positive")
        _check(self.chunked_prefill_size > 0, "--chunked-prefill-size", "must be positive")
        _check(self.max_prefill_tokens > 0, "--max-prefill-tokens", "must be positive")
        _check(self.schedule_policy in ("lpm", "fcfs"), "--schedule-policy", "must be lpm or fcfs")
        _check(self.stream_interval > 0, "--stream-interval", "must be positive")
        _check(self.page_size == 1, "--page-size", "only page size 1 is supported so far")
        _check(0 < self.port < 65536, "--port", f"{self.port} is not a valid port")
        _check(self.num_threads is None or self.num_threads > 0, "--num-threads", "must be positive")
        _check(self.block_quant_activations in BLOCK_QUANT_ACTIVATION_CHOICES, "--block-quant-activations",
               f"must be one of {', '.join(BLOCK_QUANT_ACTIVATION_CHOICES)}, got {self.block_quant_activations!r}")
        _check(self.block_quant_activations != "int8" or not (self.disable_block_quant or self.disable_packed_linear),
               "--block-quant-activations", "int8 needs the block-quant kernel: drop --disable-block-quant and "
               "--disable-packed-linear")
        _check(self.device in ("auto", "cpu", "cuda") or self.device.removeprefix("cuda:").isdigit(), "--device",
               f"unknown device {self.device!r}")
        _check(not (self.enable_jump_forward and self.disable_radix_cache), "--enable-jump-forward",
               "needs the radix cache (a jump-forward re-prefills the request over its cached prefix)")
        self._check_ngram()
        self._check_data_parallel()
        self._check_tensor_parallel()
        hybrid = self.speculative_hybrid_ngram_tokens
        _check(hybrid is None or hybrid >= 0, "--speculative-hybrid-ngram-tokens", "must be >= 0 (0: no n-gram nodes)")
        spec = self._resolve_speculative()
        algo = spec["speculative_algorithm"]
        _check(not hybrid or algo in ("EAGLE", "EAGLE3"), "--speculative-hybrid-ngram-tokens",
               f"applies to EAGLE / EAGLE3 only (the algorithm here is {algo})")
        quantization = self.speculative_draft_model_quantization
        _check(quantization is None or algo in ("EAGLE", "EAGLE3"),
               "--speculative-draft-model-quantization", f"applies to EAGLE / EAGLE3 only (the algorithm here is {algo})")
        shipped = drafts.shipped_draft_path(algo) if algo in ("EAGLE", "EAGLE3") else None
        uses_shipped = shipped is not None and spec["speculative_draft_model_path"] == str(shipped)
        if hybrid is None:  # tuned with the shipped heads' tuned settings only; a shape given pins the tree
            shape_given = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens,
                           self.speculative_config) != (None, None, None, None)
            hybrid = drafts.TUNED_HYBRID_NGRAM_TOKENS.get(algo, 0) if uses_shipped and not shape_given else 0
        spec["speculative_hybrid_ngram_tokens"] = hybrid
        spec["speculative_ngram_corpus"] = self._resolve_ngram_corpus(algo)
        if algo in ("EAGLE", "EAGLE3") and quantization is None:  # measured on the shipped heads only
            spec["speculative_draft_model_quantization"] = "q8_0" if uses_shipped else "none"
        return ResolvedArgs(**{**dataclasses.asdict(self), **spec})

    def _check_data_parallel(self) -> None:
        _check(self.dp_size >= 1, "--dp-size", "must be a positive integer")
        _check(self.router_policy in ROUTER_POLICIES, "--router-policy", f"must be one of {', '.join(ROUTER_POLICIES)}")
        _check(self.dp_size == 1 or self.tp_size == 1, "--dp-size", "cannot be combined with --tp-size > 1 yet "
               "(each replica would need its own group of ranks and devices)")
        _check(self.dp_size == 1 or router_installed(), "--dp-size",
               f"{self.dp_size} runs the replicas behind sglang-router, which is not installed here; install the "
               "extra: pip install 'treespec[router]' (make install does)")
    def _check_tensor_parallel(self) -> None:
        _check(self.tp_size >= 1, "--tp-size", "must be a positive integer")
        _check(self.nnodes >= 1, "--nnodes", "must be a positive integer")
        _check(self.tp_size % self.nnodes == 0, "--nnodes", f"must divide --tp-size {self.tp_size} (ranks per node)")
        _check(0 <= self.node_rank < self.nnodes, "--node-rank", f"must be in [0, --nnodes {self.nnodes})")
        _check(self.nnodes == 1 or self.dist_init_addr is not None, "--dist-init-addr",
               "is required with --nnodes > 1 (host:port of node 0, reachable from every node)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            _check(bool(host) and port.isdigit() and 0 < int(port) < 65536, "--dist-init-addr",
                   f"must be host:port, got {self.dist_init_addr!r}")

    def _check_ngram(self) -> None:
        """The NGRAM flags (checked whatever the algorithm, so a bad value never waits to bite)."""
        positive = [("speculative_ngram_min_match_window_size", "--speculative-ngram-min-match-window-size"),
                    ("speculative_ngram_max_match_window_size", "--speculative-ngram-max-match-window-size"),
                    ("speculative_ngram_min_bfs_breadth", "--speculative-ngram-min-bfs-breadth"),
                    ("speculative_ngram_max_bfs_breadth", "--speculative-ngram-max-bfs-breadth"),
                    ("speculative_ngram_capacity", "--speculative-ngram-capacity")]
        for name, flag in positive:
            value = getattr(self, name)
            _check(value is None or value >= 1, flag, "must be a positive integer")  # None: min match's auto
        _check(self.speculative_ngram_max_match_window_size >= (self.speculative_ngram_min_match_window_size or 1),
               "--speculative-ngram-max-match-window-size", "must be >= --speculative-ngram-min-match-window-size")
        _check(self.speculative_ngram_max_bfs_breadth >= self.speculative_ngram_min_bfs_breadth,
               "--speculative-ngram-max-bfs-breadth", "must be >= --speculative-ngram-min-bfs-breadth")
        _check(self.speculative_ngram_branch_length >= 2, "--speculative-ngram-branch-length",
               "must be >= 2 (a matched token and one continuation)")
        min_accept = self.speculative_ngram_min_accept_prob
        _check(min_accept is None or 0.0 <= min_accept < 1.0, "--speculative-ngram-min-accept-prob",
               "must be in [0, 1)")

    def _resolve_ngram(self) -> dict:
        """NGRAM: no draft model and no EAGLE tree flags (each given one is an error naming it); the tree
        size is --speculative-num-draft-tokens (default NGRAM_DEFAULT_DRAFT_TOKENS), or by batch size
        --speculative-config, whose entries must be chains (eagle_topk 1). On the default model with
        neither given, the tuned schedule shipped in treespec/drafts/ngram/. The EAGLE shape fields are
        derived for display: num_steps = the deepest tree (num_draft_tokens - 1), eagle_topk = the widest
        branching (--speculative-ngram-max-bfs-breadth)."""
        for name, flag in EAGLE_ONLY_FLAGS.items():
            _check(getattr(self, name) is None, flag,
                   "applies to EAGLE / EAGLE3 only; NGRAM sizes its tree with --speculative-num-draft-tokens")
        ndraft, schedule_path = self.speculative_num_draft_tokens, self.speculative_config
        if ndraft is None and schedule_path is None and self.model_path is None:
            tuned = drafts.ngram_schedule_path()  # None if the file is not in this checkout
            schedule_path = str(tuned) if tuned is not None else None
        if schedule_path:
            schedules = _read_schedule(schedule_path)
            chains = all(shape.topk == 1 for sched in schedules for _, shape in sched.entries)
            _check(chains, "--speculative-config",
                   "NGRAM entries are chains sized by num_draft_tokens (= num_steps + 1); eagle_topk must be 1")
        ndraft = NGRAM_DEFAULT_DRAFT_TOKENS if ndraft is None else ndraft
        _check(ndraft > 1, "--speculative-num-draft-tokens", "must be an integer >= 2")
        return {"speculative_algorithm": "NGRAM", "speculative_num_steps": ndraft - 1,
                "speculative_eagle_topk": self.speculative_ngram_max_bfs_breadth,
                "speculative_num_draft_tokens": ndraft, "speculative_token_map": None,
                "speculative_config": schedule_path}

    def _resolve_ngram_corpus(self, algo: str) -> str | None:
        """The warm corpus file NGRAM's shared trie starts with, or None: a file given by flag, else on
        the default model the shipped one (None where this checkout lacks it)."""
        corpus = self.speculative_ngram_corpus
        if corpus is not None and corpus.lower() == "none":
            return None
        if corpus is not None:
            _check(algo == "NGRAM", "--speculative-ngram-corpus", f"applies to NGRAM only (the algorithm here is {algo})")
            _check(Path(corpus).is_file(), "--speculative-ngram-corpus", f"no such file: {corpus}")
            return corpus
        shipped = drafts.ngram_corpus_path() if algo == "NGRAM" and self.model_path is None else None
        return str(shipped) if shipped is not None else None

    def _resolve_speculative(self) -> dict:
        """The speculative_* fields resolved: the algorithm; for the default model, the shipped head with
        its token map, tuned shape and tuned schedule unless given; the tree shape checked."""
        algo = (self.speculative_algorithm or "NONE").upper()
        if algo == "AUTO":
            # NGRAM: on the CPU hosts measured it beat the shipped EAGLE-3 head (with or without n-gram
            # nodes) on every workload at batch 1, and needs no draft model (docs/performance.md)
            default_model = self.model_path is None and not self.speculative_draft_model_path
            algo = "NGRAM" if default_model else "NONE"
        _check(algo in SPECULATIVE_ALGORITHMS, "--speculative-algorithm",
               f"must be auto, NONE, EAGLE, EAGLE3 or NGRAM, got {algo!r}")
        if algo == "NONE":
            return {"speculative_algorithm": algo}
        given_map = self.speculative_token_map
        asks_for_map = given_map is not None and given_map.lower() != "none"
        _check(not asks_for_map or algo == "EAGLE", "--speculative-token-map",
               "applies to --speculative-algorithm EAGLE only (EAGLE-3 heads bring their own draft vocabulary)")
        if algo == "NGRAM":
            return self._resolve_ngram()
        # the hybrid's n-gram nodes fill their budget (NgramCache.draft without a threshold): refused, not ignored
        _check(self.speculative_ngram_min_accept_prob is None, "--speculative-ngram-min-accept-prob",
               "applies to --speculative-algorithm NGRAM only")
        draft_path, token_map, schedule_path = self.speculative_draft_model_path, given_map, self.speculative_config
        shape = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        if not draft_path and self.model_path is None:
            shipped = drafts.shipped_draft_path(algo)  # the head shipped for the default model
            if shipped is not None:
                draft_path = str(shipped)
                shipped_map = shipped / "token_map.pt"  # the hot-token list shipped with an EAGLE head
                if given_map is None and shipped_map.is_file():
                    token_map = str(shipped_map)
                if shape == (None, None, None):
                    shape = drafts.TUNED[algo]
                    # the schedule tuned by benchmarks/bench_speculative.py: settings by batch size
                    tuned_schedule = shipped / "speculative_config.json"
                    if schedule_path is None and tuned_schedule.is_file():
                        schedule_path = str(tuned_schedule)
        if given_map is not None and not asks_for_map:  # "none": no list, not even a shipped one
            token_map = None
        elif token_map is not None:
            _check(Path(token_map).is_file(), "--speculative-token-map", f"{token_map!r} is not a file")
        if schedule_path:
            thresholds = [shape.ngram_min_accept_prob for sched in _read_schedule(schedule_path)
                          for _, shape in sched.entries]
            _check(not any(thresholds), "--speculative-config", "ngram_min_accept_prob applies to NGRAM entries only")
        # imported here: this module stays torch-free whatever treespec.speculative's package comes to import
        from treespec.speculative import shapes

        if shape == (None, None, None):
            shape = GENERIC_SPECULATIVE_SHAPE
        steps, topk, ndraft = shape
        # each flag on its own first, so the error names it; then the tree-shape rules (shapes.py)
        _check(steps is not None and steps > 0, "--speculative-num-steps", "must be a positive integer")
        _check(topk is not None and topk > 0, "--speculative-eagle-topk", "must be a positive integer")
        _check(ndraft is not None and ndraft > 1, "--speculative-num-draft-tokens", "must be an integer >= 2")
        try:
            shapes.validate_shape(steps, topk, ndraft, f"--speculative-num-draft-tokens {ndraft} (with "
                                  f"--speculative-num-steps {steps}, --speculative-eagle-topk {topk})")
        except shapes.ScheduleError as e:
            raise ArgError(str(e)) from e
        _check(bool(draft_path), "--speculative-draft-model-path",
               f"is required with --speculative-algorithm {algo} (a head is shipped only for the default model)")
        return {"speculative_algorithm": algo, "speculative_draft_model_path": draft_path,
                "speculative_num_steps": steps, "speculative_eagle_topk": topk,
                "speculative_num_draft_tokens": ndraft,
                "speculative_config": schedule_path, "speculative_token_map": token_map}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=FLAG_HELP[f.name])
                continue
            kind = str(f.type)
            conv = int if kind.startswith("int") else float if kind.startswith("float") else str
            parser.add_argument(flag, type=conv, default=f.default,
                                help=FLAG_HELP[f.name] + " (default: %(default)s)")

    @staticmethod
    def from_cli(argv: list[str] | None = None) -> ResolvedArgs:
        """Parse and resolve the command line; a bad value exits with the usage and the flag's error."""
        parser = argparse.ArgumentParser(prog="treespec-server", description="treespec LLM server")
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(argv)
        try:
            return ServerArgs(**vars(ns)).resolve()
        except ArgError as e:
            parser.error(str(e))


# What each flag means, as `--help` prints it (a test checks that every field has a line).
FLAG_HELP = {
    "model_path": "HF model folder or .gguf file; none = the embedded default (SmolLM2-135M-Instruct)",
    "tokenizer_path": "tokenizer folder (default: the model's)",
    "served_model_name": "model name reported by the OpenAI routes",
    "dtype": "auto | float32 | bfloat16 | float16; auto = float32 on CPU (exact speculation), bfloat16 on CUDA",
    "device": "auto | cpu | cuda | cuda:N; auto = CUDA when available",
    "context_length": "maximum tokens per sequence (default: the model's)",
    "max_total_tokens": "KV pool size in tokens, shared by all requests (default: 65536)",
    "max_running_requests": "requests decoded together at most",
    "chunked_prefill_size": "prompt tokens prefilled per step at most (longer prompts go in chunks)",
    "max_prefill_tokens": "tokens in one prefill batch at most",
    "schedule_policy": "lpm (longest cached prefix first) | fcfs",
    "disable_radix_cache": "do not share cached prefixes between requests",
    "page_size": "KV page size (only 1 so far)",
    "schedule_conservativeness": "scale of the decode headroom reserved at admission (lower admits more)",
    "enable_jump_forward": "grammar-constrained requests append the text their grammar forces (JSON keys, "
                           "punctuation) without a model step; that text is tokenized on its own, so outputs "
                           "may differ from decoding it token by token (needs the radix cache)",
    "stream_interval": "a streamed request's new tokens go out once at least this many are waiting (its "
                       "first token and its end go out at once); larger sends fewer, bigger deltas",
    "speculative_algorithm": "auto | NONE | EAGLE | EAGLE3 | NGRAM; auto = NGRAM on the default model (with "
                             "its tuned schedule: speculate at batch 1), else NONE; NGRAM drafts from n-grams of "
                             "all requests' text (no draft model); EAGLE3 uses the shipped head on the default model",
    "speculative_draft_model_path": "EAGLE/EAGLE3: draft head folder (default: the shipped head for the default model)",
    "speculative_num_steps": "EAGLE/EAGLE3: draft depth: draft forwards per step",
    "speculative_eagle_topk": "EAGLE/EAGLE3: branches kept per draft step (1 = a chain)",
    "speculative_num_draft_tokens": "tree nodes verified per step, the root included (NGRAM default: 4)",
    "speculative_config": "JSON schedule of speculative settings by running batch size (NGRAM: chains, "
                          "num_draft_tokens = num_steps + 1; default on the default model: the tuned one)",
    "speculative_draft_dtype": "auto (= the target's) | float32 | bfloat16 | float16",
    "speculative_draft_model_quantization": "EAGLE/EAGLE3: none | q8_0; q8_0 rounds the draft head's matmul "
                                            "weights to 8-bit blocks of 32 (GGUF Q8_0) on CPU: faster draft "
                                            "forwards; the target decides every token, so outputs do not change "
                                            "(default: q8_0 with the shipped heads, else none)",
    "speculative_token_map": "EAGLE: hot-token list the draft picks from; none turns off a shipped head's list",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix of the context matched against the n-gram cache "
                                               "(default: 1 where nodes need an estimated acceptance, as the tuned "
                                               "schedule's do; 2 where trees fill their node budget)",
    "speculative_ngram_max_match_window_size": "NGRAM: longest suffix of the context matched (the longest match wins)",
    "speculative_ngram_min_bfs_breadth": "NGRAM: children kept per draft node after the longest match",
    "speculative_ngram_max_bfs_breadth": "NGRAM: children kept per draft node after the shortest match "
                                         "(breadth falls linearly with the match length)",
    "speculative_ngram_branch_length": "NGRAM: longest n-gram stored (how many recent tokens each insert spans)",
    "speculative_ngram_capacity": "NGRAM: size in nodes of each n-gram trie (the one shared by all requests, "
                                  "each running request's own); least recently used branches are evicted "
                                  "(~130 B of host memory per node in the C++ trie, ~430 B in the Python fallback)",
    "speculative_ngram_corpus": "NGRAM: token texts put in the shared n-gram trie at start and after /flush_cache "
                                "(a gzipped JSON corpus file, see python -m treespec.train.ngram_corpus; none = off; "
                                "default: the corpus shipped for the default model, off for others)",
    "speculative_ngram_min_accept_prob": "NGRAM: draft nodes whose estimated chance of acceptance is below this "
                                         "stay out of the tree, which is sized by what the match promises up to "
                                         "--speculative-num-draft-tokens (0 = fill the budget, as SGLang; default: "
                                         "the --speculative-config entry's, the tuned one on the default model)",
    "speculative_hybrid_ngram_tokens": "EAGLE/EAGLE3: n-gram nodes added to each draft tree where the "
                                       "context matches the n-gram cache well, adapting per request between 2 "
                                       "and 4x this (0 = off; default: 6 with the shipped EAGLE-3 head at its "
                                       "tuned setting, 0 when a tree shape flag is given; the NGRAM flags apply but the min accept prob)",
    "host": "HTTP host",
    "port": "HTTP port",
    "api_key": "require this key as a Bearer token (all routes but /health)",
    "log_level": "debug | info | warning | error",
    "num_threads": "torch intra-op threads (default: torch's)",
    "disable_packed_linear": "CPU: plain F.linear instead of the packed-weight matmul kernel (same outputs, slower)",
    "disable_block_quant": "CPU, GGUF models: stream fp32 weights instead of the 32-block quant codes (same outputs)",
    "block_quant_activations": "CPU, GGUF models: auto (default: int8 wherever the block-quant kernel runs) | "
                               "int8 (each matmul's input quantized per 32 values, as llama.cpp does: faster "
                               "decode, verify and prefill; speculation stays exact) | fp32 (outputs as over "
                               "the dequantized fp32 weights)",
    "random_seed": "base seed for requests that set none",
    "skip_warmup": "serve without the warm-up request",
    "dp_size": "data-parallel replicas: N full servers (own scheduler and KV pool) on internal ports behind "
               "sglang-router on --port (needs the treespec[router] extra)",
    "router_policy": "with --dp-size > 1: sglang-router's routing policy (cache_aware: the replica holding "
                     "the longest prefix of the prompt, balanced by load)",
    "tp_size": "tensor-parallel ranks: the model's heads, MLP and vocabulary split over this many scheduler "
               "processes (gloo on CPU, NCCL on CUDA: one GPU per rank)",
    "nnodes": "machines the --tp-size ranks span (each runs --tp-size / --nnodes ranks)",
    "node_rank": "this machine's index among --nnodes (0 serves HTTP; others run their ranks only)",
    "dist_init_addr": "host:port where rank 0's node listens for the others to join (required with --nnodes > 1)",
}


@dataclass(frozen=True)
class ResolvedArgs(ServerArgs):
    """The flags after ServerArgs.resolve() (build it only that way): every check passed;
    speculative_algorithm is NONE, EAGLE, EAGLE3 or NGRAM; with EAGLE / EAGLE3 the draft path and the tree
    shape are set (for the default model: the shipped head, its tuned shape, schedule and token map); with
    NGRAM num_draft_tokens is set (num_steps and eagle_topk derived from it and the ngram flags).

    Device and dtypes are settled where the model runs, by torch_device() / torch_dtype() /
    torch_draft_dtype(): "auto" needs torch to ask for CUDA, and the launcher (the HTTP process) never
    imports torch. A CUDA device that is not there is an ArgError naming --device from torch_device()."""

    def resolve(self) -> ResolvedArgs:
        return self  # already resolved

    def torch_device(self) -> torch.device:
        """--device: "auto" is CUDA when available, else the CPU; CUDA must be there when asked for."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device != "cpu":
            _check(torch.cuda.is_available(), "--device", "CUDA was requested but is not available")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """--dtype: "auto" is float32 on the CPU and bfloat16 on CUDA (default_dtype)."""
        return torch_dtype(default_dtype(self.torch_device().type) if self.dtype == "auto" else self.dtype)

    def torch_draft_dtype(self) -> torch.dtype:
        """--speculative-draft-dtype: "auto" is the target's dtype."""
        if self.speculative_draft_dtype == "auto":
            return self.torch_dtype()
        return torch_dtype(self.speculative_draft_dtype)


def default_dtype(device: str) -> str:
    # CPU: fp32. bf16 decodes faster on CPUs with native bf16 (measured ~1.2-1.7x here with
    # benchmarks/bench_one_batch.py), but its rounding makes the tree-verify forward disagree
    # with plain decoding often enough that greedy speculation stops being token-exact
    # (measured: bench_speculative.py, exact=False in bf16). Lossless comes first.
    return "float32" if device == "cpu" else "bfloat16"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a DTYPE_NAMES name stands for."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype name {name!r}, expected one of {DTYPE_NAMES}")
    import torch

    return getattr(torch, name)
