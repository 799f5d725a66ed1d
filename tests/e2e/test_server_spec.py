"""End-to-end with EAGLE-3 speculation on: speculative stats reach meta_info, /get_server_info and /metrics.

Uses the shipped EAGLE-3 head when there is one; otherwise a randomly initialised head for the default
target (acceptance near the minimum: this checks the plumbing, not the speed-up)."""

from __future__ import annotations

import json

import httpx
import pytest
from server_e2e_helpers import SERVER_ARGS, sse_events, wait_idle

from treespec.server.testing import popen_launch_server


def eagle3_args(path) -> list[str]:
    """The shipped EAGLE-3 head with its tuned settings if there is one, else a random head."""
    try:
        from treespec.drafts import shipped_draft_path

        if shipped_draft_path("EAGLE3") is not None:
            return ["--speculative-algorithm", "EAGLE3"]
    except ImportError:
        pass
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", random_eagle3_head(path),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]


def random_eagle3_head(path) -> str:
    try:
        from treespec.model_loader import resolve_model_path
        from treespec.models.config import ModelConfig
        from treespec.models.draft_loader import create_draft_model, save_draft
        from treespec.speculative.eagle_worker import EagleWorker  # noqa: F401
    except ImportError as e:
        pytest.skip(f"EAGLE-3 speculation is not available yet: {e}")
    target = resolve_model_path(None)
    cfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    save_draft(create_draft_model("EAGLE3", cfg, 2048, intermediate_size=256, init_std=0.02, seed=0), path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = eagle3_args(tmp_path_factory.mktemp("eagle3_head"))
    srv = popen_launch_server([*SERVER_ARGS, "--skip-warmup", *spec])
    yield srv
    assert srv.terminate() == 0, srv.log_tail()


def test_speculative_stats_flow_through_the_server(server):
    url = server.base_url
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    out = httpx.post(f"{url}/generate", json=body, timeout=300).json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) >= 1
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=300) as r:
        events = sse_events(r.iter_lines())
    assert events[-2]["output_ids"] == out["output_ids"] and events[-2]["text"] == out["text"]
    info = wait_idle(url)
    assert info["kv_pool_balanced"] is True
    assert info["speculative_algorithm"] == "EAGLE3" and info["avg_spec_accept_length"] >= 1
    metrics = httpx.get(f"{url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("treespec:spec_accept_length{"))
    assert float(line.split()[-1]) >= 1
