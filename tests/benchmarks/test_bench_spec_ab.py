"""bench_spec_ab's saved prompts: built once where the workloads' data is, replayed where it is not."""

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
