"""GPU-only tests: FlashInfer vs the torch attention backend, greedy speculative == plain on the
default model, and the Triton kernels compiled on CUDA against their torch references.

Every test here is skipped without CUDA (and the FlashInfer ones without flashinfer). To run them on
a GPU machine:

    pip install -e '.[cuda,dev]'      # flashinfer-python comes with the cuda extra
    pytest tests/cuda
"""

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
