"""Compile every Triton kernel of treespec.kernels for a CUDA architecture, without a GPU.

Triton ships ptxas, so lowering to a cubin needs no device: this catches typing and lowering errors
that the interpreter (TRITON_INTERPRET=1) does not see. It must run in a process where triton was
imported *without* TRITON_INTERPRET (the interpreter replaces triton.language's own jitted helpers):

    python -m treespec.kernels.compile_check [arch ...]      # default: 80 90
"""

import inspect
import os
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import mask_pack, tree_build, tree_sampling, tree_verify


def _signature(kernel: Any, default: str, **types: str) -> dict[str, str]:
    return {name: types.get(name, default) for name in inspect.signature(kernel.fn).parameters}


def kernel_specs() -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """(kernel, argument types, constexpr values) for each kernel, with representative dtypes."""
    return [
        (mask_pack._segment_packbits_kernel, _signature(
            mask_pack._segment_packbits_kernel, "*i64", mask_ptr="*u8", packed_ptr="*u8",
            BLOCK_BYTES="constexpr"), {"BLOCK_BYTES": 128}),
        (tree_build._build_tree_kernel, _signature(
            tree_build._build_tree_kernel, "*i64", tree_mask_ptr="*u8", topk="i32", num_steps="i32",
            num_draft_tokens="i32", parent_list_width="i32", NODE_BLOCK="constexpr", PREFIX_BLOCK="constexpr"),
         {"NODE_BLOCK": 64, "PREFIX_BLOCK": 256}),
        (tree_verify._verify_tree_greedy_kernel, _signature(
            tree_verify._verify_tree_greedy_kernel, "*i64", num_nodes="i32", max_depth="i32"), {}),
        (tree_sampling._tree_sampling_kernel, _signature(
            tree_sampling._tree_sampling_kernel, "*i64", uniform_ptr="*fp32", uniform_final_ptr="*fp32",
            probs_ptr="*fp32", num_nodes="i32", max_depth="i32", vocab_size="i32", VOCAB_BLOCK="constexpr"),
         {"VOCAB_BLOCK": 1024}),
    ]


def compile_all(arch: int = 90) -> list[str]:
    """Compile each kernel to a cubin for sm_<arch>; returns the kernel names. Raises on any error."""
    if triton.knobs.runtime.interpret:
        raise RuntimeError("unset TRITON_INTERPRET: the compile check needs triton's compiled mode")
    names = []
    for kernel, signature, constants in kernel_specs():
        arg_names = list(signature)
        constexprs = {(arg_names.index(name),): value for name, value in constants.items()}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32))
        assert compiled.asm["cubin"], kernel.fn.__name__
        names.append(kernel.fn.__name__)
    return names


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for arch in [int(a) for a in sys.argv[1:]] or [80, 90]:
        print(f"sm_{arch}: compiled", ", ".join(compile_all(arch)))
