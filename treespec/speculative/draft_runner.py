"""DraftRunner: the draft head, its own KV pool (indexed by the shared allocator's slot ids) and its
attention backend; plus the two kinds of draft batches (extend over verified tokens, tree decode)."""

from __future__ import annotations

import torch
from torch import nn

from treespec.attention.metadata import AttentionMetadata, build_metadata
from treespec.attention.select import create_attn_backend
from treespec.forward_batch import ForwardBatch, ForwardContext, ForwardMode, ModelOutput
from treespec.mem.kv_pool import KVPool
from treespec.model_runner import ModelRunner
from treespec.models.block_quant import BLOCK, BlockQuant, quantize_q8_0
from treespec.models.draft_config import DraftHeadError
from treespec.models.draft_loader import DraftModel, load_draft_model, load_token_map
from treespec.models.layers import use_cpu_kernels
from treespec.models.packed_linear import pack_linears, pack_weight, packing_layout


class DraftRunner:
    def __init__(self, draft_path: str, algorithm: str, target: ModelRunner, dtype: torch.dtype | None = None,
                 token_map_path: str | None = None, quantization: str | None = None) -> None:
        # The draft may run in a cheaper dtype than the target: verification by the target keeps the
        # output exact whatever the draft proposes; only the accept rate can move.
        self.device, self.dtype = target.device, dtype or target.dtype
        self.context_len = target.context_len
        model = load_draft_model(draft_path, algorithm, target.context_len)
        tcfg, dcfg = target.config, model.config
        where = f"--speculative-draft-model-path {draft_path!r}"
        if dcfg.vocab_size != tcfg.vocab_size:
            raise DraftHeadError(f"{where}: draft head vocab_size {dcfg.vocab_size} != target vocab_size "
                                 f"{tcfg.vocab_size}")
        if model.algorithm == "EAGLE" and dcfg.hidden_size != tcfg.hidden_size:
            raise DraftHeadError(f"{where}: EAGLE head hidden_size {dcfg.hidden_size} != target hidden_size "
                                 f"{tcfg.hidden_size}")
        if model.algorithm == "EAGLE3":
            if model.target_hidden_size != tcfg.hidden_size:
                raise DraftHeadError(f"{where}: EAGLE-3 head expects target hidden size {model.target_hidden_size}, "
                                     f"the target has {tcfg.hidden_size}")
            model.capture_layers(tcfg.num_layers)  # the head's captured layers exist in this target
        self.model: DraftModel = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.rotary.to(self.device)
        # shared with the target when the dtypes agree, else a cast copy
        # (under tensor parallelism the draft runs whole on every rank: the target's full vocab weights)
        embed, lm_head = target.vocab_weights()
        self.model.set_target_weights(embed.to(self.dtype), lm_head.to(self.dtype))
        if token_map_path is not None:
            if model.algorithm != "EAGLE":
                raise ValueError("--speculative-token-map applies to EAGLE heads; EAGLE-3 heads bring their own")
            self.model.restrict_vocab(load_token_map(token_map_path, tcfg.vocab_size))
        # --speculative-draft-model-quantization q8_0: the head's own matmul weights become their Q8_0
        # rounding (fp32 values of 8-bit blocks), which the block-quant kernels stream at half a bf16
        # panel's bytes. Only where those kernels run (fp32 packed panels on CPU); the draft only proposes.
        # Their inputs go in as the target's do (int8 under the CPU default): a catch-up extend over a
        # verify step's accepted tokens is then a few cheap rows (AMD host, EAGLE-3 hybrid on held-out
        # code editing: 1.67x -> 1.74x plain in one process, the same accepted drafts).
        quantize = quantization == "q8_0" and target.packed_linear and packing_layout(self.device, self.dtype) == "panel"
        quants = round_to_q8_0(self.model) if quantize else {}
        activations = target.block_quant_activations
        if target.packed_linear and pack_linears(self.model, self.device, self.dtype, quants, activations):
            shared = self.model.uses_target_head and self.dtype == target.dtype and target.tp is None
            head = self.model.head_weight
            self.model.packed_head = (target.model.packed_lm_head if shared
                                      else pack_weight(head, block_quant=quants.get("lm_head"), activations=activations))
            use_cpu_kernels(self.model)
        self.config = dcfg
        self.kv_pool = KVPool(target.kv_pool.size, dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim,
                              self.dtype, self.device)
        self.attn_backend = create_attn_backend(self.device, dcfg, self.dtype)  # the target's selection
        self.forward_context = ForwardContext(self.kv_pool, self.attn_backend)
        self.hot_token_map = getattr(self.model, "hot_token_map", None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        self.attn_backend.init_forward_metadata(batch.attn)
        return self.model(batch, self.forward_context)

    def clamp_positions(self, positions: torch.Tensor) -> torch.Tensor:
        # Tree nodes past the context length are never emitted (max_new_tokens stops first); clamping
        # only keeps their RoPE lookup in range.
        return positions.clamp(max=self.context_len - 1)


def draft_extend_batch(
    input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, attn: AttentionMetadata,
    target_hidden: torch.Tensor, last_rows: torch.Tensor,
) -> ForwardBatch:
    """The draft over verified tokens: row i is (token i+1, target hidden state at i), causal attention."""
    return ForwardBatch(
        mode=ForwardMode.DRAFT_EXTEND, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        attn=attn, logits_indices=last_rows, input_hidden=target_hidden,
    )


def draft_tree_step_batch(
    input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, prefix_slots: list[torch.Tensor],
    step_slots: torch.Tensor, branch_slots: torch.Tensor, device: torch.device,
) -> ForwardBatch:
    """One draft decode step over the k frontier rows of each request, attending along the real tree.

    step_slots [s+1, bs, k]: scratch slots written by steps 0..s (step s = this one, its out_cache_loc);
    branch_slots [bs, k, s+1]: per row, the slots of its draft ancestors and itself. Request b's rows
    see its prefix plus exactly the step_slots entries listed in their branch (custom mask).
    """
    num_steps_done, bs, k = step_slots.shape
    per_req = step_slots.permute(1, 0, 2)  # [bs, s+1, k], columns in (step, row) order
    on_branch = per_req[:, None, :, :] == branch_slots[:, :, :, None]  # [bs, row, step, col]
    on_branch = on_branch.reshape(bs, k, num_steps_done * k).cpu()
    kv_lists, masks = [], []
    for b in range(bs):
        prefix = prefix_slots[b]
        kv_lists.append(torch.cat([prefix, per_req[b].reshape(-1).to(prefix)]))
        masks.append(torch.cat([torch.ones(k, prefix.numel(), dtype=torch.bool), on_branch[b]], dim=1))
    return ForwardBatch(
        mode=ForwardMode.DRAFT_DECODE, input_ids=input_ids, positions=positions,
        out_cache_loc=step_slots[-1].reshape(-1).to(device),
        attn=build_metadata([k] * bs, kv_lists, masks, device=device), input_hidden=hidden,
    )


def round_to_q8_0(model: nn.Module) -> dict[str, BlockQuant]:
    """Round each nn.Linear weight (input size a multiple of 32) and the model's own lm_head to Q8_0 in
    place; returns their block quants by module name ("lm_head" for the head) for packing."""
    quants: dict[str, BlockQuant] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.in_features % BLOCK == 0:
            quants[name] = quantize_q8_0(module.weight)
            module.weight.data = quants[name].dequantize().to(module.weight.dtype)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Parameter) and head.shape[-1] % BLOCK == 0:
        quants["lm_head"] = quantize_q8_0(head)
        head.data = quants["lm_head"].dequantize().to(head.dtype)
    return quants
