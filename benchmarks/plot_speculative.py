"""Plot bench_speculative.py results: output tokens/s vs batch size for plain decoding and each draft
head's best setting, and accept-length histograms (tokens emitted per verify step) at batch 1.

    python benchmarks/bench_speculative.py --algorithm EAGLE3 --json eagle3.json
    python benchmarks/bench_speculative.py --algorithm EAGLE --json eagle.json
    python benchmarks/plot_speculative.py eagle3.json eagle.json --output speculative.png
"""

from __future__ import annotations

import argparse
import json

LABELS = {"EAGLE3": "EAGLE-3", "EAGLE": "EAGLE"}


def best_per_batch(rows: list[dict]) -> dict[int, dict]:
    """Per batch size the fastest speculative row."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["setting"] is not None and r["output_tok_s"] > best.get(r["batch_size"], {}).get("output_tok_s", 0):
            best[r["batch_size"]] = r
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="bench_speculative.py JSON files (one per algorithm)")
    parser.add_argument("--output", default="speculative.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    results = [json.load(open(path)) for path in args.inputs]
    fig, (speed, hist) = plt.subplots(1, 2, figsize=(11, 4.2))
    plain = {r["batch_size"]: r["output_tok_s"] for r in results[0]["rows"] if r["setting"] is None}
    sizes = sorted(plain)
    speed.plot(sizes, [plain[b] for b in sizes], "o-", color="gray", label="no speculation")
    width = 0.8 / len(results)
    for i, res in enumerate(results):
        label = LABELS.get(res["algorithm"], res["algorithm"])
        best = best_per_batch(res["rows"])
        bs = sorted(best)
        speed.plot(bs, [best[b]["output_tok_s"] for b in bs], "o-", label=f"{label} (best setting per batch)")
        one = best.get(1)
        if one and one.get("accept_histogram"):
            counts = {int(k): v for k, v in one["accept_histogram"].items()}
            total = sum(counts.values())
            xs = sorted(counts)
            hist.bar([x + (i - (len(results) - 1) / 2) * width for x in xs], [counts[x] / total for x in xs],
                     width=width, label=f"{label} {tuple(one['setting'])}, mean {one['accept_length']:.2f}")
    speed.set(xscale="log", xlabel="batch size", ylabel="output tokens/s", title="Decoding throughput (greedy)")
    speed.minorticks_off()
    speed.set_xticks(sizes, [str(b) for b in sizes])
    speed.legend()
    hist.set(xlabel="tokens emitted per verify step", ylabel="fraction of steps", title="Accept length, batch 1")
    hist.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
