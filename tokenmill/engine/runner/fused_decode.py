"""A decode step as one native call (tokenmill/kernels/decode_step.c).

At batch 1 the module path spends about as long in Python glue and OpenMP
fork/joins (~8 native calls per layer) as in arithmetic, and at batch 16 they are
still a third of the step. `FusedDecode` names every weight, norm and KV pool of a
loaded Llama-family model to the kernel once, and then runs a whole decode step (all
layers, the final norm, the LM head) in one call and one parallel region, with the
module path's own arithmetic: the same greedy tokens and the same logits to fp32
rounding. One sequence takes tm_decode_step; 2 up to `max_rows` sequences of one new
token each take tm_decode_batch (all rows through each group of weights at once). The
one difference: from VNNI_DENSE_MIN_ROWS (20) rows, where the module path's linears
switch to their dense bf16 weights, the fused step stays on the quantized-activation
kernel (see MAX_ROWS), each row computed as it is at any smaller batch. Where those
linears are gemm16 (AVX2 without native bf16: the same kernel on both paths), the
fused step takes every decode step, whatever its rows (WIDE_MAX_ROWS).

A bf16 model (`--quantization none`, the default for float checkpoints) takes it too,
up to bf16_gemv.c's 48 rows: its linears are the module path's bf16 GEMV, called from
inside the step on the plain bf16 weights (the LM head's logits rounded to bf16 and
widened, as `head(x).float()`); past them the modules' F.linear takes over, and so
does the module path.

It covers what it can prove identical, and `FusedDecode.build` returns None (the
model runner keeps the module path) for anything else; a step with a prompt chunk or
speculative verification (a row of more than one token), more than `max_rows`
rows, runs the module path. Rows sharing a prefix (a cached system prompt) read it once
for all of them, inside the call, with the cpu backend's cascade arithmetic. Covered:
`--quantization gguf-a16` / `gguf-a8` (every linear on the quantized-activation
kernel) or a bf16 model (every linear plain bf16), with a bf16 KV cache or an 8-bit
one (`--kv-cache-dtype int8 / fp8`: stored and read as the modules' tm_store_kv_q8 and
tm_paged_decode_q8 do, each row over its own blocks) on the `cpu` attention backend,
no tensor parallelism, Llama layers (with Qwen3's q/k norms; without biases but a bf16
model's, as Qwen2's q/k/v) and Gemma 3's (issue 58: the record's per-head q/k norms,
the norms of the attention and MLP outputs, each layer's RoPE table and sliding window,
GeGLU, the embedding rows scaled by sqrt(hidden) here before the call; no cascade
over a shared prefix, which has no window), and an MoE model's sparse layers (issue 59:
router, top-k and the routed experts on their GGUF records inside the call,
kernels/moe_step.h; experts kept float, a top k torch picks by partial sort, or a LoRA
adapter keep the module path). Steps with LoRA adapters take it too, any mix of adapters
and the base (`run(..., lora)`): each adapter's low-rank products are added inside the
call after each linear, its rows grouped (kernels/lora_delta.h).
TOKENMILL_FUSED_DECODE=0 turns it off (the A/B switch
for benchmarks/workloads/w3_decode.py); `enabled` does the same for one engine at run time.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from tokenmill.attention import cpu as cpu_attention
from tokenmill.attention.cpu import CpuBackend
from tokenmill.attention.kv_quant import KVFormat
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.quantized import QuantizedKVBackend, QuantizedPool
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.kernels import bf16_gemv
from tokenmill.kernels import decode_step as native
from tokenmill.models.gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3MLP,
)
from tokenmill.models.layers import Linear, RMSNorm
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tokenmill.models.lora import LoRALinear, installed_generation
from tokenmill.models.moe import MoeForCausalLM, SparseMoeBlock
from tokenmill.quant.embedding import LookupEmbedding
from tokenmill.quant.fused_mlp import FusedSiluMLP
from tokenmill.quant.linear import Int4Linear
from tokenmill.quant.moe_experts import RecordExperts
from tokenmill.quant.widened import WidenedWeight

logger = logging.getLogger(__name__)
ENV = "TOKENMILL_FUSED_DECODE"
# The most rows a fused decode step takes. Past VNNI_DENSE_MIN_ROWS (20) the module
# path runs the linears on packed bf16 weights, which beat the kernel there one call
# at a time; a whole step in one call on the kernel beats them up to here. In-process
# decode of n requests x (128 prompt + 128 new tokens), quiet, 2 threads, output tok/s
# fused on the kernel vs the modules' packed bf16: 1,024 vs 892 at 32 rows, 1,033 vs 706
# at 64, 900 vs 781 at 96, 935 vs 981 at 128 (BENCHMARKS.md, "Batched decode in one
# call"). Those rows get the kernel's quantized activations, whose accuracy the gate
# measures per row (independent of the batch: benchmarks/accuracy.py's decode mode);
# prompt chunks keep the module path and its dense weights.
MAX_ROWS = 111
# When the module path's large-batch linears are gemm16 too (WidenedWeight: AVX2
# without native bf16), both paths run the same kernel and the fused step only saves
# the glue and the fork/joins, at any batch: it takes every decode step. In-process,
# n requests x 64 cached prompt tokens, 32 new tokens, fused with no limit vs 111, 2
# threads on the busy Zen 3 host, A/B alternating: 1.01-1.21x (median 278 vs 248
# tok/s) at 128 rows, 1.02-1.19x at 200.
WIDE_MAX_ROWS = 1 << 30
# From this many rows a fused step runs the linears as gemm16 does when their large-batch
# path is it (`--batched-linears int16`, AVX2): the kernel's bits, faster than its
# per-row passes (q4q8_gemv.c). Whole fused steps on the 2-core AVX2 EPYC, per-row ÷
# gemm16 time (A/B alternating in one process): 1.00 at 8 rows, 1.12 at 16, 1.29 at 24
# and 48, 1.38 at 64; 12 lies between the tie and the first win.
WIDE_MIN_ROWS = 12
FMT_BF16 = 2  # decode_step.c: a plain (N, K) bf16 weight, with the record's bits 0
MAX_LORA_RANK = 512  # lora_delta.h's MAX_LORA_R: one linear's stacked adapter rank
MAX_TOP_K = 64  # moe_step.h's MAX_TOP_K


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").lower() not in ("0", "false", "no", "off")


def _lowbit(linear: object, bits: int | None) -> bool:
    """The module runs the quantized-activation kernel at batch 1, with no bias."""
    return (type(linear) is Int4Linear and linear.activations != "bf16"
            and linear.bias is None and (bits is None or linear.vnni_bits == bits)
            and (linear.dense_min_rows is None or linear.dense_min_rows > 1))


def _bf16(t: torch.Tensor, *shape: int) -> bool:
    return t.dtype == torch.bfloat16 and t.is_contiguous() and tuple(t.shape) == shape


def _plain_bf16(linear: object, bias: bool = True) -> bool:
    """The module is a bf16 linear (with a bf16 bias, if `bias` allows one) that runs
    bf16_gemv at a decode step's rows."""
    return (isinstance(linear, Linear) and type(linear).forward is Linear.forward
            and linear.weight.device.type == "cpu"
            and _bf16(linear.weight, linear.out_features, linear.in_features)
            and (linear.bias is None or (bias and _bf16(linear.bias, linear.out_features))))


