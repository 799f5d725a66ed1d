"""End-to-end: --api-key (the warm-up request authenticates too), a scheduler that dies (503 then a
non-zero exit, nothing left behind), and a start-up failure that is reported instead of hanging."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest
from server_e2e_helpers import SERVER_ARGS, pid_alive, server_info

from treespec.server.testing import popen_launch_server

API_KEY = "sk-test-123"


@pytest.fixture(scope="module")
def server():
    srv = popen_launch_server(SERVER_ARGS, api_key=API_KEY)
    yield srv
    srv.terminate()


def test_api_key_required_except_on_health(server):
    url = server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/get_server_info", "/v1/models", "/metrics", "/get_model_info"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    resp = httpx.post(f"{url}/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                      headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    resp = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 401
    ok = httpx.post(f"{url}/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                    headers=server.headers, timeout=120)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    assert httpx.get(f"{url}/v1/models", headers=server.headers).status_code == 200


def maps_torch(pid: int) -> bool:
    """True if the process has torch's shared library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/PID/maps")
def test_only_the_scheduler_process_loads_torch(server):
    """Running, not just importing: the launcher (the HTTP process) and the detokenizer never load
    torch; the scheduler, which holds the model, does (the check would see it)."""
    pids = server_info(server.base_url, server.headers)["pids"]
    assert not maps_torch(pids["launcher"])
    assert not maps_torch(pids["detokenizer"])
    assert maps_torch(pids["scheduler"])


def test_scheduler_death_makes_server_unhealthy_and_launcher_exit(server):
    info = server_info(server.base_url, server.headers)
    pids, ipc_dir = info["pids"], info["ipc_dir"]
    result: dict = {}

    def long_request() -> None:
        body = {"text": "Count to one thousand:", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
        try:
            result["resp"] = httpx.post(f"{server.base_url}/generate", json=body, headers=server.headers, timeout=60)
        except httpx.HTTPError as e:
            result["error"] = e

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 60
    while server_info(server.base_url, server.headers)["stats"]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(pids["scheduler"], signal.SIGKILL)

    saw_503 = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            resp = httpx.get(f"{server.base_url}/health", timeout=2)
            if resp.status_code == 503:
                saw_503 = True
                assert "scheduler" in resp.json()["reason"]
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert saw_503
    worker.join(30)
    # the in-flight request was answered (503), not left hanging
    assert "resp" in result and result["resp"].status_code == 503, result
    rc = server.proc.wait(30)
    assert rc != 0
    assert not pid_alive(pids["detokenizer"])
    assert not os.path.exists(ipc_dir)


def test_startup_failures_are_reported():
    with pytest.raises(RuntimeError, match="does not exist"):
        popen_launch_server(["--model-path", "/nonexistent/model", "--skip-warmup"], timeout=120)
    with pytest.raises(RuntimeError, match="cannot listen"):  # a later --port overrides the free one
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            popen_launch_server(["--port", str(busy.getsockname()[1])], timeout=120)

