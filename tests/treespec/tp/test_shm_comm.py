"""The shared-memory collectives' failure mode: a rank waiting on a peer that died raises instead of
spinning forever (gloo would see the peer's socket close; shared memory has no such signal)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from treespec.distributed.shm_comm import PeerDied, ShmExchange


def test_waiting_on_a_dead_rank_raises():
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    shm = ShmExchange(0, 2, None)
    try:
        shm.pids[1] = gone.pid
        with pytest.raises(PeerDied, match="rank 1"):
            shm.all_reduce(torch.ones(4))
    finally:
        shm.unlink()
    assert not os.path.exists(shm.path)
