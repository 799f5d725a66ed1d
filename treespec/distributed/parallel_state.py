"""The tensor-parallel process group of one rank (`--tp-size`), over torch.distributed.

Two groups over the same ranks, as SGLang keeps them: the device group carries the model's collectives
(NCCL on CUDA, gloo on the CPU) and the CPU group (always gloo) carries the scheduler's per-loop
broadcast of new inputs from rank 0 (`broadcast_frames`). On the CPU both are one gloo group.

Every rank must call the same collectives in the same order with the same shapes: the schedulers are
kept in lock step by giving them identical inputs (server/scheduler_process.py), and every collective
here returns bit-identical results on every rank (ring all-reduce / all-gather), so their decisions
(sampling, accepted drafts, the radix cache) stay identical too.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from treespec.distributed.placement import TPPlacement
from treespec.distributed.shm_comm import ShmExchange, shm_available

logger = logging.getLogger(__name__)

# a peer that dies is noticed at once (its socket closes); this bounds a peer that hangs instead
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class TPGroup:
    """One rank's view of the group: its rank and size, and the collectives the model and the
    scheduler use. Built by `init_tp_group` in the rank's process entry point; destroyed at its end."""

    def __init__(self, rank: int, size: int, device_group, cpu_group) -> None:
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group
        self.shm: ShmExchange | None = None  # CPU ranks of one machine: see attach_shm

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ model collectives
    def attach_shm(self) -> None:
        """Exchange through shared memory from now on (distributed/shm_comm.py; ~1 ms per gloo call
        on loopback). Rank 0 creates the file and removes its name once every rank has mapped it,
        so nothing is left in /dev/shm whichever process dies."""
        if self.is_first:
            try:
                shm = ShmExchange(self.rank, self.size, None)
            except OSError as e:  # no room in /dev/shm: every rank stays on gloo
                logger.warning("shared-memory collectives unavailable (%s); using gloo", e)
                self.broadcast_frames([b""])
                return
            self.broadcast_frames([shm.path.encode()])
        else:
            path = self.broadcast_frames(None)[0].decode()
            if not path:
                return
            shm = ShmExchange(self.rank, self.size, path)
        dist.barrier(group=self.cpu_group)
        if self.is_first:
            shm.unlink()
        self.shm = shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (the partial outputs of a row-parallel matmul)."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        x = x.contiguous()
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` side by side along the last dimension, in rank order (vocab-parallel logits)."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather_last_dim(x)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ scheduler collectives
    def broadcast_frames(self, frames: list[bytes] | None) -> list[bytes]:
        """Rank 0's list of raw messages, on every rank (others pass None). Sent as bytes, not
        pickled objects: every rank decodes them with io_struct.decode, which refuses unknown types."""
        if self.is_first:
            lengths = torch.tensor([len(f) for f in frames], dtype=torch.int64)
            header = torch.tensor([lengths.numel()], dtype=torch.int64)
        else:
            header = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        count = int(header.item())
        if count == 0:
            return []
        if not self.is_first:
            lengths = torch.zeros(count, dtype=torch.int64)
        dist.broadcast(lengths, src=0, group=self.cpu_group)
        total = int(lengths.sum())
        if self.is_first:
            payload = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8)
        else:
            payload = torch.empty(total, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.cpu_group)
        if self.is_first:
            return list(frames)
        data = payload.numpy().tobytes()
        out, start = [], 0
        for n in lengths.tolist():
            out.append(data[start : start + n])
            start += n
        return out

    def all_ranks_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (e.g. every rank's KV pool balances)."""
        t = torch.tensor([0 if flag else 1], dtype=torch.int64)
        dist.all_reduce(t, group=self.cpu_group)
        return int(t.item()) == 0


def init_tp_group(placement: TPPlacement, device: torch.device) -> TPGroup:
    """Join the group (blocks until all ranks have joined): NCCL on CUDA (plus a gloo group for the
    scheduler's broadcasts), gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=placement.init_method, rank=placement.rank,
                            world_size=placement.size, timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    group = TPGroup(placement.rank, placement.size, world, cpu_group)
    if shm_available(device, placement.nnodes):
        group.attach_shm()
    logger.info("tensor-parallel rank %d of %d joined (%s%s)", placement.rank, placement.size, backend,
                ", shared-memory collectives" if group.shm else "")
    return group


def destroy_tp_group(group: TPGroup | None = None) -> None:
    if group is not None:
        group.shm = None  # the mapping goes with the process
    if dist.is_initialized():
        dist.destroy_process_group()