def _plain_norm(norm: object) -> bool:
    """The shared RMSNorm's arithmetic (GemmaRMSNorm only loads its weight as 1 + w)."""
    return isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward \
        and type(norm).add_forward is RMSNorm.add_forward


def _norms(layer: torch.nn.Module, hidden: int, head_dim: int
           ) -> list[tuple[torch.nn.Module, int]]:
    """A layer's norms and their sizes: input and pre-MLP (post_attention_layernorm on a
    Llama layer, pre_feedforward_layernorm on Gemma's), then Gemma's norms of the
    attention and MLP outputs, then the q/k norms where the layer has them."""
    attn = layer.self_attn
    if type(layer) is Gemma3DecoderLayer:
        norms = [(layer.input_layernorm, hidden), (layer.pre_feedforward_layernorm, hidden),
                 (layer.post_attention_layernorm, hidden),
                 (layer.post_feedforward_layernorm, hidden)]
    else:
        norms = [(layer.input_layernorm, hidden), (layer.post_attention_layernorm, hidden)]
    if getattr(attn, "q_norm", None) is not None:
        norms += [(attn.q_norm, head_dim), (attn.k_norm, head_dim)]
    return norms


def _cpu_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)


def _moe_unsupported(block: SparseMoeBlock, hidden: int, bits: int | None) -> str | None:
    """Why a sparse MoE layer cannot run inside the step (kernels/moe_step.h); None if
    it can: its experts in their records (a GGUF's, gguf-a16 / gguf-a8) at the MLP
    activations' width `bits` (None: the first MLP seen sets it), a bf16 router,
    a top k that torch.topk picks by nth_element (the order moe_step.h reproduces)."""
    experts, gate = block.experts, block.gate
    if type(experts) is not RecordExperts:
        return ("MoE experts not in GGUF kernel records (float experts: the module path "
                "runs them)")
    if (bits is not None and experts.bits != bits) or experts.hidden != hidden:
        return "MoE experts on other activations than the other MLPs' linears"
    e, k = experts.num_experts, block.top_k
    if not 1 <= k <= MAX_TOP_K or k * 64 <= e:
        return (f"top {k} of {e} experts (the kernel takes top k with k * 64 > experts, "
                f"k <= {MAX_TOP_K})")
    if not _plain_bf16(gate, bias=False) or gate.out_features != e or gate.in_features != hidden:
        return "an MoE router that is not a bf16 (experts, hidden) linear"
    if experts.intermediate % 32 or experts.intermediate < 32:
        return f"expert width {experts.intermediate} is not a multiple of 32"
    return None


