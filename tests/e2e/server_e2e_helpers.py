"""Helpers for the end-to-end server tests (each test module starts at most one server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REFERENCE_SCRIPT = Path(__file__).with_name("engine_reference.py")
# one torch thread: on a shared 2-core machine, OpenMP spin-waiting makes 2 threads several times slower
# fp32: outputs compared across batch compositions must not depend on bf16 rounding
SERVER_ARGS = ["--max-total-tokens", "4096", "--num-threads", "1", "--speculative-algorithm", "NONE",
               "--dtype", "float32"]


def engine_reference(requests: list[dict], engine_kwargs: dict | None = None) -> list[dict]:
    """Greedy outputs of the in-process Engine for `requests`, computed in a child process."""
    engine = {"max_total_tokens": 4096, "num_threads": 1, "speculative_algorithm": "NONE", "dtype": "float32",
              **(engine_kwargs or {})}
    spec = {"engine": engine, "requests": requests}
    proc = subprocess.run([sys.executable, str(REFERENCE_SCRIPT)], input=json.dumps(spec), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def server_info(base_url: str, headers: dict | None = None) -> dict:
    resp = httpx.get(f"{base_url}/server_info", headers=headers or {}, timeout=30)
    resp.raise_for_status()
    return resp.json()


def wait_idle(base_url: str, headers: dict | None = None, timeout: float = 60.0) -> dict:
    """Poll /server_info until nothing runs or waits (the pool balance is then checked deeply)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(base_url, headers)
        stats = info["stats"]
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and info["kv_pool_balanced"] is not None:
            return info
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {stats}"
        time.sleep(0.2)


def sse_events(lines) -> list:
    """Parse `data: ...` lines of an event stream into JSON objects, ending at [DONE] (included as None)."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            events.append(None)
            break
        events.append(json.loads(payload))
    return events


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, i.e. exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
