"""ModelRunner: one target model (its class from the registry by config.json's architectures), its KV
pool and its attention backend. Under tensor parallelism (`tp`), this rank's shard of them: its heads,
its KV heads, its vocab rows (treespec/distributed/sharding.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from treespec.attention.select import create_attn_backend
from treespec.forward_batch import ForwardBatch, ForwardContext, ModelOutput
from treespec.mem.kv_pool import KVPool
from treespec.model_loader import load_config, load_hf_weights
from treespec.models.block_quant import load_block_quant
from treespec.models.config import ModelConfig
from treespec.models.packed_linear import packing_layout
from treespec.models.registry import model_class_for

if TYPE_CHECKING:
    from treespec.distributed.parallel_state import TPGroup


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        kv_pool_size: int,
        context_len: int | None = None,
        packed_linear: bool = True,
        block_quant: bool = True,
        block_quant_activations: str = "fp32",
        tp: TPGroup | None = None,
        keep_full_vocab: bool = True,
    ) -> None:
        """`block_quant_activations`: what block-quant matmuls take their inputs as (fp32 | int8 | auto:
        int8 where GGUF blocks are streamed, else fp32; the choice is kept as `self.block_quant_activations`);
        `tp`: load this rank's shard; `keep_full_vocab`: under tp, keep the whole embedding and lm_head
        for a draft head that shares them (vocab_weights)."""
        self.device, self.dtype = device, dtype
        self.tp = tp
        self.hf_config = load_config(model_dir)
        model_class = model_class_for(self.hf_config)  # first: an unsupported model fails naming the registry
        self.config = ModelConfig.from_hf(self.hf_config)
        limit = self.config.max_position_embeddings
        if self.config.sliding_window:
            # Without sliding-window attention we are exact only up to the window.
            limit = min(limit, self.config.sliding_window)
        self.context_len = min(context_len or limit, limit)
        state = load_hf_weights(model_dir)
        # GGUF blocks kept beside the fp32 weights (models/block_quant.py): the same results, faster.
        # Only the panel layout streams them, so only then are they read.
        use_blocks = packed_linear and block_quant and packing_layout(device, dtype) == "panel"
        block_quants = load_block_quant(model_dir) if use_blocks else {}
        requested_activations = block_quant_activations
        if block_quant_activations == "auto":  # int8 only where the blocks are streamed: nothing else takes it
            block_quant_activations = "int8" if block_quants else "fp32"
        self.block_quant_activations = block_quant_activations
        # the whole embedding and lm_head, for a draft head that shares them (it runs replicated)
        self.full_vocab_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        if tp is None:
            self.local_config = self.config
            with torch.device("cpu"):
                model = model_class(self.config, self.context_len)
        else:
            from treespec.distributed import sharding

            self.local_config = sharding.local_config(self.config, tp.rank, tp.size)
            if keep_full_vocab:
                embed = state["model.embed_tokens.weight"]
                self.full_vocab_weights = (embed, embed if self.config.tie_word_embeddings else state["lm_head.weight"])
            state = sharding.shard_state(state, self.config, tp.rank, tp.size)
            block_quants = sharding.shard_block_quants(block_quants, self.config, tp.rank, tp.size)
            with torch.device("cpu"):
                model = model_class(self.local_config, self.context_len, tp, self.config.vocab_size)
        model.load_weights(state)
        del state
        self.model = model.to(device=device, dtype=dtype).eval()
        self.model.rotary.to(device)
        self.packed_linear = packed_linear and self.model.pack_for_inference(device, dtype, block_quants,
                                                                             block_quant_activations)
        if not self.model.has_block_quant_weights():  # no matmul takes int8: asked for, an error; auto, fp32
            if requested_activations == "int8":
                raise ValueError("--block-quant-activations int8: no weight of this model runs on the block-quant "
                                 "kernel (it takes a GGUF Q4_0/Q4_1/Q8_0 model in fp32 on a CPU)")
            self.block_quant_activations = "fp32"
        self.kv_pool = KVPool(
            kv_pool_size, self.config.num_layers, self.local_config.num_kv_heads, self.config.head_dim, dtype, device
        )
        self.attn_backend = create_attn_backend(device, self.local_config, dtype)
        # What the model's layers read, built once: the model never sees the runner. Replacing
        # kv_pool or attn_backend afterwards means building this again.
        self.forward_context = ForwardContext(self.kv_pool, self.attn_backend)

    def schedule_kind(self) -> str:
        """Which of a --speculative-config file's schedules fits this runner's costs (SpecSchedule.from_file):
        "cuda" on a GPU; "cpu_avx2" where the CPU block-quant matmuls run their AVX2 code (no AVX-512 VNNI,
        or TREESPEC_CPU_QUANT_ISA=avx2: the code each weight was packed for), whose verify rows cost ~3x
        what they cost under AVX-512 VNNI; else "cpu"."""
        if self.device.type != "cpu":
            return self.device.type
        return "cpu_avx2" if any(not p.avx512 for p in self.model.block_quant_weights()) else "cpu"

    def vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding, lm_head) over the whole vocabulary, on this runner's device and dtype."""
        if self.tp is None:
            return self.model.embed_tokens.weight, self.model.lm_head_weight
        if self.full_vocab_weights is None:
            raise RuntimeError("this tensor-parallel runner was built with keep_full_vocab=False")
        return tuple(w.to(device=self.device, dtype=self.dtype) for w in self.full_vocab_weights)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, return_all_hidden: bool = False) -> ModelOutput:
        self.attn_backend.init_forward_metadata(batch.attn)
        return self.model(batch, self.forward_context, return_all_hidden)
