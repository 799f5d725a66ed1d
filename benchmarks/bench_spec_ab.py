"""Plain vs speculative serving, side by side on the same prompts, per workload (greedy).

    python benchmarks/bench_spec_ab.py                                    # plain vs the default server
    python benchmarks/bench_spec_ab.py --spec-args "--speculative-algorithm NGRAM" --workloads code_edit
    python benchmarks/bench_spec_ab.py --num-prompts 12 --max-new-tokens 160 --concurrency 4,16
    python benchmarks/bench_spec_ab.py --spec-args "--speculative-algorithm NONE"   # the bias check: ~1.00x

Starts two servers at once: `--plain-args` (default `--speculative-algorithm NONE`) and `--spec-args`
(default: none, the default server). Batch 1: each prompt goes to both servers one after the other,
the order alternating prompt by prompt, so machine drift hits both alike. Concurrency c: all of a
workload's prompts at most c in flight, in passes ordered by `concurrent_pass_order`: plain, spec,
spec, plain (ABBA) when plain was launched first, spec, plain, plain, spec (BAAB) when spec was, both
(eight passes) with one launch order, so neither server holds the outer places more often. A pass's
place can move its speed: over 12 summarising c4 groups on the 2-vCPU AMD VM (2026-11-27) the last pass
ran 2.5 % (+-0.9) above its group's mean and the middle two 1.2-1.9 % below, so ABBA alone read the
speculative server ~3 % low there (ABBA groups 0.98x, BAAB groups 1.05x); over 16 chat c16 groups
right after, no place differed by more than 1 % (cause unknown). One group's ratio varies by +-3-5 %
on that VM: `--groups N` repeats a cell's groups N times. Tokens/s =
completion tokens / wall time of the requests (prefill included), summed per server. Greedy outputs
must be equal: the table counts prompts whose output ids match. Accept length = tokens per verify
step of the speculative server (meta_info), pooled; with drafts from several sources, the accepted
drafts per source too.

Launch order: on the 2-vCPU dev VM the server launched second ran 5-19 % faster than the first, with
the same flags (plain vs plain: 1.19x at batch 1, 1.15x at c16; launched the other way round, 0.89x and
0.96x; cause unknown). So the whole run happens twice by default (`--launch-orders 2`): plain launched
first, then the speculative server first, and each row's ratio is the geometric mean of the two runs'
ratios (tokens/s averaged over both). Even so one launch's ratio moves +-4 % between launches (chat
at 16 concurrent on the Zen 4 VM: 0.92-1.08 over eighteen launches, 2026-12-07), more than a cell's
margin to a target: `--launches K` runs each launch order K times, alternating, each with a new pair
of servers, and the row gives the geometric mean over all 2K launches with its standard error
(`launch_spread`: the spread of the launches' log ratios / sqrt(2K), as a factor) and the lowest and
highest launch. Every timed pass starts from flushed caches (`/flush_cache`: the radix cache,
and on the speculative server its n-gram corpus and parked draft rows), so no pass drafts from an
earlier pass's replies to the same prompts (before 2026-11-26 the c4/c16 passes could: each prompt went
to the speculative server once at batch 1 and twice per concurrency); both servers are flushed before
each pass, and each gets SETTLE_S after each batch-1 request, so neither server's work between requests
(NGRAM's inserts of released text) runs during the other's timed requests (before 2026-11-27 it could,
skewing cells either way). Workloads: benchmarks/spec_workloads.py. Prints a table and writes --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from spec_workloads import WORKLOADS, workload_prompts  # noqa: E402


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx"))]
    return f"{model}; {' '.join(keep)}"


async def generate(client: httpx.AsyncClient, url: str, ids: list[int], max_new: int) -> tuple[dict, float]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}
    start = time.perf_counter()
    resp = await client.post(f"{url}/generate", json=body)
    resp.raise_for_status()
    return resp.json(), time.perf_counter() - start


async def run_concurrent(url: str, prompts: list[list[int]], max_new: int, conc: int) -> tuple[list[dict], float]:
    limit = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=3600) as client:
        async def one(ids):
            async with limit:
                return (await generate(client, url, ids, max_new))[0]

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return list(outs), time.perf_counter() - start


def flush(urls: dict[str, str]) -> None:
    """Forget both servers' cached text (radix cache, n-gram corpus, parked draft rows) and the work
    their last requests left (NGRAM's released text waiting for an idle moment); both are idle here."""
    for url in urls.values():
        httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()


# After each timed request, both servers get this long to finish their work between requests (NGRAM
# inserts a released request's text into its n-gram cache once it has no request in flight: ~3-15 ms
# of Python): on two shared cores it would otherwise run during the other server's next request.
SETTLE_S = 0.05


async def run_batch1(urls: dict[str, str], prompts: list[list[int]], max_new: int) -> tuple[dict, dict]:
    outs: dict[str, list[dict]] = {k: [] for k in urls}
    secs: dict[str, float] = Counter()
    async with httpx.AsyncClient(timeout=3600) as client:
        for i, ids in enumerate(prompts):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in order:
                out, dt = await generate(client, urls[name], ids, max_new)
                outs[name].append(out)
                secs[name] += dt
                await asyncio.sleep(SETTLE_S)
    return outs, secs


def launch_spread(ratios: list[float]) -> float | None:
    """The standard error of the geometric mean of `ratios` (one per launch), as a factor: exp of the
    sample standard deviation of their logs over sqrt(n). None for fewer than two launches."""
    n = len(ratios)
    if n < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    return math.exp(sd / math.sqrt(n))


def combine(runs: list[dict]) -> dict:
    """One row from the same (workload, mode) measured under each launch (each launch order, K times
    with --launches K): tokens/s averaged, the ratio the geometric mean of the launches' ratios (the
    launch-order bias cancels) with its standard error over the launches, counts summed."""
    if len(runs) == 1:
        return runs[0]
    ratios = [r["ratio"] for r in runs]
    by_source: Counter[str] = Counter()
    for r in runs:
        by_source.update(r["accepted_drafts_by_source"])
    steps = sum(r["spec_steps"] for r in runs)
    emitted = sum((r["accept_length"] or 0) * r["spec_steps"] for r in runs)
    return {**runs[0], "prompts": sum(r["prompts"] for r in runs),
            "plain_tok_s": sum(r["plain_tok_s"] for r in runs) / len(runs),
            "spec_tok_s": sum(r["spec_tok_s"] for r in runs) / len(runs),
            "ratio": math.prod(ratios) ** (1 / len(runs)), "ratios_by_launch": ratios,
            "launch_spread": launch_spread(ratios),
            "accept_length": emitted / steps if steps else None,
            "spec_steps": steps, "accepted_drafts_by_source": dict(by_source), "equal": sum(r["equal"] for r in runs)}


def summarize(workload: str, mode: str, outs: dict[str, list[dict]], secs: dict[str, float]) -> dict:
    tokens = {k: sum(o["meta_info"]["completion_tokens"] for o in v) for k, v in outs.items()}
    tok_s = {k: tokens[k] / secs[k] for k in outs}
    metas = [o["meta_info"] for o in outs["spec"]]
    steps = sum(m.get("spec_verify_ct", 0) for m in metas)
    emitted = sum(m.get("spec_accept_length", 0) * m.get("spec_verify_ct", 0) for m in metas)
    by_source: Counter[str] = Counter()
    for m in metas:
        by_source.update(m.get("spec_accepted_drafts_by_source", {}))
    equal = sum(a["output_ids"] == b["output_ids"] for a, b in zip(outs["plain"], outs["spec"], strict=True))
    return {"workload": workload, "mode": mode, "prompts": len(outs["plain"]), "plain_tok_s": tok_s["plain"],
            "spec_tok_s": tok_s["spec"], "ratio": tok_s["spec"] / tok_s["plain"],
            "accept_length": emitted / steps if steps else None, "spec_steps": steps,
            "accepted_drafts_by_source": dict(by_source), "equal": equal}


def print_row(row: dict) -> None:
    if not getattr(print_row, "header", False):
        print(f"{'workload':<10} {'mode':<6} {'n':>3} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
              f"{'accept':>6} {'equal':>6}  drafts by source")
        print_row.header = True
    acc = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
    src = ", ".join(f"{k} {v}" for k, v in sorted(row["accepted_drafts_by_source"].items())) or "-"
    spread = ""
    if row.get("launch_spread") is not None:  # several launches: the standard error and the range
        ratios = row["ratios_by_launch"]
        spread = (f"  (x/ {row['launch_spread']:.3f} over {len(ratios)} launches, "
                  f"{min(ratios):.3f}-{max(ratios):.3f})")
    print(f"{row['workload']:<10} {row['mode']:<6} {row['prompts']:>3} {row['plain_tok_s']:>11.1f} "
          f"{row['spec_tok_s']:>10.1f} {row['ratio']:>5.2f}x {acc:>6} {row['equal']:>3}/{row['prompts']:<2}  {src}"
          f"{spread}", flush=True)


def save_prompts(path: str, workloads: list[str], num_prompts: int) -> int:
    """Build the workloads' prompts with the default model's tokenizer and write them as token ids."""
    from treespec.model_loader import resolve_model_path
    from treespec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model_path(None)))
    out = {w: workload_prompts(w, tokenizer, num_prompts) for w in workloads}
    Path(path).write_text(json.dumps(out))
    print(f"wrote {path}: {', '.join(f'{w} {len(v)}' for w, v in out.items())}")
    return 0


