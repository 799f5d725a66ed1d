"""Helpers shared by the child processes (scheduler, detokenizer)."""

from __future__ import annotations

import logging
import os
import signal

import zmq


def setup_logging(name: str, log_level: str) -> None:
    """Log lines of this process, named `name`, at `log_level` (httpx's per-request lines left out)."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format=f"[%(asctime)s {name}] %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def setup_child(name: str, log_level: str) -> None:
    """Common start of a child process: logging, and Ctrl-C left to the launcher (which stops us)."""
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format=f"[%(asctime)s {name}] %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_term)


def _exit_on_term(signum, frame) -> None:  # noqa: ARG001
    # Nothing to flush or save (the launcher removes the socket directory): skip the slow interpreter
    # teardown of a process holding a model.
    logging.shutdown()
    os._exit(0)


class ParentWatch:
    """Notices that the launcher is gone (e.g. SIGKILLed) so that a child never outlives it."""

    def __init__(self) -> None:
        self.parent_pid = os.getppid()

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid


def make_socket(ctx: zmq.Context, kind: int, bind: str | None = None, connect: str | None = None) -> zmq.Socket:
    """A PUSH / PULL socket with unbounded queues (a send never blocks a loop) and no linger."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(bind)
    if connect:
        sock.connect(connect)
    return sock
