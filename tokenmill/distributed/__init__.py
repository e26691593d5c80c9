"""Tensor parallelism on torch.distributed (gloo on CPUs, NCCL on GPUs).

parallel_state: the process group, rank and world size, and the counted
collectives the model calls; launch: where the ranks meet (flags or the
torchrun-style environment) and which ranks run on this node; worker_group:
the local worker processes rank 0 spawns and watches; worker: the loop a
worker rank runs (`tokenmill worker`, `python -m tokenmill.distributed.worker`).
"""
