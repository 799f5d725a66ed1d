"""The tensor-parallel flags: each bad value is an error naming its flag; which ranks a node runs."""

from __future__ import annotations

import pytest

from treespec.args import ArgError, ServerArgs
from treespec.server.tp_launch import local_placements


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"tp_size": 0}, "--tp-size"),
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "--nnodes"),
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank"),
    ({"tp_size": 2, "nnodes": 2}, "--dist-init-addr"),
    ({"tp_size": 2, "dist_init_addr": "no-port"}, "--dist-init-addr"),
    ({"tp_size": 2, "dist_init_addr": "h:99999"}, "--dist-init-addr"),
])
def test_bad_tp_flags_name_the_flag(kwargs, flag):
    with pytest.raises(ArgError, match=flag):
        ServerArgs(speculative_algorithm="NONE", **kwargs).resolve()


def test_each_node_runs_its_own_ranks():
    args = dict(speculative_algorithm="NONE", tp_size=4, nnodes=2, dist_init_addr="10.0.0.1:5000")
    node0 = local_placements(ServerArgs(**args, node_rank=0).resolve())
    node1 = local_placements(ServerArgs(**args, node_rank=1).resolve())
    assert [(n, p.rank) for n, p in node0] == [("scheduler", 0), ("scheduler-tp1", 1)]
    assert [(n, p.rank) for n, p in node1] == [("scheduler-tp2", 2), ("scheduler-tp3", 3)]
    assert {p.init_method for _, p in node0 + node1} == {"tcp://10.0.0.1:5000"}
    assert all(p.size == 4 and p.ranks_per_node == 2 for _, p in node0 + node1)
    single = local_placements(ServerArgs(speculative_algorithm="NONE", tp_size=2).resolve())
    assert [p.rank for _, p in single] == [0, 1] and single[0][1].init_addr.startswith("127.0.0.1:")
