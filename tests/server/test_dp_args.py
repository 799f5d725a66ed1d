"""--dp-size / --router-policy: checks naming the flag, the error when sglang-router is missing, each
replica's flags, and the router's command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from treespec import args as args_module
from treespec.args import ArgError, ServerArgs
from treespec.server.dp_launcher import free_ports, replica_args
from treespec.server.router_process import router_command


def test_dp_size_and_router_policy_are_checked():
    with pytest.raises(ArgError, match="^--dp-size: must be a positive integer"):
        ServerArgs(dp_size=0).resolve()
    with pytest.raises(ArgError, match="^--router-policy: must be one of cache_aware"):
        ServerArgs(router_policy="fastest").resolve()
    with pytest.raises(ArgError, match="^--dp-size: cannot be combined with --tp-size"):
        ServerArgs(dp_size=2, tp_size=2).resolve()
    resolved = ServerArgs().resolve()
    assert (resolved.dp_size, resolved.router_policy) == (1, "cache_aware")


def test_dp_size_without_sglang_router_names_the_flag_and_the_extra(monkeypatch):
    monkeypatch.setattr(args_module, "router_installed", lambda: False)
    with pytest.raises(ArgError, match=r"^--dp-size: 2 runs the replicas behind sglang-router.*treespec\[router\]"):
        ServerArgs(dp_size=2).resolve()
    ServerArgs(dp_size=1).resolve()  # one server needs no router


def test_cli_error_when_sglang_router_is_missing():
    """The real command line, in a Python where sglang_router cannot be imported: usage + the error, exit 2."""
    code = ("import sys; sys.modules['sglang_router'] = None; "  # None in sys.modules: find_spec says missing
            "from treespec.server.launch_server import main; main(['--dp-size', '2'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--dp-size: 2 runs the replicas behind sglang-router" in proc.stderr
    assert "pip install 'treespec[router]'" in proc.stderr


def test_engine_refuses_dp_size():
    from treespec.engine import Engine

    with pytest.raises(ValueError, match="^dp_size"):
        Engine(dp_size=2)


def test_replica_args_one_server_on_an_internal_port():
    given = ServerArgs(dp_size=4, host="0.0.0.0", port=8000, device="cuda").resolve()
    replica = replica_args(given, index=3, port=40001, cpu_count=16)
    assert (replica.dp_size, replica.host, replica.port) == (1, "127.0.0.1", 40001)
    assert replica.num_threads == 4  # the cores split between the replicas
    assert replica.device == "cuda:3"  # replica i on GPU i
    pinned = replica_args(ServerArgs(dp_size=2, num_threads=3).resolve(), index=1, port=40002, cpu_count=2)
    assert pinned.num_threads == 3 and pinned.device == "auto"
    assert replica_args(ServerArgs(dp_size=4).resolve(), 0, 40003, cpu_count=2).num_threads == 1
    assert replica.resolve() is replica  # still resolved: the replica runs it as it is


def test_free_ports_are_distinct():
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


def test_router_command():
    cmd = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], "cache_aware", "0.0.0.0", 30000,
                         29001, log_level="info", api_key="sk-1")
    assert cmd[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    text = " ".join(cmd)
    assert "--worker-urls http://127.0.0.1:1 http://127.0.0.1:2 --policy cache_aware" in text
    assert "--host 0.0.0.0 --port 30000" in text and "--prometheus-port 29001" in text
    assert "--api-key sk-1" in text and "--log-level warn" in text
    assert "--api-key" not in " ".join(router_command(["http://h:1"], "random", "h", 1, 2))


@pytest.mark.skipif(not args_module.router_installed(), reason="sglang-router is not installed (pip install 'treespec[router]')")
def test_router_command_is_accepted_by_sglang_router():
    """Every flag we pass exists in the installed sglang-router (its own parser checks them)."""
    from sglang_router.launch_router import parse_router_args

    cmd = router_command(["http://127.0.0.1:1"], "round_robin", "127.0.0.1", 30000, 29001, api_key="k")
    parsed = parse_router_args(cmd[3:])
    assert parsed.worker_urls == ["http://127.0.0.1:1"] and parsed.policy == "round_robin"
    assert parsed.port == 30000 and parsed.prometheus_port == 29001 and parsed.api_key == "k"


class FakeRouter:
    """Stands in for RouterProcess: a sleeping child process, and the workers removed from it."""

    def __init__(self) -> None:
        import subprocess

        self.proc = subprocess.Popen(["sleep", "60"])
        self.removed: list[str] = []

    def remove_worker(self, url: str) -> bool:
        self.removed.append(url)
        return True

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_monitor_reports_a_dead_replica_keeps_serving_and_exits_when_the_router_dies(caplog):
    """The launcher's monitor loop on stand-in processes: a killed replica is removed from the router and
    reported by name, serving goes on with the other; the router's death ends it with 1; stop() stops
    the replica left."""
    import logging
    import multiprocessing as mp
    import os
    import signal
    import threading
    import time

    from treespec.server.dp_launcher import DataParallelLauncher, Replica

    launcher = DataParallelLauncher(ServerArgs(dp_size=2).resolve())
    ctx = mp.get_context("spawn")
    for index, port in enumerate((40010, 40011)):
        proc = ctx.Process(target=time.sleep, args=(60,))
        proc.start()
        launcher.replicas.append(Replica(index, port, proc))
    launcher.router = router = FakeRouter()
    result: dict = {}
    caplog.set_level(logging.INFO, logger="treespec.dp_launcher")
    watcher = threading.Thread(target=lambda: result.setdefault("code", launcher.monitor()))
    watcher.start()
    try:
        os.kill(launcher.replicas[1].process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not router.removed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert router.removed == ["http://127.0.0.1:40011"] and watcher.is_alive()
        assert (f"replica 1 (http://127.0.0.1:40011, pid {launcher.replicas[1].process.pid}) exited with code -9; "
                "removed from the router; serving with 1 of 2 replicas (not restarted)") in caplog.text
        router.proc.kill()
        watcher.join(10)
        assert result == {"code": 1} and "sglang-router" in caplog.text
    finally:
        launcher.stop()
        router.stop()
    assert not any(r.process.is_alive() for r in launcher.replicas)
