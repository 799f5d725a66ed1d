"""pool_spec_ab: every launch of several bench_spec_ab runs pooled per cell, and the target verdicts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import pool_spec_ab  # noqa: E402


def launch_row(workload: str, mode: str, ratio: float) -> dict:
    return {"workload": workload, "mode": mode, "prompts": 2, "plain_tok_s": 100.0,
            "spec_tok_s": 100.0 * ratio, "ratio": ratio, "accept_length": 2.0, "spec_steps": 10,
            "accepted_drafts_by_source": {"ngram": 5}, "equal": 2}


def write_run(path: Path, launches: dict[str, list[tuple[str, str, float]]], spec_args: str = "") -> str:
    by_launch = {k: [launch_row(*cell) for cell in v] for k, v in launches.items()}
    run = {"host": "test", "plain_args": "--speculative-algorithm NONE", "spec_args": spec_args,
           "max_new_tokens": 160, "rows": [], "rows_by_launch_order": by_launch}
    path.write_text(json.dumps(run))
    return str(path)


def test_launches_of_every_file_pool_per_cell_with_verdicts(tmp_path, capsys):
    a = write_run(tmp_path / "a.json", {"plain_first": [("chat", "c16", 0.95), ("chat", "bs1", 1.5)],
                                        "spec_first": [("chat", "c16", 1.05), ("chat", "bs1", 1.6)]})
    b = write_run(tmp_path / "b.json", {"plain_first_1": [("chat", "c16", 1.00)],
                                        "spec_first_1": [("chat", "c16", 1.02)]})
    out_json = tmp_path / "pool.json"
    assert pool_spec_ab.main([a, b, "--target", "c16=0.9", "--target", "c16=1.0", "--target", "bs1:chat=1.6",
                              "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    rows = {(r["workload"], r["mode"]): r for r in json.loads(out_json.read_text())["rows"]}
    c16 = rows[("chat", "c16")]
    logs = [math.log(r) for r in (0.95, 1.05, 1.00, 1.02)]  # both files' launches, in file order
    assert c16["ratios_by_launch"] == [0.95, 1.05, 1.00, 1.02] and c16["prompts"] == 8 and c16["equal"] == 8
    assert c16["ratio"] == pytest.approx(math.exp(sum(logs) / 4))
    assert c16["lower"] == pytest.approx(c16["ratio"] / c16["launch_spread"] ** 2) and c16["lower"] < 0.98
    # 0.9 sits below two standard errors under the mean, 1.0 between them and the mean (1.004)
    assert c16["targets"] == {"0.9": "meets", "1.0": "on the line"}
    assert rows[("chat", "bs1")]["targets"] == {"1.6": "misses"}  # mean 1.549 of 1.5 and 1.6
    assert "target chat c16 >= 1.0: on the line" in printed and "over 4 launches, 0.950-1.050" in printed


def test_runs_of_other_flags_are_an_error_naming_the_file(tmp_path, capsys):
    a = write_run(tmp_path / "a.json", {"plain_first": [("chat", "c16", 1.0)]})
    b = write_run(tmp_path / "b.json", {"plain_first": [("chat", "c16", 1.0)]},
                  spec_args="--speculative-algorithm NONE")
    with pytest.raises(SystemExit):
        pool_spec_ab.main([a, b, "--json", str(tmp_path / "pool.json")])
    err = capsys.readouterr().err
    assert "b.json" in err and "spec_args" in err


@pytest.mark.parametrize("target", ["c16", "c16=x", "=1.0", "c16=-1", "c16=nan"])
def test_a_malformed_target_is_a_cli_error_naming_the_flag(tmp_path, capsys, target):
    a = write_run(tmp_path / "a.json", {"plain_first": [("chat", "c16", 1.0)]})
    with pytest.raises(SystemExit):
        pool_spec_ab.main([a, "--target", target, "--json", str(tmp_path / "pool.json")])
    assert "--target" in capsys.readouterr().err


def test_a_target_for_a_cell_no_run_measured_is_an_error(tmp_path, capsys):
    a = write_run(tmp_path / "a.json", {"plain_first": [("chat", "c16", 1.0)]})
    with pytest.raises(SystemExit):
        pool_spec_ab.main([a, "--target", "bs1:chat=1.3", "--json", str(tmp_path / "pool.json")])
    assert "no such cell" in capsys.readouterr().err
