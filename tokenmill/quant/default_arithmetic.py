"""The arithmetic `--quantization auto` runs a GGUF file's records with, per ISA (issue 57).

One function decides it, from the CPU's flags (tokenmill/cpuinfo.py) and the ISA the
quantized-activation kernel was built for (q4q8_gemv.c), and says why: the start-up
log, /server_info (`quantization_reason`) and `tokenmill explain` print that reason.

  AVX-512 VNNI  gguf-a8 (int8 activations per block of 32 for the MLP and the LM head,
                int16 for the attention's linears; llama.cpp's int8 arithmetic where it
                is int8): on the full-text accuracy gate it lies under llama.cpp's mean
                KLD on every gated file, the embedded Q4_1 0.00247 [0.00240, 0.00255]
                vs 0.00278, SmolLM2 Q4_K_M 0.00258 vs 0.00439, Q6_K 0.00263 vs 0.00420,
                Gemma 3 270M 0.00203 vs 0.00471 (docs/accuracy_gate.md; its all-int8
                form failed on the Q4_1 at 0.00298). gguf-a16 stays one flag away.
  AVX2          gguf-a16, as before: a8 gives the same bits on AVX2 (the kernels are
                exact), but its speed there was never measured (no AVX2 machine), so
                the default does not move on a guess
  neither       gguf (torch's int4 kernel on bf16 activations)

A8_DEFAULT_ON_AVX512_VNNI = False would put gguf-a16 back as the AVX-512 VNNI default.
TOKENMILL_GGUF_DEFAULT=gguf-a16|gguf-a8|gguf forces the default for a process (the
test suite runs under either: tests that need one arithmetic name it); an explicit
`--quantization` wins over both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenmill.cpuinfo import cpu_flags
from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import vnni

# on since gguf-a8 in its current form (attention at int16) passed on every gated file:
# the embedded Q4_1 0.00247 vs llama.cpp's 0.00278 (all-int8: 0.00298, FAIL), SmolLM2
# Q4_K_M 0.00258 vs 0.00439, Q6_K 0.00263 vs 0.00420, Gemma 3 0.00203 vs 0.00471
# (docs/accuracy_gate.md)
A8_DEFAULT_ON_AVX512_VNNI = True
FORCE_ENV = "TOKENMILL_GGUF_DEFAULT"
GATE_PAGE = "docs/accuracy_gate.md"
CHOICES = ("gguf-a8", "gguf-a16", "gguf")


@dataclass(frozen=True)
class DefaultArithmetic:
    method: str  # a tokenmill.quant method: gguf-a8 | gguf-a16 | gguf
    reason: str  # "gguf-a8: default on AVX-512 VNNI (accuracy gate: docs/accuracy_gate.md)"


def default_gguf_arithmetic(flags: set[str] | None = None,
                            a8_on_vnni: bool | None = None) -> DefaultArithmetic:
    """The default method for a GGUF file's blocks on this CPU, and why. `flags` (default:
    /proc/cpuinfo's) and `a8_on_vnni` (default: A8_DEFAULT_ON_AVX512_VNNI) are for
    tests. A bad TOKENMILL_GGUF_DEFAULT is a ValueError naming it."""
    forced = os.environ.get(FORCE_ENV, "").strip()
    if forced:
        if forced not in CHOICES:
            raise ValueError(f"{FORCE_ENV}={forced!r}: use one of {', '.join(CHOICES)}")
        if forced != "gguf" and not vnni.available():
            raise ValueError(f"{FORCE_ENV}={forced}: its native kernel "
                             "(tokenmill/kernels/q4q8_gemv.c) could not be built here")
        return DefaultArithmetic(forced, f"{forced}: forced by {FORCE_ENV}")
    if not vnni.fast():  # the kernel is not built, or built without SIMD dot products
        return DefaultArithmetic("gguf", "gguf: the quantized-activation kernel has no "
                                 "AVX2 or AVX-512 VNNI build here: torch's int4 kernel on "
                                 "bf16 activations")
    flags = cpu_flags() if flags is None else flags
    a8 = A8_DEFAULT_ON_AVX512_VNNI if a8_on_vnni is None else a8_on_vnni
    if "avx512_vnni" in flags and q4q8_gemv.has_vnni():
        if a8:
            return DefaultArithmetic("gguf-a8", "gguf-a8: default on AVX-512 VNNI "
                                     f"(accuracy gate: {GATE_PAGE})")
        return DefaultArithmetic("gguf-a16", "gguf-a16: default on AVX-512 VNNI "
                                 f"(A8_DEFAULT_ON_AVX512_VNNI off; {GATE_PAGE})")
    return DefaultArithmetic("gguf-a16", "gguf-a16: default on AVX2 (gguf-a8 not timed on "
                             f"AVX2; accuracy gate: {GATE_PAGE})")
