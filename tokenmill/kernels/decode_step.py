"""A whole decode step in one native call (decode_step.c): the ctypes side.

`ModelRecord` / `LayerRecord` mirror the C structs that name every weight, norm and
KV pool by address; `tokenmill/engine/runner/fused_decode.py` fills them once from a loaded
model and keeps the tensors alive. `step` runs one token, `step_batch` one token for
each of several sequences; either adds LoRA adapters' deltas (`LoraRecord`, one per
layer of an adapter: lora_delta.h) after each linear.
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.kernels.build import Library

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class LayerRecord(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", _PTR), ("o", _PTR),
                ("gate_up", _PTR), ("down", _PTR), ("qkv_fmt", _I64), ("o_fmt", _I64),
                ("gate_up_fmt", _I64), ("down_fmt", _I64), ("k_cache", _PTR),
                ("v_cache", _PTR), ("qkv_bias", _PTR), ("o_bias", _PTR), ("gate_up_bias", _PTR),
                ("down_bias", _PTR), ("k_scale", _PTR), ("v_scale", _PTR),
                # Gemma 3 (None / 0 on a Llama layer): per-head q/k norms, the attention's
                # and the MLP's output norms, the layer's own rotary tables, its window
                ("q_norm", _PTR), ("k_norm", _PTR), ("attn_out_norm", _PTR),
                ("mlp_out_norm", _PTR), ("cos", _PTR), ("sin", _PTR), ("window", _I64),
                # a sparse MoE layer (num_experts 0: dense; kernels/moe_step.h): the router
                # (E, hidden) bf16, arrays of E record pointers and E formats (int64) for
                # gate_up and down, top_k, norm_topk, the experts' width, and (E + 1,)
                # int64 read counters or None
                ("router", _PTR), ("expert_gate_up", _PTR), ("expert_down", _PTR),
                ("expert_gate_up_fmt", _PTR), ("expert_down_fmt", _PTR),
                ("num_experts", _I64), ("top_k", _I64), ("norm_topk", _I64),
                ("expert_inter", _I64), ("expert_reads", _PTR)]


class LoraRecord(ctypes.Structure):
    """One layer of an adapter, per linear (qkv, o, gate_up, down): A (r, K) bf16
    (every targeted sub-projection's A stacked along the rank), B bf16 (each targeted
    sub-projection's scaled B as (rows / 16, rank / 2, 16, 2), one after the other), the
    rank r and each sub-projection's rank, even (q, k, v / o / gate, up / down; 0: not
    targeted): lora_delta.h's layouts, models/lora.py's native_pair. r 0: no delta on the
    linear."""
    _fields_ = [("a", _PTR * 4), ("b", _PTR * 4), ("r", _I64 * 4), ("part_r", (_I64 * 3) * 4)]


class ModelRecord(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("head_dim", _I64), ("inter", _I64), ("vocab", _I64), ("bits", _I64),
                ("num_blocks", _I64), ("block_size", _I64), ("max_pos", _I64),
                ("eps", _F32), ("scale", _F32), ("embed", _PTR), ("cos", _PTR), ("sin", _PTR),
                ("final_norm", _PTR), ("lm_head", _PTR), ("lm_head_fmt", _I64),
                ("layers", ctypes.POINTER(LayerRecord)), ("wide_min_rows", _I64),
                # -1: bf16 pools; else the 8-bit pools' FMT_* (paged_decode.c): k_cache /
                # v_cache then hold the bytes, k_scale / v_scale their scales
                ("kv_fmt", _I64),
                # the MLP's activation: ACT_SILU (0) or ACT_GELU_TANH (1, Gemma's GeGLU)
                ("act", _I64),
                # the attention linears' (qkv, o) activation width where it is not `bits`
                # (the MLP's and the LM head's): gguf-a8's 16; 0 `bits` too
                ("attn_bits", _I64)]


ACT_SILU, ACT_GELU_TANH = 0, 1


_lib = Library("decode_step", {
    "tm_decode_step_abi": ([], _I64),
    "tm_decode_step": ([ctypes.POINTER(ModelRecord), _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR,
                        _PTR, _I64], _I64),
    "tm_decode_batch": ([ctypes.POINTER(ModelRecord), _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64,
                         _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64], _I64),
    "tm_moe_layer": ([ctypes.POINTER(ModelRecord), _I64, _PTR, _I64, _PTR, _I64], _I64),
})


def available() -> bool:
    """Built, and its structs are laid out as ModelRecord / LayerRecord say."""
    abi = _lib.get("tm_decode_step_abi")
    return abi is not None and abi() == (ctypes.sizeof(ModelRecord) * 1000
                                         + ctypes.sizeof(LayerRecord))


def step(model: ModelRecord, token: int, pos: int, slot: int, table: torch.Tensor,
         seq_len: int, hidden_out: torch.Tensor, logits: torch.Tensor | None,
         lora: ctypes.Array | None = None) -> int:
    """One token through every layer, the final norm and (with `logits`) the LM head.
    table: the sequence's block-table row, int32 contiguous; hidden_out (hidden,) bf16;
    logits (vocab,) fp32; lora: the sequence's adapter (a LoraRecord per layer), None the
    base. Returns the kernel's code: 0, -1 an input out of range (nothing written), -2
    no scratch."""
    fn = _lib.get("tm_decode_step")
    return fn(ctypes.byref(model), token, pos, slot, table.data_ptr(), seq_len,
              hidden_out.data_ptr(), None if logits is None else logits.data_ptr(),
              None if lora is None else ctypes.addressof(lora), torch.get_num_threads())


def step_batch(model: ModelRecord, tokens: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
               hidden_out: torch.Tensor, logits: torch.Tensor | None,
               shared_blocks: int = 0, loras: list[ctypes.Array] | None = None,
               row_slot: torch.Tensor | None = None) -> int:
    """One token for each of B sequences through every layer, the final norm and (with
    `logits`) the LM head. tokens, positions, slots, seq_lens: (B,) int64 contiguous;
    tables (B, width) int32 contiguous, the block-table rows; shared_blocks: 0, or the
    leading blocks every row's table has in common, attended once for all rows (the cpu
    backend's cascade, same bits); hidden_out (B, hidden) bf16; logits (B, vocab) fp32;
    loras: the step's adapters (each a LoraRecord per layer), row_slot (B,) int64
    contiguous: each row's index into `loras`, -1 the base. Returns the kernel's code,
    as `step`."""
    fn = _lib.get("tm_decode_batch")
    slots_arr = None
    if loras:
        slots_arr = (_PTR * len(loras))(*(ctypes.addressof(lo) for lo in loras))
    return fn(ctypes.byref(model), tokens.shape[0], tokens.data_ptr(), positions.data_ptr(),
              slots.data_ptr(), tables.data_ptr(), tables.shape[1], shared_blocks,
              seq_lens.data_ptr(),
              hidden_out.data_ptr(), None if logits is None else logits.data_ptr(),
              len(loras) if loras else 0, slots_arr,
              None if not loras or row_slot is None else row_slot.data_ptr(),
              torch.get_num_threads())


def moe_layer(model: ModelRecord, layer: int, x: torch.Tensor) -> torch.Tensor | None:
    """Sparse layer `layer`'s MLP alone, as a step runs it (kernels/moe_step.h): x (B,
    hidden) bf16 contiguous, the post-attention norm's output -> (B, hidden) bf16; None
    when the kernel refuses the layer. For tests against the module path."""
    y = torch.empty_like(x)
    rc = _lib.get("tm_moe_layer")(ctypes.byref(model), layer, x.data_ptr(), x.shape[0],
                                   y.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise MemoryError("moe_layer: no scratch memory")
    return None if rc else y
