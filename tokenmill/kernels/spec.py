"""KernelSpec: one compiled variant of a kernel, as the backend launches it.

Each kernel module lists its variants (`compile_specs(dtype, head_dim)`) next
to its launcher, so that `compile_check` builds exactly what runs: the same
signature, constexprs and launch options.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelSpec:
    name: str
    kernel: object  # a triton JITFunction
    signature: dict[str, str]  # argument -> triton type ("*bf16", "i32", "constexpr")
    constexprs: dict[str, object]
    options: dict[str, int] = field(default_factory=dict)  # num_warps, num_stages
    dots: int = 0  # tl.dot calls in the kernel: each must map to tensor cores
    min_cc: int = 80  # the oldest target it is built for (fp8 needs sm_89+)
