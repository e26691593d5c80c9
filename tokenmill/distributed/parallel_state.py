"""This process's place in the tensor-parallel group, and the collectives the model calls.

One state per process (a process is one rank). With a world of one every
collective is the identity and nothing is counted, so a single-device model
runs the same code. Two groups, as vLLM keeps them: `group` carries the
model's tensors (NCCL on CUDA, gloo on CPUs) and `control` (always gloo, on
the host) carries Python objects: the step's inputs rank 0 broadcasts, and the
start-up agreement on the KV block count. A worker waits for the next step on
`control`, possibly for as long as the server idles, so its timeout is long;
a rank that dies closes its sockets and the others' next collective raises at
once (gloo: "Connection closed by peer"), which is how death is noticed.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.distributed.errors import TensorParallelError

__all__ = ["ParallelState", "TensorParallelError", "destroy_parallel", "get_tp",
           "init_parallel"]

logger = logging.getLogger(__name__)

STEP_TIMEOUT = datetime.timedelta(minutes=10)  # one collective inside a step
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for the next step


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # dist.ProcessGroup for tensors
    control: Any = None  # dist.ProcessGroup (gloo) for objects
    device: torch.device | None = None
    all_reduce_calls: int = 0  # model all-reduces so far (the tests count them)
    # seconds spent inside them, waiting for the slowest rank included (benchmarks)
    all_reduce_s: float = 0.0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal slice of `size`; raises if it does not divide."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel "
                             f"size ({self.world_size})")
        n = size // self.world_size
        return self.rank * n, n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the partial sums of a row-parallel linear)."""
        if self.world_size == 1:
            return x
        self.all_reduce_calls += 1
        t0 = time.perf_counter()
        _collective(dist.all_reduce, x, group=self.group)
        self.all_reduce_s += time.perf_counter() - t0
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's (N, V / world) slice, concatenated on rank 0 to (N, V); the
        other ranks get an unread tensor of that shape (only rank 0 samples)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        _collective(dist.gather, x, parts, dst=0, group=self.group)
        if parts is None:
            return x.new_empty((*x.shape[:-1], x.shape[-1] * self.world_size))
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj, on every rank."""
        box = [obj]
        _collective(dist.broadcast_object_list, box, src=0, group=self.control)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's obj, in rank order, on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_driver else None
        _collective(dist.gather_object, obj, out, dst=0, group=self.control)
        return out

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the KV block count all ranks can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        _collective(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def _collective(fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except (RuntimeError, ValueError) as e:  # gloo / NCCL errors are RuntimeErrors
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise TensorParallelError(f"a tensor-parallel collective failed ({first_line}); "
                                  "a rank has probably died") from e


_state = ParallelState()


def get_tp() -> ParallelState:
    return _state


def init_parallel(rank: int, world_size: int, master_addr: str, master_port: int,
                  device: torch.device) -> ParallelState:
    """Join the group (blocks until every rank has joined) and make it this process's."""
    global _state
    if world_size == 1:
        _state = ParallelState(device=device)
        return _state
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _state = ParallelState(rank, world_size, dist.group.WORLD, control, device)
    logger.info("tensor-parallel rank %d of %d joined (%s, master %s:%d)", rank, world_size,
                backend, master_addr, master_port)
    return _state


def destroy_parallel() -> None:
    """Leave the group; this process is a world of one again."""
    global _state
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # a peer already gone
            pass
    _state = ParallelState()
