"""Kernel tests compare each Triton kernel with its torch implementation.

Without CUDA the Triton kernels run on CPU tensors in Triton's interpreter. Triton reads
TRITON_INTERPRET when `triton` (and triton.language's own jitted helpers) are imported, so it is set
here, before anything imports triton. If triton was already imported in compiled mode (e.g. by tests
collected earlier in the same session), the Triton comparisons are skipped: export TRITON_INTERPRET=1
(or set it in a root conftest on CPU-only machines). With CUDA the kernels run compiled on the GPU.
"""

import os
import sys

import pytest
import torch

_INTERPRETER_USABLE = "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def triton_device() -> str:
    """Device for the Triton side of a comparison: 'cuda' (compiled) or 'cpu' (interpreter)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.cuda.is_available() and not interpret:
        return "cuda"
    if interpret and _INTERPRETER_USABLE:
        return "cpu"
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; export it to run these tests")

