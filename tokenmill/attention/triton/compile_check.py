"""Compile every kernel variant a CUDA step can launch (the attention backend's,
the layer ops', the fp8 decode GEMM's, the GGUF-block GEMM's) for sm_80 and sm_90 (fp8: sm_90 only), with
no GPU: shared memory per variant against the target's limit, and whether every
dot became a tensor-core instruction.

    python -m tokenmill.attention.triton.compile_check   # a table; exit 1 on failure

Run it in a process without TRITON_INTERPRET (interpreted kernels cannot be
compiled). Triton caches the binaries (~/.triton/cache), so reruns are quick.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import asdict, dataclass

from tokenmill.kernels.spec import KernelSpec

# (compute capability, shared memory per block in bytes: 163 KB, 227 KB)
TARGETS = {"sm_80": (80, 163 * 1024), "sm_90": (90, 227 * 1024)}


@dataclass
class CompileResult:
    kernel: str
    dtype: str
    head_dim: int
    target: str
    shared: int  # bytes
    shared_limit: int
    dots: int  # tl.dot calls expected
    tensor_core_dots: int  # of them, lowered to mma (mma.sync) or wgmma
    ptx_mma: int  # mma.sync instructions in the PTX
    ptx_wgmma: int  # wgmma.mma_async instructions
    seconds: float

    @property
    def ok(self) -> bool:
        cores = self.tensor_core_dots == self.dots and (self.dots == 0 or self.ptx_mma
                                                       or self.ptx_wgmma)
        return self.shared <= self.shared_limit and cores


def _tensor_core_dots(ttgir: str) -> int:
    """Dots in the TTGIR that run on tensor cores: `ttng.warp_group_dot` (wgmma) or
    a `tt.dot` whose operands are laid out for an NVIDIA mma (mma.sync)."""
    nvidia_mma = set(re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<", ttgir, re.MULTILINE))
    count = len(re.findall(r"= ttng\.warp_group_dot ", ttgir))
    for line in re.findall(r"= tt\.dot .*", ttgir):
        parents = set(re.findall(r"parent = (#mma\d*)", line))
        count += bool(parents) and parents <= nvidia_mma
    return count


def _all_dots(ttgir: str) -> int:
    return len(re.findall(r"= (?:tt\.dot|ttng\.warp_group_dot) ", ttgir))


def _specs() -> list[tuple[str, int, KernelSpec]]:
    """(dtype, head_dim, spec) of every variant: the attention backend's, and the
    layer ops' and fp8 GEMM's that a CUDA step launches (head_dim 0: not per head)."""
    from tokenmill.attention.triton import decode, prefill, rotary_store, store_kv
    from tokenmill.attention.triton.backend import CUDA_DTYPES, CUDA_HEAD_DIMS
    from tokenmill.kernels import (
        triton_decode_linear,
        triton_fp8_gemm,
        triton_gguf_gemm,
        triton_layer_ops,
        triton_moe,
    )

    jobs = []
    for dtype in CUDA_DTYPES.values():
        for head_dim in CUDA_HEAD_DIMS:
            jobs += [(dtype, head_dim, spec) for spec in (
                store_kv.compile_specs(dtype, head_dim) + decode.compile_specs(dtype, head_dim)
                + prefill.compile_specs(dtype, head_dim)
                + rotary_store.compile_specs(dtype, head_dim))]
            jobs += [(dtype, head_dim, spec) for spec in
                     triton_layer_ops.compile_specs(dtype, head_dim) if spec.name == "rotary"]
        jobs += [(dtype, 0, spec) for spec in
                 triton_layer_ops.compile_specs(dtype, CUDA_HEAD_DIMS[0])
                 if spec.name != "rotary"]
        jobs += [(dtype, 0, spec) for spec in triton_decode_linear.compile_specs(dtype)]
        jobs += [(dtype, 0, spec) for spec in triton_fp8_gemm.compile_specs(dtype)]
        jobs += [(dtype, 0, spec) for spec in triton_gguf_gemm.compile_specs(dtype)]
        jobs += [(dtype, 0, spec) for spec in triton_moe.compile_specs(dtype)]
    return jobs


def compile_all() -> list[CompileResult]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for dtype, head_dim, spec in _specs():
        kernel = spec.kernel
        assert list(spec.signature) == kernel.arg_names, spec.name
        # what the JIT's specialisation gives at launch: aligned pointers and
        # strides (multiples of head_dim); do_not_specialize ints get nothing
        plain = {p.name for p in kernel.params if p.do_not_specialize}
        attrs = {(i,): [["tt.divisibility", 16]]
                 for i, (name, ty) in enumerate(spec.signature.items())
                 if ty.startswith("*") or (ty == "i32" and name not in plain)}
        for target, (cc, limit) in TARGETS.items():
            if cc < spec.min_cc:
                continue
            start = time.perf_counter()
            binary = triton.compile(ASTSource(kernel, spec.signature, spec.constexprs, attrs),
                                    target=GPUTarget("cuda", cc, 32), options=spec.options)
            ttgir, ptx = binary.asm["ttgir"], binary.asm["ptx"]
            assert _all_dots(ttgir) == spec.dots, (spec.name, _all_dots(ttgir))
            results.append(CompileResult(
                spec.name, dtype, head_dim, target, binary.metadata.shared, limit,
                spec.dots, _tensor_core_dots(ttgir), ptx.count("mma.sync"),
                ptx.count("wgmma.mma_async"), round(time.perf_counter() - start, 2)))
    return results


def main() -> int:
    import json

    import triton

    results = compile_all()
    if "--json" in sys.argv:
        print(json.dumps({"triton": triton.__version__,
                          "results": [asdict(r) | {"ok": r.ok} for r in results]}))
    else:
        print(f"triton {triton.__version__}")
        print(f"{'kernel':18} {'dtype':5} {'d':>4} {'target':6} {'shared':>8} {'limit':>7} "
              f"{'tc dots':>7} {'mma':>5} {'wgmma':>5} {'s':>5}")
        for r in results:
            print(f"{r.kernel:18} {r.dtype:5} {r.head_dim:4} {r.target:6} {r.shared:8} "
                  f"{r.shared_limit:7} {r.tensor_core_dots:>3}/{r.dots:<3} {r.ptx_mma:5} "
                  f"{r.ptx_wgmma:5} {r.seconds:5.1f}{'' if r.ok else '  FAIL'}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