def unsupported_reason(model: torch.nn.Module, backend: object,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why `model` with this backend and pool cannot take the fused step; None if it can."""
    if not enabled_by_env():
        return f"{ENV}=0"
    gemma = type(model) is Gemma3ForCausalLM
    if type(model) not in (LlamaForCausalLM, MoeForCausalLM) and not gemma:
        return f"not a Llama-family or Gemma 3 model ({type(model).__name__})"
    if get_tp().world_size != 1:
        return "tensor parallelism"
    fmt: KVFormat | None = None  # --kv-cache-dtype int8 / fp8: the wrapped backend's pools
    if type(backend) is QuantizedKVBackend:
        fmt, backend = backend.fmt, backend.inner
    if type(backend) is not CpuBackend:
        return f"attention backend {getattr(backend, 'name', type(backend).__name__)}, not cpu"
    cfg = model.config
    if gemma and getattr(model, "softcap", None):
        return "final logit softcapping"
    inner = model.model
    hidden, d = cfg.hidden_size, cfg.head_dim
    # the activations' widths: one for the attention linears, one for the MLPs' (and the
    # LM head's); gguf-a8 runs the attention at 16 (decode_step.c's attn_bits)
    attn_bits = mlp_bits = None
    first = inner.layers[0]  # every layer must have its shapes (the kernel takes one set)
    heads, kv_heads = first.self_attn.num_heads, first.self_attn.num_kv_heads
    # every layer's linears on the quantized-activation kernel, or every one plain bf16
    # (Gemma's MLP is its own module either way: GeGLU, nothing fused into down_proj)
    if type(first.mlp) is SparseMoeBlock:  # an MoE model's first layer: its attention says
        plain = type(first.self_attn.o_proj) is not Int4Linear
    else:
        plain = (type(first.mlp) is LlamaMLP if not gemma
                 else type(first.mlp) is Gemma3MLP and _plain_bf16(first.mlp.down_proj))
    mlp_types = (Gemma3MLP,) if gemma else (FusedSiluMLP, LlamaMLP)
    dense = [layer.mlp for layer in inner.layers if type(layer.mlp) in mlp_types]
    inter = dense[0].down_proj.in_features if dense else 0
    layer_type, attn_type = ((Gemma3DecoderLayer, Gemma3Attention) if gemma
                             else (LlamaDecoderLayer, LlamaAttention))
    rotaries = (inner.rotary_emb, inner.rotary_emb_local) if gemma else (inner.rotary_emb,)
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        if type(layer) is not layer_type or type(attn) is not attn_type:
            return f"layer {i} is not a plain {'Gemma 3' if gemma else 'Llama'} layer"
        sparse = type(layer.mlp) is SparseMoeBlock
        if sparse:
            why = _moe_unsupported(layer.mlp, hidden, mlp_bits)
            if why is not None:
                return f"layer {i}: {why}"
            mlp_bits = layer.mlp.experts.bits
        linears = ((attn.qkv_proj, attn.o_proj) if sparse else
                   (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
        if gemma and (type(layer.mlp) is not Gemma3MLP or layer.mlp.approximate != "tanh"):
            return f"layer {i}: a GeGLU other than gelu's tanh approximation"
        if plain:
            if type(layer.mlp) not in mlp_types or not all(_plain_bf16(lin) for lin in linears):
                return (f"layer {i}: a linear neither on the quantized-activation kernel "
                        "(--quantization gguf-a16 / gguf-a8) nor bf16")
        else:
            if not gemma and not sparse and type(layer.mlp) is not FusedSiluMLP:
                return (f"layer {i}: its MLP does not run silu * up in the down projection "
                        "(--quantization gguf-a16 / gguf-a8)")
            attn_bits = attn_bits or getattr(attn.qkv_proj, "vnni_bits", None)
            if not sparse:
                mlp_bits = mlp_bits or getattr(layer.mlp.down_proj, "vnni_bits", None)
            if not (all(_lowbit(lin, attn_bits) for lin in linears[:2])
                    and all(_lowbit(lin, mlp_bits) for lin in linears[2:])):
                return (f"layer {i}: a linear not on the quantized-activation kernel "
                        "(--quantization gguf-a16 / gguf-a8), with a bias, or at another "
                        "activation width than its kind's in the other layers")
        for norm, size in _norms(layer, hidden, d):
            if not _plain_norm(norm) or not _bf16(norm.weight, size) \
                    or norm.eps != cfg.rms_norm_eps:
                return f"layer {i}: a norm that is not bf16 RMSNorm"
        k, v = kv_caches[i]
        if fmt is not None:  # --kv-cache-dtype int8 / fp8: bytes and their scales
            if not all(isinstance(p, QuantizedPool) and p.fmt == fmt and _cpu_contiguous(
                    p.data, p.scale) and p.scale.dtype == torch.float32 for p in (k, v)):
                return "an 8-bit KV cache not laid out as the kernel reads it"
        elif k.dtype != torch.bfloat16 or not _cpu_contiguous(k, v):
            return "a KV cache that is not bf16 on the CPU"
        shapes = [(hidden, (heads + 2 * kv_heads) * d), (heads * d, hidden),
                  (hidden, 2 * inter), (inter, hidden)]
        if (attn.attn.scale != first.self_attn.attn.scale or (not gemma and attn.attn.scale != d ** -0.5)
                or attn.head_dim != d or all(attn.rotary is not r for r in rotaries)
                or (attn.attn.sliding_window is not None and not gemma)
                or [(lin.in_features, lin.out_features) for lin in linears]
                != shapes[:len(linears)]):
            return f"layer {i}: attention or MLP shapes unlike a Llama layer's"
    for rotary in rotaries:
        if rotary.cos_cache.dtype != torch.float32 or not rotary.cos_cache.is_contiguous() \
                or not rotary.sin_cache.is_contiguous() or d % 16 or d > 1024 \
                or rotary.cos_cache.shape != rotaries[0].cos_cache.shape:
            return "rotary tables or head_dim the kernel does not take"
    if not (isinstance(inner.embed_tokens, LookupEmbedding)
            or _bf16(inner.embed_tokens.weight, cfg.vocab_size, hidden)) \
            or not _plain_norm(inner.norm) or not _bf16(inner.norm.weight, hidden):
        return "embedding or final norm not bf16"
    if not native.available():
        return "the native kernel (tokenmill/kernels/decode_step.c) could not be built"
    if plain and bf16_gemv.max_rows() < 1:
        return "the bf16 GEMV (tokenmill/kernels/bf16_gemv.c) could not be built"
    return None


class FusedDecode:
    """The model's weights, norms and KV pools named to decode_step.c, and the step."""

    def __init__(self, model: LlamaForCausalLM | Gemma3ForCausalLM,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cfg, inner = model.config, model.model
        self.enabled = True
        self.hidden, self.vocab = cfg.hidden_size, cfg.vocab_size
        layers = (native.LayerRecord * len(inner.layers))()
        gemma = type(model) is Gemma3ForCausalLM
        # a bf16 model (every linear plain bf16: unsupported_reason) or the kernel's
        self.plain = _plain_bf16(inner.layers[0].self_attn.o_proj)
        self._moe_arrays: list[object] = []  # what the MoE layers' records point into
        wide = not self.plain  # every linear's large-batch path is gemm16 (widened.py)
        for rec, layer, (k, v) in zip(layers, inner.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            norms = [norm.weight.data_ptr() for norm, _ in _norms(layer, cfg.hidden_size,
                                                                  cfg.head_dim)]
            rec.input_norm, rec.post_norm = norms[0], norms[1]
            if gemma:  # its output norms (GGUF's stored 1 + w and HF's w + 1 alike: plain)
                rec.attn_out_norm, rec.mlp_out_norm = norms[2], norms[3]
                rotary = attn.rotary
                rec.cos, rec.sin = rotary.cos_cache.data_ptr(), rotary.sin_cache.data_ptr()
                rec.window = attn.attn.sliding_window or 0
            if attn.q_norm is not None:
                rec.q_norm, rec.k_norm = norms[-2], norms[-1]
            sparse = type(mlp) is SparseMoeBlock
            if sparse:
                self._name_experts(rec, mlp)
            for name, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                              *(() if sparse else (("gate_up", mlp.gate_up_proj),
                                                   ("down", mlp.down_proj)))):
                if self.plain:
                    setattr(rec, name, lin.weight.data_ptr())
                    setattr(rec, f"{name}_fmt", FMT_BF16)
                    setattr(rec, f"{name}_bias", None if lin.bias is None else lin.bias.data_ptr())
                    continue
                setattr(rec, name, lin.vnni_packed.data_ptr())
                setattr(rec, f"{name}_fmt", lin.vnni_format)
                wide = wide and isinstance(lin.dense, WidenedWeight)
            if isinstance(k, QuantizedPool):  # 8-bit: the bytes, and their scales
                rec.k_cache, rec.v_cache = k.data.data_ptr(), v.data.data_ptr()
                rec.k_scale, rec.v_scale = k.scale.data_ptr(), v.scale.data_ptr()
            else:
                rec.k_cache, rec.v_cache = k.data_ptr(), v.data_ptr()
        first = inner.layers[0].self_attn
        head = model.lm_head
        # the MLPs' and the LM head's activation width, and the attention linears' (gguf-a8:
        # 8 and 16; unsupported_reason checked every layer agrees)
        bits = 0 if self.plain else self._mlp_bits(inner.layers)
        attn_bits = 0 if self.plain else first.qkv_proj.vnni_bits
        # the LM head runs inside the call when it is on the same kernel (the embedded
        # model's Q8_0 head is, and a bf16 model's plain one); otherwise the runner calls
        # compute_logits after it
        self.lm_head_fused = ((_plain_bf16(head, bias=False) if self.plain
                               else _lowbit(head, bits))
                              and head.out_features == cfg.vocab_size
                              and head.in_features == cfg.hidden_size
                              and type(model).compute_logits in (
                                  LlamaForCausalLM.compute_logits,
                                  Gemma3ForCausalLM.compute_logits))
        pool = kv_caches[0][0]
        # an 8-bit cache's format, as the module path's store and decode read it
        self.kv_fmt = pool.fmt if isinstance(pool, QuantizedPool) else None
        _, num_blocks, block_size, _ = (pool.data if self.kv_fmt else pool).shape
        rotary = inner.rotary_emb
        # an embedding in GGUF blocks, or Gemma's scaled by sqrt(hidden): each step's rows
        # (dequantized, scaled as the module path does) into a table of its own
        self.gguf_embed = isinstance(inner.embed_tokens, LookupEmbedding)
        self.embed_scale = (torch.tensor(inner.embed_scale, dtype=torch.bfloat16) if gemma
                            else None)
        self.row_embed = self.gguf_embed or gemma
        # the cascade (a shared prefix read once) has no sliding window
        self.windowed = any(rec.window for rec in layers)
        self.record = native.ModelRecord(
            num_layers=len(inner.layers), hidden=cfg.hidden_size, heads=first.num_heads,
            kv_heads=first.num_kv_heads, head_dim=cfg.head_dim,
            inter=self._inter(inner.layers), vocab=cfg.vocab_size,
            bits=bits, num_blocks=num_blocks, block_size=block_size,
            max_pos=rotary.cos_cache.shape[0], eps=cfg.rms_norm_eps, scale=first.attn.scale,
            embed=0 if self.row_embed else inner.embed_tokens.weight.data_ptr(),
            cos=rotary.cos_cache.data_ptr(),
            sin=rotary.sin_cache.data_ptr(), final_norm=inner.norm.weight.data_ptr(),
            lm_head=(None if not self.lm_head_fused else head.weight.data_ptr() if self.plain
                     else head.vnni_packed.data_ptr()),
            lm_head_fmt=(0 if not self.lm_head_fused else FMT_BF16 if self.plain
                         else head.vnni_format), layers=layers,
            kv_fmt=-1 if self.kv_fmt is None else self.kv_fmt.native_code,
            act=native.ACT_GELU_TANH if gemma else native.ACT_SILU,
            attn_bits=0 if attn_bits == bits else attn_bits)
        # a bf16 model's modules run bf16_gemv up to its rows, F.linear past them
        self.max_rows = min(MAX_ROWS, bf16_gemv.max_rows()) if self.plain else MAX_ROWS
        if wide and (not self.lm_head_fused or isinstance(head.dense, WidenedWeight)):
            self.record.wide_min_rows = WIDE_MIN_ROWS
            self.max_rows = WIDE_MAX_ROWS
        self._layers = layers  # the record points into it
        self._model = model  # and into these tensors: keep them alive
        # LoRA adapter id -> (its weights per linear, the LoraRecords naming them, the
        # installed_generation they were checked at)
        self._adapters: dict[int, tuple[tuple, ctypes.Array, int]] = {}

    @staticmethod
    def _mlp_bits(layers: torch.nn.ModuleList) -> int:
        """The MLPs' activation width (a dense MLP's down projection's, or the experts')."""
        mlp = layers[0].mlp
        return mlp.experts.bits if type(mlp) is SparseMoeBlock else mlp.down_proj.vnni_bits

    @staticmethod
    def _inter(layers: torch.nn.ModuleList) -> int:
        """The dense MLPs' width (an all-sparse model's: its experts')."""
        mlps = [layer.mlp for layer in layers]
        dense = [m for m in mlps if type(m) is not SparseMoeBlock]
        return dense[0].down_proj.in_features if dense else mlps[0].experts.intermediate

    def _name_experts(self, rec: native.LayerRecord, block: SparseMoeBlock) -> None:
        """A sparse layer's router, its experts' records and formats, and the read
        counters the step adds to (folded into the experts' traffic when read)."""
        experts = block.experts
        e = experts.num_experts
        gate_up = (ctypes.c_void_p * e)(*[r.data_ptr() for r in experts.gate_up_records])
        down = (ctypes.c_void_p * e)(*[r.data_ptr() for r in experts.down_records])
        gate_up_fmt = torch.tensor(experts.gate_up_formats, dtype=torch.int64)
        down_fmt = torch.tensor(experts.down_formats, dtype=torch.int64)
        reads = experts.traffic.native_counters(experts.expert_bytes)
        self._moe_arrays += [gate_up, down, gate_up_fmt, down_fmt]
        rec.router = block.gate.weight.data_ptr()
        rec.expert_gate_up = ctypes.cast(gate_up, ctypes.c_void_p)
        rec.expert_down = ctypes.cast(down, ctypes.c_void_p)
        rec.expert_gate_up_fmt, rec.expert_down_fmt = gate_up_fmt.data_ptr(), down_fmt.data_ptr()
        rec.num_experts, rec.top_k = e, block.top_k
        rec.norm_topk, rec.expert_inter = int(bool(block.norm_topk_prob)), experts.intermediate
        rec.expert_reads = reads.data_ptr()

    @classmethod
    def build(cls, model: torch.nn.Module, backend: object,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> FusedDecode | None:
        reason = unsupported_reason(model, backend, kv_caches)
        if reason is not None:
            if getattr(model, "is_moe", False):  # models/moe.py: say it once, at info
                logger.info("MoE model: decode runs the module path (routed experts grouped "
                            "by expert), not the fused native decode step: %s", reason)
            else:
                logger.debug("batch-1 decode runs the module path: %s", reason)
            return None
        assert isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM))
        return cls(model, kv_caches)

    def _linears(self) -> list[tuple[object, object, object, object]]:
        return [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj) for layer in self._model.model.layers]

    def adapter_records(self, lora_id: int) -> ctypes.Array | None:
        """Adapter `lora_id`'s LoraRecord per layer (its pairs named for the kernel); None
        when it cannot be fused (a linear not wrapped by models/lora.py, a stacked rank
        over the kernel's MAX_LORA_R, an MoE model: the module path). Rebuilt when the
        adapter is installed again (a reload after eviction: new tensors); an adapter no
        longer installed is dropped from the cache with the next one built. Checked
        against the installed weights only when an adapter was installed or removed since
        (a step's check of 120 linears per adapter cost ~1 ms)."""
        generation = installed_generation()
        cached = self._adapters.get(lora_id)
        if cached is not None and cached[2] == generation:
            return cached[1]
        if any(type(layer.mlp) is SparseMoeBlock for layer in self._model.model.layers):
            return None  # adapters on an MoE model: the module path
        linears = self._linears()
        weights = tuple(lin.adapters.get(lora_id) if isinstance(lin, LoRALinear) else False
                        for group in linears for lin in group)
        if False in weights:
            return None
        if cached is not None and all(a is b for a, b in zip(cached[0], weights)):
            self._adapters[lora_id] = (weights, cached[1], generation)
            return cached[1]
        self._forget_uninstalled(linears)
        records = (native.LoraRecord * len(linears))()
        for rec, group, i in zip(records, linears, range(0, len(weights), 4)):
            for j, lin in enumerate(group):
                w = weights[i + j]
                if w is None:
                    continue  # r 0: no delta on this linear
                pair = w.native_pair(lin.sizes)  # kept alive by w
                if pair is None or pair[0].shape[0] > MAX_LORA_RANK:
                    return None
                a, b, ranks = pair
                rec.a[j], rec.b[j], rec.r[j] = a.data_ptr(), b.data_ptr(), a.shape[0]
                for p, r in enumerate(ranks):
                    rec.part_r[j][p] = r
        self._adapters[lora_id] = (weights, records, generation)
        return records

    def _forget_uninstalled(self, linears: list) -> None:
        """Drop cached records whose weights are no longer the installed ones (an adapter
        unloaded or evicted): they held its tensors alive."""
        flat = [lin for group in linears for lin in group]
        for lora_id, (weights, _, _) in list(self._adapters.items()):
            if any(w is not None and lin.adapters.get(lora_id) is not w
                   for lin, w in zip(flat, weights)):
                del self._adapters[lora_id]

    def forget_adapters(self) -> None:
        self._adapters.clear()

    def takes(self, query_lens: list[int], logit_rows: list[int]) -> bool:
        """A decode step of one token per sequence, at most `max_rows` of them, that
        samples every row (the model runner asks before it plans the step: this one
        needs no attention plan)."""
        n = len(query_lens)
        return (self.enabled and 1 <= n <= self.max_rows and logit_rows == list(range(n))
                and all(q == 1 for q in query_lens))

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
            lora: dict[int, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(logits (B, vocab) fp32 or None, final hidden states (B, hidden) bf16) for the
        step's B rows; None when the kernel refuses an input (nothing written: the
        module path then runs and reports it) or an adapter cannot be fused. `lora`:
        adapter id -> the rows that run under it (models/lora.py's groups; the base's
        rows absent)."""
        if not lora:
            return self._run(ids, pos, meta)
        records = [self.adapter_records(lora_id) for lora_id in lora]
        if any(r is None for r in records):
            return None
        row_slot = torch.full((ids.numel(),), -1, dtype=torch.int64)
        for slot, rows in enumerate(lora.values()):
            row_slot[rows.cpu()] = slot
        return self._run(ids, pos, meta, records, row_slot)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
             loras: list[ctypes.Array] | None = None, row_slot: torch.Tensor | None = None
             ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        tables = meta.block_tables
        n = ids.numel()
        if (tables.dtype != torch.int32 or not tables.is_contiguous() or tables.dim() != 2
                or tables.shape[0] != n
                or tables.shape[1] * meta.block_size < max(meta.seq_lens_list)):
            return None
        shared = 0
        if n > 1 and self.kv_fmt is None and not self.windowed:
            # a shared prefix (a cached system prompt): read once for all rows, as the
            # modules' cascade call does, instead of once per row (W5: 7.2 s vs 8.3 s);
            # with an 8-bit cache every row reads its own blocks, as tm_paged_decode_q8 does
            shared = cpu_attention.shared_blocks(tables.tolist(), meta.seq_lens_list,
                                                 meta.block_size)
            shared = shared if cpu_attention.takes_cascade(shared, n) else 0
        hidden = torch.empty((n, self.hidden), dtype=torch.bfloat16)
        logits = torch.empty((n, self.vocab), dtype=torch.float32) if self.lm_head_fused \
            else None
        if self.row_embed:  # the step's rows as the table, the ids their row numbers
            rows = self._model.model.embed_tokens(ids.reshape(-1))
            if self.embed_scale is not None:  # Gemma: as Gemma3Model.forward scales them
                rows = rows * self.embed_scale
            rows = rows.contiguous()
            self.record.embed = rows.data_ptr()
            ids = torch.arange(n)
        if n == 1:
            rc = native.step(self.record, int(ids.item()), int(pos.item()),
                             int(meta.slot_mapping.item()), tables,
                             meta.seq_lens_list[0], hidden, logits,
                             loras[int(row_slot[0])] if loras and row_slot[0] >= 0 else None)
        else:
            def i64(t: torch.Tensor) -> torch.Tensor:
                return t.to(torch.int64).contiguous()
            args = (self.record, i64(ids), i64(pos), i64(meta.slot_mapping), tables,
                    torch.tensor(meta.seq_lens_list, dtype=torch.int64), hidden, logits, shared)
            rc = native.step_batch(*args, loras, row_slot) if loras else native.step_batch(*args)
        if rc == -2:
            raise MemoryError("fused decode step: no scratch memory")
        return None if rc else (logits, hidden)
