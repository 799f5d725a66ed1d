"""Where one tensor-parallel rank runs. Torch-free: the launcher builds these without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPPlacement:
    """Where one rank runs: its global rank, the group size, and the address rank 0 listens on."""

    rank: int
    size: int
    init_addr: str  # host:port of the TCP store (rank 0's node)
    nnodes: int = 1

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def init_method(self) -> str:
        host, _, port = self.init_addr.rpartition(":")
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"tcp://{host}:{port}"
