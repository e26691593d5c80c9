"""Rank 0's side of tensor parallelism: start the local workers, join them, drive them.

On node 0 the engine process is rank 0; it starts ranks 1 .. ranks_per_node - 1
as `python -m tokenmill.engine.executor.worker` processes (other nodes start theirs
with `tokenmill worker`), joins the group, and broadcasts its EngineConfig so
that every rank builds the same model from one source of truth. Then every
step is broadcast as the runner runs it (`send_step`). A local worker that
exits is seen by polling its process before each step (and by the engine
core's heartbeat thread, between steps); a remote one by the next collective,
which raises as soon as its sockets close.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
from typing import Any

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.launch import LaunchConfig, launch_config
from tokenmill.distributed.parallel_state import (
    ParallelState,
    TensorParallelError,
    destroy_parallel,
    init_parallel,
)
from tokenmill.engine.executor.join_watch import TeedWorker, join_watching
from tokenmill.loaders import ModelSource, load_model_config, resolve_model

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0


def check_shapes(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError naming the first dimension the ranks cannot split evenly."""
    n = world_size
    kv = config.num_key_value_heads
    problems = [(config.num_attention_heads, "num_attention_heads"),
                (config.intermediate_size, "intermediate_size"),
                (config.vocab_size, "vocab_size")]
    if config.num_experts:  # MoE: every expert's intermediate dimension is split (models/moe.py)
        problems.append((config.moe_intermediate_size, "moe_intermediate_size"))
    for size, what in problems:
        if size % n:
            raise ValueError(f"--tensor-parallel-size {n} does not divide the model's {what} "
                             f"({size}); choose a size that divides it")
    if (kv % n) if kv >= n else (n % kv):
        raise ValueError(f"--tensor-parallel-size {n} and the model's num_key_value_heads "
                         f"({kv}) do not split: the size must divide the KV heads, or be a "
                         "multiple of them (each KV head then replicated)")


def check_tensor_parallel(config: EngineConfig) -> None:
    """The launch flags agree and the model splits over the ranks (reads only the
    model's config); ValueError otherwise, before anything is started."""
    launch = launch_config(config)
    if launch.world_size > 1:
        check_shapes(load_model_config(resolve_model(config.model, need_weights=False)),
                     launch.world_size)


def rank_device(device: torch.device, launch: LaunchConfig, rank: int) -> torch.device:
    """CUDA: one GPU per rank on its node; CPU: the CPU."""
    if device.type != "cuda":
        return device
    index = launch.local_index(rank)
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank {rank} needs GPU {index} on its node, which "
                         f"has {torch.cuda.device_count()}")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cpu_threads_per_rank(launch: LaunchConfig) -> int:
    return max(1, (os.cpu_count() or 1) // launch.ranks_per_node)


class WorkerGroup:
    def __init__(self, launch: LaunchConfig, procs: dict[int, TeedWorker],
                 tp: ParallelState) -> None:
        self.launch = launch
        self.procs = procs  # rank -> process, the workers on this node
        self.tp = tp
        self.rank_parameter_bytes: list[int] = []
        self._broken: str | None = None
        self._closed = False
        atexit.register(self.close)  # an LLM nobody closed: stop the workers, leave the group

    def attach(self, runner: Any, parameter_bytes: int) -> None:
        """Drive `runner`'s steps; learn every rank's weight bytes (the workers send them)."""
        runner.driver = self
        self.rank_parameter_bytes = self.tp.gather_object(parameter_bytes) or []
        logger.info("tensor parallel over %d ranks (%d node(s)): weights per rank %s MiB",
                    self.tp.world_size, self.launch.nnodes,
                    ", ".join(f"{b / 2**20:.1f}" for b in self.rank_parameter_bytes))

    def dead_worker(self) -> str | None:
        if self._broken is not None:
            return self._broken
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                self._broken = (f"tensor-parallel rank {rank} (pid {proc.pid}) exited "
                                f"with code {code}")
                return self._broken
        return None

    def send_step(self, inputs: Any) -> None:
        reason = self.dead_worker()
        if reason is not None:
            raise TensorParallelError(reason)
        try:
            self.tp.broadcast_object(inputs)
        except TensorParallelError as e:
            self._broken = str(e)
            raise

    def mark_broken(self, reason: str) -> None:
        """The group is out of step (rank 0 failed inside a step, or at start-up): the
        workers wait in a collective that will never complete, so close() kills them."""
        self._broken = self._broken or reason

    def close(self) -> None:
        """Tell the workers to stop, wait for the local ones, leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.dead_worker() is None:
            try:
                self.tp.broadcast_object(None)
            except TensorParallelError:
                pass
        else:  # a broken group: the workers left alive cannot be told to stop
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        self.procs = {}
        destroy_parallel()


def start_workers(config: EngineConfig, source: ModelSource,
                  device: torch.device) -> WorkerGroup | None:
    """None for one rank. Otherwise start this node's workers and join the group as
    rank 0; returns once every rank (on every node) has joined and has the config."""
    launch = launch_config(config)
    if launch.world_size == 1:
        return None
    if launch.node_rank != 0:
        raise ValueError(f"--node-rank {launch.node_rank}: the engine runs on node 0; start "
                         "the other nodes with `tokenmill worker` (docs/tensor-parallel.md)")
    launch = launch.with_port()
    own_device = rank_device(device, launch, 0)
    threads = cpu_threads_per_rank(launch)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)  # the ranks share this node's cores
    procs = {rank: _spawn(launch, rank, threads, device.type)
             for rank in launch.local_ranks if rank != 0}
    try:
        tp = join_watching(lambda: init_parallel(0, launch.world_size, launch.master_addr,
                                                 launch.master_port, own_device), procs)
        tp.broadcast_object(config)
    except BaseException:
        for proc in procs.values():
            proc.kill()
        raise
    return WorkerGroup(launch, procs, tp)


def worker_command(launch: LaunchConfig, rank: int, device_kind: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.engine.executor.worker", "--device", device_kind,
            "--tensor-parallel-size", str(launch.world_size), "--nnodes", str(launch.nnodes),
            "--node-rank", str(launch.node_rank), "--master-addr", launch.master_addr,
            "--master-port", str(launch.master_port), "--rank", str(rank),
            "--parent-pid", str(os.getpid())]


def _spawn(launch: LaunchConfig, rank: int, threads: int, device_kind: str) -> TeedWorker:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return TeedWorker(worker_command(launch, rank, device_kind), env)
