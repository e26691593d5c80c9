"""The `triton` attention backend: paged decode, prefill/extend and the KV store
as Triton kernels. GPU first; on a CPU it runs under TRITON_INTERPRET=1 (tests).

KV layout (num_blocks, block_size, kv_heads, head_dim): one token's heads are
contiguous, so a key tile is BLOCK_N rows of head_dim contiguous values.
Kernels never load a slot past a sequence's end, so unused slots may hold
anything (needs_zeroed_blocks=False).

The kernel modules import triton, and triton reads TRITON_INTERPRET when a
kernel is defined: they are imported on first use, never by `import tokenmill`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch

from tokenmill.attention.base import AttentionBackend, BackendUnavailable
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.triton.plan import TritonPlan, build_plan
from tokenmill.kernels import layer_ops

# what the compile test builds for sm_80/sm_90 (every variant launchable on CUDA);
# under the interpreter fp32 and small head dims serve tests and tiny models
# (bf16 dots are wrong under the interpreter: bf16 is proven by compilation)
CUDA_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
CUDA_HEAD_DIMS = (64, 128, 256)  # 256: Gemma 3
INTERPRETER_DTYPES = (torch.float16, torch.float32)
INTERPRETER_HEAD_DIMS = (16, 32, 64, 128, 256)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels() -> tuple[ModuleType, ModuleType, ModuleType]:
    """The kernel modules (store_kv, decode, prefill), imported on first use."""
    from tokenmill.attention.triton import decode, prefill, store_kv

    return store_kv, decode, prefill


@functools.cache
def _rotary_store() -> ModuleType:
    from tokenmill.attention.triton import rotary_store

    return rotary_store


# rotary and the KV store in one kernel (rotary_store.py); False: the two kernels, for
# an A/B (benchmarks/gpu_check.py)
FUSED_ROTARY_STORE = True


class TritonBackend(AttentionBackend):
    name = "triton"
    block_dim = 0
    needs_zeroed_blocks = False
    supports_padded_decode = True  # the store kernel skips slot < 0
    cuda_graph_capturable = True

    def __init__(self, device: torch.device, dtype: torch.dtype, *,
                 num_splits: int | None = None) -> None:
        """num_splits: force the decode split-K factor (tests); None chooses per step."""
        super().__init__(device, dtype)
        dtypes = tuple(CUDA_DTYPES) if device.type == "cuda" else INTERPRETER_DTYPES
        if dtype not in dtypes:
            raise BackendUnavailable(
                f"the triton backend runs {', '.join(map(str, dtypes))} on {device.type}, "
                f"not {dtype}; choose the torch backend for it")
        self.num_splits = num_splits
        self.num_sms = layer_ops.num_sms(device) if device.type == "cuda" else 4

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if device.type == "cuda":
            if torch.cuda.get_device_capability(device) < (8, 0):
                return "the triton kernels need compute capability 8.0 or newer"
            return None
        if device.type == "cpu":
            return None if _interpreting() else (
                "on a CPU the triton backend runs only under Triton's interpreter "
                "(TRITON_INTERPRET=1, for tests); choose the cpu or torch backend")
        return f"the triton backend runs on CUDA (or the CPU interpreter), not {device.type}"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        dims = INTERPRETER_HEAD_DIMS if self.device.type == "cpu" else CUDA_HEAD_DIMS
        if head_dim not in dims:
            raise BackendUnavailable(f"the triton backend supports head_dim {dims} on "
                                     f"{self.device.type}, not {head_dim}")
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def plan(self, meta: AttentionMetadata) -> TritonPlan:
        return build_plan(meta, self.device, self.num_sms, self.num_splits)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        store_kv, _, _ = _kernels()
        store_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def rotate_and_store(self, qk: torch.Tensor, v: torch.Tensor, num_heads: int,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata) -> bool:
        """rotary_store.py: one launch a layer where rotary and the store took two."""
        if not FUSED_ROTARY_STORE:
            return False
        return _rotary_store().rotary_store_kv(qk, v, num_heads, positions, cos, sin,
                                               k_cache, v_cache, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        _, decode, prefill = _kernels()
        plan = meta.plan if isinstance(meta.plan, TritonPlan) else self.plan(meta)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, heads, head_dim)
        if plan.num_decodes:
            decode.paged_decode(q, k_cache, v_cache, out, plan, scale, sliding_window)
        if plan.num_tiles:
            prefill.paged_prefill(q, k_cache, v_cache, out, plan, scale, sliding_window)
        return out
