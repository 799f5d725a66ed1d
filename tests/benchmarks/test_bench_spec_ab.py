"""bench_spec_ab: saved prompts (built once where the workloads' data is, replayed where it is not) and
the concurrent passes' order (no server holds the faster places more often), repeated launches and their
spread."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import bench_spec_ab  # noqa: E402


def test_saved_prompts_round_trip_and_missing_workload_is_an_error(tmp_path, capsys):
    path = tmp_path / "prompts.json"
    assert bench_spec_ab.main(["--save-prompts", str(path), "--workloads", "code_edit", "--num-prompts", "2"]) == 0
    saved = json.loads(path.read_text())
    assert list(saved) == ["code_edit"] and len(saved["code_edit"]) == 2
    assert all(isinstance(t, int) for ids in saved["code_edit"] for t in ids)
    with pytest.raises(SystemExit):  # a workload the file lacks: a CLI error naming --prompts, no server started
        bench_spec_ab.main(["--prompts", str(path), "--workloads", "chat"])
    assert "--prompts" in capsys.readouterr().err


@pytest.mark.parametrize("launch_orders", [1, 2])
def test_concurrent_passes_give_each_server_the_outer_places_as_often_as_the_inner(launch_orders):
    launches = bench_spec_ab.LAUNCH_ORDERS[:launch_orders]
    places = {"plain": [0, 0], "spec": [0, 0]}  # [outer, inner] places of each group of four
    for order in launches:
        passes = bench_spec_ab.concurrent_pass_order(order, launch_orders)
        assert len(passes) % 4 == 0 and passes.count("plain") == passes.count("spec")
        for i, name in enumerate(passes):
            places[name][0 if i % 4 in (0, 3) else 1] += 1
    assert places["plain"] == places["spec"] and places["spec"][0] == places["spec"][1]


def test_groups_below_one_is_a_cli_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):  # no server started
        bench_spec_ab.main(["--groups", "0"])
    assert "--groups" in capsys.readouterr().err


def test_launches_alternate_the_orders_and_each_counts_once_in_the_row(capsys):
    assert bench_spec_ab.launch_sequence(2, 3) == [("plain", "spec"), ("spec", "plain")] * 3
    assert bench_spec_ab.launch_sequence(1, 2) == [("plain", "spec")] * 2
    ratios = [0.9, 1.0, 1.1, 1.2]
    runs = [{"workload": "chat", "mode": "c16", "prompts": 2, "plain_tok_s": 100.0, "spec_tok_s": 100.0 * r,
             "ratio": r, "accept_length": 2.0, "spec_steps": 10, "accepted_drafts_by_source": {"ngram": 5},
             "equal": 2} for r in ratios]
    row = bench_spec_ab.combine(runs)
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 4
    assert row["ratio"] == pytest.approx(math.exp(mean))
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert row["launch_spread"] == pytest.approx(math.exp(sd / 2))
    assert row["ratios_by_launch"] == ratios and row["prompts"] == 8 and row["equal"] == 8
    assert row["accepted_drafts_by_source"] == {"ngram": 20} and row["accept_length"] == pytest.approx(2.0)
    assert bench_spec_ab.launch_spread([1.05]) is None and bench_spec_ab.launch_spread([1.0, 1.0]) == 1.0
    bench_spec_ab.print_row(row)
    assert "over 4 launches, 0.900-1.200" in capsys.readouterr().out


def test_launches_below_one_is_a_cli_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):  # no server started
        bench_spec_ab.main(["--launches", "0"])
    assert "--launches" in capsys.readouterr().err
