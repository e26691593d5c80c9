"""The hardware floor for the benchmarks, from `tokenmill roofline --hardware cpu`.

The CPU micro-benchmark underestimates bandwidth on a loaded machine, so the
floors default to PERFORMANCE.md's quiet-machine ceilings (read 47 GB/s, bf16
435 GFLOP/s on small shapes); pass other figures to see the floor they imply.
`explain` / `floor_lines` hold a run (W1, W2, W4, W5) against this CPU's measured
figures with `tokenmill explain`, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

QUIET_READ_GB_S = 47.0
# vdpbf16ps zmm's ceiling on the 2 cores (tokenmill/roofline/ceiling.py: 3.69 G a second a
# core × 64 FLOPs), not torch's 435 GFLOP/s matmul: a floor must bound every kernel
QUIET_BF16_TFLOP_S = 0.473

# engine weight format -> roofline --dtype ("gguf": the embedded file's own tensors, Q4_1
# linears and the tied embedding / LM head Q8_0, which the GGUF paths run as stored)
ROOFLINE_DTYPE = {"gguf": "gguf", "gguf-a8": "gguf", "gguf-a16": "gguf", "int4": "int4",
                  "int8": "int8"}


def roofline_dtype(quantization: str | None, torch_dtype: str) -> str:
    if quantization in ROOFLINE_DTYPE:
        return ROOFLINE_DTYPE[quantization]
    return "fp32" if "float32" in torch_dtype else "bf16"


def roofline(weight_dtype: str, *, prompt_len: int, output_len: int, batch: int = 1,
             bandwidth_gb_s: float = QUIET_READ_GB_S,
             tflop_s: float = QUIET_BF16_TFLOP_S, context: int | None = None,
             model: str = "smollm2-135m") -> dict:
    """`tokenmill roofline MODEL --hardware cpu --json` with these figures."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "roofline", model,
           "--hardware", "cpu", "--json", "--dtype", weight_dtype,
           "--bandwidth", str(bandwidth_gb_s), "--flops", str(tflop_s),
           "--batch", str(batch), "--prompt-len", str(prompt_len),
           "--output-len", str(output_len)]
    if context is not None:
        cmd += ["--context", str(context)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def decode_floor_ms(weight_dtype: str, prompt_len: int, output_len: int,
                    bandwidth_gb_s: float = QUIET_READ_GB_S, model: str = "smollm2-135m"
                    ) -> float:
    """Batch-1 TPOT floor: (weight + KV bytes read per step) / bandwidth, the KV at the
    mean context of the steps a TPOT averages (prompt_len + output_len / 2 tokens)."""
    r = roofline(weight_dtype, prompt_len=prompt_len, output_len=output_len,
                 bandwidth_gb_s=bandwidth_gb_s, context=prompt_len + output_len // 2,
                 model=model)
    return r["decode"][0]["step_floor_ms"]


# vpdpbusd zmm's ceiling: twice vdpbf16ps's operations a cycle (the ceiling measured
# 933 against 463 G a second on the 2 cores)
INT8_OVER_BF16 = 2.0


def prefill_int8_share(gguf: str) -> str:
    """Which of a prompt's linear FLOPs the engine's default runs at int8 on this CPU:
    "all" (Gemma 3: every linear on its records at 8 bits), "mlp" (the MLP at 8 bits,
    the attention's linears at bf16 or int16, both half int8's rate) or "none" (no
    int8 kernel here: AVX2)."""
    from gguf import GGUFReader

    from tokenmill.config import GGUF_INT8_ATTENTION_ARCHITECTURES
    from tokenmill.quant.mlp_int8 import available

    if not available():
        return "none"
    field = GGUFReader(gguf).fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    return "all" if f"{arch.capitalize()}ForCausalLM" in GGUF_INT8_ATTENTION_ARCHITECTURES \
        else "mlp"


def prefill_floor_ms(prompt_len: int, tflop_s: float = QUIET_BF16_TFLOP_S,
                     model: str = "smollm2-135m", int8_share: str = "none") -> float:
    """TTFT floor of one prompt: max(FLOPs / matmul rate, bytes / bandwidth). With
    int8_share "mlp", every FLOP but the attention's linears' is held against int8's
    rate (INT8_OVER_BF16 x tflop_s: the attention's score FLOPs too, which keeps it a
    floor); "all": every FLOP. Otherwise all at the bf16 rate."""
    r = roofline("bf16", prompt_len=prompt_len, output_len=1, tflop_s=tflop_s, model=model)
    p = r["prefill"]
    if int8_share == "none":
        return p["ttft_floor_ms"]
    bf16 = 0.0 if int8_share == "all" else p["attention_linear_flops"]
    compute_s = bf16 / (tflop_s * 1e12) + (p["flops"] - bf16) / (INT8_OVER_BF16 * tflop_s * 1e12)
    return 1e3 * max(p["memory_time_s"], compute_s)


def explain(result: dict, model: str | None = None) -> dict:
    """`tokenmill explain --json --hardware cpu [--model MODEL]` on a result (tokenmill
    bench's JSON shape): the run against this CPU's measured floor, as a user would hold
    it. `model`: the file the servers ran (a server on a GGUF file names it by its base
    name). A failure raises ValueError with explain's own message."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="explain-") as f:
        json.dump(result, f)
        f.flush()
        cmd = [sys.executable, "-m", "tokenmill.cli", "explain", f.name, "--json",
               "--hardware", "cpu", *(["--model", model] if model else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ValueError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                             else f"exit status {done.returncode}")
        return json.loads(done.stdout)


def floor_lines(ex: dict) -> list[str]:
    """explain's distance to the floor in a few lines: the decode step (TPOT), or a
    prefill-only run's TTFT, and for an engine-side run the whole run's forward time,
    each against its floor; the figures the floor used; the verdict."""
    lines = []
    if d := ex.get("decode"):
        shared = d.get("shared_prefill_tokens_per_step") or 0
        lines.append(f"decode step {d['measured_step_ms']:.1f} ms against a "
                     f"{d['floor_step_ms']:.1f} ms floor ({d['fraction_of_floor']:.0%} of it; "
                     f"batch {d['batch']:.3g}, {d['bound']}-bound"
                     + (f", {shared:.0f} joining prompt tokens a step" if shared else "") + ")")
    if (p := ex.get("prefill")) and not ex.get("decode"):  # a prefill-only run (W4)
        lines.append(f"prefill (TTFT p50) {p['measured_ttft_ms']:.0f} ms against a "
                     f"{p['floor_ttft_ms']:.0f} ms floor for {p['prompt_tokens']:,} tokens "
                     f"({p['fraction_of_floor']:.0%} of it; {p['bound']}-bound)")
    if (e := ex.get("engine")) and "forward_floor_s" in e:
        lines.append(f"whole run's forward {e['time_s']['forward']:.1f} s against a "
                     f"{e['forward_floor_s']:.1f} s floor ({e['fraction_of_floor']:.0%} of it); "
                     f"{e['overhead_share']:.0%} of step time outside the forward")
    attention = ("" if not ex.get("attention_compute_dtype") else
                 f" (the attention's linears at {ex['attention_compute_dtype']}: "
                 f"{ex['attention_peak_flops'] / 1e9:.0f} GFLOP/s)")
    lines.append(f"floor figures: {ex['dtype']} weights, {ex['compute_dtype']} peak "
                 f"{ex['peak_flops'] / 1e9:.0f} GFLOP/s{attention}, "
                 f"{ex['memory_bandwidth_bytes_s'] / 1e9:.1f} GB/s ({ex['bandwidth_basis']})")
    lines.append(f"explain: {ex['bottleneck']}")
    return lines
