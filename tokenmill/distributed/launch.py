"""Where the ranks of a tensor-parallel group meet, and which of them run on this node.

The flags are torchrun's (`--nnodes`, `--node-rank`, `--master-addr`,
`--master-port`) and default to the environment variables torchrun and cluster
schedulers use (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT). Ranks are laid
out node by node: with N ranks on M nodes, node k runs ranks k*N/M ..
(k+1)*N/M - 1. Node 0 runs rank 0, the engine; every other rank is a worker.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from typing import Any

DEFAULT_MASTER_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int = 1  # --tensor-parallel-size
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (single node only)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if self.nnodes < 1:
            raise ValueError("--nnodes must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size ({self.world_size}) must be a multiple "
                             f"of --nnodes ({self.nnodes}): every node runs as many ranks")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a multi-node launch needs --master-port (or MASTER_PORT), "
                             "the same on every node")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port, got {self.master_port}")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def local_index(self, rank: int) -> int:
        """The rank's index on its node (its GPU there)."""
        return rank - self.node_rank * self.ranks_per_node

    def with_port(self) -> LaunchConfig:
        """This config with a concrete master port (a free one when none was given)."""
        if self.master_port:
            return self
        with socket.socket() as s:
            s.bind((self.master_addr, 0))
            port = s.getsockname()[1]
        return LaunchConfig(self.world_size, self.nnodes, self.node_rank, self.master_addr, port)


def env_default(name: str, fallback: str) -> str:
    return os.environ.get(name) or fallback


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size and torchrun's rendezvous flags (their env names as defaults)."""
    g = parser.add_argument_group("tensor parallelism (docs/tensor-parallel.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (heads, MLP and vocabulary), one "
                   "process each: gloo on CPUs, NCCL on GPUs (default 1)")
    g.add_argument("--nnodes", type=int, default=int(env_default("NNODES", "1")),
                   help="nodes the ranks run on (default $NNODES or 1); node 0 runs the "
                   "engine, the others run `tokenmill worker`")
    g.add_argument("--node-rank", type=int, default=int(env_default("NODE_RANK", "0")),
                   help="this node's index (default $NODE_RANK or 0)")
    g.add_argument("--master-addr", default=env_default("MASTER_ADDR", "127.0.0.1"),
                   help="address of node 0, where the ranks meet (default $MASTER_ADDR "
                   "or 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=int(env_default("MASTER_PORT", "0")),
                   help="TCP port on node 0 where the ranks meet (default $MASTER_PORT; on "
                   "one node a free port)")


def launch_config(config: Any) -> LaunchConfig:
    """The LaunchConfig of an EngineConfig (duck-typed: its tensor-parallel fields)."""
    return LaunchConfig(config.tensor_parallel_size, config.nnodes, config.node_rank,
                        config.master_addr, config.master_port)
