"""The tuner's output: the best setting per measured batch size becomes a valid --speculative-config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from treespec.speculative.shapes import SpecSchedule, SpecShape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loader import load_benchmark  # noqa: E402


def load_bench():
    return load_benchmark("bench_speculative")


def test_schedule_from_best_round_trips_through_the_server_parser(tmp_path) -> None:
    bench = load_bench()
    best = {1: {"setting": [5, 4, 8], "speedup": 1.6}, 4: {"setting": [3, 1, 4], "speedup": 1.2}, 16: None}
    schedule = bench.schedule_from_best(best)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(schedule))
    parsed = SpecSchedule.from_file(path)
    assert parsed.shape_for(1) == SpecShape(5, 4, 8)
    assert parsed.shape_for(2) == parsed.shape_for(4) == SpecShape(3, 1, 4)
    assert parsed.shape_for(5).num_steps == 0 and parsed.shape_for(64).num_steps == 0  # plain won at 16
    # when speculation also wins at the largest measured size, it covers every larger batch too
    wide = SpecSchedule.from_file(_write(tmp_path, bench.schedule_from_best({1: best[1], 8: best[4]})))
    assert wide.shape_for(100) == SpecShape(3, 1, 4)


def _write(tmp_path: Path, schedule: dict) -> Path:
    path = tmp_path / "other.json"
    path.write_text(json.dumps(schedule))
    return path
