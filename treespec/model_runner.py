"""ModelRunner: one target model (its class from the registry by config.json's architectures), its KV
pool and its attention backend."""

from __future__ import annotations

from pathlib import Path

import torch

from treespec.attention.select import create_attn_backend
from treespec.forward_batch import ForwardBatch, ForwardContext, ModelOutput
from treespec.mem.kv_pool import KVPool
from treespec.model_loader import load_config, load_hf_weights
from treespec.models.block_quant import load_block_quant
from treespec.models.config import ModelConfig
from treespec.models.packed_linear import packing_layout
from treespec.models.registry import model_class_for


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
    ) -> None:
        self.device, self.dtype = device, dtype
        self.hf_config = load_config(model_dir)
        model_class = model_class_for(self.hf_config)  # first: an unsupported model fails naming the registry
        self.config = ModelConfig.from_hf(self.hf_config)
        limit = self.config.max_position_embeddings
        if self.config.sliding_window:
            # Without sliding-window attention we are exact only up to the window.
            limit = min(limit, self.config.sliding_window)
        self.context_len = min(context_len or limit, limit)
        with torch.device("cpu"):
            model = model_class(self.config, self.context_len)
        model.load_weights(load_hf_weights(model_dir))
        self.model = model.to(device=device, dtype=dtype).eval()
        self.model.rotary.to(device)
        # GGUF blocks kept beside the fp32 weights (models/block_quant.py): the same results, faster.
        # Only the panel layout streams them, so only then are they read.
        use_blocks = packed_linear and block_quant and packing_layout(device, dtype) == "panel"
        block_quants = load_block_quant(model_dir) if use_blocks else {}
        self.packed_linear = packed_linear and self.model.pack_for_inference(device, dtype, block_quants)
        self.kv_pool = KVPool(
            kv_pool_size, self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, dtype, device
        )
        self.attn_backend = create_attn_backend(device, self.config, dtype)
        # What the model's layers read, built once: the model never sees the runner. Replacing
        # kv_pool or attn_backend afterwards means building this again.
        self.forward_context = ForwardContext(self.kv_pool, self.attn_backend)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, return_all_hidden: bool = False) -> ModelOutput:
        self.attn_backend.init_forward_metadata(batch.attn)
        return self.model(batch, self.forward_context, return_all_hidden)
