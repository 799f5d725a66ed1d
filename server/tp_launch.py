"""Launching tensor-parallel ranks (`--tp-size`, `--nnodes`, `--node-rank`, `--dist-init-addr`).

Each node's launcher starts the scheduler processes of its own ranks: node r runs global ranks
r * (tp / nnodes) .. (r + 1) * (tp / nnodes) - 1. Node 0 also runs the HTTP server and the detokenizer,
and its rank 0 alone talks to them (server/scheduler_process.py). Another node's launcher runs its ranks
only, and exits non-zero when one of them dies (which a peer's failure causes: its collectives fail).
Torch-free: the launcher never imports torch.
"""

from __future__ import annotations

import logging
import socket
from multiprocessing.connection import wait

from treespec.args import ServerArgs

logger = logging.getLogger("treespec.launch_server")


def local_placements(args: ServerArgs) -> list[tuple[str, object]]:
    """(process name, TPPlacement) of each rank this node runs, rank order; the name of global rank 0 is
    "scheduler", as without tensor parallelism."""
    from treespec.distributed.placement import TPPlacement

    per_node = args.tp_size // args.nnodes
    addr = args.dist_init_addr or f"127.0.0.1:{_free_port()}"
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    return [("scheduler" if r == 0 else f"scheduler-tp{r}", TPPlacement(r, args.tp_size, addr, args.nnodes))
            for r in ranks]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_ranks_only(launcher) -> int:
    """A node other than 0: run this node's ranks until one dies (returns 1) or SIGTERM / Ctrl-C."""
    launcher.start_schedulers(None)
    args = launcher.args
    print(f"treespec node {args.node_rank} of {args.nnodes}: ranks {', '.join(launcher.procs)} ready", flush=True)
    sentinels = {p.sentinel: name for name, p in launcher.procs.items()}
    while True:
        dead = wait(list(sentinels), timeout=1.0)
        if dead:
            name = sentinels[dead[0]]
            proc = launcher.procs[name]
            proc.join(0.1)
            logger.error("the %s process (pid %s) died with exit code %s; shutting down", name, proc.pid,
                         proc.exitcode)
            return 1
