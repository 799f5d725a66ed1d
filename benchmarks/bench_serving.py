"""Online serving benchmark against a running server: ours (SGLang-native /generate, streaming) or any
OpenAI-compatible one (/v1/completions, streaming).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000          # a running server
    python benchmarks/bench_serving.py --backend openai --base-url http://host:8000 --model NAME
    # start our server itself, once per --launch, same prompts for each, results side by side:
    python benchmarks/bench_serving.py --launch "--speculative-algorithm NONE" --launch "" \\
        --max-concurrency 1,4,16

Datasets (--dataset-name): `sharegpt` (first user turns of the fixed held-out ShareGPT split, chat
template, up to --sharegpt-output-len new tokens, stopping at EOS), `random` (random token ids,
--random-input-len / --random-output-len scaled by U[--random-range-ratio, 1], EOS ignored),
`generated-shared-prefix` (--gsp-num-groups system prompts of --gsp-system-prompt-len tokens, each
shared by --gsp-prompts-per-group questions of --gsp-question-len tokens, --gsp-output-len new tokens).
Requests arrive as a Poisson process at --request-rate (inf: all at once), at most --max-concurrency
in flight (a comma list runs each value in turn).

Prints one table row per (server, concurrency) and appends one JSON object per row to --output-file
(JSON lines) with: server (the --launch args or the base URL), backend, dataset, concurrency,
request_rate, completed, failed, duration_s, request_throughput (req/s), input_tok_s, output_tok_s,
total_tok_s, {ttft,itl,e2e}_ms_{mean,median,p99}, tokens_per_chunk (output tokens per streamed chunk:
above 1 when speculation emits several tokens per step), accept_length (server-reported: completion
tokens / verify steps, null without speculation), errors (up to 5 messages). Token counts are the
server's (meta_info completion_tokens, or the OpenAI `usage` chunk), never re-tokenized. Exit status 1
when a server fails to start or answer, or any request fails; each reason is printed, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm


@dataclass
class RequestInput:
    prompt_ids: list[int]
    prompt_text: str
    output_len: int
    ignore_eos: bool


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    chunks: int = 0
    verify_steps: int = 0


# ---------------------------------------------------------------------------------------------- data
def sharegpt_inputs(tokenizer, n: int, output_len: int) -> list[RequestInput]:
    from treespec.train.data import holdout_prompts

    ids = holdout_prompts(tokenizer, None, 500, n, max_prompt_tokens=512)
    return [RequestInput(p, tokenizer.decode(p), output_len, False) for p in ids]


def random_inputs(tokenizer, n: int, input_len: int, output_len: int, ratio: float, rng: random.Random) -> list[RequestInput]:
    vocab = tokenizer.vocab_size
    out = []
    for _ in range(n):
        ilen = max(1, int(input_len * rng.uniform(ratio, 1.0)))
        ids = [rng.randrange(100, vocab) for _ in range(ilen)]
        out.append(RequestInput(ids, tokenizer.decode(ids), max(1, int(output_len * rng.uniform(ratio, 1.0))), True))
    return out


def shared_prefix_inputs(tokenizer, groups: int, per_group: int, system_len: int, question_len: int,
                         output_len: int, rng: random.Random) -> list[RequestInput]:
    vocab = tokenizer.vocab_size
    out = []
    for _ in range(groups):
        system = [rng.randrange(100, vocab) for _ in range(system_len)]
        for _ in range(per_group):
            ids = system + [rng.randrange(100, vocab) for _ in range(question_len)]
            out.append(RequestInput(ids, tokenizer.decode(ids), output_len, True))
    rng.shuffle(out)
    return out


# ---------------------------------------------------------------------------------------------- clients
def _sse_payloads(line: str):
    if line.startswith("data:"):
        data = line[5:].strip()
        if data and data != "[DONE]":
            yield json.loads(data)


async def _http_error(resp: httpx.Response) -> str:
    return "" if resp.status_code == 200 else f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"


def _record_chunk(res: RequestResult, start: float, last: float) -> float:
    """A streamed chunk carrying new tokens arrived: TTFT for the first, an ITL gap after that."""
    now = time.perf_counter()
    if res.chunks == 0:
        res.ttft = now - start
    else:
        res.itls.append(now - last)
    res.chunks += 1
    return now


async def send_treespec(client: httpx.AsyncClient, url: str, req: RequestInput, temperature: float,
                        model: str | None) -> RequestResult:
    body = {"input_ids": req.prompt_ids, "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": temperature,
                                "ignore_eos": req.ignore_eos}}
    res, start, last, seen, meta = RequestResult(prompt_tokens=len(req.prompt_ids)), time.perf_counter(), 0.0, 0, {}
    async with client.stream("POST", f"{url}/generate", json=body) as resp:
        res.error = await _http_error(resp)
        if res.error:
            return res
        async for line in resp.aiter_lines():
            for chunk in _sse_payloads(line):
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                n = len(chunk.get("output_ids", []))
                if n > seen:  # a chunk carrying new tokens (several when speculation accepts drafts)
                    last, seen = _record_chunk(res, start, last), n
                meta = chunk.get("meta_info", meta)
    res.e2e = time.perf_counter() - start
    res.output_tokens = meta.get("completion_tokens", seen)
    res.verify_steps = meta.get("spec_verify_ct", 0)
    res.ok = True
    return res


async def send_openai(client: httpx.AsyncClient, url: str, req: RequestInput, temperature: float,
                      model: str | None) -> RequestResult:
    body = {"model": model or "default", "prompt": req.prompt_text, "max_tokens": req.output_len,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": req.ignore_eos}
    res, start, last, usage = RequestResult(prompt_tokens=len(req.prompt_ids)), time.perf_counter(), 0.0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        res.error = await _http_error(resp)
        if res.error:
            return res
        async for line in resp.aiter_lines():
            for chunk in _sse_payloads(line):
                usage = chunk.get("usage") or usage
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    last = _record_chunk(res, start, last)
    res.e2e = time.perf_counter() - start
    res.output_tokens = usage["completion_tokens"] if usage else res.chunks
    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens) if usage else res.prompt_tokens
    res.ok = True
    return res


async def run_once(send, url: str, inputs: list[RequestInput], concurrency: int, rate: float, temperature: float,
                   model: str | None, headers: dict, seed: int, progress: bool) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(inputs), disable=not progress, desc=f"concurrency {concurrency}", file=sys.stderr)
    limits = httpx.Limits(max_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), headers=headers, limits=limits) as client:
        async def one(req: RequestInput) -> RequestResult:
            async with limit:
                try:
                    result = await send(client, url, req, temperature, model)
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    result = RequestResult(error=f"{type(e).__name__}: {e}"[:200])
            bar.update(1)
            return result

        start, tasks = time.perf_counter(), []
        for req in inputs:
            tasks.append(asyncio.create_task(one(req)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


# ---------------------------------------------------------------------------------------------- metrics
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    out: dict = {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
                 "request_throughput": len(done) / duration if duration else 0.0}
    inp, outp = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    out.update(input_tok_s=inp / duration if duration else 0.0, output_tok_s=outp / duration if duration else 0.0,
               total_tok_s=(inp + outp) / duration if duration else 0.0)
    series = {"ttft": [r.ttft for r in done], "itl": [x for r in done for x in r.itls], "e2e": [r.e2e for r in done]}
    for name, values in series.items():
        ms = [v * 1e3 for v in values]
        out[f"{name}_ms_mean"] = statistics.fmean(ms) if ms else 0.0
        out[f"{name}_ms_median"] = percentile(ms, 50)
        out[f"{name}_ms_p99"] = percentile(ms, 99)
    chunks = sum(r.chunks for r in done)
    out["tokens_per_chunk"] = outp / chunks if chunks else 0.0
    verify = sum(r.verify_steps for r in done)
    spec_tokens = sum(r.output_tokens for r in done if r.verify_steps)
    out["accept_length"] = spec_tokens / verify if verify else None
    out["errors"] = [r.error for r in results if not r.ok][:5]
    return out


def print_row(row: dict) -> None:
    if not getattr(print_row, "header", False):
        print(f"{'server':<34} {'conc':>4} {'ok':>4} {'req/s':>6} {'out tok/s':>9} {'TTFT ms mean/p99':>17} "
              f"{'ITL ms mean/p99':>16} {'E2E ms mean/p99':>17} {'tok/chunk':>9} {'accept':>6}")
        print_row.header = True
    acc = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
    print(f"{row['server'][:34]:<34} {row['concurrency']:>4} {row['completed']:>4} {row['request_throughput']:6.2f} "
          f"{row['output_tok_s']:9.1f} {row['ttft_ms_mean']:8.0f}/{row['ttft_ms_p99']:<8.0f} "
          f"{row['itl_ms_mean']:7.0f}/{row['itl_ms_p99']:<8.0f} {row['e2e_ms_mean']:8.0f}/{row['e2e_ms_p99']:<8.0f} "
          f"{row['tokens_per_chunk']:9.2f} {acc:>6}", flush=True)
    for err in row["errors"]:
        print(f"    error: {err}")


# ---------------------------------------------------------------------------------------------- main
def build_inputs(args: argparse.Namespace, tokenizer) -> list[RequestInput]:
    rng = random.Random(args.seed)
    if args.dataset_name == "sharegpt":
        return sharegpt_inputs(tokenizer, args.num_prompts, args.sharegpt_output_len)
    if args.dataset_name == "random":
        return random_inputs(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, rng)
    return shared_prefix_inputs(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                                args.gsp_question_len, args.gsp_output_len, rng)


def check_server(url: str, backend: str, headers: dict) -> str | None:
    """None when the server answers, else a one-line reason. Any OpenAI server lists /v1/models; only
    ours (and SGLang) has /health."""
    route = "/health" if backend == "treespec" else "/v1/models"
    try:
        resp = httpx.get(f"{url}{route}", timeout=10, headers=headers)
    except httpx.HTTPError as e:
        return f"server at {url} is not reachable: {type(e).__name__}: {e}"
    return None if resp.status_code == 200 else f"GET {url}{route} answered HTTP {resp.status_code}: {resp.text[:200]}"


def load_tokenizer(name: str | None, url: str, headers: dict):
    """--tokenizer, else the served model's own when the server names a local folder (/get_model_info),
    else the embedded default model's: prompts are token ids, so they must match the server's vocabulary."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from treespec.model_loader import resolve_model_path

    if name is None:
        try:
            served = httpx.get(f"{url}/get_model_info", timeout=10, headers=headers).json().get("tokenizer_path")
            name = served if served and Path(served).is_dir() else None
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    return AutoTokenizer.from_pretrained(name or str(resolve_model_path(None)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="treespec", choices=["treespec", "openai"])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="openai backend: model name")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded default model's)")
    p.add_argument("--launch", action="append", default=None,
                   help="start our server with these args (repeatable: each is benchmarked in turn)")
    p.add_argument("--dataset-name", default="sharegpt", choices=["sharegpt", "random", "generated-shared-prefix"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--sharegpt-output-len", type=int, default=128)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=4)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", default="1,4,16", help="in-flight limit; a comma list sweeps")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default="bench_serving.jsonl")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    print_row.header = False  # a new table per run

    concurrencies = [int(c) for c in args.max_concurrency.split(",")]
    send = send_treespec if args.backend == "treespec" else send_openai
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    inputs: list[RequestInput] | None = None  # built once, from the first server that answers
    failed = 0
    for launch in args.launch or [None]:
        server, url, label = None, args.base_url, args.base_url
        try:
            if launch is not None:
                from treespec.server.testing import popen_launch_server

                label = launch or "(defaults)"
                print(f"launching server: {label}", file=sys.stderr, flush=True)
                try:
                    server = popen_launch_server(shlex.split(launch), api_key=args.api_key)
                except RuntimeError as e:  # exited or never healthy: the log tail says why
                    print(f"error: server '{label}' failed to start: {e}", file=sys.stderr)
                    failed += 1
                    continue
                url = server.base_url
            error = check_server(url, args.backend, headers)
            if error:
                print(f"error: {error}", file=sys.stderr)
                failed += 1
                continue
            if inputs is None:
                inputs = build_inputs(args, load_tokenizer(args.tokenizer, url, headers))
                print(f"{len(inputs)} prompts ({args.dataset_name}), rate {args.request_rate}, backend {args.backend}")
            asyncio.run(run_once(send, url, inputs[:1], 1, float("inf"), args.temperature, args.model, headers,
                                 args.seed, False))  # warm-up
            for conc in concurrencies:
                results, duration = asyncio.run(run_once(send, url, inputs, conc, args.request_rate, args.temperature,
                                                         args.model, headers, args.seed, not args.disable_tqdm))
                row = {"server": label, "backend": args.backend, "dataset": args.dataset_name, "concurrency": conc,
                       "request_rate": None if args.request_rate == float("inf") else args.request_rate,
                       **summarize(results, duration)}
                failed += row["failed"]
                print_row(row)
                with open(args.output_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
        finally:
            if server is not None:
                server.terminate()
    if inputs is not None:
        print(f"appended rows to {args.output_file}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
