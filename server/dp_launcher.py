"""`launch_server --dp-size N`: N treespec servers (replicas) behind sglang-router.

Each replica is a whole treespec server (launcher, scheduler, detokenizer; its own KV pool and radix
cache) started by `launch_server` with --dp-size 1 on an internal port of 127.0.0.1. Once every replica
answers /health, sglang-router (router_process.py) is started on --host/--port with the replicas as its
workers and --router-policy (cache_aware by default: a prompt goes to the replica whose cache holds the
longest prefix of it, unless the load is too uneven).

Failures: a replica that dies is removed from the router at once (requests that had not reached it go
to the others: the router retries a request that cannot connect) and reported by a log line naming it;
the launcher keeps serving with the replicas left and does not restart it (a restarted replica starts
with an empty cache; run the separate-command form under a supervisor to restart replicas). With no
replica left, or the router gone, the launcher stops everything and exits 1. SIGTERM / Ctrl-C stop the
router, then the replicas, and exit 0. Replicas and the router run in their own process groups, so a
terminal's Ctrl-C reaches the launcher only and shutdown goes in that order; each dies with the launcher
if it is killed (replicas watch their parent, the router gets the kernel's parent-death signal).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import httpx

from treespec.args import ServerArgs
from treespec.server.launch_server import (
    READY_TIMEOUT_S,
    StartupError,
    _check_port_free,
    _on_signal,
    _Shutdown,
)
from treespec.server.proc_util import setup_logging
from treespec.server.router_process import RouterProcess, router_command

logger = logging.getLogger("treespec.dp_launcher")

REPLICA_HOST = "127.0.0.1"
REPLICA_STOP_TIMEOUT_S = 30.0
PARENT_POLL_S = 0.5


@dataclass
class Replica:
    index: int
    port: int
    process: mp.Process

    @property
    def url(self) -> str:
        return f"http://{REPLICA_HOST}:{self.port}"

    def describe(self) -> str:
        return f"replica {self.index} ({self.url}, pid {self.process.pid})"


def free_ports(n: int) -> list[int]:
    """n distinct ports free on REPLICA_HOST now (held together while picked, so never the same one)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((REPLICA_HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def replica_args(args: ServerArgs, index: int, port: int, cpu_count: int) -> ServerArgs:
    """One replica's flags: a single server on an internal port. Unless --num-threads is given, the
    machine's cores are split between the replicas (N replicas of all cores each would oversubscribe
    them); --device cuda gives replica i the GPU cuda:i."""
    threads = args.num_threads or max(1, cpu_count // args.dp_size)
    device = f"cuda:{index}" if args.device == "cuda" else args.device
    return dataclasses.replace(args, dp_size=1, host=REPLICA_HOST, port=port, num_threads=threads, device=device)


def run_replica(args: ServerArgs, index: int) -> None:
    """Entry point of a replica process (spawned): the ordinary single-server launcher."""
    os.setpgrp()  # the launcher, not the terminal, stops this replica
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format=f"[%(asctime)s replica {index}] %(levelname)s %(message)s")
    # the router opens each connection with an HTTP/2 probe, which uvicorn answers 400 and logs as a warning
    logging.getLogger("uvicorn.error").addFilter(lambda r: r.getMessage() != "Invalid HTTP request received.")
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    from treespec.server.launch_server import launch_server

    sys.exit(launch_server(args))


def _stop_when_orphaned(parent_pid: int) -> None:
    """The launcher is gone (e.g. SIGKILLed): shut this replica down as SIGTERM would."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def _display_url(host: str, port: int) -> str:
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DataParallelLauncher:
    """Owns the replica processes and the router process, from start to stop."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.replicas: list[Replica] = []
        self.router: RouterProcess | None = None
        self.base_url = _display_url(args.host, args.port)

    def start(self) -> None:
        args = self.args
        _check_port_free(args.host, args.port)
        *ports, prometheus_port = free_ports(args.dp_size + 1)
        ctx = mp.get_context("spawn")
        cpus = os.cpu_count() or 1
        for index, port in enumerate(ports):
            proc = ctx.Process(target=run_replica, args=(replica_args(args, index, port, cpus), index),
                               name=f"treespec-replica-{index}")
            proc.start()
            self.replicas.append(Replica(index, port, proc))
            logger.info("started %s", self.replicas[-1].describe())
        self._wait_replicas_healthy()
        urls = [r.url for r in self.replicas]
        cmd = router_command(urls, args.router_policy, args.host, args.port, prometheus_port, args.log_level,
                             args.api_key)
        self.router = RouterProcess(cmd, self.base_url, args.api_key)
        try:
            self.router.wait_ready(len(urls))
        except RuntimeError as e:
            raise StartupError(str(e)) from None
        print(f"treespec ready on {self.base_url} (sglang-router, policy {args.router_policy}, "
              f"dp {args.dp_size}: replicas {' '.join(urls)})", flush=True)

    def _wait_replicas_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = list(self.replicas)
        while pending:
            for r in list(pending):
                if not r.process.is_alive():
                    raise StartupError(f"{r.describe()} exited during start-up with code {r.process.exitcode} "
                                       "(its log above says why)")
                try:
                    if httpx.get(f"{r.url}/health", timeout=5).status_code == 200:
                        pending.remove(r)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise StartupError(f"replicas {[r.index for r in pending]} not ready after {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.25)

    def monitor(self) -> int:
        """Serve until the router or the last replica dies (returns 1); a signal ends it by _Shutdown."""
        alive = {r.process.sentinel: r for r in self.replicas}
        while True:
            for sentinel in wait(list(alive), timeout=0.5):
                self._report_dead(alive.pop(sentinel), len(alive))
            if not alive:
                logger.error("no replica left; shutting down")
                return 1
            if self.router.proc.poll() is not None:
                logger.error("sglang-router (pid %d) exited with code %s; shutting down", self.router.proc.pid,
                             self.router.proc.returncode)
                return 1

    def _report_dead(self, replica: Replica, num_alive: int) -> None:
        replica.process.join(1)
        removed = self.router.remove_worker(replica.url)
        logger.error("%s exited with code %s; %s; serving with %d of %d replicas (not restarted)",
                     replica.describe(), replica.process.exitcode,
                     "removed from the router" if removed else "the router's health check will drop it",
                     num_alive, len(self.replicas))

    def stop(self) -> None:
        """The router first (no new requests), then every replica (each stops its own children)."""
        if self.router is not None:
            self.router.stop()
        for r in self.replicas:
            if r.process.is_alive():
                r.process.terminate()
        for r in self.replicas:
            r.process.join(REPLICA_STOP_TIMEOUT_S)
            if r.process.is_alive():
                logger.error("%s did not stop; killing it", r.describe())
                r.process.kill()
                r.process.join(5)


def launch_data_parallel(args: ServerArgs) -> int:
    """Run the replicas and the router until SIGTERM / Ctrl-C (returns 0) or a failure (returns 1)."""
    setup_logging("dp-launcher", args.log_level)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    launcher = DataParallelLauncher(args)
    try:
        launcher.start()
        return launcher.monitor()
    except _Shutdown:
        logger.info("shutting down")
        return 0
    except StartupError as e:
        logger.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the stop short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.stop()
