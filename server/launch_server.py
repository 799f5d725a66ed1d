"""`python -m treespec.server.launch_server` / `treespec-server`: start the three processes and serve HTTP.

The launcher resolves the model, makes a private socket directory (mode 0700), spawns the scheduler and
the detokenizer, waits until both are loaded, runs the HTTP server (TokenizerManager on its event loop),
sends one warm-up request and prints one "ready" line. A watchdog thread turns a dead child into
"unhealthy" (/health 503) and, a moment later, a non-zero exit. SIGTERM / Ctrl-C stop everything and
remove the socket directory.

Module-level imports stay light: spawned children import this module's parent package, not this file's
heavy dependencies.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait

from treespec.args import DEFAULT_MODEL_NAME, ServerArgs
from treespec.server.proc_util import setup_logging

logger = logging.getLogger("treespec.launch_server")

READY_TIMEOUT_S = 1800.0
UNHEALTHY_GRACE_S = 2.0
HARD_EXIT_AFTER_S = 15.0


class StartupError(RuntimeError):
    pass


class _Shutdown(BaseException):
    """Raised in the main thread by SIGTERM / SIGINT once uvicorn (if running) has stopped."""


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Shutdown(signum)


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.sock_dir = tempfile.mkdtemp(prefix="treespec-ipc-")  # mode 0700
        self.procs: dict = {}
        self.exit_code = 0
        self.server = None  # uvicorn.Server once running
        self.stopping = threading.Event()

    # ------------------------------------------------------------------ children
    def start_children(self, names) -> dict:
        """Start the scheduler, which resolves the model (converting a GGUF once) and loads it, then the
        detokenizer on the tokenizer the scheduler reports. This process never imports torch."""
        from treespec.server.detokenizer import run_detokenizer_process

        info = self.start_schedulers(names)
        info["tokenizer_path"] = self.args.tokenizer_path or info["model_dir"]
        self._start_and_wait("detokenizer", run_detokenizer_process,
                             (self.args.log_level, info["tokenizer_path"], names))
        return info

    def start_schedulers(self, names) -> dict:
        """The scheduler, or with --tp-size one per rank this node runs (server/tp_launch.py), all started
        before any is waited for (they join one process group); returns rank 0's (or the first's) info."""
        from treespec.server.scheduler_process import run_scheduler_process

        if self.args.tp_size == 1:
            return self._start_and_wait("scheduler", run_scheduler_process, (self.args, names))
        from treespec.server.tp_launch import local_placements

        readers = {name: self._spawn(name, run_scheduler_process,
                                     (self.args, names if placement.rank == 0 else None), (placement,))
                   for name, placement in local_placements(self.args)}
        infos = self._wait_ready(readers)
        return infos[next(iter(readers))]

    def _start_and_wait(self, name: str, target, args: tuple) -> dict:
        return self._wait_ready({name: self._spawn(name, target, args)})[name]

    def _spawn(self, name: str, target, args: tuple, extra: tuple = ()):
        """Start target(*args, ready_pipe, *extra) in a child; returns the pipe's reading end."""
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, writer, *extra), name=f"treespec-{name}", daemon=True)
        proc.start()
        writer.close()
        self.procs[name] = proc
        return reader

    def _wait_ready(self, readers: dict) -> dict:
        infos: dict = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = dict(readers)
        while pending:
            if time.monotonic() > deadline:
                raise StartupError(f"{sorted(pending)} not ready after {READY_TIMEOUT_S:.0f} s")
            for conn in wait(list(pending.values()), timeout=0.5):
                name = next(n for n, c in pending.items() if c is conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = {"status": "error", "message": f"exited during start-up (code {self.procs[name].exitcode})"}
                if msg.get("status") != "ready":
                    detail = msg.get("traceback") or ""
                    if msg.get("user_error"):  # a bad flag: its message names it; no traceback
                        raise StartupError(msg["message"])
                    raise StartupError(f"the {name} process failed to start: {msg.get('message')}\n{detail}")
                infos[name] = msg
                del pending[name]
        return infos

    def stop_children(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)

    def cleanup(self) -> None:
        self.stopping.set()
        start = time.monotonic()
        self.stop_children()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        logger.debug("children stopped and sockets removed in %.2f s", time.monotonic() - start)

    # ------------------------------------------------------------------ threads
    def request_exit(self, code: int) -> None:
        self.exit_code = code
        if self.server is not None:
            self.server.should_exit = True

    def watchdog(self, state, tm) -> None:
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
        while not self.stopping.is_set():
            dead = wait(list(sentinels), timeout=0.5)
            if not dead or self.stopping.is_set():
                continue
            name = sentinels[dead[0]]
            proc = self.procs[name]
            proc.join(0.1)
            reason = f"the {name} process (pid {proc.pid}) died with exit code {proc.exitcode}"
            logger.error("%s; shutting down", reason)
            state.unhealthy = reason
            tm.fail_all_threadsafe(reason)
            time.sleep(UNHEALTHY_GRACE_S)  # /health answers 503 meanwhile
            self.request_exit(1)
            if self.stopping.wait(HARD_EXIT_AFTER_S):
                return
            logger.error("HTTP server did not stop; exiting hard")
            self.cleanup()
            os._exit(1)

    def warmup(self, state, base_url: str) -> None:
        import httpx

        while self.server is None or not self.server.started:
            if self.stopping.wait(0.05) or (self.server is not None and self.server.should_exit):
                return
        if not self.args.skip_warmup:
            headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
            body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            try:
                resp = httpx.post(f"{base_url}/generate", json=body, headers=headers, timeout=600)
                resp.raise_for_status()
            except Exception as e:
                logger.error("the warm-up request failed: %s", e)
                self.request_exit(1)
                return
        state.ready = True
        print(f"treespec ready on {base_url} (model {state.model_name}, {_spec_summary(self.args)})", flush=True)


def _spec_summary(args: ServerArgs) -> str:
    if args.speculative_algorithm == "NONE":
        return "speculative decoding off"
    return (f"speculative {args.speculative_algorithm} steps={args.speculative_num_steps} "
            f"topk={args.speculative_eagle_topk} draft_tokens={args.speculative_num_draft_tokens}")


def _model_name(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model_path is None:
        return DEFAULT_MODEL_NAME
    return args.model_path


def _check_port_free(host: str, port: int) -> None:
    """Fail before loading the model when the HTTP port is taken."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise StartupError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None


def launch_server(args: ServerArgs) -> int:
    """Run the server until SIGTERM / Ctrl-C (returns 0) or a failure (returns non-zero)."""
    if args.dp_size > 1:  # replicas behind sglang-router
        from treespec.server.dp_launcher import launch_data_parallel

        return launch_data_parallel(args)
    setup_logging("launcher", args.log_level)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    launcher = Launcher(args)
    try:
        return _serve(launcher, args)
    except _Shutdown:
        logger.info("shutting down")
        return launcher.exit_code
    except StartupError as e:
        logger.error("%s", e)
        return 1
    finally:
        launcher.cleanup()


def _serve(launcher: Launcher, args: ServerArgs) -> int:
    import uvicorn

    from treespec.request_checks import ModelLimits
    from treespec.server.http_server import ServerState, create_app
    from treespec.server.io_struct import IpcNames
    from treespec.server.tokenizer_manager import TokenizerManager
    from treespec.tokenizer import load_tokenizer

    if args.node_rank > 0:  # another machine's ranks of a multi-node --tp-size: no HTTP here
        from treespec.server.tp_launch import serve_ranks_only

        return serve_ranks_only(launcher)
    _check_port_free(args.host, args.port)
    names = IpcNames.in_dir(launcher.sock_dir)
    info = launcher.start_children(names)
    model_dir, tokenizer_path = info["model_dir"], info["tokenizer_path"]
    limits = ModelLimits(info["context_len"], info["max_total_num_tokens"], info["vocab_size"])
    tokenizer = load_tokenizer(tokenizer_path)
    state = ServerState(args, model_dir, str(tokenizer_path), _model_name(args), limits,
                        procs=launcher.procs, ipc_dir=launcher.sock_dir)
    tm = TokenizerManager(names, tokenizer, limits)
    app = create_app(state, tm)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(app, host=args.host, port=args.port, loop=loop, log_config=None,
                            log_level="debug" if args.log_level == "debug" else "warning",
                            access_log=args.log_level == "debug",
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    launcher.server = uvicorn.Server(config)
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
    base_url = f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"
    threading.Thread(target=launcher.watchdog, args=(state, tm), name="watchdog", daemon=True).start()
    threading.Thread(target=launcher.warmup, args=(state, base_url), name="warmup", daemon=True).start()
    launcher.server.run()
    return launcher.exit_code


def main(argv: list[str] | None = None) -> None:
    args = ServerArgs.from_cli(argv)
    sys.exit(launch_server(args))


if __name__ == "__main__":
    main()
