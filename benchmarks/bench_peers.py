"""treespec against llama.cpp's `llama-server` on the same GGUF, side by side (greedy, served over HTTP).

    python benchmarks/bench_peers.py --llama-server /path/to/llama-server     # the embedded default GGUF
    python benchmarks/bench_peers.py --gguf model.Q4_1.gguf --num-prompts 16 --passes 2
    python benchmarks/bench_peers.py                  # llama-server from PATH; without one, treespec alone

Systems, all serving the same file at once (an idle server uses no CPU): treespec plain
(`--speculative-algorithm NONE`), treespec with its defaults (NGRAM at batch 1 for the embedded
model), and `llama-server -m FILE -t THREADS -c 16384 -np 16` (how to build it: docs/performance.md).
Prompts: held-out ShareGPT chat turns (benchmarks/spec_workloads.py `chat`), chat-templated ids sent as
ids to every system, so tokenization cannot differ. Batch 1: each prompt goes to every system in turn,
the order rotating prompt by prompt, so machine drift hits all alike. Concurrency c: all prompts at most
c in flight, whole passes in the order A B C C B A. With --passes N every pass takes its own prompts
(a repeated prompt would be drafted from its own earlier answer by the default's n-gram corpus). Tokens/s = completion tokens / wall time of the
requests (prefill included), each system stopping at its own EOS or `--max-new-tokens`. "equal" counts
prompts whose greedy token ids equal treespec plain's (llama.cpp's Q4_1 path quantizes activations to
8 bits, so its text may differ). Prints a table with the host's CPU model and flags and each system's
version; writes --json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec_ab import cpu_flags  # noqa: E402
from spec_workloads import workload_prompts  # noqa: E402


@dataclass
class System:
    """One served system: where it listens and how to ask it for a greedy completion."""
    name: str
    base_url: str
    kind: str  # "treespec" | "llama.cpp"
    version: str
    stop: object  # callable that shuts it down


@dataclass(frozen=True)
class Completion:
    ids: list[int]
    seconds: float


async def complete(client: httpx.AsyncClient, system: System, ids: list[int], max_new: int) -> Completion:
    """One greedy completion of prompt `ids` from `system`."""
    start = time.perf_counter()
    if system.kind == "treespec":
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}
        resp = await client.post(f"{system.base_url}/generate", json=body)
        resp.raise_for_status()
        out = resp.json()["output_ids"]
    else:
        body = {"prompt": ids, "n_predict": max_new, "temperature": 0, "top_k": 1, "return_tokens": True,
                "cache_prompt": True}
        resp = await client.post(f"{system.base_url}/completion", json=body)
        resp.raise_for_status()
        out = resp.json()["tokens"]
    return Completion(list(out), time.perf_counter() - start)


async def batch1(systems: list[System], prompts: list[list[int]], max_new: int) -> dict[str, list[Completion]]:
    outs: dict[str, list[Completion]] = {s.name: [] for s in systems}
    async with httpx.AsyncClient(timeout=3600) as client:
        for i, ids in enumerate(prompts):
            k = i % len(systems)
            for system in systems[k:] + systems[:k]:
                outs[system.name].append(await complete(client, system, ids, max_new))
    return outs


async def concurrent(system: System, prompts: list[list[int]], max_new: int, conc: int) -> tuple[list[Completion], float]:
    limit = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=3600) as client:
        async def one(ids):
            async with limit:
                return await complete(client, system, ids, max_new)

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return list(outs), time.perf_counter() - start


def summarize(mode: str, outs: dict[str, list[Completion]], secs: dict[str, float]) -> list[dict]:
    """One row per system: tokens/s, ratio to llama.cpp (if it ran) and to treespec plain, equal outputs."""
    tok_s = {k: sum(len(c.ids) for c in v) / max(secs[k], 1e-9) for k, v in outs.items()}
    ref = outs.get("treespec-plain")
    rows = []
    for name, comps in outs.items():
        equal = sum(a.ids == b.ids for a, b in zip(comps, ref, strict=True)) if ref else None
        rows.append({"mode": mode, "system": name, "prompts": len(comps), "tokens": sum(len(c.ids) for c in comps),
                     "seconds": round(secs[name], 3), "tok_s": round(tok_s[name], 2),
                     "vs_llama_cpp": round(tok_s[name] / tok_s["llama.cpp"], 3) if "llama.cpp" in tok_s else None,
                     "vs_plain": round(tok_s[name] / tok_s["treespec-plain"], 3) if "treespec-plain" in tok_s else None,
                     "equal_to_plain": equal})
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        vs_l = f"{r['vs_llama_cpp']:.2f}x" if r["vs_llama_cpp"] is not None else "-"
        vs_p = f"{r['vs_plain']:.2f}x" if r["vs_plain"] is not None else "-"
        print(f"{r['mode']:<5} {r['system']:<17} {r['prompts']:>3} {r['tokens']:>6} {r['tok_s']:>8.1f} "
              f"{vs_l:>8} {vs_p:>8} {r['equal_to_plain']:>3}/{r['prompts']}", flush=True)


def find_llama_server(flag: str | None) -> str | None:
    """The llama-server binary: the flag's path (must exist), else PATH, else None."""
    if flag:
        if not Path(flag).is_file():
            raise SystemExit(f"--llama-server {flag!r} does not exist")
        return flag
    return shutil.which("llama-server")


