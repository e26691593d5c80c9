"""The hardware floor for the benchmarks, from `tokenmill roofline --hardware cpu`.

The CPU micro-benchmark underestimates bandwidth on a loaded machine, so the
floors default to PERFORMANCE.md's quiet-machine ceilings (read 47 GB/s, bf16
435 GFLOP/s on small shapes); pass other figures to see the floor they imply.
"""

from __future__ import annotations

import json
import subprocess
import sys

QUIET_READ_GB_S = 47.0
QUIET_BF16_TFLOP_S = 0.435

# engine weight format -> roofline --dtype (the GGUF path runs Q4_1 blocks natively)
ROOFLINE_DTYPE = {"gguf": "q4_1", "gguf-a8": "q4_1", "gguf-a16": "q4_1", "int4": "int4", "int8": "int8"}


def roofline_dtype(quantization: str | None, torch_dtype: str) -> str:
    if quantization in ROOFLINE_DTYPE:
        return ROOFLINE_DTYPE[quantization]
    return "fp32" if "float32" in torch_dtype else "bf16"


def roofline(weight_dtype: str, *, prompt_len: int, output_len: int, batch: int = 1,
             bandwidth_gb_s: float = QUIET_READ_GB_S,
             tflop_s: float = QUIET_BF16_TFLOP_S) -> dict:
    """`tokenmill roofline smollm2-135m --hardware cpu --json` with these figures."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "roofline", "smollm2-135m",
           "--hardware", "cpu", "--json", "--dtype", weight_dtype,
           "--bandwidth", str(bandwidth_gb_s), "--flops", str(tflop_s),
           "--batch", str(batch), "--prompt-len", str(prompt_len),
           "--output-len", str(output_len)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def decode_floor_ms(weight_dtype: str, prompt_len: int, output_len: int,
                    bandwidth_gb_s: float = QUIET_READ_GB_S) -> float:
    """Batch-1 decode step floor: (weight + KV bytes read per step) / bandwidth."""
    r = roofline(weight_dtype, prompt_len=prompt_len, output_len=output_len,
                 bandwidth_gb_s=bandwidth_gb_s)
    return r["decode"][0]["step_floor_ms"]


def prefill_floor_ms(prompt_len: int, tflop_s: float = QUIET_BF16_TFLOP_S) -> float:
    """TTFT floor of one prompt: max(FLOPs / matmul rate, bytes / bandwidth)."""
    r = roofline("bf16", prompt_len=prompt_len, output_len=1, tflop_s=tflop_s)
    return r["prefill"]["ttft_floor_ms"]
