"""Per-model KV buffers indexed by the slot ids of the shared allocator."""

from __future__ import annotations

import torch

from treespec.mem.huge_pages import huge_page_bytes


class KVPool:
    """K and V buffers, one pair per layer, each [num_slots + 1, num_kv_heads, head_dim] (slot 0 = padding).
    On CPU all of them are views of one zeroed buffer on transparent huge pages: a step reads a
    request's K and V rows at its slots, scattered once speculation has freed a tree's rejected slots,
    and with 4 KB pages nearly every such row is a TLB miss (in one paired in-process run: the default
    engine's decode steps 6 % faster, verify steps 2-4 %, a plain engine's decode 2 %)."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        shape = (size + 1, num_kv_heads, head_dim)
        if torch.device(device).type != "cpu":
            self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            return
        numel = shape[0] * shape[1] * shape[2]
        buffers = huge_page_bytes(2 * num_layers * numel * torch.empty((), dtype=dtype).element_size())
        buffers = buffers.view(dtype).view(2 * num_layers, *shape)
        buffers.zero_()
        self.k_buffer = list(buffers[:num_layers].unbind(0))
        self.v_buffer = list(buffers[num_layers:].unbind(0))

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = k.to(self.k_buffer[layer_id].dtype)
        self.v_buffer[layer_id][loc] = v.to(self.v_buffer[layer_id].dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
