"""All-reduce and all-gather through shared memory, for the CPU ranks of one machine.

gloo's collectives go through TCP on loopback: about 1 ms each on the 2-core dev machine, and a decode
step makes two per layer. Ranks on one machine can instead exchange through a shared buffer: each
writes its tensor into its own slot and raises its sequence number; once every rank's number has
reached this call's, each reads all slots in rank order (so the sum is bit-identical on every rank,
and equals gloo's for two ranks: a + b). Two buffers alternate: a rank can write call s + 1 while a
slower one still reads call s, and cannot reach call s + 2 before that one finished reading (it waits
for its number s + 1, raised after the read).

The ordering relies on x86's total store order (the data copy, then the number's store, from one
thread); `shm_available` offers it on x86-64 CPUs only. Tensors larger than a slot go to gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile

import numpy as np
import torch

# per rank and buffer at most 4 MiB (decode and verify batches; big prefills use gloo), and 32 MiB in all:
# containers often have a 64 MiB /dev/shm
MAX_SLOT_FLOATS, TOTAL_BYTES = 1 << 20, 32 << 20
SPINS_PER_LIVENESS_CHECK = 4096  # a waiting rank checks this often that its peers still run


class PeerDied(RuntimeError):
    """A rank waited on by a shared-memory collective is gone (gloo would notice its closed socket)."""


def shm_available(device: torch.device, nnodes: int) -> bool:
    return device.type == "cpu" and nnodes == 1 and platform.machine().lower() in ("x86_64", "amd64")


class ShmExchange:
    """One rank's view of the shared buffers: [2 buffers][size slots][slot_floats] fp32 data, then one
    int64 sequence number per rank, then each rank's pid."""

    def __init__(self, rank: int, size: int, path: str | None) -> None:
        """`path` None: create the file (rank 0, which removes it once all have mapped it: `unlink`)."""
        self.rank, self.size = rank, size
        self.slot_floats = min(MAX_SLOT_FLOATS, TOTAL_BYTES // (2 * size * 4))
        data_bytes = 2 * size * self.slot_floats * 4
        if path is None:
            fd, path = tempfile.mkstemp(prefix="treespec-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            try:
                os.posix_fallocate(fd, 0, data_bytes + 16 * size)  # a full tmpfs fails here, not with SIGBUS later
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        self.path = path
        self.buf = mmap.mmap(fd, data_bytes + 16 * size)
        os.close(fd)
        self.data = torch.frombuffer(self.buf, dtype=torch.float32, count=2 * size * self.slot_floats)
        self.data = self.data.view(2, size, self.slot_floats)
        self.seqs = np.frombuffer(self.buf, dtype=np.int64, count=size, offset=data_bytes)
        self.pids = np.frombuffer(self.buf, dtype=np.int64, count=size, offset=data_bytes + 8 * size)
        self.pids[rank] = os.getpid()  # read by the others once all have mapped the file (a barrier)
        self.seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.numel() <= self.slot_floats

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, stacked in rank order: a view [size, numel] of this call's buffer."""
        self.seq += 1
        n = x.numel()
        slots = self.data[self.seq % 2]
        slots[self.rank, :n].copy_(x.reshape(-1))
        self.seqs[self.rank] = self.seq
        spins = 0
        while int(self.seqs.min()) < self.seq:
            os.sched_yield()  # the cores may be shared: let the other rank run
            spins += 1
            if spins % SPINS_PER_LIVENESS_CHECK == 0:
                self._check_peers()
        return slots[:, :n]

    def _check_peers(self) -> None:
        for r, pid in enumerate(self.pids.tolist()):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise PeerDied(f"tensor-parallel rank {r} (pid {pid}) is gone") from None
            except PermissionError:
                pass  # exists

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        out = parts[0].clone()
        for r in range(1, self.size):
            out += parts[r]
        return out.view(x.shape)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x.contiguous())
        return torch.cat([parts[r].view(x.shape) for r in range(self.size)], dim=-1)

    def unlink(self) -> None:
        os.unlink(self.path)
