"""Bytes and FLOPs per step, the step-time floor, what fits in memory, and $ per token.

A step's floor is max(bytes ÷ bandwidth, FLOPs ÷ peak): the time the step would take if
it only moved its bytes at full bandwidth, or only did its math at full rate. With
tensor parallelism over N devices, bandwidth, FLOP/s and memory scale by N (communication
is not modeled), and so does the price.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tokenmill.roofline.arch import ModelArch, WeightBits
from tokenmill.roofline.hardware import Hardware, bandwidth_basis

# share of device memory usable for weights + KV (the rest: activations, allocator, runtime)
MEMORY_FRACTION = 0.90


def cost_per_million_tokens(cost_per_hour: float, tokens_per_s: float) -> float:
    """$ per 1M tokens = $/hour ÷ (tokens/s × 3600) × 10⁶."""
    return cost_per_hour / (tokens_per_s * 3600.0) * 1e6


def fleet_cost(num_gpus: int, hours: float, cost_per_hour: float) -> float:
    return num_gpus * hours * cost_per_hour


@dataclass(frozen=True)
class StepFloor:
    num_tokens: int  # tokens processed in the step (decode: the batch; prefill: the prompt)
    weight_bytes: float  # weight bytes the step reads
    kv_bytes: float  # KV bytes it reads (decode) or writes (prefill)
    flops: float
    memory_time_s: float
    compute_time_s: float
    attention_linear_flops: float = 0.0  # of `flops`, the attention's linears'

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved; above the ridge point the step is compute-bound."""
        return self.flops / self.bytes

    @property
    def time_s(self) -> float:
        return max(self.memory_time_s, self.compute_time_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_time_s >= self.compute_time_s else "compute"


@dataclass(frozen=True)
class Machine:
    """The hardware as the model sees it: N devices of one kind, one compute dtype."""

    hardware: Hardware
    num_gpus: int
    compute_dtype: str
    attention_dtype: str | None = None  # the attention's linears' peak, where it differs

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.hardware.memory_bandwidth_bytes_s * self.num_gpus

    @property
    def peak_flops(self) -> float:
        return self.hardware.flops(self.compute_dtype) * self.num_gpus

    @property
    def attention_peak_flops(self) -> float | None:
        """The attention's linears' peak where attention_dtype sets one, else None."""
        if self.attention_dtype is None:
            return None
        return self.hardware.flops(self.attention_dtype) * self.num_gpus

    @property
    def memory_bytes(self) -> float:
        return self.hardware.memory_bytes * self.num_gpus

    @property
    def ridge_intensity(self) -> float:
        return self.peak_flops / self.bandwidth_bytes_s

    def floor(self, num_tokens: int, weight_bytes: float, kv_bytes: float,
              flops: float, attention_linear_flops: float = 0.0) -> StepFloor:
        """attention_linear_flops: the part of `flops` in the attention's linears, held
        against attention_dtype's peak where there is one (gguf-a8's int16 attention:
        half int8's rate on VNNI)."""
        bytes_moved = weight_bytes + kv_bytes
        compute_s = flops / self.peak_flops
        if (peak := self.attention_peak_flops) is not None:
            compute_s += attention_linear_flops * (1.0 / peak - 1.0 / self.peak_flops)
        return StepFloor(num_tokens, weight_bytes, kv_bytes, flops,
                         bytes_moved / self.bandwidth_bytes_s, compute_s, attention_linear_flops)


def machine_for(hardware: Hardware, num_gpus: int, bits: WeightBits) -> Machine:
    """The machine as `bits` computes on it: its matmuls' peak, and the attention's
    where that differs (held against the same dtype: no second peak)."""
    attention = bits.attention_compute_dtype
    attention_peak = None if attention is None else hardware.peak_dtype(attention)
    compute = hardware.peak_dtype(bits.compute_dtype)
    return Machine(hardware, num_gpus, compute,
                   None if attention_peak == compute else attention_peak)


def decode_step(arch: ModelArch, bits: WeightBits, machine: Machine, batch: int,
                context: int, kv_bytes_per_element: float) -> StepFloor:
    """One decode step: `batch` sequences each add one token, attending to `context` tokens."""
    weight_bytes = bits.bytes_read_per_step(arch, batch)
    kv_bytes = batch * (arch.kv_bytes_at_context(context, kv_bytes_per_element)
                        + arch.kv_bytes_per_token(kv_bytes_per_element))  # read + append
    flops = batch * (2.0 * arch.matmul_params_per_token() + arch.attention_flops_per_token(context))
    return machine.floor(batch, weight_bytes, kv_bytes, flops,
                         batch * 2.0 * arch.attention_linear_params_per_token())


def prefill_step(arch: ModelArch, bits: WeightBits, machine: Machine, prompt_len: int,
                 kv_bytes_per_element: float) -> StepFloor:
    """One prompt in one step; logits only for its last token (what serving engines do)."""
    weight_bytes = bits.bytes_read_per_step(arch, prompt_len)
    kv_bytes = arch.kv_bytes_at_context(prompt_len, kv_bytes_per_element)  # written once
    flops = (2.0 * prompt_len * arch.matmul_params_per_token(with_lm_head=False)
             + 2.0 * arch.vocab_size * arch.hidden_size
             + arch.prefill_attention_flops(prompt_len))
    return machine.floor(prompt_len, weight_bytes, kv_bytes, flops,
                         prompt_len * 2.0 * arch.attention_linear_params_per_token())


def max_batch_that_fits(arch: ModelArch, bits: WeightBits, machine: Machine, context: int,
                        kv_bytes_per_element: float) -> int:
    """Sequences of `context` tokens whose KV fits beside the weights (0: weights don't fit)."""
    free = machine.memory_bytes * MEMORY_FRACTION - bits.weight_bytes(arch)
    per_sequence = arch.kv_bytes_at_context(context, kv_bytes_per_element)
    return max(0, int(free // per_sequence)) if per_sequence > 0 else 0


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    step: StepFloor
    tok_s_per_user: float
    tok_s_total: float
    cost_per_1m_output_tokens: float
    fits: bool

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            "bytes_per_step": self.step.bytes,
            "weight_bytes_per_step": self.step.weight_bytes,
            "kv_bytes_per_step": self.step.kv_bytes,
            "flops_per_step": self.step.flops,
            "arithmetic_intensity": self.step.intensity,
            "bound": self.step.bound,
            "step_floor_ms": self.step.time_s * 1e3,
            "tpot_floor_ms": self.step.time_s * 1e3,
            "tok_s_per_user": self.tok_s_per_user,
            "tok_s_total": self.tok_s_total,
            "cost_per_1m_output_tokens": self.cost_per_1m_output_tokens,
            "fits_in_memory": self.fits,
        }


@dataclass(frozen=True)
class RooflineReport:
    model: str
    hardware: Hardware
    machine: Machine
    dtype: str
    kv_dtype: str
    total_params: int
    active_params: int
    weight_bytes: float
    kv_bytes_per_token: float
    kv_bytes_per_sequence: float
    prompt_len: int
    output_len: int
    context: int
    cost_per_hour: float  # for all num_gpus devices
    rows: list[DecodeRow]
    prefill: StepFloor
    max_batch: int
    notes: list[str]

    def to_dict(self) -> dict:
        hw = self.hardware
        return {
            "model": self.model,
            "hardware": {"name": hw.name, "description": hw.description,
                         "memory_bandwidth_bytes_s": hw.memory_bandwidth_bytes_s,
                         "peak_flops": hw.peak_flops, "memory_bytes": hw.memory_bytes,
                         "source": hw.source, "bandwidth_basis": bandwidth_basis(hw),
                         "num_gpus": self.machine.num_gpus,
                         "compute_dtype": self.machine.compute_dtype,
                         **({"measured": hw.measured} if hw.measured else {})},
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "context": self.context,
            "ridge_intensity": self.machine.ridge_intensity,
            "cost_per_hour": self.cost_per_hour,
            "max_batch": self.max_batch,
            "decode": [row.to_dict() for row in self.rows],
            "prefill": {**asdict(self.prefill), "bytes": self.prefill.bytes,
                        "arithmetic_intensity": self.prefill.intensity,
                        "bound": self.prefill.bound,
                        "ttft_floor_ms": self.prefill.time_s * 1e3},
            "notes": self.notes,
        }


KV_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}


def analyze(arch: ModelArch, bits: WeightBits, hardware: Hardware, *, batches: list[int],
            prompt_len: int, output_len: int, context: int, kv_dtype: str, num_gpus: int = 1,
            cost_per_hour: float | None = None) -> RooflineReport:
    kv_bpe = KV_BYTES[kv_dtype]
    machine = machine_for(hardware, num_gpus, bits)
    price = (hardware.cost_per_hour if cost_per_hour is None else cost_per_hour) * num_gpus
    fit = max_batch_that_fits(arch, bits, machine, context, kv_bpe)
    rows = []
    for batch in batches:
        step = decode_step(arch, bits, machine, batch, context, kv_bpe)
        total = batch / step.time_s
        rows.append(DecodeRow(batch, step, 1.0 / step.time_s, total,
                              cost_per_million_tokens(price, total), batch <= fit))
    notes = []
    if fit == 0:
        notes.append(f"weights ({bits.weight_bytes(arch) / 1e9:.1f} GB) do not fit in "
                     f"{MEMORY_FRACTION:.0%} of {machine.memory_bytes / 1e9:.0f} GB: "
                     "add --num-gpus or quantize (--dtype)")
    if arch.max_position_embeddings and context > arch.max_position_embeddings:
        notes.append(f"context {context} exceeds the model's max_position_embeddings "
                     f"{arch.max_position_embeddings}")
    if arch.is_moe:
        notes.append("MoE: routed experts read per step = expected distinct experts under "
                     "uniform routing, E·(1-(1-k/E)^batch) per layer")
    return RooflineReport(
        model=arch.name, hardware=hardware, machine=machine, dtype=bits.name, kv_dtype=kv_dtype,
        total_params=arch.total_params(), active_params=arch.active_params(),
        weight_bytes=bits.weight_bytes(arch),
        kv_bytes_per_token=arch.kv_bytes_per_token(kv_bpe),
        kv_bytes_per_sequence=arch.kv_bytes_at_context(context, kv_bpe),
        prompt_len=prompt_len, output_len=output_len, context=context, cost_per_hour=price,
        rows=rows, prefill=prefill_step(arch, bits, machine, prompt_len, kv_bpe),
        max_batch=fit, notes=notes,
    )
