"""A tensor-parallel worker: `tokenmill worker` (tokenmill/cli/worker.py) /
`python -m tokenmill.engine.executor.worker`.

On node 0 the engine starts its local workers itself (one process per rank,
`--rank` given). On every other node the user runs this command once with the
same `--tensor-parallel-size`, `--nnodes`, `--master-addr` and `--master-port`
as the engine and that node's `--node-rank`; it runs the node's first rank and
starts the others. Everything else (model, dtype, cache sizes) comes from rank
0's EngineConfig, broadcast at start-up, so the nodes cannot disagree on it.

A worker builds its shard exactly as rank 0 does (engine/runner/rank_model.py), then
loops: receive a step from rank 0, run it on its shard (taking part in the
all-reduces and the logits gather), until rank 0 says stop or goes away.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys

logger = logging.getLogger("tokenmill.engine.executor.worker")

_PR_SET_PDEATHSIG = 1


def add_worker_args(ap: argparse.ArgumentParser) -> None:
    from tokenmill.distributed.launch import add_launch_args

    add_launch_args(ap)
    ap.add_argument("--rank", type=int, default=None,
                    help=argparse.SUPPRESS)  # one rank only (started by rank 0 or this command)
    ap.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="the engine's device kind: gloo on cpu, NCCL on cuda (auto: cuda "
                    "when there is one; it must match the engine's)")
    ap.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"])


def run_from_args(args: argparse.Namespace) -> int:
    from tokenmill.distributed.launch import LaunchConfig

    try:
        launch = LaunchConfig(args.tensor_parallel_size, args.nnodes, args.node_rank,
                              args.master_addr, args.master_port)
        rank_label = args.rank if args.rank is not None else launch.local_ranks[0]
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s "
                            f"%(name)s[rank {rank_label}]: %(message)s")
        if launch.world_size == 1:
            raise ValueError("a worker needs --tensor-parallel-size of 2 or more")
        if args.rank is None and launch.node_rank == 0:
            raise ValueError("node 0 runs the engine (tokenmill serve / generate / LLM with "
                             "tensor_parallel_size), which starts its own workers")
    except ValueError as e:
        print(f"tokenmill worker: error: {e}", file=sys.stderr)
        return 2
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    if args.rank is not None:
        return run_rank(launch, args.rank, args.device)
    ranks = list(launch.local_ranks)
    from tokenmill.engine.executor.worker_group import cpu_threads_per_rank

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(launch)))
    children = [subprocess.Popen([sys.executable, "-m", "tokenmill.engine.executor.worker",
                                  *_launch_argv(launch), "--rank", str(r),
                                  "--device", args.device,
                                  "--parent-pid", str(os.getpid())], env=env)
                for r in ranks[1:]]
    code = run_rank(launch, ranks[0], args.device)
    for child in children:
        code = code or child.wait()
    return code


def _launch_argv(launch) -> list[str]:
    return ["--tensor-parallel-size", str(launch.world_size), "--nnodes", str(launch.nnodes),
            "--node-rank", str(launch.node_rank), "--master-addr", launch.master_addr,
            "--master-port", str(launch.master_port)]


def run_rank(launch, rank: int, device_kind: str = "auto") -> int:
    """Join, build this rank's shard, run steps until rank 0 stops or dies."""
    import torch

    from tokenmill.distributed.parallel_state import (
        TensorParallelError,
        destroy_parallel,
        init_parallel,
    )
    from tokenmill.engine.core.builder import check_startup_choices
    from tokenmill.engine.executor.worker_group import cpu_threads_per_rank, rank_device
    from tokenmill.engine.runner.rank_model import build_rank_model
    from tokenmill.loaders import resolve_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads_per_rank(launch))
    if device_kind == "auto":
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    device = rank_device(torch.device(device_kind), launch, rank)
    try:
        tp = init_parallel(rank, launch.world_size, launch.master_addr, launch.master_port,
                           device)
        config = tp.broadcast_object()
        if check_startup_choices(config).type != device.type:
            logger.error("rank %d runs on %s but the engine's device is %s; start the "
                         "worker with --device %s", rank, device.type, config.device,
                         check_startup_choices(config).type)
            return 2
        source = resolve_model(config.model, need_weights=config.load_format != "dummy")
        built = build_rank_model(config, source, device)
        tp.gather_object(built.parameter_bytes)
        logger.info("rank %d ready: %.1f MiB of weights, %d KV blocks", rank,
                    built.parameter_bytes / 2**20, built.num_blocks)
        built.precompile.start()  # each rank its own, off the start-up path
        with torch.inference_mode():
            while True:
                inputs = tp.broadcast_object()
                if inputs is None:
                    break
                built.runner.run_step(inputs)
    except TensorParallelError as e:
        logger.error("rank %d: %s; exiting", rank, e)
        return 1
    destroy_parallel()
    logger.info("rank %d stopped", rank)
    return 0


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the collectives notice rank 0's exit
        pass
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died while we started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill worker",
                                 description="a tensor-parallel worker (see docs/tensor-parallel.md)")
    add_worker_args(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
