"""Few-shot workload with and without the radix prefix cache, side by side in one run.

Many requests share one long few-shot prefix (worked examples) and differ only in the final
question, the pattern of batched evaluation and agent programs. Prints throughput and the cache
hit rate for both settings and writes JSON.

    python benchmarks/bench_prefix_cache.py --num-requests 32 --shots 20 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import time

COUNTRIES = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Canada", "Ottawa"),
    ("Egypt", "Cairo"), ("Norway", "Oslo"), ("India", "New Delhi"), ("Chile", "Santiago"), ("Spain", "Madrid"),
    ("Italy", "Rome"), ("Ghana", "Accra"), ("Cuba", "Havana"), ("Iran", "Tehran"), ("Nepal", "Kathmandu"),
    ("Poland", "Warsaw"), ("Greece", "Athens"), ("Turkey", "Ankara"), ("Mexico", "Mexico City"),
    ("Brazil", "Brasilia"), ("Sweden", "Stockholm"), ("Austria", "Vienna"), ("Vietnam", "Hanoi"),
    ("Morocco", "Rabat"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"), ("Finland", "Helsinki"),
    ("Hungary", "Budapest"), ("Iceland", "Reykjavik"), ("Thailand", "Bangkok"), ("Colombia", "Bogota"),
    ("Denmark", "Copenhagen"), ("Ethiopia", "Addis Ababa"), ("Argentina", "Buenos Aires"),
    ("Australia", "Canberra"), ("Germany", "Berlin"), ("Belgium", "Brussels"), ("Romania", "Bucharest"),
]


def build_prompts(num_requests: int, shots: int) -> list[str]:
    examples = COUNTRIES[:shots]
    prefix = "Answer each question with the capital city and one fact about it.\n\n" + "".join(
        f"Question: What is the capital of {c}?\nAnswer: The capital of {c} is {cap}.\n\n" for c, cap in examples
    )
    targets = [COUNTRIES[(shots + i) % len(COUNTRIES)][0] for i in range(num_requests)]
    return [prefix + f"Question: What is the capital of {c} (request {i})?\nAnswer:" for i, c in enumerate(targets)]


def run(disable_radix_cache: bool, prompts: list[str], output_len: int, model_path: str | None,
        threads: int | None = None) -> dict:
    from treespec.engine import Engine

    engine = Engine(model_path=model_path, disable_radix_cache=disable_radix_cache, max_total_tokens=32768,
                    num_threads=threads)
    engine.generate("warm up", {"max_new_tokens": 2})
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": output_len})
    elapsed = time.perf_counter() - start
    engine.check_pool_balance()
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "radix_cache": not disable_radix_cache,
        "num_requests": len(prompts),
        "seconds": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "input_tok_s": prompt_tokens / elapsed,
        "output_tok_s": completion / elapsed,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt_tokens,
        "outputs": [o["output_ids"] for o in outs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--shots", type=int, default=20)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default="bench_prefix_cache.json")
    args = parser.parse_args()
    prompts = build_prompts(args.num_requests, args.shots)
    rows = [run(flag, prompts, args.output_len, args.model_path, args.num_threads) for flag in (False, True)]
    same = rows[0]["outputs"] == rows[1]["outputs"]
    print(f"{'radix cache':>12} {'seconds':>8} {'req/s':>7} {'in tok/s':>9} {'out tok/s':>9} {'hit rate':>9}")
    for r in rows:
        print(f"{'on' if r['radix_cache'] else 'off':>12} {r['seconds']:8.2f} {r['requests_per_s']:7.2f} "
              f"{r['input_tok_s']:9.1f} {r['output_tok_s']:9.1f} {r['cache_hit_rate']:9.1%}")
    print(f"speed-up with the cache: {rows[0]['requests_per_s'] / rows[1]['requests_per_s']:.2f}x; "
          f"greedy outputs identical: {same}")
    for r in rows:
        del r["outputs"]
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "outputs_identical": same}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
