"""sglang-router as a child process of the data-parallel launcher: its command line, its start, and the
calls the launcher makes on its worker API.

The router (PyPI `sglang-router`, a Rust HTTP router; 0.3.2 here) is run through its documented command,
`python -m sglang_router.launch_router`, never imported: its flags are its interface. Facts this relies
on (sglang-router 0.3.2): it registers workers in the background after it starts listening, so the
launcher waits on GET /readiness ({"healthy_workers": n}); GET /workers lists {"id", "url"}, and
DELETE /workers/{id} removes one; a request that fails with 408/429/5xx or cannot connect is retried
(--retry-max-retries, default 5) on a worker the policy picks again; a worker failing
--health-failure-threshold (3) checks in a row is marked unhealthy and skipped.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import httpx

logger = logging.getLogger("treespec.dp_launcher")

ROUTER_READY_TIMEOUT_S = 120.0
# the router's default is 60 s; the launcher removes a dead replica itself, the health check is the backstop
HEALTH_CHECK_INTERVAL_S = 5
# the router's default (180 s) would hold a Ctrl-C for minutes; the replicas stop in ~5 s (uvicorn's grace)
SHUTDOWN_GRACE_S = 5
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}


def router_command(worker_urls: list[str], policy: str, host: str, port: int, prometheus_port: int,
                   log_level: str = "info", api_key: str | None = None) -> list[str]:
    """The sglang-router command line for these replicas (also the documented separate-command form)."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--policy", policy, "--host", host, "--port", str(port),
           # its metrics server listens on 29000 by default: a second router on the machine would clash
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
           "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
           "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S),
           "--worker-startup-check-interval", "1",
           # info logs every step of every worker registration: treespec's info is the router's warn
           "--log-level", ROUTER_LOG_LEVELS.get(log_level, "warn")]
    if api_key:
        cmd += ["--api-key", api_key]  # the key the router presents to the workers
    return cmd


def _die_with_parent() -> None:
    """Runs in the router's process before exec: on Linux the kernel sends it SIGTERM when the launcher
    dies, even by SIGKILL, so the router never outlives the launcher. (Elsewhere the launcher's own
    shutdown is the only guard.)"""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    except OSError:
        pass


class RouterProcess:
    """One sglang-router child process, in its own session (a terminal's Ctrl-C reaches the launcher
    only, which stops the router itself)."""

    def __init__(self, cmd: list[str], base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=preexec)

    def wait_ready(self, num_workers: int, timeout: float = ROUTER_READY_TIMEOUT_S) -> None:
        """Until the router reports all `num_workers` replicas healthy; RuntimeError if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited during start-up with code {self.proc.returncode}")
            try:
                resp = httpx.get(f"{self.base_url}/readiness", headers=self.headers, timeout=5)
                if resp.status_code == 200 and resp.json().get("healthy_workers") == num_workers:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"sglang-router did not report {num_workers} healthy workers within {timeout:.0f} s")

    def remove_worker(self, worker_url: str) -> bool:
        """Take a worker out of the router's list (so no retry picks it again); True if it was there."""
        try:
            workers = httpx.get(f"{self.base_url}/workers", headers=self.headers, timeout=5).json()["workers"]
            ids = [w["id"] for w in workers if w["url"] == worker_url]
            for worker_id in ids:
                httpx.delete(f"{self.base_url}/workers/{worker_id}", headers=self.headers,
                             timeout=5).raise_for_status()
            return bool(ids)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.warning("could not remove %s from the router: %s", worker_url, e)
            return False

    def stop(self, timeout: float = SHUTDOWN_GRACE_S + 5) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
