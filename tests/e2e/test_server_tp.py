"""End-to-end tensor parallelism (`--tp-size 2` over gloo) on a tiny model: greedy outputs through the
server equal the in-process Engine's (TP 1), the KV pools balance on both ranks; the same two ranks run
as two "nodes" (`--nnodes 2 --node-rank 0/1 --dist-init-addr`), each launcher with its own rank; a
killed rank takes the server to 503, the launcher exits non-zero and no process is left behind; a
killed launcher leaves no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from model_factory import make_tiny_model
from server_e2e_helpers import engine_reference, pid_alive, server_info, wait_idle

from treespec.server.testing import free_port, popen_launch_server

PROMPTS = [[1, 17, 42, 99], [5, 6, 7, 8, 9, 10, 11], [250, 3, 250, 3, 250], [2] * 20]  # the tiny vocab: 300
PARAMS = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tp_e2e") / "llama")


def server_args(tiny_dir) -> list[str]:
    return ["--model-path", str(tiny_dir), "--speculative-algorithm", "NONE", "--max-total-tokens", "2048",
            "--num-threads", "1", "--skip-warmup"]


def generate_all(base_url: str) -> list[list[int]]:
    outs = []
    for ids in PROMPTS:
        resp = httpx.post(f"{base_url}/generate", json={"input_ids": ids, "sampling_params": PARAMS}, timeout=120)
        assert resp.status_code == 200, resp.text
        outs.append(resp.json()["output_ids"])
    return outs


def reference(tiny_dir) -> list[list[int]]:
    refs = engine_reference([{"input_ids": ids, "sampling_params": PARAMS} for ids in PROMPTS],
                            {"model_path": str(tiny_dir), "max_total_tokens": 2048})
    return [r["output_ids"] for r in refs]


def test_tp2_server_matches_tp1_then_a_killed_rank_takes_it_down(tiny_dir):
    server = popen_launch_server([*server_args(tiny_dir), "--tp-size", "2"])
    try:
        assert generate_all(server.base_url) == reference(tiny_dir)
        info = wait_idle(server.base_url)
        assert info["kv_pool_balanced"] is True  # checked on both ranks
        assert info["stats"]["tp_size"] == 2
        pids = info["pids"]
        assert set(pids) == {"launcher", "scheduler", "scheduler-tp1", "detokenizer"}
        os.kill(pids["scheduler-tp1"], signal.SIGKILL)
        saw_503 = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                resp = httpx.get(f"{server.base_url}/health", timeout=2)
                saw_503 |= resp.status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert saw_503
        assert server.proc.wait(30) != 0
        for name in ("scheduler", "scheduler-tp1", "detokenizer"):
            assert not pid_alive(pids[name]), f"{name} outlived the launcher"
        assert not os.path.exists(info["ipc_dir"])
    finally:
        server.terminate()


def test_two_nodes_on_one_machine(tiny_dir):
    """Node 1's launcher runs rank 1 only (no HTTP); node 0 serves. Stopping node 0 ends node 1 (its
    rank's collectives fail), with a non-zero exit."""
    addr = f"127.0.0.1:{free_port()}"
    multi = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "treespec.server.launch_server", *server_args(tiny_dir), *multi,
                              "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        server = popen_launch_server([*server_args(tiny_dir), *multi, "--node-rank", "0"])
        try:
            assert generate_all(server.base_url) == reference(tiny_dir)
            info = server_info(server.base_url)
            assert set(info["pids"]) == {"launcher", "scheduler", "detokenizer"}
            assert wait_idle(server.base_url)["kv_pool_balanced"] is True
        finally:
            assert server.terminate() == 0
        assert node1.wait(60) != 0
        assert "ranks scheduler-tp1 ready" in node1.stdout.read()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)


def test_a_killed_launcher_leaves_no_rank_behind(tiny_dir):
    """SIGKILL gives the launcher no chance to stop its children: rank 0 notices its parent is gone,
    and rank 1 notices rank 0 is gone (its collective fails)."""
    server = popen_launch_server([*server_args(tiny_dir), "--tp-size", "2"])
    try:
        pids = server_info(server.base_url)["pids"]
        os.kill(pids["launcher"], signal.SIGKILL)
        children = [pids[name] for name in ("scheduler", "scheduler-tp1", "detokenizer")]
        deadline = time.monotonic() + 30
        while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(pid) for pid in children)
    finally:
        server.terminate()
