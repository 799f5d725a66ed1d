"""Tensor parallelism on this machine: TP 1 vs TP 2 outputs and throughput through the real server.

    python benchmarks/bench_tp.py                          # default model, 16 held-out ShareGPT prompts
    python benchmarks/bench_tp.py --num-prompts 4 --max-new-tokens 8 --model-path DIR --output-file x.jsonl

For each server configuration (--config, repeatable; default: TP 1 plain, TP 2 plain, TP 2 with the
default speculation) it starts `launch_server`, sends the same greedy requests (the fixed held-out
ShareGPT split, chat template, EOS stops) all at once (batch = --num-prompts) and then one at a time
(batch 1, the first --batch1-prompts), and records output ids, output tokens per second and whether the
KV pool balanced on every rank afterwards (`kv_pool_balanced` of /server_info). It then prints how many
prompts gave outputs identical to the first configuration's and to the previous one's (by default: TP 2
vs TP 1, and speculative vs plain within TP 2), and writes one JSON object per
configuration to --output-file. Exit status 1 when a server fails or a pool does not balance.

What two cores can show: that TP 2 is correct (outputs, pools) and what its collectives cost. Not that it
is faster: both ranks share the same two cores and the same memory bandwidth that one TP 1 process
already saturates, so splitting the weights saves no bandwidth and adds two all-reduces per layer.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shlex
import sys
import time

import httpx

from treespec.server.testing import popen_launch_server

DEFAULT_CONFIGS = ["--tp-size 1 --speculative-algorithm NONE", "--tp-size 2 --speculative-algorithm NONE",
                   "--tp-size 2"]
COMMON = ["--dtype", "float32", "--max-total-tokens", "16384"]


def held_out_prompts(model_path: str | None, n: int) -> list[list[int]]:
    from treespec.model_loader import resolve_model_path
    from treespec.tokenizer import load_tokenizer
    from treespec.train.data import holdout_prompts

    tokenizer = load_tokenizer(resolve_model_path(model_path))
    return holdout_prompts(tokenizer, None, 500, n, max_prompt_tokens=512)


def generate(base_url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    start = time.perf_counter()
    resp = httpx.post(f"{base_url}/generate", json=body, timeout=1800)
    resp.raise_for_status()
    return resp.json()["output_ids"], time.perf_counter() - start


def run_config(config: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    flags = [*COMMON, *shlex.split(config)] + (["--model-path", args.model_path] if args.model_path else [])
    server = popen_launch_server(flags, timeout=1800)
    try:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            batched = list(pool.map(lambda p: generate(server.base_url, p, args.max_new_tokens), prompts))
        batch_s = time.perf_counter() - start
        single = [generate(server.base_url, p, args.max_new_tokens) for p in prompts[: args.batch1_prompts]]
        info = httpx.get(f"{server.base_url}/server_info", timeout=60).json()
    finally:
        server.terminate()
    outputs = [out for out, _ in batched]
    batch1_tokens = sum(len(out) for out, _ in single)
    return {
        "config": config, "outputs": outputs,
        "batch_tok_s": sum(len(o) for o in outputs) / batch_s,
        "batch1_tok_s": batch1_tokens / sum(t for _, t in single) if single else None,
        "kv_pool_balanced": info.get("kv_pool_balanced"),
        "accept_length": info.get("stats", {}).get("avg_spec_accept_length"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", help="server flags of one configuration (repeatable)")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch1-prompts", type=int, default=4)
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args(argv)
    prompts = held_out_prompts(args.model_path, args.num_prompts)
    rows = []
    for config in args.config or DEFAULT_CONFIGS:
        try:
            rows.append(run_config(config, prompts, args))
        except Exception as e:  # a server that fails to start or answer: reported, not a traceback
            print(f"{config!r}: {type(e).__name__}: {str(e)[-2000:]}", file=sys.stderr)
            return 1
    reference = rows[0]["outputs"]
    print(f"{'config':44} {'same as first':>13} {'same as prev':>12} {'batch tok/s':>11} {'batch-1 tok/s':>13} "
          f"{'pools':>6} {'accept':>6}")
    ok = True
    previous = reference
    for row in rows:
        row["same_as_first"] = sum(a == b for a, b in zip(row["outputs"], reference, strict=True))
        row["same_as_previous"] = sum(a == b for a, b in zip(row["outputs"], previous, strict=True))
        previous = row["outputs"]
        ok &= row["kv_pool_balanced"] is True
        b1 = f"{row['batch1_tok_s']:.1f}" if row["batch1_tok_s"] else "-"
        accept = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
        print(f"{row['config']:44} {row['same_as_first']:>6}/{len(prompts):<6} "
              f"{row['same_as_previous']:>5}/{len(prompts):<6} {row['batch_tok_s']:>11.1f} "
              f"{b1:>13} {str(row['kv_pool_balanced']):>6} {accept:>6}")
    if args.output_file:
        with open(args.output_file, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
