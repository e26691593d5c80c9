"""gpu_check.py's MoE rows (issue 59): the Triton fused-MoE kernel against the grouped
torch path, and decode at Qwen3-30B-A3B shapes (24 of its 48 layers, so bf16 weights
and the KV cache fit an 80 GB GPU; tiny shapes under --smoke) held against the
active-expert floor: the weights a step must read are the attention's, the routers'
and the LM head's, plus per layer the distinct experts the batch's tokens chose
(k at batch 1; E·(1-(1-k/E)^B) expected under uniform routing at batch B), plus KV.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

QWEN3_30B_A3B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 24,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8}
TINY_MOE = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 64, "num_experts": 8,
            "num_experts_per_tok": 2}


def moe_config(shapes: dict[str, int], dtype: str, max_pos: int) -> dict[str, Any]:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **shapes,
            "norm_topk_prob": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "max_position_embeddings": max_pos, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype}


def fused_moe_error(device: torch.device, dtype: torch.dtype) -> float:
    """Max abs error of triton_moe.fused_moe against the grouped torch path in float64,
    Qwen3-MoE's 128 experts top-8 at a tiny width, 1 and 9 tokens."""
    from tokenmill.kernels.triton_moe import fused_moe
    from tokenmill.models.moe_compute import grouped_experts, route

    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for tokens in (1, 9):
        x = torch.randn(tokens, 64, generator=g)
        w13 = torch.randn(128, 64, 64, generator=g) * 0.1
        w2 = torch.randn(128, 64, 32, generator=g) * 0.1
        weights, ids = route(torch.randn(tokens, 128, generator=g), 8, True)
        want = grouped_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
        got = fused_moe(x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype),
                        weights.to(device), ids.to(device))
        worst = max(worst, float((got.double().cpu() - want).abs().max()))
    return worst


def active_weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens must read: every parameter but the
    embedding table and the routed experts, plus the expected distinct experts' bytes."""
    from tokenmill.models.moe import Experts

    dense = experts = 0.0
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            e = module.num_experts
            k = model.config.num_experts_per_tok
            distinct = e * (1 - (1 - k / e) ** batch)
            per_expert = sum(p.nbytes for p in module.parameters()) / e
            experts += distinct * per_expert
    for name, p in model.named_parameters():
        if "embed_tokens" not in name and ".experts." not in name:
            dense += p.nbytes
    return dense + experts


def moe_rows(check: Any, tmp: Path, gpu_check: Any) -> None:
    """Append the MoE rows to `check` (a gpu_check.Check); `gpu_check`: that module, as
    it runs (a script: __main__), for its Row, sig and write_tokenizer."""
    Row, sig, write_tokenizer = gpu_check.Row, gpu_check.sig, gpu_check.write_tokenizer
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    on_gpu = check.device.type == "cuda"
    kernel_dtype = torch.bfloat16 if on_gpu else torch.float32
    err = fused_moe_error(check.device, kernel_dtype)
    check.rows.append(Row("correctness", "fused MoE kernel vs grouped experts", f"{err:.2e}",
                          "max abs", floor="< 3e-2" if on_gpu else "< 1e-5",
                          note="128 experts top-8, 1 and 9 tokens (triton_moe)"))
    shapes = QWEN3_30B_A3B if on_gpu else TINY_MOE
    label = "Qwen3-30B-A3B shapes, 24 layers" if on_gpu else "tiny MoE shapes"
    path = tmp / "moe-speed"
    path.mkdir()
    plan = check.plan
    (path / "config.json").write_text(json.dumps(
        moe_config(shapes, check.engine_dtype_name, plan.max_model_len)))
    write_tokenizer(path, shapes["vocab_size"])
    engine = LLMEngine(EngineConfig(
        model=str(path), dtype=check.engine_dtype_name, device=check.device.type,
        load_format="dummy", attention_backend="triton", max_num_seqs=64,
        max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
        cache=CacheConfig(num_kv_blocks=plan.num_kv_blocks, enable_prefix_caching=False)))
    model = engine.runner.model
    kv_token = 2 * shapes["num_hidden_layers"] * shapes["num_key_value_heads"] * \
        shapes["head_dim"] * torch.empty((), dtype=engine.dtype).element_size()
    for batch in (1, 64):
        rng = random.Random(batch)
        steps = plan.warmup_steps + plan.timed_steps
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"m{i}", [rng.randrange(3, shapes["vocab_size"])
                                         for _ in range(plan.context)], params)
        seqs = [s for r in engine.requests.values() for s in r.seqs]
        while any(s.num_output_tokens == 0 for s in seqs):
            engine.step()
        for _ in range(plan.warmup_steps):
            engine.step()
        check.sync()
        t0 = time.perf_counter()
        for _ in range(plan.timed_steps):
            engine.step()
        check.sync()
        step_s = (time.perf_counter() - t0) / plan.timed_steps
        engine.abort_request(list(engine.requests))
        ctx = plan.context + plan.warmup_steps + plan.timed_steps / 2
        floor_s = (active_weight_bytes(model, batch) + batch * ctx * kv_token) / (
            check.bandwidth_gb_s * 1e9)
        value, unit = ((sig(step_s * 1e3), "ms/token") if batch == 1
                       else (sig(batch / step_s), "tok/s"))
        floor = f"{floor_s * 1e3:.3f} ms" if batch == 1 else f"{batch / floor_s:.0f} tok/s"
        check.rows.append(Row("speed", f"MoE batch {batch} decode ({label})", value, unit,
                              floor=floor, vs_floor=f"{100 * floor_s / step_s:.1f}% of bandwidth",
                              note="floor: active-expert bytes (expected distinct experts)"))
        check.progress()
    del engine, model
    check.free()
