"""The KV-transfer wire format: msgpack headers (msgspec) and raw block bytes.

A pull is one ZMQ request/reply on a DEALER -> ROUTER connection:
  consumer -> producer: [PullRequest]
  producer -> consumer: [PullReply, frame_0, ..., frame_{n-1}]   (error: [PullReply])
Frames, in order: for each layer, K then V; for each, its tensors (a plain pool: the
K or V tensor; an int8/fp8 pool: its bytes, then its fp32 scales). Each frame holds the
pulled blocks one after another in the pool's own layout, as little-endian bytes, so a
frame is `index_select` of the blocks along the pool's block dimension. The layout
(`KVLayout`) travels in both messages: a pull whose layout differs from the producer's
is refused before any bytes move, the error naming the first field that differs.
"""

from __future__ import annotations

import warnings

import msgspec
import numpy as np
import torch

PROTOCOL_VERSION = 1


class KVLayout(msgspec.Struct, frozen=True):
    """What must match between two engines for one's KV bytes to mean the same in the
    other's pool; the fields are compared in this order."""

    protocol: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # torch dtype of the stored values: bfloat16, float32, int8, ...
    kv_format: str  # "plain", or the 8-bit format name (its scales travel too)
    block_dim: int
    tensor_shapes: list[list[int]]  # one block of each frame's tensor, its block dim 1


class PullRequest(msgspec.Struct, tag="pull"):
    request_id: str  # the producer's request id (kv_transfer_params.remote_request_id)
    block_ids: list[int]  # the producer's blocks (kv_transfer_params.remote_block_ids)
    layout: KVLayout


class PullReply(msgspec.Struct, tag="blocks"):
    request_id: str
    error: str | None = None  # set: no frames follow
    field: str | None = None  # the layout field that differs, or the request field at fault
    layout: KVLayout | None = None
    num_tokens: int = 0  # tokens whose KV the blocks hold (the prompt)
    prompt_token_ids: list[int] = []
    frame_bytes: list[int] = []  # each frame's size, checked on arrival


Message = PullRequest | PullReply
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Message)


def pool_tensors(kv_caches: list) -> list[torch.Tensor]:
    """Every tensor of the pool, in frame order (see the module docstring)."""
    out = []
    for k, v in kv_caches:
        for side in (k, v):
            out += [side.data, side.scale] if hasattr(side, "scale") else [side]
    return out


def layout_of(kv_caches: list, block_size: int, block_dim: int) -> KVLayout:
    first = kv_caches[0][0]
    quantized = hasattr(first, "scale")
    data = first.data if quantized else first
    shape = list(data.shape)
    shape[block_dim] = 1
    # the pool's shapes are (kv_heads, blocks, block_size, head_dim) on every backend here
    heads, head_dim = data.shape[0], data.shape[-1]
    shapes = []
    for t in pool_tensors(kv_caches[:1])[: 2 if quantized else 1]:
        s = list(t.shape)
        s[block_dim] = 1
        shapes.append(s)
    return KVLayout(PROTOCOL_VERSION, block_size, len(kv_caches), heads, head_dim,
                    str(data.dtype).removeprefix("torch."),
                    first.fmt.name if quantized else "plain", block_dim, shapes)


def layout_mismatch(mine: KVLayout, theirs: KVLayout) -> str | None:
    """The first field in which two layouts differ, or None."""
    for name in KVLayout.__struct_fields__:
        if getattr(mine, name) != getattr(theirs, name):
            return name
    return None


def describe_mismatch(name: str, mine: KVLayout, theirs: KVLayout, mine_is: str) -> str:
    other = "consumer" if mine_is == "producer" else "producer"
    return (f"KV layout mismatch in {name}: the {mine_is} has {getattr(mine, name)!r}, "
            f"the {other} {getattr(theirs, name)!r} (both instances need the same model, "
            f"--block-size, --dtype and --kv-cache-dtype)")


def gather_blocks(kv_caches: list, block_ids: list[int], block_dim: int) -> list:
    """The frames of `block_ids`: copies, as contiguous uint8 numpy arrays (buffers ZMQ
    sends without another copy). On a CPU the copy is numpy's, not torch's: it runs on
    the transport's thread, where a torch parallel region would start a second OpenMP
    team beside the engine's (measured: seconds per pull on 2 busy cores)."""
    out = []
    idx = None
    for t in pool_tensors(kv_caches):
        raw = t.view(torch.uint8)
        if raw.device.type == "cpu":
            out.append(np.take(raw.numpy(), block_ids, axis=block_dim).reshape(-1))
        else:
            if idx is None:
                idx = torch.tensor(block_ids, dtype=torch.int64, device=raw.device)
            out.append(raw.index_select(block_dim, idx).cpu().reshape(-1).numpy())
    return out


def frame_sizes(kv_caches: list, num_blocks: int, block_dim: int) -> list[int]:
    return [t.nbytes // t.shape[block_dim] * num_blocks for t in pool_tensors(kv_caches)]


def scatter_blocks(kv_caches: list, block_ids: list[int], block_dim: int,
                   frames: list) -> None:
    """Write the frames (bytes-like, sizes checked by the caller) into `block_ids`:
    one slice copy per run of adjacent blocks (a fresh table is mostly one run), which
    is far faster than index_copy_ on byte tensors on a CPU."""
    runs = _runs(block_ids)
    for t, frame in zip(pool_tensors(kv_caches), frames, strict=True):
        raw = t.view(torch.uint8)  # bytes: one copy for every dtype (fp8 has no kernels)
        shape = list(raw.shape)
        shape[block_dim] = len(block_ids)
        if raw.device.type == "cpu":
            dst, src = raw.numpy(), np.frombuffer(frame, dtype=np.uint8).reshape(shape)
        else:
            with warnings.catch_warnings():  # a received frame is read-only; only read
                warnings.simplefilter("ignore", UserWarning)
                dst = raw
                src = torch.frombuffer(frame, dtype=torch.uint8).view(shape).to(t.device)
        for at, start, n in runs:
            index = (slice(None),) * block_dim
            dst[(*index, slice(start, start + n))] = src[(*index, slice(at, at + n))]


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(offset in block_ids, first block, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            at, start, n = runs[-1]
            runs[-1] = (at, start, n + 1)
        else:
            runs.append((i, b, 1))
    return runs
