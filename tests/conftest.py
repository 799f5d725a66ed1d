"""Session-wide test setup.

Triton reads TRITON_INTERPRET when it is first imported, so on machines without CUDA it is set here,
before any test module can import triton: the kernel tests then run Triton kernels on CPU tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