# the launch orders of a run, in turn (--launch-orders takes the first one or both)
LAUNCH_ORDERS: tuple[tuple[str, str], ...] = (("plain", "spec"), ("spec", "plain"))


def launch_sequence(launch_orders: int, launches: int) -> list[tuple[str, str]]:
    """The launches of a run, in turn: the launch orders alternating, each `launches` times."""
    return list(LAUNCH_ORDERS[:launch_orders]) * launches


def concurrent_pass_order(launch_order: tuple[str, str], launch_orders: int) -> tuple[str, ...]:
    """The passes of one concurrency cell, by server: each server takes the outer places of a group of
    four (ABBA) as often as the inner ones, over the run (the launched-first server's group under each
    launch order; both groups when there is one launch order)."""
    first, second = launch_order
    abba = (first, second, second, first)
    return abba if launch_orders == 2 else abba + (second, first, first, second)


def run_servers(args: argparse.Namespace, order: tuple[str, str], concs: list[int], saved: dict | None) -> list[dict]:
    """Launch both servers in `order`, measure every workload and mode, stop them; the rows."""
    from treespec.server.testing import popen_launch_server
    from treespec.tokenizer import load_tokenizer

    flags = {"plain": args.plain_args, "spec": args.spec_args}
    servers = {}
    rows = []
    try:
        for name in order:
            print(f"launching {name}: {flags[name] or '(defaults)'}", file=sys.stderr, flush=True)
            servers[name] = popen_launch_server(shlex.split(flags[name]))
        urls = {k: servers[k].base_url for k in ("plain", "spec")}
        info = httpx.get(f"{urls['spec']}/server_info", timeout=60).json()
        model = httpx.get(f"{urls['spec']}/model_info", timeout=60).json()
        tokenizer = load_tokenizer(model["tokenizer_path"] or model["model_path"])
        print(f"host: {cpu_flags()}\nplain: {args.plain_args or '(defaults)'} | spec: {args.spec_args or '(defaults)'}"
              f" ({info.get('speculative_algorithm')})\n{args.max_new_tokens} new tokens, greedy; {order[0]} launched first",
              flush=True)
        print_row.header = False
        passes = concurrent_pass_order(order, args.launch_orders) * args.groups  # every concurrency cell's
        for url in urls.values():  # warm-up: kernels, allocator, first-request paths
            asyncio.run(run_concurrent(url, [tokenizer.encode("Hello there.")], 16, 1))
        for workload in args.workloads:
            if saved is not None:
                prompts = saved[workload][: args.num_prompts]
            else:
                prompts = workload_prompts(workload, tokenizer, args.num_prompts)
            if not args.no_batch1:
                flush(urls)
                outs, secs = asyncio.run(run_batch1(urls, prompts, args.max_new_tokens))
                rows.append(summarize(workload, "bs1", outs, secs))
                print_row(rows[-1])
            for conc in concs:
                outs, secs = {"plain": [], "spec": []}, Counter()
                for name in passes:
                    flush(urls)  # both: the idle one drops the work its last pass left
                    got, dt = asyncio.run(run_concurrent(urls[name], prompts, args.max_new_tokens, conc))
                    outs[name] = got  # every pass is greedy: the same outputs
                    secs[name] += dt / passes.count(name)
                rows.append(summarize(workload, f"c{conc}", outs, secs))
                print_row(rows[-1])
    finally:
        for s in servers.values():
            s.terminate()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain-args", default="--speculative-algorithm NONE")
    p.add_argument("--spec-args", default="", help="the speculative server's flags (default: the defaults)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=12, help="per workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="4,16", help="comma list; empty: batch 1 only")
    p.add_argument("--no-batch1", action="store_true", help="only the concurrency cells (tuning a load schedule)")
    p.add_argument("--launch-orders", type=int, default=2, choices=(1, 2),
                   help="2: run everything twice, plain launched first, then speculative first (default)")
    p.add_argument("--launches", type=int, default=1,
                   help="launches per launch order, alternating, each a new pair of servers (a launch's ratio "
                        "moves +-4 %% here: more launches, a steadier row, with its standard error)")
    p.add_argument("--groups", type=int, default=1,
                   help="groups of four concurrent passes per cell and launch order (a pass's speed varies "
                        "+-3-5 %% here: more groups, a steadier ratio)")
    p.add_argument("--json", default="bench_spec_ab.json")
    p.add_argument("--save-prompts", default=None, metavar="FILE",
                   help="write each workload's prompt token ids to FILE (JSON) and exit, starting no server")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="read the prompts from a --save-prompts FILE instead of building them (hosts without "
                        "the ShareGPT wheel, e.g. a GPU machine with no registry)")
    args = p.parse_args(argv)
    if args.groups < 1:
        p.error("--groups must be at least 1")
    if args.launches < 1:
        p.error("--launches must be at least 1")
    if args.save_prompts:
        return save_prompts(args.save_prompts, args.workloads, args.num_prompts)
    saved = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    if saved is not None:
        missing = [w for w in args.workloads if w not in saved]
        if missing:
            p.error(f"--prompts {args.prompts} has no prompts for workload(s) {', '.join(missing)}")

    concs = [int(c) for c in args.concurrency.split(",") if c]
    launches = launch_sequence(args.launch_orders, args.launches)
    runs = [run_servers(args, order, concs, saved) for order in launches]
    rows = [combine(list(same)) for same in zip(*runs, strict=True)]
    if len(runs) > 1:
        print(f"all {len(runs)} launches ({', '.join(f'{a} first' for a, _ in launches)}), "
              "ratio = their geometric mean:")
        print_row.header = False
        for row in rows:
            print_row(row)
    names = [f"{a}_first" if args.launches == 1 else f"{a}_first_{i // args.launch_orders + 1}"
             for i, (a, _) in enumerate(launches)]
    Path(args.json).write_text(json.dumps({"host": cpu_flags(), "plain_args": args.plain_args,
                                           "spec_args": args.spec_args, "max_new_tokens": args.max_new_tokens,
                                           "rows": rows, "rows_by_launch_order": dict(zip(names, runs, strict=True))},
                                          indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