def llama_cpp_version(binary: str) -> str:
    try:
        res = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("version")]
    return lines[0].split(":", 1)[1].strip() if lines else "unknown"


def start_llama_server(binary: str, gguf: Path, threads: int, extra: str, version: str | None = None,
                       timeout: float = 600) -> System:
    from treespec.server.testing import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="llama-server-", suffix=".log", delete=False)
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-c", "16384", "-np", "16", "--host", "127.0.0.1",
           "--port", str(port), *shlex.split(extra)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return System("llama.cpp", url, "llama.cpp", version or llama_cpp_version(binary), stop)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop()
    raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s; log: {log.name}")


def start_treespec(name: str, flags: list[str]) -> System:
    from treespec.server.testing import popen_launch_server

    server = popen_launch_server(flags)
    return System(name, server.base_url, "treespec", importlib.metadata.version("treespec"), server.terminate)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="the GGUF every system serves (default: the embedded model's)")
    p.add_argument("--llama-server", default=None, help="path of llama-server (default: PATH; none: treespec alone)")
    p.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. '--spec-type ngram-simple'")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--llama-version", default=None,
                   help="llama.cpp's version as reported (a build from the PyPI sdist reports build 0)")
    p.add_argument("--treespec-args", default="", help="extra flags for both treespec servers")
    p.add_argument("--no-default", action="store_true", help="skip the treespec server with default flags")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="16", help="comma list; empty: batch 1 only")
    p.add_argument("--passes", type=int, default=1, help="repeat every measurement this many times")
    p.add_argument("--json", default="bench_peers.json")
    args = p.parse_args(argv)

    from treespec.model_loader import find_default_gguf
    from treespec.tokenizer import load_tokenizer

    gguf = Path(args.gguf) if args.gguf else find_default_gguf()
    binary = find_llama_server(args.llama_server)
    if binary is None:
        print("no llama-server (give --llama-server or put it on PATH; docs/performance.md says how to build "
              "it): measuring treespec alone", flush=True)
    concs = [int(c) for c in args.concurrency.split(",") if c]
    # the embedded model is served without --model-path: that is what selects its shipped draft head
    common = (["--model-path", str(gguf)] if args.gguf else []) + shlex.split(args.treespec_args)
    systems: list[System] = []
    try:
        systems.append(start_treespec("treespec-plain", [*common, "--speculative-algorithm", "NONE"]))
        if not args.no_default:
            systems.append(start_treespec("treespec-default", common))
        if binary:
            systems.append(start_llama_server(binary, gguf, args.threads, args.llama_args, args.llama_version))
        model = httpx.get(f"{systems[0].base_url}/model_info", timeout=60).json()
        tokenizer = load_tokenizer(model["tokenizer_path"] or model["model_path"])
        # each pass its own prompts: the default server's n-gram corpus remembers earlier outputs, so a
        # repeated prompt would be drafted from its own previous answer (measured: 1.9x plain, not 1.0x)
        all_prompts = workload_prompts("chat", tokenizer, args.num_prompts * args.passes)
        prompts = all_prompts[: args.num_prompts]
        host = cpu_flags()
        print(f"host: {host}\nfile: {gguf}\n" + "\n".join(f"{s.name}: {s.version}" for s in systems)
              + f"\n{len(prompts)} held-out chat prompts per pass, up to {args.max_new_tokens} new tokens, greedy, "
              f"{args.passes} pass(es) on distinct prompts", flush=True)
        warm = [tokenizer.encode("Hello there.")]  # not a measured prompt: nothing of it in any cache
        for s in systems:  # warm-up: kernels, allocators, first-request paths
            asyncio.run(concurrent(s, warm, 8, 1))
        print(f"{'mode':<5} {'system':<17} {'n':>3} {'tokens':>6} {'tok/s':>8} {'vs l.cpp':>8} {'vs plain':>8} equal")
        rows = []
        for pass_index in range(args.passes):
            prompts = all_prompts[pass_index * args.num_prompts : (pass_index + 1) * args.num_prompts]
            outs = asyncio.run(batch1(systems, prompts, args.max_new_tokens))
            secs = {k: sum(c.seconds for c in v) for k, v in outs.items()}
            rows += summarize("bs1", outs, secs)
            print_rows(rows[-len(systems):])
            for conc in concs:
                outs, secs = {}, Counter()
                for s in systems + systems[::-1]:  # A B C C B A
                    got, dt = asyncio.run(concurrent(s, prompts, args.max_new_tokens, conc))
                    outs[s.name] = got  # greedy: both passes give the same outputs
                    secs[s.name] += dt / 2
                rows += summarize(f"c{conc}", outs, secs)
                print_rows(rows[-len(systems):])
        Path(args.json).write_text(json.dumps({
            "host": host, "gguf": str(gguf), "versions": {s.name: s.version for s in systems},
            "llama_args": args.llama_args, "treespec_args": args.treespec_args, "passes": args.passes,
            "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    finally:
        for s in systems:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
