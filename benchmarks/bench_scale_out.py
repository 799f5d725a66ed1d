"""Scale-out throughput: DP 1 vs DP 2 (replicas behind sglang-router), and TP once the server has --tp-size.

    python benchmarks/bench_scale_out.py                                      # DP 1 and DP 2, cache_aware
    python benchmarks/bench_scale_out.py --router-policies cache_aware,round_robin
    python benchmarks/bench_scale_out.py --dp-sizes 1 --tp-size 2             # passed through as --tp-size 2

Each configuration is one server started by `launch_server` (DP N: N replicas behind the router; unless
--server-args sets --num-threads, the machine's cores are split between the replicas, so DP 1 and DP 2
use the same cores). Two workloads, the same prompts for every configuration: `shared-prefix`
(--groups system prompts of --system-len tokens, each shared by --per-group questions of --question-len
tokens) and `plain` (independent prompts of --plain-len tokens). Requests are non-streaming /generate
with text prompts (the router's cache-aware tree matches text), --concurrency in flight, --output-len
new tokens each (EOS ignored). Reported per row: requests/s, output tokens/s, the prefix-cache hit rate
(prompt tokens found cached / prompt tokens, from each response's meta_info.cached_tokens) and how many
requests each replica served (its /server_info num_finished). A table on stdout; the rows, the command
and the host's CPU to --output-file (JSON). Exit status 1 if a server fails to start or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import random_inputs, shared_prefix_inputs  # noqa: E402


def cpu_description() -> dict:
    """The CPU model, core count and the SIMD flags that matter to the kernels (from /proc/cpuinfo)."""
    info = {"model": "unknown", "cores": 0, "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    info["model"] = model.group(1) if model else "unknown"
    info["cores"] = len(re.findall(r"^processor\s*:", text, re.M))
    wanted = ("avx", "fma", "f16c", "amx", "vnni", "bf16")
    info["flags"] = sorted(f for f in (flags.group(1).split() if flags else []) if f.startswith(wanted))
    return info


def replica_urls(server, dp_size: int) -> list[str]:
    if dp_size == 1:
        return [server.base_url]
    return re.search(r"replicas (.+)\)", server.log_tail(1 << 20)).group(1).split()


def num_finished(urls: list[str]) -> list[int]:
    return [httpx.get(f"{u}/server_info", timeout=30).json()["stats"]["num_finished"] for u in urls]


async def run_workload(url: str, prompts: list[str], output_len: int, concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    metas: list[dict] = []
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def one(text: str) -> None:
            body = {"text": text, "sampling_params": {"max_new_tokens": output_len, "temperature": 0,
                                                      "ignore_eos": True}}
            async with limit:
                try:
                    resp = await client.post(f"{url}/generate", json=body)
                except httpx.HTTPError as e:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                    return
            if resp.status_code == 200:
                metas.append(resp.json()["meta_info"])
            else:
                errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    return {"completed": len(metas), "failed": len(errors), "duration_s": duration,
            "request_throughput": len(metas) / duration,
            "output_tok_s": sum(m["completion_tokens"] for m in metas) / duration,
            "cache_hit_rate": sum(m["cached_tokens"] for m in metas) / prompt_tokens if prompt_tokens else 0.0,
            "errors": errors[:5]}


def build_workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    from transformers import AutoTokenizer

    from treespec.model_loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or str(resolve_model_path(None)))
    rng = random.Random(args.seed)
    shared = shared_prefix_inputs(tokenizer, args.groups, args.per_group, args.system_len, args.question_len,
                                  args.output_len, rng)
    plain = random_inputs(tokenizer, args.groups * args.per_group, args.plain_len, args.output_len, 1.0, rng)
    return {"shared-prefix": [r.prompt_text for r in shared], "plain": [r.prompt_text for r in plain]}


def configurations(args: argparse.Namespace) -> list[tuple[str, list[str], int]]:
    """(label, launch_server args, dp size) for each configuration to measure."""
    base = shlex.split(args.server_args) + (["--tp-size", str(args.tp_size)] if args.tp_size else [])
    tp = f" tp {args.tp_size}" if args.tp_size else ""
    out = []
    for dp in (int(d) for d in args.dp_sizes.split(",")):
        if dp == 1:
            out.append((f"dp 1{tp}", base, 1))
            continue
        for policy in args.router_policies.split(","):
            out.append((f"dp {dp}{tp} {policy}", [*base, "--dp-size", str(dp), "--router-policy", policy], dp))
    return out


def print_row(row: dict) -> None:
    print(f"{row['config']:<26} {row['workload']:<14} {row['completed']:>4} {row['failed']:>4} "
          f"{row['request_throughput']:7.2f} {row['output_tok_s']:9.1f} {row['cache_hit_rate']:9.2f}  "
          f"{'/'.join(map(str, row['requests_per_replica']))}", flush=True)
    for err in row["errors"]:
        print(f"    error: {err}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp-sizes", default="1,2", help="comma list of --dp-size values")
    p.add_argument("--router-policies", default="cache_aware", help="comma list, for each DP > 1")
    p.add_argument("--tp-size", type=int, default=None, help="passed to every server as --tp-size")
    p.add_argument("--server-args", default="--speculative-algorithm NONE", help="more launch_server flags")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--plain-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default="bench_scale_out.json")
    args = p.parse_args(argv)

    from treespec.server.testing import start_server

    workloads = build_workloads(args)
    rows, failed = [], 0
    print(f"{'config':<26} {'workload':<14} {'ok':>4} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'cache hit':>9}  "
          "requests per replica")
    for label, launch_args, dp in configurations(args):
        server = start_server(launch_args)
        try:
            try:
                server.wait_ready()
            except RuntimeError as e:
                print(f"error: {label} failed to start: {str(e)[-1500:]}", file=sys.stderr)
                failed += 1
                continue
            urls = replica_urls(server, dp)
            for name, prompts in workloads.items():
                before = num_finished(urls)
                result = asyncio.run(run_workload(server.base_url, prompts, args.output_len, args.concurrency))
                after = num_finished(urls)
                row = {"config": label, "dp_size": dp, "tp_size": args.tp_size, "server_args": launch_args,
                       "workload": name, "concurrency": args.concurrency, **result,
                       "requests_per_replica": [a - b for a, b in zip(after, before, strict=True)]}
                failed += row["failed"]
                rows.append(row)
                print_row(row)
        finally:
            server.terminate()
    report = {"command": sys.argv, "cpu": cpu_description(), "rows": rows}
    Path(args.output_file).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output_file} (CPU: {report['cpu']['model']}, {report['cpu']['cores']} cores)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
