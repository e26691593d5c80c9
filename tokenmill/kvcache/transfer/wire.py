"""The KV-transfer wire format: msgpack headers (msgspec) and raw block bytes.

Messages go over a DEALER -> ROUTER connection the consumer keeps open per producer;
every message gets exactly one reply, so a kept connection stays in step:
  consumer -> producer: [PullRequest]
  producer -> consumer: [PullReply, frame, ...]       (error: [PullReply], no frames)
  consumer -> producer: [Release]                     (the consumer will never pull)
  producer -> consumer: [Released]
The payload is the segments of every pool tensor back to back, in order:
for each layer, K then V; for each, its tensors (a plain pool: the K or V tensor; an
int8/fp8 pool: its bytes, then its fp32 scales). A segment holds the pulled blocks one
after another in the pool's own layout, as little-endian bytes (`index_select` of the
blocks along the pool's block dimension); `PullReply.segment_bytes` gives each one's
size. It goes in a few large frames, each whole segments of up to FRAME_BYTES in all
(one bigger segment: a frame of its own; `PullReply.frame_segments` gives each frame's
count): a receive buffer over glibc's 32 MiB mmap ceiling would be fresh pages on every
pull. The layout (`KVLayout`) travels in the pull: a pull whose layout differs from the
producer's is refused before any bytes move, the error naming the first field that
differs.
"""

from __future__ import annotations

import warnings

import msgspec
import numpy as np
import torch

PROTOCOL_VERSION = 2  # 2: one payload frame, Release


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
    segment_bytes: list[int] = []  # each pool tensor's segment of the payload, checked
    frame_segments: list[int] = []  # how many segments each payload frame holds


class Release(msgspec.Struct, tag="release"):
    """The consumer will not pull request_id's blocks (its client left, or its pull
    failed): the producer drops the pin now instead of at pin_timeout_s."""

    request_id: str


class Released(msgspec.Struct, tag="released"):
    request_id: str
    freed: bool  # False: nothing pinned under that id (already pulled, expired, unknown)


Message = PullRequest | PullReply | Release | Released
FRAME_BYTES = 8 << 20


def frame_groups(segment_bytes: list[int], max_bytes: int = FRAME_BYTES) -> list[int]:
    """Consecutive segments per frame, each frame at most max_bytes unless one segment
    alone is bigger."""
    counts: list[int] = []
    size = 0
    for b in segment_bytes:
        if counts and size + b <= max_bytes:
            counts[-1] += 1
            size += b
        else:
            counts.append(1)
            size = b
    return counts
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


def gather_blocks(kv_caches: list, block_ids: list[int], block_dim: int,
                  out: np.ndarray) -> np.ndarray:
    """The payload of `block_ids` written into `out` (uint8, at least `payload_bytes`
    long; the transport's reused staging buffer), returned trimmed. On a CPU the copy
    is numpy's, not torch's: it runs on the transport's thread, where a torch parallel
    region would start a second OpenMP team beside the engine's (measured: seconds per
    pull on 2 busy cores). One slice copy per tensor and run of adjacent blocks (a
    prefill's blocks are mostly one run), one gather per tensor otherwise."""
    runs = _runs(block_ids)
    idx = None
    at = 0
    for t in pool_tensors(kv_caches):
        raw = t.view(torch.uint8)
        shape = list(raw.shape)
        shape[block_dim] = len(block_ids)
        size = raw.nbytes // raw.shape[block_dim] * len(block_ids)
        dst = out[at:at + size].reshape(shape)
        at += size
        if raw.device.type == "cpu":
            _copy_blocks(dst, raw.numpy(), runs, block_ids, block_dim, gather=True)
        else:
            if idx is None:
                idx = torch.tensor(block_ids, dtype=torch.int64, device=raw.device)
            torch.from_numpy(dst).copy_(raw.index_select(block_dim, idx))
    return out[:at]


def segment_sizes(kv_caches: list, num_blocks: int, block_dim: int) -> list[int]:
    return [t.nbytes // t.shape[block_dim] * num_blocks for t in pool_tensors(kv_caches)]


def scatter_blocks(kv_caches: list, block_ids: list[int], block_dim: int,
                   segments: list) -> None:
    """Write the segments (bytes-like, one per pool tensor, sizes checked by the caller)
    into `block_ids`: one slice copy per tensor and run of adjacent blocks (a fresh
    table is mostly one run), one fancy-index copy per tensor when it is scattered."""
    runs = _runs(block_ids)
    for t, segment in zip(pool_tensors(kv_caches), segments, strict=True):
        raw = t.view(torch.uint8)  # bytes: one copy for every dtype (fp8 has no kernels)
        shape = list(raw.shape)
        shape[block_dim] = len(block_ids)
        src = np.frombuffer(segment, dtype=np.uint8).reshape(shape)
        if raw.device.type == "cpu":
            _copy_blocks(raw.numpy(), src, runs, block_ids, block_dim, gather=False)
        else:
            with warnings.catch_warnings():  # a received frame is read-only; only read
                warnings.simplefilter("ignore", UserWarning)
                src_t = torch.from_numpy(src).to(t.device)
            idx = torch.tensor(block_ids, dtype=torch.int64, device=t.device)
            raw.index_copy_(block_dim, idx, src_t)


_MANY_RUNS = 4  # past this many runs one fancy-index copy beats a slice copy per run


def _copy_blocks(dst: np.ndarray, src: np.ndarray, runs: list[tuple[int, int, int]],
                 block_ids: list[int], block_dim: int, gather: bool) -> None:
    """gather: dst[block i] = src[block_ids[i]]; else dst[block_ids[i]] = src[block i]."""
    index = (slice(None),) * block_dim
    if len(runs) > _MANY_RUNS:
        ids = np.asarray(block_ids, dtype=np.intp)
        if gather:
            np.take(src, ids, axis=block_dim, out=dst, mode="clip")  # ids checked upstream
        else:
            dst[(*index, ids)] = src
        return
    for at, start, n in runs:
        pool_part, wire_part = (*index, slice(start, start + n)), (*index, slice(at, at + n))
        if gather:
            dst[wire_part] = src[pool_part]
        else:
            dst[pool_part] = src[wire_part]


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
