"""The in-process target: drives `LLMEngine.step()` with the same workload and schedule as
the HTTP client, so a served and an offline run are directly comparable.

Requests are added between steps once their planned time has come (the engine cannot take
one mid-step, so a step's length shows up as generator lag). A token's timestamp is the
moment `step()` returned it; the engine's own counts stand in for the server's `usage`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tokenmill.bench.client import RequestRecord
from tokenmill.bench.runner import LoadSpec, OnDone, RunOutcome, count_tokens
from tokenmill.bench.workload import BenchRequest, iter_arrivals

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")


class OfflineTarget:
    def __init__(self, engine_config, temperature: float = 0.0, ignore_eos: bool = True) -> None:
        from tokenmill.engine.core.llm_engine import LLMEngine  # torch: only when asked for

        self.engine = LLMEngine(engine_config)
        self.tokenizer = self.engine.tokenizer
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self._next_id = 0

    @property
    def dtype(self) -> str | None:
        dtype = getattr(self.engine, "dtype", None)
        return None if dtype is None else str(dtype).replace("torch.", "")

    @property
    def quantization(self) -> str | None:
        """The weight path the engine resolved (`gguf-a8` or `gguf-a16` for the embedded
        model's default, `none` for a bf16 checkpoint): what `tokenmill explain` holds it
        to."""
        return getattr(self.engine, "quantization", None)

    @property
    def quantization_reason(self) -> str | None:
        """Why the engine runs that path ("gguf-a8: default on AVX-512 VNNI (...)")."""
        runner = getattr(self.engine, "runner", None)
        forms = getattr(getattr(runner, "model", None), "weight_forms", None)
        return forms.get("method_reason") if isinstance(forms, dict) else None

    @property
    def hardware(self) -> str:
        """What `tokenmill explain` holds the run against: "cpu" or the CUDA device name."""
        import torch

        wanted = getattr(self.engine.config, "device", "auto")
        if wanted != "cpu" and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
        return "cpu"

    def warmup(self, requests: list[BenchRequest], concurrency: int | None) -> None:
        if requests:
            self.run(requests, LoadSpec(concurrency=concurrency), np.random.default_rng(0),
                     lambda r: None)

    def run(self, requests: list[BenchRequest], load: LoadSpec, rng: np.random.Generator,
            on_done: OnDone, max_requests: int | None = None) -> RunOutcome:
        from tokenmill.sampling_params import SamplingParams

        if any(r.is_conversation for r in requests):
            raise ValueError("conversation workloads need a server (--base-url): the offline "
                             "target sends single requests only")
        engine = self.engine
        stats_before = _stats_dict(engine.get_stats())
        limit = len(requests) if load.duration_s is None else (max_requests or float("inf"))
        arrivals = iter_arrivals(load.request_rate, load.burstiness, rng)
        records: list[RequestRecord] = []
        live: dict[str, RequestRecord] = {}
        seen_tokens: dict[str, int] = {}
        seen_text: dict[str, str] = {}
        decode_batches: list[int] = []
        next_arrival = next(arrivals)
        freed_at = 0.0  # when the last concurrency slot freed
        t0 = time.perf_counter()

        def elapsed() -> float:
            return time.perf_counter() - t0

        def sending_done() -> bool:
            return len(records) >= limit or (load.duration_s is not None
                                             and next_arrival >= load.duration_s)

        while not sending_done() or live:
            now = elapsed()
            while (not sending_done() and next_arrival <= now
                   and (not load.concurrency or len(live) < load.concurrency)):
                i = len(records)
                req = requests[i % len(requests)]
                planned = next_arrival if not load.concurrency else max(next_arrival, freed_at)
                record = RequestRecord(i, req.prompt_len, req.output_len, planned_time_s=planned)
                records.append(record)
                rid = f"bench-{self._next_id}"
                self._next_id += 1
                params = SamplingParams(temperature=self.temperature, max_tokens=req.output_len,
                                        ignore_eos=self.ignore_eos)
                record.send_time_s = elapsed()
                try:
                    engine.add_request(rid, req.prompt, params)
                except ValueError as e:
                    record.fail("rejected", str(e), elapsed())
                    on_done(record)
                else:
                    live[rid], seen_tokens[rid], seen_text[rid] = record, 0, ""
                next_arrival = next(arrivals)
                if load.duration_s is not None and elapsed() >= load.duration_s:
                    next_arrival = load.duration_s  # stop sending
            if not live:
                if not sending_done():
                    time.sleep(max(0.0, next_arrival - elapsed()))
                continue
            outputs = engine.step()
            t = elapsed()
            decode = 0
            for out in outputs:
                record = live.get(out.request_id)
                if record is None:
                    continue
                comp = out.outputs[0]
                new = len(comp.token_ids) - seen_tokens[out.request_id]
                if new > 0:
                    if seen_tokens[out.request_id] > 0:
                        decode += 1
                    if record.first_chunk_time_s is None:
                        record.first_chunk_time_s = t
                    record.chunk_times_s.append(t)
                    record.chunk_tokens.append(new)
                    record.chunk_texts.append(comp.text[len(seen_text[out.request_id]):])
                    seen_tokens[out.request_id] = len(comp.token_ids)
                    seen_text[out.request_id] = comp.text
                if out.finished:
                    record.usage_prompt_tokens = len(out.prompt_token_ids)
                    record.usage_completion_tokens = len(comp.token_ids)
                    record.finish_reason = comp.finish_reason
                    record.end_time_s = t
                    if not record.chunk_times_s:
                        record.fail("no_content", "the engine finished without a token", t)
                    del live[out.request_id]
                    freed_at = t
                    on_done(record)
            if decode:
                decode_batches.append(decode)
        duration = max((r.end_time_s for r in records), default=0.0)
        for r in records:
            count_tokens(r, self.tokenizer)
        return RunOutcome(records, duration, {"engine": self._engine_block(
            stats_before, _stats_dict(engine.get_stats()), decode_batches, duration)})

    def _engine_block(self, before: dict, after: dict, decode_batches: list[int],
                      wall_time_s: float) -> dict[str, Any]:
        def diff(key: str) -> Any:
            return after.get(key, 0) - before.get(key, 0)

        time_s = {p: after["time_s"].get(p, 0.0) - before["time_s"].get(p, 0.0) for p in PHASES}
        return {
            "num_steps": diff("num_steps"),
            "time_s": time_s,
            "num_prefill_tokens": diff("num_prefill_tokens"),
            "num_decode_tokens": diff("num_decode_tokens"),
            "mean_decode_batch": (float(np.mean(decode_batches)) if decode_batches else 0.0),
            "num_decode_steps": len(decode_batches),
            "num_preemptions": diff("num_preemptions"),
            "prefix_cache_hits": diff("prefix_cache_hits"),
            "prefix_cache_queries": diff("prefix_cache_queries"),
            "moe_expert_bytes": diff("moe_expert_bytes"),
            "wall_time_s": wall_time_s,
            "step_time_share": {p: v / wall_time_s for p, v in time_s.items()}
            if wall_time_s > 0 else {},
        }


def _stats_dict(stats) -> dict[str, Any]:
    fields = ("num_steps", "num_prefill_tokens", "num_decode_tokens", "num_preemptions",
              "prefix_cache_hits", "prefix_cache_queries", "moe_expert_bytes")
    d = {f: getattr(stats, f, 0) or 0 for f in fields}
    d["time_s"] = dict(getattr(stats, "time_s", {}) or {})
    return d
