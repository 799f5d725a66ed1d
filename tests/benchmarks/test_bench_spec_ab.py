"""bench_spec_ab: saved prompts (built once where the workloads' data is, replayed where it is not) and
the concurrent passes' order (no server holds the faster places more often)."""

from __future__ import annotations

import json
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
