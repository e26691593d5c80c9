"""tokenmill's log-probs at llama-perplexity's scored positions, through the real
engine (scheduler, KV cache, the path's kernels). Two modes, both scoring the same
positions; the whole log-softmax of each goes to a sink (the fp32 reference stores
it, a path under test is compared with it):

prefill (default; as llama-perplexity evaluates a chunk): each chunk is one prompt
  with vLLM's prompt_logprobs, the engine's token budget set to n_ctx / 2
  (PREFILL_FLAGS) so the scored second half is one prefill chunk that reads the
  first half back from the KV cache (where an int8 / fp8 cache shows), batched
  linears at 256 rows. With the gate's own flag `--scored-step-rows N` (not an
  engine flag) the first half is still one prefill step, and the scored half then
  runs N rows a step (16: below VNNI_DENSE_MIN_ROWS, so a GGUF path's linears take
  their per-row quantized-activation kernel, the arithmetic of its decode steps,
  each row's activations quantized alone as at batch 1), as a served prompt is
  prefilled and its tokens then decoded.
decode: the chunk's tokens up to the first scored position are the prompt, then
  every scored position is a teacher-forced decode step (as
  tokenmill/engine/core/teacher_forced.py), all chunks one batch: the serving decode
  path, ~20x slower on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from benchmarks.accuracy_gate import routes
from benchmarks.accuracy_gate.chunks import Chunking
from benchmarks.accuracy_gate.kld import PositionFigures

# (row of the scored position in chunk-major order, log-probs of the step (N, V) fp32)
Sink = Callable[[np.ndarray, torch.Tensor], None]


SCORED_STEP_FLAG = "--scored-step-rows"


def split_gate_flags(flags: str) -> tuple[str, int | None]:
    """(engine flags, N of --scored-step-rows N or None)."""
    words = shlex.split(flags)
    if SCORED_STEP_FLAG not in words:
        return flags, None
    i = words.index(SCORED_STEP_FLAG)
    if i + 1 >= len(words) or not words[i + 1].isdigit() or int(words[i + 1]) < 1:
        raise ValueError(f"{SCORED_STEP_FLAG} takes a positive number of rows")
    rows = int(words[i + 1])
    return shlex.join(words[:i] + words[i + 2:]), rows


# The gate's own flag (not the engine's): `--quantization fp8` on a CPU, which the engine
# refuses (no fp8 matmul), built anyway so that Fp8Linear runs its CPU branch: the
# weights' e4m3 codes per output channel and the activations' per token, dequantized and
# multiplied in fp32 (what torch._scaled_mm computes on the GPU, up to its accumulation
# order), the LM head bf16 as on the GPU. Issue 63: fp8 gated at the model level
# without a device.
FP8_CPU_EMULATION_FLAG = "--fp8-cpu-emulation"


def build_engine(model: str, flags: str):
    from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args
    from tokenmill.engine.core.llm_engine import LLMEngine

    words = shlex.split(flags)
    emulate = FP8_CPU_EMULATION_FLAG in words
    if emulate:
        words.remove(FP8_CPU_EMULATION_FLAG)
    parser = argparse.ArgumentParser(prog="engine flags")
    add_engine_args(parser)
    args = parser.parse_args([model, "--no-prefix-caching", *words])
    with _fp8_on_cpu() if emulate else contextlib.nullcontext():
        return LLMEngine(engine_config_from_args(args))


@contextlib.contextmanager
def _fp8_on_cpu() -> Iterator[None]:
    """`--quantization fp8` accepted on a CPU while an engine is built (Fp8Linear's CPU
    branch then runs its matmuls); a GPU's own check is left as it is."""
    from unittest import mock

    import tokenmill.quant.model as quant_model

    real = quant_model.fp8_unavailable_reason

    def reason(device: torch.device) -> str | None:
        return None if device.type == "cpu" else real(device)

    with mock.patch.object(quant_model, "fp8_unavailable_reason", reason):
        yield


def describe(engine) -> str:
    return (f"{engine.dtype}".removeprefix("torch.") + f", weights {engine.quantization}, "
            f"KV {engine.config.cache.kv_cache_dtype}")


class _CapturingSampler:
    """Stands in for the engine's sampler: hands the step's log-probs to the sink
    and appends the text's next token."""

    def __init__(self, chunks: dict[str, tuple[int, list[int]]], chunking: Chunking,
                 sink: Sink):
        self.chunks, self.chunking, self.sink = chunks, chunking, sink

    def __call__(self, logits: torch.Tensor, seqs):
        from tokenmill.engine.core.sampler import SamplerOutput

        logp = torch.log_softmax(logits.float(), dim=-1)
        rows, tokens = [], []
        for seq in seqs:
            index, chunk = self.chunks[seq.request_id]
            n = seq.num_tokens  # the logits are those of position n - 1
            scored = n - 1 - self.chunking.first
            assert 0 <= scored < self.chunking.scored_per_chunk, (seq.request_id, n)
            rows.append(index * self.chunking.scored_per_chunk + scored)
            tokens.append(chunk[n])
        self.sink(np.asarray(rows), logp)
        return SamplerOutput(token_ids=tokens, logprobs=[None] * len(seqs))


def prefill_flags(chunking: Chunking) -> str:
    return f"--max-num-batched-tokens {chunking.n_ctx - chunking.first}"


