"""treespec.kernels: tree-speculation and KV-index kernels.

Every kernel has one contract (see each module's docstring), a torch implementation (`*_torch`, the CPU
path and the reference; build_tree and greedy verify walk host ints there, cheaper than torch ops on
a step's few nodes) and a Triton implementation (`*_triton`, CUDA; also runs on CPU tensors under
`TRITON_INTERPRET=1`, which must be set before `triton` is first imported). The plain names dispatch:
Triton when the tensors are on CUDA, torch otherwise. `python -m treespec.kernels.compile_check` lowers
every kernel to a CUDA cubin without a GPU.
"""

from .cache_locs import assign_draft_cache_locs, assign_req_to_token_pool, create_flashinfer_kv_indices
from .mask_pack import packed_segment_indptr, segment_packbits, segment_unpackbits
from .tree_build import build_tree, tree_parent_nodes
from .tree_sampling import tree_speculative_sampling_target_only
from .tree_verify import verify_tree_greedy

__all__ = [
    "assign_draft_cache_locs",
    "assign_req_to_token_pool",
    "build_tree",
    "create_flashinfer_kv_indices",
    "packed_segment_indptr",
    "segment_packbits",
    "segment_unpackbits",
    "tree_parent_nodes",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
]
