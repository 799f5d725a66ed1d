"""TokenToKVPoolAllocator: hands out KV slot indices shared by the target and draft KV pools."""

from __future__ import annotations

import torch


class OutOfKVSlots(RuntimeError):
    """Raised when an allocation asks for more KV slots than are free."""


class TokenToKVPoolAllocator:
    """A free list of KV slot ids (page_size 1).

    Slot 0 is reserved as a padding slot: writes to it are harmless and it is never handed out,
    so `size` usable slots are 1..size.
    """

    def __init__(self, size: int, device: str | torch.device = "cpu") -> None:
        if size <= 0:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor:
        """Return `need_size` free slot ids (int64); raise OutOfKVSlots if there are not enough."""
        if need_size < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({need_size})")
        if need_size > self.free_slots.numel():
            raise OutOfKVSlots(f"need {need_size} KV slots, only {self.free_slots.numel()} free")
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        self.free_slots = torch.cat([self.free_slots, indices.to(self.free_slots)])

    def backup_state(self) -> torch.Tensor:
        """Snapshot of the free list; the tensor is immutable here since alloc/free rebind, never mutate."""
        return self.free_slots

    def restore_state(self, state: torch.Tensor) -> None:
        self.free_slots = state
