"""Test utilities: start the real server in a subprocess on a free port and wait until it is healthy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    port: int
    log_path: str
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    final_log: str | None = None  # the log, kept in memory once the file is removed

    def log_tail(self, n: int = 4000) -> str:
        if self.final_log is not None:
            return self.final_log[-n:]
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Wait until GET /health answers 200 (the model is loaded and the warm-up request succeeded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.terminate()  # keeps the log in memory, removes the file
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.terminate()
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for the launcher's "treespec ready on URL" line: with --dp-size > 1 the router answers
        /health before its replicas are registered, so /health alone does not mean ready."""
        deadline = time.monotonic() + timeout
        while f"treespec ready on {self.base_url} " not in self.log_tail(1 << 20):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.terminate()
                raise RuntimeError(f"server not ready (exit code {self.proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.25)

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL (of the launcher's process group) if it does not exit in time. The log
        file is then removed (set TREESPEC_KEEP_SERVER_LOGS=1 to keep it); log_tail() still works."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.final_log is None:
            self.final_log = self.log_tail(1 << 20)
            if not os.environ.get("TREESPEC_KEEP_SERVER_LOGS"):
                os.unlink(self.log_path)
        return self.proc.returncode


def start_server(args: list[str] | None = None, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Launch `python -m treespec.server.launch_server ARGS --port <free>` in its own process group, output
    to a log file; returns at once (call `wait_healthy`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "treespec.server.launch_server", "--port", str(port), *(args or [])]
    if api_key:
        cmd += ["--api-key", api_key]
    fd, log_path = tempfile.mkstemp(prefix="treespec-server-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    return ServerProcess(proc, f"http://127.0.0.1:{port}", port, log_path, api_key,
                         {"Authorization": f"Bearer {api_key}"} if api_key else {})


def popen_launch_server(args: list[str] | None = None, timeout: float = 600.0, api_key: str | None = None,
                        env: dict[str, str] | None = None) -> ServerProcess:
    """Start the server and wait until GET /health answers 200 (RuntimeError with the log tail if not)."""
    server = start_server(args, api_key, env)
    server.wait_healthy(timeout)
    return server
