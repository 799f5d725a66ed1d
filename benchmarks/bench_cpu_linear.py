"""CPU matmul layouts side by side: the time of one decode step's matmuls (every linear layer of a
Llama-family model, lm_head included) for several row counts, through our panel kernel, oneDNN's
prepacked layout and plain F.linear (MKL), interleaved in one run; with the panel kernel also its
block-quant path over GGUF-style blocks of 32 weights with an fp16 scale and min: "panel_q4" with 4-bit
codes two per byte (Q4_0/Q4_1, the default model's layers), "panel_q8" with 8-bit codes (Q8_0, its
lm_head); and "panel_q4_int8" / "panel_q8_int8", the same blocks with int8 activations
(`--block-quant-activations int8`). TREESPEC_CPU_QUANT_ISA=avx2 runs the block-quant kernels' AVX2
code on an AVX-512 CPU.

    python benchmarks/bench_cpu_linear.py                         # SmolLM2-135M's shapes, fp32
    python benchmarks/bench_cpu_linear.py --rows 1,2,4,8 --json cpu_linear.json
    python benchmarks/bench_cpu_linear.py --step-layout               # one packed step: apart vs gathered
    python benchmarks/bench_cpu_linear.py --rows 1,8,12 --cached      # the same weight again: compute alone

Rows = tokens in the forward: 1 is a batch-1 decode, 2-16 a speculative verify, hundreds a prefill
chunk. Each shape gets enough distinct weights (--weight-mb per shape) that they stream from memory
instead of sitting in cache, as in a real step (--cached: the first of them over and over instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from treespec.kernels import cpu_linear
from treespec.models import weight_arena
from treespec.models.block_quant import BLOCK, BlockQuant
from treespec.models.packed_linear import onednn_packs, pack_weight, packed_linear, packing_layout

# (out, in, count per step) of SmolLM2-135M: fused qkv, o, fused gate/up, down over 30 layers + lm_head
SMOLLM2_SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def random_block_quant(out_f: int, in_f: int, gen: torch.Generator, bits: int = 8) -> BlockQuant:
    codes = torch.randint(0, 2**bits, (out_f, in_f), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(out_f, in_f // BLOCK, generator=gen) * 2e-3 / in_f**0.5).half()
    return BlockQuant(codes, scales, (-(2 ** (bits - 1)) * scales.float()).half())


def step_weights(gen: torch.Generator) -> list:
    """One decode step's packed weights of the default model in the order it reads them: 4-bit layers
    (qkv, o, gate_up, down per layer), then the 8-bit lm_head, each its own tensor."""
    layers = [shape for shape in SMOLLM2_SHAPES if shape[2] > 1]
    out_f, in_f, _ = SMOLLM2_SHAPES[-1]
    quants = {(o, i): random_block_quant(o, i, gen, 4) for o, i, _ in layers}
    packed = {shape: pack_weight(q.dequantize(), "panel", q) for shape, q in quants.items()}
    head = random_block_quant(out_f, in_f, gen, 8)
    steps = [replace(packed[(o, i)], data=packed[(o, i)].data.clone()) for _ in range(layers[0][2]) for o, i, _ in layers]
    return [*steps, pack_weight(head.dequantize(), "panel", head)]


def bench_step_layout(repeats: int, copies: int = 3) -> dict:
    """ms of one 1-row decode step's matmuls streamed from weights packed one by one ("apart") and from
    the same weights gathered back to back in step order (models/weight_arena.py, as the model holds
    them), interleaved; `copies` distinct steps of each so that none stays in cache."""
    gen = torch.Generator().manual_seed(0)
    apart = [step_weights(gen) for _ in range(copies)]
    ways = {"apart": apart, "gathered": [weight_arena.gather(step) for step in apart]}
    xs = {w.data.shape[1] * BLOCK: torch.randn(1, w.data.shape[1] * BLOCK, generator=gen) for w in apart[0]}
    samples = {way: [] for way in ways}
    for _ in range(repeats):
        for way, steps in ways.items():
            start = time.perf_counter()
            for step in steps:
                for w in step:
                    packed_linear(xs[w.data.shape[1] * BLOCK], w, None)
            samples[way].append((time.perf_counter() - start) / copies * 1e3)
    result = {way: statistics.median(ms) for way, ms in samples.items()}
    mb = sum(w.data.numel() for w in apart[0]) / 1e6
    print(f"one 1-row step's matmuls ({mb:.1f} MB): " + ", ".join(
        f"{way} {ms:.2f} ms ({mb / ms:.1f} GB/s)" for way, ms in result.items())
        + f"; gathered/apart {result['apart'] / result['gathered']:.2f}x")
    return {"step_layout_ms": result, "step_mb": mb}


def reuse_first(weights: dict) -> None:
    """--cached: every list of distinct weights becomes its first weight as many times, so a timed pass
    reads it from cache: the kernels' compute alone, against the default's streamed weights."""
    for ways in weights.values():
        for way, ws in ways.items():
            ways[way] = [ws[0]] * len(ws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--weight-mb", type=int, default=60, help="distinct weights per shape, in MB")
    parser.add_argument("--cached", action="store_true",
                        help="each shape's first weight over and over (from cache): the compute alone")
    parser.add_argument("--step-layout", action="store_true",
                        help="only time one 1-row step's matmuls packed apart vs gathered in step order")
    parser.add_argument("--json", default="bench_cpu_linear.json")
    args = parser.parse_args()
    if args.step_layout:
        with open(args.json, "w") as f:
            json.dump(bench_step_layout(args.repeats), f, indent=2)
        return

    cpu = torch.device("cpu")
    layouts = [name for name, ok in [("panel", packing_layout(cpu, torch.float32) == "panel"),
                                     ("onednn", onednn_packs(torch.float32))]
               if ok]
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for out_f, in_f, _ in SMOLLM2_SHAPES:
        copies = max(1, args.weight_mb * 2**20 // (out_f * in_f * 4))
        dense = [torch.randn(out_f, in_f, generator=gen) / in_f**0.5 for _ in range(copies)]
        weights[(out_f, in_f)] = {"mkl": dense, **{name: [pack_weight(w, name) for w in dense] for name in layouts}}
        for bits in (4, 8) if "panel" in layouts else ():
            # --weight-mb of packed blocks too, so they stream from memory rather than the L3
            quant_copies = max(1, args.weight_mb * 2**20 // (out_f * in_f * (bits + 1) // 8))
            quants = [random_block_quant(out_f, in_f, gen, bits) for _ in range(min(quant_copies, 4))]
            packed = [pack_weight(q.dequantize(), "panel", q) for q in quants]
            weights[(out_f, in_f)][f"panel_q{bits}"] = [
                replace(packed[i % len(packed)], data=packed[i % len(packed)].data.clone()) for i in range(quant_copies)]
            # the same blocks with int8 activations (the kernel's ISA chosen as the engine chooses it)
            weights[(out_f, in_f)][f"panel_q{bits}_int8"] = [
                replace(w, activations="int8", avx512=cpu_linear.quant_int8_avx512())
                for w in weights[(out_f, in_f)][f"panel_q{bits}"]]
    if "panel" in layouts:
        layouts += ["panel_q4", "panel_q8", "panel_q4_int8", "panel_q8_int8"]
    if args.cached:
        reuse_first(weights)

    def call(way: str, x: torch.Tensor, weight) -> torch.Tensor:
        return F.linear(x, weight) if way == "mkl" else packed_linear(x, weight, None)

    rows_out = []
    print(f"{'rows':>5} | " + " ".join(f"{w + ' ms':>10}" for w in ["mkl", *layouts]) + " | fastest vs mkl, onednn")
    for rows in [int(r) for r in args.rows.split(",")]:
        step_ms = {way: 0.0 for way in ["mkl", *layouts]}
        for out_f, in_f, per_step in SMOLLM2_SHAPES:
            x = torch.randn(rows, in_f, generator=gen)
            samples = {way: [] for way in step_ms}
            for _ in range(args.repeats):
                for way in step_ms:  # interleaved: machine noise hits every layout alike
                    ws = weights[(out_f, in_f)][way]
                    call(way, x, ws[0])
                    start = time.perf_counter()
                    for w in ws:
                        call(way, x, w)
                    samples[way].append((time.perf_counter() - start) / len(ws))
            for way in step_ms:
                step_ms[way] += statistics.median(samples[way]) * per_step * 1e3
        best = min(step_ms, key=step_ms.get)
        ratios = f"{best} {step_ms['mkl'] / step_ms[best]:.2f}x"
        if "onednn" in step_ms:
            ratios += f", {step_ms['onednn'] / step_ms[best]:.2f}x"
        print(f"{rows:>5} | " + " ".join(f"{v:10.1f}" for v in step_ms.values()) + f" | {ratios}", flush=True)
        rows_out.append({"rows": rows, "step_ms": step_ms, "threads": torch.get_num_threads()})
    with open(args.json, "w") as f:
        json.dump(rows_out, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
