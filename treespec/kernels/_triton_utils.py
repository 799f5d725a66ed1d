"""Helpers shared by the Triton kernels."""

import torch
import triton


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every tensor lives on CUDA: the Triton path; otherwise the torch path is used."""
    return all(t.is_cuda for t in tensors)


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))
