"""explain's MoE part: routed-expert bytes per token, measured and floor, and the lever.

At batch 1 a token reads only its k experts per layer (the active-expert floor);
a batch of B tokens reads the union of what they chose, E·(1-(1-k/E)^B) experts per
layer under uniform routing, so expert bytes per token fall with B only as fast as
tokens share experts: far more slowly than a dense model's weights, which every
token of the batch shares. The engine counts the expert bytes it actually read
(`engine.moe_expert_bytes`, CPU path): that, per token, is held against both.
"""

from __future__ import annotations

from tokenmill.roofline import fmt
from tokenmill.roofline.arch import ModelArch, WeightBits


def expert_bytes_per_token(arch: ModelArch, bits: WeightBits, batch: float) -> float:
    """Routed-expert bytes per token of a step of `batch` tokens (uniform routing)."""
    per_expert = arch.expert_params() * bits.experts / 8
    return arch.num_moe_layers * arch.expected_distinct_experts(batch) * per_expert / batch


def moe_note(arch: ModelArch, bits: WeightBits, batch: float, engine: dict | None) -> str:
    """One line: measured routed-expert bytes per token (where the engine counted them)
    against the active-expert floor at batch 1 and the expectation at this batch."""
    floor = expert_bytes_per_token(arch, bits, 1)
    here = expert_bytes_per_token(arch, bits, batch)
    every = arch.routed_expert_params() * bits.experts / 8
    line = (f"MoE: routed-expert bytes per token: active-expert floor (k={arch.num_experts_per_tok}"
            f" of {arch.num_experts}) {fmt.num_bytes(floor)}, expected at batch {batch:.3g} "
            f"{fmt.num_bytes(here)} (all experts: {fmt.num_bytes(every)})")
    moved = (engine or {}).get("moe_expert_bytes") or 0
    tokens = ((engine or {}).get("num_prefill_tokens") or 0) + \
        ((engine or {}).get("num_decode_tokens") or 0)
    if moved and tokens:
        line += (f"; measured {fmt.num_bytes(moved / tokens)} per token over prefill and decode"
                 f" ({moved / tokens / floor:.2f}× the floor)")
    return line


def expert_sharing_why(arch: ModelArch, bits: WeightBits, batch: float, target: float) -> str:
    """Why a bigger batch helps an MoE decode less than a dense one."""
    now = arch.expected_distinct_experts(batch)
    then = arch.expected_distinct_experts(target)
    return (f"batching amortizes experts only when tokens share them: {now:.3g} → {then:.3g} "
            f"of {arch.num_experts} experts read per layer, expert bytes per token "
            f"{fmt.num_bytes(expert_bytes_per_token(arch, bits, batch))} → "
            f"{fmt.num_bytes(expert_bytes_per_token(arch, bits, target))}")
