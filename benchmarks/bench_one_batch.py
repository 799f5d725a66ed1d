"""Static-batch latency: prefill and decode tokens/s of treespec vs transformers' generate, side by
side in one run, on the same model, dtype and prompts.

    python benchmarks/bench_one_batch.py                      # default model, fp32 + bf16, bs 1 and 8
    python benchmarks/bench_one_batch.py --dtypes float32 --batch-sizes 1 --output-len 32
    python benchmarks/bench_one_batch.py --speculative-algorithm auto   # the server's default (NGRAM)

treespec decodes plainly unless --speculative-algorithm says otherwise (the ceiling columns assume one
token per step). Prints a table and writes JSON (one object per (dtype, batch size) row) to --json.
Decode tokens/s = batch * (output_len - 1) / (time(output_len tokens) - time(1 token)), so the
prefill is subtracted out; each number is the median of --repeats runs, ours and transformers'
interleaved so that machine noise hits both alike.

The roofline columns bound what any runtime can reach: a decode step streams every weight from memory
once, so decode tok/s <= batch * bandwidth / weight bytes, with the bandwidth measured here by a large
matrix-vector product. "vs hf" is that bound over transformers' measured decode: a runtime speed-up
over transformers above it is impossible on this machine.

The ceiling columns judge our own decode against the memory: "read GB/s" is this machine's read
bandwidth (the best of several sums over a 1 GiB array), "MB/tok" the bytes our batch-1 decode step
streams (the packed matmul weights as laid out for our kernels, e.g. GGUF block codes and scales, plus
the norms and the KV of the mean context), "ceiling" read bandwidth / those bytes, and "share" our
measured batch-1 decode tok/s over that ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def time_ours(engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def time_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def weight_stream_gb_s(dtype: torch.dtype, repeats: int = 5) -> float:
    """Memory bandwidth as a batch-1 decode sees it: matrix-vector products over 280 MB of weights
    (far more than the caches), the faster of MKL (F.linear) and the packed layout our matmuls use here."""
    from treespec.models.packed_linear import pack_weight, packed_linear, packing_layout

    weights = [torch.randn(3072, 576).to(dtype) for _ in range(280_000_000 // (3072 * 576 * 4))]
    x = torch.randn(1, 576).to(dtype)
    ways = {"mkl": [lambda w=w: torch.nn.functional.linear(x, w) for w in weights]}
    layout = packing_layout(torch.device("cpu"), dtype)
    if layout is not None:
        ways[layout] = [lambda p=pack_weight(w, layout): packed_linear(x, p, None) for w in weights]
    best = 0.0
    for calls in ways.values():
        for call in calls:
            call()
        start = time.perf_counter()
        for _ in range(repeats):
            for call in calls:
                call()
        seconds = (time.perf_counter() - start) / repeats
        best = max(best, sum(w.numel() * w.element_size() for w in weights) / seconds / 1e9)
    return best


def read_bandwidth_gb_s(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth: the best of `repeats` sums over a `gib` GiB fp32 array (far larger than caches)."""
    data = torch.ones(int(gib * 2**30) // 4)
    data.sum()  # first touch
    best = min(_timed(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best / 1e9


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def streamed_bytes_per_token(model: torch.nn.Module, kv_bytes_per_position: int, context_len: int) -> int:
    """Bytes one batch-1 decode step of our model reads: every matmul weight in the layout our kernels
    stream (packed data and block scales; a dense weight where nothing is packed), the other parameters
    a step reads (norms, biases; of the embedding only one row), and the KV of `context_len` positions."""
    from treespec.models.packed_linear import PackedLinear, PackedWeight

    def packed_bytes(p: PackedWeight) -> int:
        return p.data.numel() * p.data.element_size()

    total = 0
    packed_head = getattr(model, "packed_lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    skip = {id(embed.weight)} if embed is not None else set()
    if packed_head is not None:
        total += packed_bytes(packed_head)
        skip.add(id(model.lm_head_weight))  # the dense copy is kept for drafts, not read here
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += packed_bytes(module.packed)
    for param in {id(p): p for p in model.parameters()}.values():
        if id(param) not in skip:
            total += param.numel() * param.element_size()
    if embed is not None:
        total += embed.weight[0].numel() * embed.weight.element_size()
    return total + kv_bytes_per_position * context_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculative-algorithm", default="NONE",
                        help="treespec's (NONE, auto, EAGLE, EAGLE3, NGRAM); default NONE: plain decoding")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    parser.add_argument("--json", default="bench_one_batch.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from treespec.engine import Engine

    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    rows = []
    for dtype in args.dtypes.split(","):
        engine = Engine(model_path=args.model_path, dtype=dtype, disable_radix_cache=True, max_total_tokens=16384,
                        num_threads=args.num_threads, speculative_algorithm=args.speculative_algorithm)
        hf = AutoModelForCausalLM.from_pretrained(engine.scheduler.model_dir, dtype=getattr(torch, dtype)).eval()
        vocab = engine.scheduler.vocab_size
        # Roofline: a batch-1 decode step reads every weight once, so it cannot beat bytes / bandwidth.
        weight_gb = sum(p.numel() * p.element_size() for p in hf.parameters()) / 1e9
        bandwidth = weight_stream_gb_s(getattr(torch, dtype))
        read_gb_s = read_bandwidth_gb_s()
        cfg = engine.scheduler.model_config
        kv_per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        mean_context = args.input_len + args.output_len // 2
        stream_bytes = streamed_bytes_per_token(engine.scheduler.runner.model, kv_per_position, mean_context)
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            gen = torch.Generator().manual_seed(bs)
            prompts = torch.randint(100, vocab, (bs, args.input_len), generator=gen).tolist()
            time_ours(engine, prompts, 2)  # warm-up
            time_hf(hf, prompts, 2)
            t = {"ours_1": [], "ours_n": [], "hf_1": [], "hf_n": []}
            for _ in range(args.repeats):
                t["ours_1"].append(time_ours(engine, prompts, 1))
                t["hf_1"].append(time_hf(hf, prompts, 1))
                t["ours_n"].append(time_ours(engine, prompts, args.output_len))
                t["hf_n"].append(time_hf(hf, prompts, args.output_len))
            med = {k: statistics.median(v) for k, v in t.items()}
            decoded = bs * (args.output_len - 1)
            row = {
                "dtype": dtype, "batch_size": bs, "input_len": args.input_len, "output_len": args.output_len,
                "threads": torch.get_num_threads(), "speculative_algorithm": args.speculative_algorithm,
                "treespec_prefill_tok_s": bs * args.input_len / med["ours_1"],
                "hf_prefill_tok_s": bs * args.input_len / med["hf_1"],
                "treespec_decode_tok_s": decoded / max(med["ours_n"] - med["ours_1"], 1e-9),
                "hf_decode_tok_s": decoded / max(med["hf_n"] - med["hf_1"], 1e-9),
            }
            row["decode_speedup"] = row["treespec_decode_tok_s"] / row["hf_decode_tok_s"]
            row["weight_gb"], row["bandwidth_gb_s"] = weight_gb, bandwidth
            # the most batch-1 decode steps per second any runtime can do here (bs>1 reads weights once too)
            row["roofline_decode_tok_s"] = bs * bandwidth / weight_gb
            row["roofline_vs_hf"] = row["roofline_decode_tok_s"] / row["hf_decode_tok_s"]
            row["prefill_speedup"] = row["treespec_prefill_tok_s"] / row["hf_prefill_tok_s"]
            row["read_bandwidth_gb_s"], row["streamed_mb_per_token"] = read_gb_s, stream_bytes / 1e6
            row["bandwidth_ceiling_tok_s"] = read_gb_s * 1e9 / stream_bytes  # one sequence: batch 1
            row["ceiling_share"] = row["treespec_decode_tok_s"] / bs / row["bandwidth_ceiling_tok_s"]
            rows.append(row)
            print_row(row)
        del engine, hf
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"\nwrote {args.json}")


def print_row(row: dict) -> None:
    if not getattr(print_row, "header", False):
        print(f"{'dtype':>9} {'bs':>3} | {'prefill tok/s':>27} | {'decode tok/s':>27} | {'roofline':>17} |"
              f" {'bandwidth ceiling, per sequence':>37}")
        print(f"{'':>9} {'':>3} | {'treespec':>9} {'hf':>8} {'ratio':>7} | {'treespec':>9} {'hf':>8} {'ratio':>7} |"
              f" {'tok/s':>7} {'vs hf':>8} | {'read GB/s':>9} {'MB/tok':>7} {'ceiling':>8} {'share':>7}")
        print_row.header = True
    print(f"{row['dtype']:>9} {row['batch_size']:>3} | {row['treespec_prefill_tok_s']:9.1f} {row['hf_prefill_tok_s']:8.1f} "
          f"{row['prefill_speedup']:6.2f}x | {row['treespec_decode_tok_s']:9.1f} {row['hf_decode_tok_s']:8.1f} "
          f"{row['decode_speedup']:6.2f}x | {row['roofline_decode_tok_s']:7.1f} {row['roofline_vs_hf']:7.2f}x |"
          f" {row['read_bandwidth_gb_s']:9.1f} {row['streamed_mb_per_token']:7.1f} {row['bandwidth_ceiling_tok_s']:8.1f}"
          f" {row['ceiling_share']:6.0%}", flush=True)


if __name__ == "__main__":
    main()
