"""ReqToTokenPool: for each running request slot, the KV slot id of every token position."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_requests: int, context_len: int, device: str | torch.device = "cpu") -> None:
        self.max_requests = max_requests
        self.context_len = context_len
        self.req_to_token = torch.zeros((max_requests, context_len), dtype=torch.int32, device=device)
        # on a CPU, a numpy view of the same memory: a speculative step's write of its kept slots is one
        # numpy assignment instead of three torch ops (~40 us right after a forward flushed the caches)
        self._host = self.req_to_token.numpy() if self.req_to_token.device.type == "cpu" else None
        self.free_slots: list[int] = list(range(max_requests))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free request slot (max_running_requests reached)")
        return self.free_slots.pop(0)

    def free(self, req_pool_idx: int) -> None:
        self.free_slots.append(req_pool_idx)

    def write(self, req_pool_idx: int, start: int, kv_slots: torch.Tensor) -> None:
        if self._host is not None and kv_slots.device.type == "cpu":
            self._host[req_pool_idx, start : start + kv_slots.numel()] = kv_slots.numpy()
            return
        self.req_to_token[req_pool_idx, start : start + kv_slots.numel()] = kv_slots.to(torch.int32)

    def read(self, req_pool_idx: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[req_pool_idx, start:end].to(torch.int64)
