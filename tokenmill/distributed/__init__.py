"""Tensor parallelism on torch.distributed (gloo on CPUs, NCCL on GPUs).

parallel_state: the process group, rank and world size, and the counted
collectives the model calls; launch: where the ranks meet (flags or the
torchrun-style environment) and which ranks run on this node. The processes
themselves (the worker group rank 0 spawns and watches, the loop a worker rank
runs: `tokenmill worker`) live in tokenmill/engine/executor/, above the engine
they run; this package sits below models/, quant/ and engine/.
"""