@contextlib.contextmanager
def _capture_prompt_logprobs(chunks: dict[str, tuple[int, list[int]]], chunking: Chunking,
                             sink: Sink):
    """Hands the prompt rows' log-probs at scored positions to the sink, then lets
    the engine record its prompt_logprobs as usual."""
    from tokenmill.engine.core import llm_engine

    original = llm_engine.record_prompt_logprobs
    per = chunking.scored_per_chunk

    def record(logits, rows, recorded):
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked, where, i = [], [], 0
        for seq, start, count in rows.spans:
            index, _ = chunks[seq.request_id]
            for pos in range(start, start + count):  # logits of position pos
                if chunking.first <= pos < chunking.n_ctx - 1:
                    picked.append(i + pos - start)
                    where.append(index * per + pos - chunking.first)
            i += count
        if picked:
            sink(np.asarray(where), logp[picked])
        original(logits, rows, recorded)

    llm_engine.record_prompt_logprobs = record
    try:
        yield
    finally:
        llm_engine.record_prompt_logprobs = original


def score(model: str, flags: str, chunks: list[list[int]], chunking: Chunking,
          sink: Sink, mode: str = "prefill") -> tuple[str, float, dict[str, float]]:
    """Run every chunk through an engine built with `flags`; returns the engine's
    description, the seconds it took and the share of linear rows per route
    (routes.py: which kernels ran)."""
    with routes.counting() as seen:
        if mode == "prefill":
            desc, secs = _score_prefill(model, flags, chunks, chunking, sink)
        else:
            desc, secs = _score_decode(model, flags, chunks, chunking, sink)
    return desc, secs, routes.shares(seen)


def _score_prefill(model, flags, chunks, chunking, sink):
    engine_flags, step_rows = split_gate_flags(flags)
    engine = build_engine(model, f"{prefill_flags(chunking)} {engine_flags}")
    desc = describe(engine) + (f", scored half in {step_rows}-row steps" if step_rows else "")
    seconds = prefill_chunks(engine, chunks, chunking, sink, step_rows)
    engine.close()
    del engine
    return desc, seconds


def prefill_chunks(engine, chunks: list[list[int]], chunking: Chunking, sink: Sink,
                   step_rows: int | None = None) -> float:
    """Every chunk as one prompt through `engine` (built with prefill_flags), its
    scored positions' log-probs to `sink`; with `step_rows` the scored half in steps
    of that many rows. Returns the seconds it took."""
    from tokenmill.sampling_params import SamplingParams

    ids = {f"kld-{i}": (i, chunk) for i, chunk in enumerate(chunks)}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    budget = engine.scheduler.config
    full = budget.max_num_batched_tokens
    t0 = time.perf_counter()
    try:
        with _capture_prompt_logprobs(ids, chunking, sink):
            if step_rows is None:
                for rid, (_, chunk) in ids.items():
                    engine.add_request(rid, chunk, params)
                while engine.has_unfinished_requests():
                    engine.step()
            else:  # one chunk at a time: its first half in one step, then N-row steps
                for rid, (_, chunk) in ids.items():
                    engine.add_request(rid, chunk, params)
                    budget.max_num_batched_tokens = chunking.first
                    engine.step()
                    budget.max_num_batched_tokens = step_rows  # lowered only: buffers fit
                    while engine.has_unfinished_requests():
                        engine.step()
                    budget.max_num_batched_tokens = full
    finally:
        budget.max_num_batched_tokens = full
    return time.perf_counter() - t0


def _score_decode(model, flags, chunks, chunking, sink):
    from tokenmill.sampling_params import SamplingParams

    engine = build_engine(model, flags)
    desc = describe(engine)
    ids = {f"kld-{i}": (i, chunk) for i, chunk in enumerate(chunks)}
    saved = engine.sampler
    engine.sampler = _CapturingSampler(ids, chunking, sink)
    t0 = time.perf_counter()
    try:
        for rid, (_, chunk) in ids.items():
            prompt = chunking.first + 1
            engine.add_request(rid, chunk[:prompt], SamplingParams(
                temperature=0.0, max_tokens=chunking.scored_per_chunk, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.sampler = saved
    seconds = time.perf_counter() - t0
    engine.close()
    del engine
    return desc, seconds


class ReferenceStore:
    """The fp32 reference's log-probs, one float32 row per scored position (a
    memory-mapped file: 11k positions x 49k tokens is 2.2 GB)."""

    def __init__(self, path, n_rows: int, n_vocab: int):
        self.path = path
        self.logp = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                              shape=(n_rows, n_vocab))
        self.seen = np.zeros(n_rows, dtype=bool)

    def __call__(self, rows: np.ndarray, logp: torch.Tensor) -> None:
        self.logp[rows] = logp.numpy()
        self.seen[rows] = True

    def check_complete(self) -> None:
        if not self.seen.all():
            raise RuntimeError(f"the reference scored {self.seen.sum()} of "
                               f"{len(self.seen)} positions")


class Comparison:
    """A path's per-position figures against a stored reference."""

    def __init__(self, reference: np.ndarray, targets: np.ndarray,
                 ref_transform: Callable[[np.ndarray], np.ndarray] | None = None):
        self.reference, self.targets = reference, targets
        self.ref_transform = ref_transform
        n = len(targets)
        self.kld, self.nll, self.nll_ref = np.zeros(n), np.zeros(n), np.zeros(n)
        self.same_top = np.zeros(n, dtype=bool)
        self.seen = np.zeros(n, dtype=bool)

    def __call__(self, rows: np.ndarray, logp: torch.Tensor) -> None:
        ref = np.asarray(self.reference[rows])
        if self.ref_transform is not None:
            ref = self.ref_transform(ref)
        fig = PositionFigures.of(ref, logp, self.targets[rows])
        self.kld[rows], self.nll[rows], self.nll_ref[rows] = fig.kld, fig.nll, fig.nll_ref
        self.same_top[rows] = fig.same_top
        self.seen[rows] = True

    def figures(self) -> PositionFigures:
        if not self.seen.all():
            raise RuntimeError(f"scored {self.seen.sum()} of {len(self.seen)} positions")
        return PositionFigures(self.kld, self.nll, self.nll_ref, self.same_top)
