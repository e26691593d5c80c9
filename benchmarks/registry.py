"""Every benchmark the tool runs, by name: its module (with a `main(argv)`) and one line."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    kind: str        # "workload", "feature" or "kernel"
    module: str
    summary: str
    writes_result: bool = False  # writes benchmarks/results/*.json at the end of a run
    shared: tuple[str, ...] = ()  # the options of `run all` it takes (--model, --repeats)

    def main(self) -> Callable[[list[str] | None], object]:
        return importlib.import_module(self.module).main


_W = "benchmarks.workloads."
_F = "benchmarks.features."
_K = "benchmarks.kernels."
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("w1", "workload", _W + "w1_offline",
              "W1 offline throughput: 256 requests, vs vLLM CPU and transformers", True,
              ("--repeats",)),
    Benchmark("w2", "workload", _W + "w2_serving",
              "W2 online serving at c=1,4,16,32, vs vLLM CPU and llama-server", True,
              ("--model", "--repeats")),
    Benchmark("w3", "workload", _W + "w3_decode",
              "W3 batch-1 decode (tg128), vs llama-bench on the same GGUF", True,
              ("--model", "--repeats")),
    Benchmark("w4", "workload", _W + "w4_prefill",
              "W4 prefill of 512 tokens (pp512), vs llama-bench on the same GGUF", True,
              ("--model", "--repeats")),
    Benchmark("w5", "workload", _W + "w5_shared_prefix",
              "W5 shared 1,024-token prefix, caching on/off, vs vLLM CPU and llama-server",
              True, ("--repeats",)),
    Benchmark("speculative", "feature", _F + "speculative",
              "speculative decoding at batch 1: speedup over none", True),
    Benchmark("structured-output", "feature", _F + "structured_output",
              "JSON-schema output vs unconstrained: TPOT and TTFT overhead", True),
    Benchmark("lora-overhead", "feature", _F + "lora_overhead",
              "4 rank-16 adapters mixed at c=16 and one at batch 1 vs no adapters", True),
    Benchmark("long-context", "feature", _F + "long_context",
              "bf16 vs 8-bit KV cache at the same KV memory, long prompts", True),
    Benchmark("soak", "feature", _F + "soak",
              "serve at saturation for --duration s: RSS, KV blocks, errors", True),
    Benchmark("spec-stress", "feature", _F + "spec_stress",
              "ngram speculation under a randomized mix and a small KV pool: stall hunt"),
    Benchmark("served-rss", "feature", _F + "served_rss",
              "served RSS / PSS of the engine core and tree vs llama-server, same file", True,
              ("--model", "--repeats")),
    Benchmark("heap-growth", "feature", _F + "heap_growth",
              "the C heap by request wave with malloc_trim off: RSS, mallinfo2, objects"),
    Benchmark("data-parallel", "feature", _F + "data_parallel",
              "2 replicas behind vllm-router, by routing policy"),
    Benchmark("pd-transfer", "feature", _F + "pd_transfer",
              "KV transfer over loopback: GB/s of the PD connector vs a socket copy", True),
    Benchmark("pd-trade", "feature", _F + "pd_trade",
              "PD disaggregation's trade: ITL p99 / TTFT of 1 instance, 1P+1D, 2 replicas", True),
    Benchmark("async-scheduling", "feature", _F + "async_scheduling",
              "--async-scheduling on vs off, batch 1 and 16", True),
    Benchmark("gpu-check", "feature", "benchmarks.gpu_check",
              "on a GPU: HBM bandwidth, decode/prefill against it, CUDA graphs (--smoke: CPU)"),
    Benchmark("batch1-kernels", "kernel", _K + "batch1_kernels",
              "batch-1 decode TPOT of each weight path, one process", True),
    Benchmark("cascade-decode", "kernel", _K + "cascade_decode",
              "shared-prefix (cascade) decode attention A/B"),
    Benchmark("decode-split", "kernel", _K + "decode_split",
              "a batched fused decode step's LM head against its layers (Gemma 3 at c=16)"),
    Benchmark("int-peak", "kernel", _K + "int_peak",
              "integer multiply-add ceiling (vpmaddwd / vpdpbusd)", True),
    Benchmark("kv-adjacency", "kernel", _K + "kv_adjacency",
              "what adjacent KV blocks buy decode attention"),
    Benchmark("linear-kernels", "kernel", _K + "linear_kernels",
              "one linear layer's kernels at SmolLM2's shapes", True),
    Benchmark("native-ab", "kernel", _K + "native_ab",
              "a native kernel A/B against its build at another git revision"),
    Benchmark("q4q8-step", "kernel", _K + "q4q8_step",
              "one decode step's linears on q4q8_gemv.c, by rows"),
    Benchmark("records-stream", "kernel", _K + "records_stream",
              "batch-1 records streamed vs plain reads: huge pages, bits, prefetch"),
)
WORKLOADS = tuple(b.name for b in BENCHMARKS if b.kind == "workload")


def find(name: str) -> Benchmark:
    for b in BENCHMARKS:
        if b.name == name or b.name == name.replace("_", "-"):
            return b
    raise KeyError(name)
