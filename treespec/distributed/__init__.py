"""Tensor parallelism (`--tp-size`): the process group (parallel_state.py), how a checkpoint splits over
the ranks (sharding.py) and the layers that talk to other ranks (parallel_layers.py)."""
