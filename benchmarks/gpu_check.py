"""The one-call GPU check (issue 18): bandwidth and matmul peak, correctness on
the device, and engine speed at Llama-3-8B shapes against the floor.

    python benchmarks/gpu_check.py [--json]     # on a CUDA GPU, ~5 minutes on an H200
    python benchmarks/gpu_check.py --smoke      # the same code paths on a CPU, tiny shapes

Nothing is downloaded: the correctness checkpoint (and its word-level tokenizer)
is written to a temp dir here; the speed rows use random weights made on the
device (load_format "dummy") from a Llama-3-8B config.json written beside it.
Speed is `LLMEngine.step()` with the real scheduler, timed per step (each step
ends in the sampler's one device-to-host copy, so wall time is device time).
Floors: decode = (weight bytes read + KV bytes read) / measured copy bandwidth;
prefill MFU = matmul + attention FLOPs / time / measured bf16 matmul peak.
`--smoke` runs on a CPU: the triton kernels under the interpreter, the decode
graphs' static-buffer closure run eagerly, fp8 through its CPU emulation.
Needs torch, transformers, tokenizers, safetensors, triton and gguf (a pure-Python
wheel: carry it where it is missing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

if "--smoke" in sys.argv:  # triton reads it when a kernel is defined: before any import
    os.environ["TRITON_INTERPRET"] = "1"
# run as a script, its own folder comes first on sys.path, and benchmarks/kernels/
# would shadow the `kernels` package transformers imports: the repo root instead
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _HERE]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class Shapes:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def hf_config(self, dtype: str, max_pos: int) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": self.vocab, "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                "max_position_embeddings": max_pos, "tie_word_embeddings": False,
                "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype}


LLAMA3_8B = Shapes(128256, 4096, 14336, 32, 32, 8, 128)
TINY = Shapes(512, 128, 256, 2, 2, 1, 64)  # head_dim 64: the CUDA triton kernels' smallest


@dataclass(frozen=True)
class Plan:
    speed_shapes: Shapes
    dtype: torch.dtype  # the engines' compute dtype
    copy_bytes: int
    matmul_n: int
    context: int  # prompt tokens of each decoding sequence
    warmup_steps: int
    timed_steps: int
    batches: tuple[int, ...] = (1, 8, 32, 64)
    prefill_lens: tuple[int, ...] = (512, 2048)
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None  # None: the --gpu-memory-utilization budget
    prefill_repeats: int = 5  # timed prefills per length (the row reports their median)


GPU_PLAN = Plan(LLAMA3_8B, torch.bfloat16, 2**31, 8192, context=512, warmup_steps=4,
                timed_steps=32)
SMOKE_PLAN = Plan(TINY, torch.float32, 2**24, 256, context=8, warmup_steps=1, timed_steps=2,
                  prefill_lens=(32, 128), max_model_len=256, num_kv_blocks=256,
                  prefill_repeats=1,
                  max_num_batched_tokens=512)  # batch 64's prompts in one interpreted step


STARTUP_TARGET_S = 20.0  # issue 63: time to ready at 8B shapes, --load-format dummy


@contextlib.contextmanager
def startup_phases() -> Iterator[list[tuple[str, float]]]:
    """(phase, wall seconds) of what runs inside the block, split where the engine logs
    a start-up mark (tokenmill.startup_timer, at debug), the rest after the last mark
    as "engine built"."""
    import logging

    phases: list[tuple[str, float]] = []
    last = [time.perf_counter()]

    class Marks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            now = time.perf_counter()
            phase = record.args[0] if isinstance(record.args, tuple) and record.args \
                else record.getMessage()
            phases.append((str(phase).strip(), now - last[0]))
            last[0] = now

    log = logging.getLogger("tokenmill.startup")
    handler, level = Marks(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield phases
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        phases.append(("engine built", time.perf_counter() - last[0]))


@dataclass
class Row:
    section: str
    check: str
    value: float | str
    unit: str
    floor: str = ""  # the floor or reference it is held against
    vs_floor: str = ""  # % of bandwidth, MFU, speed-up, ...
    note: str = ""


@dataclass
class Check:
    device: torch.device
    plan: Plan
    rows: list[Row] = field(default_factory=list)
    bandwidth_gb_s: float = 0.0
    matmul_tflop_s: float = 0.0
    printed: int = 0  # rows already shown as progress
    profile: bool = False  # print a batch-1 step's kernels by device time
    out: Path | None = None  # --out: the rows so far as JSON, rewritten after each part

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self, fn: Callable[[], object], iters: int) -> float:
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / iters

    # ---- the machine ----------------------------------------------------------

    def hardware(self) -> None:
        n = self.plan.copy_bytes // 4
        src = torch.empty(n, dtype=torch.float32, device=self.device).uniform_()
        dst = torch.empty_like(src)
        s = self.seconds(lambda: dst.copy_(src), 10)
        self.bandwidth_gb_s = 2 * n * 4 / s / 1e9  # bytes read + bytes written
        self.rows.append(Row("machine", "HBM bandwidth (copy kernel)", sig(self.bandwidth_gb_s),
                             "GB/s", note="read + write of a 2 GiB copy" if self.device.type ==
                             "cuda" else "CPU memory"))
        m = self.plan.matmul_n
        a = torch.randn(m, m, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=self.device, dtype=torch.bfloat16)
        s = self.seconds(lambda: a @ b, 10)
        self.matmul_tflop_s = 2 * m**3 / s / 1e12
        self.rows.append(Row("machine", f"bf16 matmul peak ({m}^3)", sig(self.matmul_tflop_s),
                             "TFLOP/s"))

    # ---- correctness on the device ---------------------------------------------

    def correctness(self, tmp: Path) -> None:
        path = write_tiny_checkpoint(tmp / "tiny")
        ids = torch.tensor([random.Random(0).randrange(3, TINY.vocab) for _ in range(24)])
        self.rows.append(Row("correctness", "logits vs transformers (fp32, 24 tokens)",
                             f"{hf_logits_error(path, ids, self.device):.2e}", "max abs",
                             floor="< 1e-3"))
        equal, total = self.engine_vs_transformers(path)
        self.rows.append(Row("correctness", "engine greedy tokens vs transformers", f"{equal}/{total}",
                             "tokens", floor=f"{total}/{total}",
                             note=f"triton attention, decode graphs, {self.engine_dtype_name}"))
        equal, total = self.engine_vs_transformers(path, async_scheduling=True)
        self.rows.append(Row("correctness", "async scheduling greedy tokens vs transformers",
                             f"{equal}/{total}", "tokens", floor=f"{total}/{total}",
                             note="--async-scheduling: ids gathered on the device"))
        err = attention_error(self.device, self.plan.dtype)
        self.rows.append(Row("correctness", "triton vs torch attention (mixed batch)",
                             f"{err:.2e}", "max abs", floor="< 2e-2" if self.device.type == "cuda"
                             else "< 1e-4", note=str(self.plan.dtype).removeprefix("torch.")))

        err = fp8_linear_error(self.device)
        self.rows.append(Row("correctness", "fp8 linear vs its dequantized product",
                             f"{err:.2e}", "max rel", floor="< 1e-2",
                             note="rows 1, 16, 64 (triton_fp8_gemm), 80 (_scaled_mm)"))

    @property
    def engine_dtype_name(self) -> str:
        return str(self.plan.dtype).removeprefix("torch.")

    def engine_vs_transformers(self, path: str, async_scheduling: bool = False
                               ) -> tuple[int, int]:
        from transformers import LlamaForCausalLM

        rng = random.Random(1)
        prompts = [[rng.randrange(3, TINY.vocab) for _ in range(n)] for n in (5, 9, 17, 30)]
        engine = LLMEngine(EngineConfig(model=path, dtype=self.engine_dtype_name,
                                        attention_backend="triton", max_num_seqs=8,
                                        max_model_len=256, cache=CacheConfig(num_kv_blocks=64),
                                        async_scheduling=async_scheduling))
        # async: the requests end at different steps, so its batch shrinks through buckets
        new_tokens = (12, 10, 8, 6) if async_scheduling else (12,) * 4
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=new_tokens[i],
                                                         ignore_eos=True))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] = out.outputs[0].token_ids
        hf = LlamaForCausalLM.from_pretrained(path, dtype=self.plan.dtype).to(self.device).eval()
        equal = total = 0
        for i, p in enumerate(prompts):
            ref = list(p)
            n = new_tokens[i]
            with torch.no_grad():  # greedy by hand: generate() would forbid EOS or stop at it
                for _ in range(n):
                    logits = hf(torch.tensor([ref], device=self.device)).logits[0, -1]
                    ref.append(int(logits.argmax()))
            equal += sum(a == b for a, b in zip(got[str(i)], ref[len(p):]))
            total += n
        return equal, total

    # ---- speed at real shapes --------------------------------------------------

    def speed(self, tmp: Path) -> None:
        plan = self.plan
        path = tmp / "speed"
        path.mkdir()
        dtype = self.engine_dtype_name
        (path / "config.json").write_text(json.dumps(
            plan.speed_shapes.hf_config(dtype, plan.max_model_len)))
        write_tokenizer(path, plan.speed_shapes.vocab)
        label = "Llama-3-8B shapes" if plan.speed_shapes == LLAMA3_8B else "tiny shapes"

        step_s: dict[str, float] = {}

        def eager() -> None:
            engine = self.engine(path, quantization=None, eager=True)
            step_s["eager"] = self.decode(engine, 1, f"batch 1 TPOT, eager ({label})")

        def graphs() -> None:
            with startup_phases() as phases:
                engine = self.engine(path, quantization=None, eager=False)
            self.startup_rows(phases, label, engine.runner.cuda_graphs_captured)
            how = "CUDA graphs" if engine.runner.cuda_graphs_captured else \
                "static-buffer closure, run eagerly (no capture on a CPU)"
            for batch in plan.batches:
                step_s[f"b{batch}"] = self.decode(engine, batch,
                                                  f"batch {batch} decode ({label})", note=how)
            if "eager" in step_s:
                self.rows.append(Row("speed", "graphs vs eager at batch 1",
                                     sig(step_s["eager"] / step_s["b1"]), "x",
                                     floor=">= 1.5 (target on a GPU)", note=how))
            for n in plan.prefill_lens:
                self.prefill(engine, n, label)

        def fp8() -> None:
            engine = self.engine(path, quantization="fp8", eager=False)
            for batch in (1, max(plan.batches)):
                s = self.decode(engine, batch, f"fp8 batch {batch} decode ({label})")
                step_s[f"fp8 b{batch}"] = s
                if f"b{batch}" in step_s:
                    self.rows.append(Row("speed", f"fp8 vs {dtype} at batch {batch}",
                                         sig(step_s[f"b{batch}"] / s), "x",
                                         note="step-time ratio"))

        def switched_off(switch: contextlib.AbstractContextManager, quantization: str | None,
                         batches: tuple[int, ...], what: str, versus: str, base: str,
                         off: str) -> None:
            # the A/B of one change: the same step with it switched off, each batch's
            # step time against `base`'s (an earlier part's) in this run
            with switch:
                engine = self.engine(path, quantization=quantization, eager=False)
                for batch in batches:
                    s = self.decode(engine, batch, f"{what.format(batch=batch)} ({label})",
                                    note=f"A/B: {off}")
                    if f"{base}b{batch}" in step_s:
                        self.rows.append(Row("speed", f"{versus} at batch {batch}",
                                             sig(s / step_s[f"{base}b{batch}"]), "x",
                                             note="step-time ratio, graphs both ways"))

        def fp8_cublas() -> None:
            # fp8 with torch._scaled_mm (cuBLASLt) for every batch: triton_fp8_gemm's A/B
            from tokenmill.quant.fp8 import Fp8Linear

            switched_off(mock.patch.object(Fp8Linear, "small_batch_kernel", False), "fp8",
                         (1, max(plan.batches)), "fp8 batch {batch} decode, _scaled_mm",
                         "triton_fp8_gemm vs _scaled_mm", "fp8 ", "triton_fp8_gemm off")

        def fp8_three_kernels() -> None:
            # fp8 up to 16 rows as three launches (activation scales, GEMM, split reduce)
            # instead of triton_fp8_gemm.fp8_linear's one: its A/B
            from tokenmill.quant.fp8 import Fp8Linear

            switched_off(mock.patch.object(Fp8Linear, "fused_small_batch", False), "fp8",
                         (1,), "fp8 batch {batch} decode, three kernels",
                         "fp8 one launch vs three", "fp8 ", "fp8_linear off")

        def unfused() -> None:
            # the same step with the model's plain torch ops where triton_layer_ops's
            # kernels run (RMSNorm + residual, rotary, SiLU * up, fp8's activation scales)
            from tokenmill.kernels import layer_ops

            switched_off(mock.patch.object(layer_ops, "triton_ops", lambda: None), None,
                         (1, max(plan.batches)), "batch {batch} decode, torch layer ops",
                         "fused layer ops vs torch ops", "", "triton_layer_ops off")

        def separate_rotary_store() -> None:
            # rotary and the KV store as two kernels (before rotary_store.py): its A/B
            from tokenmill.attention.triton import backend as triton_backend

            switched_off(mock.patch.object(triton_backend, "FUSED_ROTARY_STORE", False), None,
                         (1, max(plan.batches)), "batch {batch} decode, rotary then store",
                         "rotary+store in one kernel vs two", "", "rotary_store off")

        def separate_decode_linears() -> None:
            # a decode batch's norms, SiLU * up and linears as separate kernels, the
            # linears on cuBLAS (before triton_decode_linear): its A/B, at the batches
            # it takes (up to 16 rows)
            from tokenmill.kernels import layer_ops

            switched_off(mock.patch.object(layer_ops, "FUSED_DECODE_LINEARS", False), None,
                         (1, 8), "batch {batch} decode, norm then cuBLAS",
                         "decode linears fused vs cuBLAS", "", "triton_decode_linear off")

        def overlapped() -> None:
            engine = self.engine(path, quantization=None, eager=False, async_scheduling=True)
            for batch in (1, max(plan.batches)):
                s = self.decode(engine, batch, f"async scheduling batch {batch} decode ({label})")
                if f"b{batch}" in step_s:
                    self.rows.append(Row("speed", f"async vs sync scheduling at batch {batch}",
                                         sig(step_s[f"b{batch}"] / s), "x",
                                         note="step-time ratio, graphs both ways"))

        def old_splits() -> None:
            # decode attention's split-K as it was before this check's first GPU run
            # (at most 16 splits of 256+ keys), the A/B of the present policy
            from tokenmill.attention.triton import plan as triton_plan

            switched_off(mock.patch.multiple(triton_plan, MAX_SPLITS=16, MIN_SPLIT_TOKENS=256),
                         None, (1, 8, max(plan.batches)),
                         "batch {batch} decode, 16 splits of 256+ keys",
                         "split-K now vs before", "", "the previous split-K")

        def profiled() -> None:
            # where a batch-1 step's GPU time goes, kernel by kernel (eager: the same
            # kernels a graph replays, each visible to the profiler)
            for quantization in (None, "fp8"):
                engine = self.engine(path, quantization=quantization, eager=True)
                self.profile_steps(engine, f"batch 1 decode step, {quantization or dtype}")
                del engine
                self.free()

        parts = [("eager", eager), ("graphs", graphs), ("unfused", unfused),
                 ("rotary store", separate_rotary_store),
                 ("decode linears", separate_decode_linears),
                 ("old splits", old_splits), ("fp8", fp8), ("fp8 cublas", fp8_cublas),
                 ("fp8 three kernels", fp8_three_kernels),
                 ("async", overlapped)]
        if self.profile:
            parts.insert(1, ("profile", profiled))
        for name, part in parts:
            self.guarded(f"speed: {name}", part)
            self.free()

    def profile_steps(self, engine: LLMEngine, what: str, steps: int = 5) -> None:
        """A batch-1 decode's kernels by device time, on stderr."""
        vocab = engine.model_config.vocab_size
        engine.add_request("prof", [3 + i % (vocab - 3) for i in range(self.plan.context)],
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        for _ in range(4):  # the prefill, then warm decode steps
            engine.step()
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                engine.step()
        engine.abort_request(list(engine.requests))
        events = list(prof.key_averages())
        if self.device.type == "cuda":
            events = [e for e in events if e.device_type.name == "CUDA"]
        key = "device_time_total" if hasattr(events[0], "device_time_total") else \
            "cuda_time_total"
        total = sum(getattr(e, key) for e in events)
        print(f"profile: {what}, {steps} steps, kernels by device time "
              f"(total {total / steps / 1e3:.3f} ms/step)", file=sys.stderr)
        for e in sorted(events, key=lambda e: -getattr(e, key))[:16]:
            print(f"  {getattr(e, key) / steps:9.1f} us/step  {e.count // steps:5d} "
                  f"calls/step  {e.key[:90]}", file=sys.stderr, flush=True)

    def guarded(self, what: str, part: Callable[[], None]) -> None:
        """Run one part; a failure becomes a FAILED row and the rest still runs
        (a GPU loan is one call: every row it can fill is worth having)."""
        try:
            part()
        except Exception as e:  # noqa: BLE001 - reported in the table and on stderr
            traceback.print_exc()
            self.rows.append(Row(what.split(":")[0], f"{what} FAILED", "FAILED", "",
                                 note=f"{type(e).__name__}: {e}"[:300]))
        self.progress()

    def progress(self) -> None:
        """Each new row on stderr as it comes: a run cut off by its time limit
        still shows what it measured."""
        for r in self.rows[self.printed:]:
            print(f"[gpu_check] {r.section} | {r.check} | {r.value} {r.unit} | {r.floor} | "
                  f"{r.vs_floor} | {r.note}", file=sys.stderr, flush=True)
        self.printed = len(self.rows)
        if self.out is not None:  # a run cut off still leaves its rows on disk
            self.out.write_text(json.dumps({"device": device_name(self.device),
                                            "rows": [asdict(r) for r in self.rows]}))

    def engine(self, path: Path, quantization: str | None, eager: bool,
               async_scheduling: bool = False) -> LLMEngine:
        plan = self.plan
        on_cpu = self.device.type == "cpu"
        engine = LLMEngine(EngineConfig(
            model=str(path), dtype=self.engine_dtype_name, device=self.device.type,
            load_format="dummy", quantization=None if on_cpu else quantization,
            enforce_eager=eager, attention_backend="triton", max_num_seqs=max(plan.batches),
            max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
            cache=CacheConfig(num_kv_blocks=plan.num_kv_blocks, enable_prefix_caching=False),
            async_scheduling=async_scheduling))
        if on_cpu and quantization == "fp8":
            # the flag refuses a CPU; the same Fp8Linear runs its CPU emulation here
            from tokenmill.quant import quantize_model

            quantize_model(engine.runner.model, "fp8")
        return engine

    def startup_rows(self, phases: list[tuple[str, float]], label: str, graphs: bool) -> None:
        """Issue 63: the engine's time to ready with dummy weights (CUDA graphs captured
        on a GPU), against STARTUP_TARGET_S, and each phase it logs (tokenmill.startup_timer); the
        process's torch import and CUDA context come before it and are not counted."""
        total = sum(s for _, s in phases)
        gpu = self.device.type == "cuda"
        how = "CUDA graphs captured" if graphs else "no graphs (a CPU)"
        self.rows.append(Row(
            "start-up", f"engine ready, dummy weights ({label})", sig(total), "s",
            floor=f"<= {STARTUP_TARGET_S:g} s (target on a GPU)" if gpu else "",
            vs_floor=("met" if total <= STARTUP_TARGET_S else
                      f"missed by {sig(total - STARTUP_TARGET_S, 3)} s") if gpu else "",
            note=how))
        for phase, secs in phases:
            self.rows.append(Row("start-up", f"  {phase}", sig(secs), "s"))

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def decode(self, engine: LLMEngine, batch: int, check: str, note: str = "") -> float:
        """Mean seconds of one decode step of `batch` sequences at plan.context tokens."""
        plan = self.plan
        rng = random.Random(batch)
        steps = plan.warmup_steps + plan.timed_steps
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        vocab = engine.model_config.vocab_size
        for i in range(batch):
            engine.add_request(f"d{i}", [rng.randrange(3, vocab) for _ in range(plan.context)],
                               params)
        seqs = [s for r in engine.requests.values() for s in r.seqs]
        while any(s.num_output_tokens == 0 for s in seqs):  # the prefills
            engine.step()
        for _ in range(plan.warmup_steps):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(plan.timed_steps):
            engine.step()
        step_s = (time.perf_counter() - t0) / plan.timed_steps
        engine.abort_request(list(engine.requests))
        mean_ctx = plan.context + plan.warmup_steps + plan.timed_steps / 2
        floor_s = (weight_bytes_read(engine.runner.model) + batch * mean_ctx
                   * kv_bytes_per_token(engine)) / (self.bandwidth_gb_s * 1e9)
        value, unit = ((sig(step_s * 1e3), "ms/token") if batch == 1
                       else (sig(batch / step_s), "tok/s"))
        floor = f"{floor_s * 1e3:.3f} ms" if batch == 1 else f"{batch / floor_s:.0f} tok/s"
        self.rows.append(Row("speed", check, value, unit, floor=floor,
                             vs_floor=f"{100 * floor_s / step_s:.1f}% of bandwidth", note=note))
        return step_s

    def prefill(self, engine: LLMEngine, n: int, label: str) -> None:
        vocab = engine.model_config.vocab_size
        rng = random.Random(n)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        times = []
        for i in range(1 + self.plan.prefill_repeats):  # the first warms up (compiles, allocates)
            engine.add_request(f"p{n}-{i}", [rng.randrange(3, vocab) for _ in range(n)], params)
            self.sync()
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - t0)
        timed = sorted(times[1:])
        s = timed[len(timed) // 2]
        flops = prefill_flops(engine, n)
        self.rows.append(Row("speed", f"prefill {n} tokens TTFT ({label})", sig(s * 1e3),
                             "ms", floor=f"{flops / (self.matmul_tflop_s * 1e12) * 1e3:.2f} ms",
                             vs_floor=f"{100 * flops / s / (self.matmul_tflop_s * 1e12):.1f}% MFU",
                             note=f"median of {len(timed)} ({timed[0] * 1e3:.4g}-"
                                  f"{timed[-1] * 1e3:.4g} ms); MFU vs the measured bf16 peak"))


# ---- pieces ---------------------------------------------------------------------


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (a CPU's 0.0004 TFLOP/s must not print 0.0)."""
    return float(f"{x:.{digits}g}")


def write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer over "t3".."t{vocab-1}" (no download, any vocab size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def write_tiny_checkpoint(path: Path) -> str:
    """A random 2-layer Llama in safetensors, its LM head scaled so next-token
    distributions are peaked (greedy tokens then do not hinge on rounding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = TINY.hf_config("float32", 1024)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                       "torch_dtype")})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    write_tokenizer(path, TINY.vocab)
    return str(path)


def hf_logits_error(path: str, ids: torch.Tensor, device: torch.device) -> float:
    from transformers import LlamaForCausalLM

    from tokenmill.loaders import load_model

    ours = load_model(path, dtype=torch.float32, device=device).model
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ids = ids.to(device)
    with torch.no_grad():
        a = ours.compute_logits(ours(ids, torch.arange(len(ids), device=device)))
        b = hf(ids[None]).logits[0].float()
    return float((a - b).abs().max())


def attention_error(device: torch.device, dtype: torch.dtype) -> float:
    """Max |triton - torch reference| over one mixed batch: a long decode, an
    extend chunk and a fresh prefill, 16-token blocks."""
    from tokenmill.attention.torch_ref import TorchBackend
    from tokenmill.attention.triton import TritonBackend

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, bs = 8, 2, 64, 16
    seq_lens, query_lens = [300, 200, 70], [1, 40, 70]
    tables, next_block = [], 0
    for n in seq_lens:
        count = -(-n // bs)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    width = max(map(len, tables))
    num_blocks = next_block

    def meta(positions: list[list[int]], q_lens: list[int]) -> AttentionMetadata:
        slots = [t[p // bs] * bs + p % bs for t, ps in zip(tables, positions) for p in ps]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=device),
            block_size=bs, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            query_lens_list=q_lens, seq_lens_list=seq_lens)

    every = meta([list(range(n)) for n in seq_lens], seq_lens)  # stores the whole prefixes
    step = meta([list(range(n - q, n)) for n, q in zip(seq_lens, query_lens)], query_lens)
    total = sum(seq_lens)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(device, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(device, dtype)
    outs = []
    for backend in (TorchBackend(device, dtype), TritonBackend(device, dtype)):
        shape = backend.kv_cache_shape(num_blocks, bs, kv_heads, head_dim)
        kc = torch.zeros(shape, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        backend.store_kv(k, v, kc, vc, every)
        step.plan = backend.plan(step)
        outs.append(backend.forward(q, None, None, kc, vc, step, head_dim**-0.5).float())
    return float((outs[0] - outs[1]).abs().max())


def fp8_linear_error(device: torch.device) -> float:
    """Fp8Linear (quantize the rows, multiply, scale) against the float32 product of
    the same dequantized operands: the largest error relative to the largest output."""
    from tokenmill.quant.fp8 import Fp8Linear, dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lin = Fp8Linear((torch.randn(1024, 4096, generator=g) * 0.02).to(device, dtype))
    w = dequantize_rows(lin.weight_fp8, lin.weight_scale.reshape(-1, 1))
    worst = 0.0
    for rows in (1, 16, 64, 80):
        x = torch.randn(rows, 4096, generator=g).to(device, dtype)
        want = dequantize_rows(*quantize_rows(x)) @ w.t()
        got = lin(x).float()
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer except the
    embedding table (a step reads only its batch's rows of it) and rotary tables."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name or "cos_cache" in name or "sin_cache" in name:
            continue
        total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(engine: LLMEngine) -> int:
    c = engine.model_config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * \
        torch.empty((), dtype=engine.dtype).element_size()


def prefill_flops(engine: LLMEngine, n: int) -> float:
    """2 x linear weights x tokens, plus causal attention's QK^T and PV (2 x 2 x
    n^2 / 2 x heads x head_dim per layer)."""
    c = engine.model_config
    linear = sum(t.numel() for name, t in engine.runner.model.named_parameters()
                 if name.endswith("weight") and t.dim() == 2 and "embed_tokens" not in name)
    linear += sum(t.numel() for name, t in engine.runner.model.named_buffers()
                  if name.endswith("weight_fp8"))
    attn = 2 * n * n * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    return 2.0 * linear * n + attn


def print_table(device: str, rows: list[Row]) -> None:
    cols = ["section", "check", "value", "unit", "floor", "vs_floor", "note"]
    cells = [[str(getattr(r, c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(f"gpu_check on {device}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}), " \
               f"torch {torch.__version__}"
    return f"cpu ({os.cpu_count()} cores, smoke: tiny shapes, triton interpreter), " \
           f"torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny shapes, the triton interpreter: the same code paths")
    parser.add_argument("--profile", action="store_true",
                        help="also print a batch-1 decode step's kernels by device time")
    parser.add_argument("--json", action="store_true",
                        help='end with one JSON line: {"device": ..., "rows": [...]}')
    parser.add_argument("--out", type=Path, default=None,
                        help="write the rows as JSON to this file as each part ends")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: "
                        "correctness, speed, gguf")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - {"correctness", "speed", "gguf"}:
        parser.error(f"--skip: unknown part(s) {sorted(skip - {'correctness', 'speed', 'gguf'})}")
    if args.smoke:
        device, plan = torch.device("cpu"), SMOKE_PLAN
    elif torch.cuda.is_available():
        device, plan = torch.device("cuda"), GPU_PLAN
    else:
        parser.error("no CUDA device; run with --smoke for the CPU version")
    check = Check(device, plan, profile=args.profile, out=args.out)
    with tempfile.TemporaryDirectory() as tmp:
        check.hardware()  # the floors need it: no guard
        check.progress()
        if "correctness" not in skip:
            check.guarded("correctness", lambda: check.correctness(Path(tmp)))
        if "gguf" not in skip:  # the GGUF-block kernels, one guard per case
            from benchmarks import gguf_gemm_rows  # here: its import must not shadow `kernels`

            gguf_gemm_rows.add_rows(check, Row)
        if "speed" not in skip:
            check.guarded("speed", lambda: check.speed(Path(tmp)))
        from benchmarks.gpu_check_moe import moe_rows  # issue 59

        check.guarded("moe", lambda: moe_rows(check, Path(tmp), sys.modules[__name__]))
    name = device_name(device)
    print_table(name, check.rows)
    if args.json:
        print(json.dumps({"device": name, "rows": [asdict(r) for r in check.rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
