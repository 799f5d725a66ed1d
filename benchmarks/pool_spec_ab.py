"""Pool several runs of bench_spec_ab.py: every launch of every file, per cell, as one row.

    python benchmarks/pool_spec_ab.py benchmarks/results/zen4-2026-12-07/*.json \\
        --target bs1:chat=1.3 --target bs1:code_edit=2.0 --target c4=0.98 --target c16=0.98

One launch of bench_spec_ab.py (a new pair of servers) reads a cell's ratio +-4-6 % on the 2-vCPU VMs,
more than some cells' margin to their target, so single tables pass or miss such a cell by chance.
This reads the JSON of runs made with the same flags (`plain_args`, `spec_args`, `max_new_tokens`;
files that differ are an error naming the file) and pools each cell's launches (`rows_by_launch_order`):
the ratio is their geometric mean, with its standard error as a factor (x/ s), the lowest and highest
launch, and `lower` = mean / s^2 (two standard errors below). `--target MODE[:WORKLOAD]=RATIO` says, per
cell it covers, "meets" (lower >= target), "on the line" (mean >= target > lower) or "misses" (mean
below). Prints a table and writes --json. Starts no server.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec_ab import combine, print_row  # noqa: E402

SAME_FLAGS = ("plain_args", "spec_args", "max_new_tokens")


def parse_target(text: str) -> tuple[str, str | None, float]:
    """'bs1:chat=1.3' -> ('bs1', 'chat', 1.3); 'c16=0.98' -> ('c16', None, 0.98) (every workload)."""
    cell, sep, value = text.partition("=")
    mode, _, workload = cell.partition(":")
    try:
        ratio = float(value)
    except ValueError:
        ratio = 0.0
    if not sep or not mode or not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"--target: expected MODE[:WORKLOAD]=RATIO (e.g. bs1:chat=1.3 or c16=0.98), "
                         f"got {text!r}")
    return mode, workload or None, ratio


def launch_rows(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Every launch's row of every run, by (workload, mode), in file and launch order."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        for rows in run["rows_by_launch_order"].values():
            for row in rows:
                cells.setdefault((row["workload"], row["mode"]), []).append(row)
    return cells


def pooled_lower(row: dict) -> float:
    """Two standard errors below the pooled ratio (the ratio itself where one launch gives no spread)."""
    spread = row.get("launch_spread")
    return row["ratio"] / spread**2 if spread else row["ratio"]


def verdict(row: dict, target: float) -> str:
    """Per cell against `target`: its lower bound (`row["lower"]`, pooled_lower) at or over it, its mean
    only, or neither."""
    if row["lower"] >= target:
        return "meets"
    return "on the line" if row["ratio"] >= target else "misses"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="bench_spec_ab.py --json outputs, all made with the same flags")
    p.add_argument("--target", action="append", default=[], metavar="MODE[:WORKLOAD]=RATIO",
                   help="a cell's target ratio (MODE bs1, c4, ...; no WORKLOAD: every workload), repeatable")
    p.add_argument("--json", default="pool_spec_ab.json")
    args = p.parse_args(argv)
    try:
        targets = [parse_target(t) for t in args.target]
    except ValueError as err:
        p.error(str(err))
    runs = []
    for name in args.files:
        try:
            run = json.loads(Path(name).read_text())
        except (OSError, json.JSONDecodeError) as err:
            p.error(f"{name}: not a readable bench_spec_ab.py JSON ({err})")
        if "rows_by_launch_order" not in run:
            p.error(f"{name}: no rows_by_launch_order (not a bench_spec_ab.py JSON)")
        differing = [k for k in SAME_FLAGS if runs and run.get(k) != runs[0].get(k)]
        if differing:
            p.error(f"{name}: {', '.join(differing)} differ from {args.files[0]}'s: "
                    "pool runs of one configuration")
        runs.append(run)
    hosts = sorted({run.get("host", "?") for run in runs})
    first = runs[0]
    print(f"{len(runs)} runs; plain: {first['plain_args'] or '(defaults)'} | "
          f"spec: {first['spec_args'] or '(defaults)'}; {first['max_new_tokens']} new tokens")
    for host in hosts:
        print(f"host ({sum(run.get('host', '?') == host for run in runs)} runs): {host}")
    rows = [combine(launches) for launches in launch_rows(runs).values()]
    for row in rows:
        print_row(row)
        row["lower"] = pooled_lower(row)
        row["targets"] = {}
    for mode, workload, target in targets:
        covered = [r for r in rows if r["mode"] == mode and workload in (None, r["workload"])]
        if not covered:
            p.error(f"--target {mode}{':' + workload if workload else ''}: no such cell in these runs")
        for row in covered:
            said = row["targets"][str(target)] = verdict(row, target)
            launches = len(row.get("ratios_by_launch", [row["ratio"]]))
            print(f"target {row['workload']} {mode} >= {target}: {said} (mean "
                  f"{row['ratio']:.3f}, two standard errors below {row['lower']:.3f}, {launches} launches)")
    flags = {k: first.get(k) for k in SAME_FLAGS}
    pooled = {"files": args.files, "hosts": hosts, **flags, "rows": rows}
    Path(args.json).write_text(json.dumps(pooled, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
