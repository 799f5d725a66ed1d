"""Our CPU kernels on and off, side by side in one process: decode tokens/s of plain and speculative
(EAGLE-3, default settings) greedy decoding with the attention kernels (`kernels/cpu_attention.cpp`:
attention, and rope + KV store) and the RMSNorm kernel (`kernels/cpu_norm.cpp`) switched off one at a time.

    python benchmarks/bench_cpu_kernels.py                      # 6 held-out prompts x 96 new tokens
    python benchmarks/bench_cpu_kernels.py --num-prompts 10 --json cpu_kernels.json

Settings are interleaved prompt by prompt so host noise hits them alike; each prompt's outputs must be
the same under every setting (the kernels change rounding only, and greedy speculation stays exact).
The panel matmul kernel stays on throughout (`bench_cpu_linear.py` measures it).
"""

from __future__ import annotations

import argparse
import json
import time

from treespec.engine import Engine
from treespec.models.layers import RMSNorm
from treespec.train.data import holdout_prompts

SETTINGS = {"all kernels": (True, True), "attention kernels off": (False, True), "norm kernel off": (True, False)}


def set_kernels(engine: Engine, attention: bool, norm: bool, saved: dict) -> None:
    """Switch the attention (attention, rope + KV store) and norm kernels of the target and (if any)
    draft on or off."""
    scheduler = engine.scheduler
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
            for setting, (attention, norm) in SETTINGS.items():
                set_kernels(engine, attention, norm, saved)
                engine.flush_cache()
                start = time.perf_counter()
                out = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
                seconds[(name, setting)] += time.perf_counter() - start
                reference = reference or out
                mismatches += out != reference
            tokens[name] += len(reference)
        for engine in engines.values():
            set_kernels(engine, True, True, saved)

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
