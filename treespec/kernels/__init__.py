"""treespec.kernels: tree-speculation and attention-mask kernels.

Every kernel has one contract (see each module's docstring), a torch implementation (`*_torch`, the CPU
path and the reference; build_tree and greedy verify walk host ints there, cheaper than torch ops on
a step's few nodes; `greedy_walk_host` is that walk for callers that hold the tree as host lists) and
a Triton implementation (`*_triton`, CUDA; also runs on CPU tensors under `TRITON_INTERPRET=1`, which
must be set before `triton` is first imported). The plain names dispatch:
Triton when the tensors are on CUDA, torch otherwise. `python -m treespec.kernels.compile_check` lowers
every kernel to a CUDA cubin without a GPU.
"""

from .mask_pack import pack_masks, packed_segment_indptr, segment_packbits, segment_unpackbits
from .tree_build import build_tree, tree_parent_nodes
from .tree_sampling import tree_speculative_sampling_target_only
from .tree_verify import greedy_walk_host, verify_tree_greedy

__all__ = [
    "build_tree",
    "greedy_walk_host",
    "pack_masks",
    "packed_segment_indptr",
    "segment_packbits",
    "segment_unpackbits",
    "tree_parent_nodes",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
]
