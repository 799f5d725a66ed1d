"""Our CPU kernels on and off, side by side in one process: decode tokens/s of plain and speculative
(the shipped EAGLE-3 head, its settings) greedy decoding with the attention kernels (`treespec/kernels/cpu_attention.cpp`:
attention, and rope + KV store), the RMSNorm kernel (`treespec/kernels/cpu_norm.cpp`) and the block-quantized
matmul (the GGUF's 32-block codes streamed instead of fp32 panels, `models/block_quant.py`) switched off
one at a time.

    python benchmarks/bench_cpu_kernels.py                      # 6 held-out prompts x 96 new tokens
    python benchmarks/bench_cpu_kernels.py --num-prompts 10 --json cpu_kernels.json

Settings are interleaved prompt by prompt so host noise hits them alike; each prompt's outputs must be
the same under every setting (the kernels change rounding only, and greedy speculation stays exact).
The panel matmul kernel itself stays on throughout (`bench_cpu_linear.py` measures it).
"""

from __future__ import annotations

import argparse
import json
import time

from treespec.engine import Engine
from treespec.models.block_quant import fuse_llama_block_quant, load_block_quant
from treespec.models.layers import RMSNorm
from treespec.models.packed_linear import PackedLinear, PackedWeight, pack_weight
from treespec.train.data import holdout_prompts

# setting: (attention kernels, norm kernel, block-quantized matmuls)
SETTINGS = {"all kernels": (True, True, True), "attention kernels off": (False, True, True),
            "RMSNorm kernel off": (True, False, True), "fp32 weights": (True, True, False)}


def fp32_panels(engine: Engine) -> dict[str, PackedWeight]:
    """The target's fp32 panels for every matmul it streams as blocks (keyed as `set_weights` swaps them)."""
    runner = engine.scheduler.runner
    cfg = runner.config
    fused = fuse_llama_block_quant(load_block_quant(engine.scheduler.model_dir), cfg.num_layers,
                                   cfg.tie_word_embeddings)
    return {name: pack_weight(quant.dequantize(), "panel") for name, quant in fused.items()}


def set_weights(engine: Engine, block_quant: bool, saved: dict) -> None:
    """Point the target's matmuls at their block-quant packs or at fp32 panels of the same values."""
    model = engine.scheduler.runner.model
    if ("fp32", id(engine)) not in saved:
        saved[("fp32", id(engine))] = fp32_panels(engine)
    fp32 = saved[("fp32", id(engine))]
    modules = {name: m for name, m in model.layers.named_modules() if isinstance(m, PackedLinear)}
    for name, panels in fp32.items():
        holder, attr = (model, "packed_lm_head") if name == "lm_head" else (modules[name], "packed")
        quant = saved.setdefault(("quant", id(engine), name), getattr(holder, attr))
        setattr(holder, attr, quant if block_quant else panels)


def set_kernels(engine: Engine, attention: bool, norm: bool, block_quant: bool, saved: dict) -> None:
    """Switch the attention (attention, rope + KV store) and norm kernels of the target and (if any)
    draft, and the target's block-quantized matmuls, on or off."""
    scheduler = engine.scheduler
    set_weights(engine, block_quant, saved)
    runners = [scheduler.runner] + ([scheduler.spec_worker.draft] if scheduler.spec_worker else [])
    for runner in runners:
        backend = runner.attn_backend
        saved.setdefault(id(backend), backend.kernel)
        backend.kernel = saved[id(backend)] if attention else None
        for module in runner.model.modules():
            if isinstance(module, RMSNorm):
                saved.setdefault(id(module), module.kernel)
                module.kernel = saved[id(module)] if norm else None
            elif hasattr(module, "rope_store_kernel"):
                saved.setdefault(id(module), module.rope_store_kernel)
                module.rope_store_kernel = saved[id(module)] if attention else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", default="bench_cpu_kernels.json")
    args = parser.parse_args()

    common = {"max_total_tokens": 8192, "max_running_requests": 4}
    engines = {"plain": Engine(None, speculative_algorithm="NONE", **common),
               "EAGLE-3": Engine(None, speculative_algorithm="EAGLE3", **common)}
    prompts = holdout_prompts(engines["plain"].tokenizer, None, 500, args.num_prompts, 512)
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    saved: dict = {}
    for engine in engines.values():
        engine.generate(input_ids=prompts[0][:16], sampling_params={"temperature": 0, "max_new_tokens": 8})
    seconds = {(e, s): 0.0 for e in engines for s in SETTINGS}
    tokens = dict.fromkeys(engines, 0)
    mismatches = 0
    for ids in prompts:
        reference = None
        for name, engine in engines.items():
            for setting, switches in SETTINGS.items():
                set_kernels(engine, *switches, saved)
                engine.flush_cache()
                start = time.perf_counter()
                out = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
                seconds[(name, setting)] += time.perf_counter() - start
                reference = reference or out
                mismatches += out != reference
            tokens[name] += len(reference)
        for engine in engines.values():
            set_kernels(engine, True, True, True, saved)

    base = seconds[("plain", "all kernels")]
    print(f"{args.num_prompts} held-out prompts, {args.max_new_tokens} new tokens max, greedy, batch 1")
    print(f"{'engine':10s} {'setting':22s} {'tok/s':>8s} {'vs plain, all kernels':>22s}")
    rows = []
    for (name, setting), secs in seconds.items():
        tps = tokens[name] / secs
        rows.append({"engine": name, "setting": setting, "tokens_per_s": tps, "vs_plain_all_kernels": base / secs})
        print(f"{name:10s} {setting:22s} {tps:8.1f} {base / secs:21.2f}x")
    print(f"outputs differing from the first setting's: {mismatches}")
    with open(args.json, "w") as f:
        json.dump({"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "rows": rows,
                   "outputs_differing": mismatches}, f, indent=2)


if __name__ == "__main__":
    main()
