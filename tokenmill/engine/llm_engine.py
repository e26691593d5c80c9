"""The engine: add_request / step / abort, and the offline `LLM` class.

One step: the scheduler picks sequences and token counts, the model runner
runs them as one flat batch, the sampler picks next tokens, the output
processor detokenizes and checks stops, the scheduler frees what finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tokenmill.attention import check_backend
from tokenmill.attention.quantized import check_kv_cache_dtype
from tokenmill.config import EngineConfig, SchedulerConfig
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.distributed.worker_group import check_tensor_parallel, start_workers
from tokenmill.engine.detokenizer import Detokenizer
from tokenmill.engine.heap_trim import HeapTrimmer
from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.overlap import OverlapStepper
from tokenmill.engine.phase_timer import PhaseTimer
from tokenmill.engine.prompt_logprobs import prompt_rows, record_prompt_logprobs
from tokenmill.engine.rank_model import build_rank_model
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.stats import EngineStats, RequestError
from tokenmill.engine.stop_checker import StopChecker, emittable_text
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.kvcache.event_stream import KVEventStream
from tokenmill.loaders import load_tokenizer, resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.startup_timer import mark
from tokenmill.structured import GrammarCache, LogitsConstraints

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    pending_siblings: int  # n > 1: samples added once the first one's prompt is cached
    arrival_time: float
    grammar: Future | None = None  # structured outputs: its compile


def check_startup_choices(config: EngineConfig) -> torch.device:
    """The device, once a bad --attention-backend (or one that cannot read the
    --kv-cache-dtype) has failed in a moment, before any weights load. `tokenmill
    serve` calls it before it starts an engine core process, so the usage error
    is its own (exit 2, one line), not a dead core's."""
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
        else config.device)
    check_kv_cache_dtype(check_backend(config.attention_backend, device),
                         config.cache.kv_cache_dtype)
    check_tensor_parallel(config)  # ValueError: a size the model's shapes do not split
    return device


def process_rss_bytes() -> int:
    """This process's resident set (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class LLMEngine:
    """detokenize=False: outputs carry token ids only (text ""), and `stop`
    strings are left to whoever detokenizes (the front end of the core process)."""

    def __init__(self, config: EngineConfig | None = None, detokenize: bool = True,
                 **kwargs) -> None:
        config = config or EngineConfig(**kwargs)
        self.config = config
        baseline_rss_bytes = process_rss_bytes()  # the interpreter, torch, libraries
        device = check_startup_choices(config)
        torch.manual_seed(config.seed)
        self.source = resolve_model(config.model, need_weights=config.load_format != "dummy")
        self.model_name = self.source.name
        # tensor parallelism: the workers are started and joined; None for one rank
        self.workers = start_workers(config, self.source, device)
        try:
            rank = build_rank_model(config, self.source, get_tp().device or device)
        except BaseException:
            if self.workers is not None:
                self.workers.mark_broken("rank 0 failed to start")
            self.close()
            raise
        loaded, self.quantization = rank.loaded, rank.quantization
        self.model_config = loaded.config
        self.dtype = loaded.dtype
        self.tokenizer = load_tokenizer(self.source)
        mark("tokenizer loaded")
        self.max_model_len, self._context_note = rank.max_model_len, rank.context_note
        num_blocks, block_size = rank.num_blocks, config.cache.block_size
        self.runner = rank.runner
        if self.workers is not None:
            self.workers.attach(self.runner, rank.parameter_bytes)
        self.block_manager = BlockManager(num_blocks, block_size,
                                          config.cache.enable_prefix_caching)
        self.kv_events = KVEventStream.start(config.cache.kv_events, self.block_manager,
                                             device.type)
        step_tokens = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:  # a whole prompt must fit one step, as vLLM
            step_tokens = max(step_tokens, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=step_tokens,
                            max_model_len=self.max_model_len,
                            enable_chunked_prefill=config.enable_chunked_prefill),
            self.block_manager)
        self.eos_token_ids = self._eos_ids()
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size,
                                     self.eos_token_ids)
        self.constraints = LogitsConstraints(self.grammars)
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids, constraints=self.constraints)
        self.detokenizer = Detokenizer(self.tokenizer) if detokenize else None
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len, self.detokenizer)
        self.speculator = None
        if config.speculative:
            from tokenmill.speculative import build_speculator

            self.speculator = build_speculator(config, self.runner, self.block_manager,
                                               self.max_model_len, loaded.dtype)
        self.overlap: OverlapStepper | None = None
        if config.async_scheduling:
            if self.speculator is not None:  # drafts need the host's accepted tokens
                logger.warning("--async-scheduling is off with speculative decoding: "
                               "every step runs synchronously")
            else:
                self.overlap = OverlapStepper(self)
        self.heap = HeapTrimmer()  # engine/heap_trim.py: RSS flat under mixed lengths
        self.requests: dict[str, _Request] = {}
        self._compiling: dict[str, _Request] = {}  # constrained requests waiting for a grammar
        # seq_id of a request's first sample -> its prompt logprobs so far
        self.prompt_logprobs: dict[int, list] = {}
        self.stats = EngineStats(num_total_blocks=num_blocks,
                                 kv_cache_bytes=self.runner.kv_cache_bytes)
        if config.cache.prefault:  # the pool was zeroed by build_rank_model
            self.block_manager.mark_all_touched()
        logger.info("engine ready: %s, dtype %s, %s attention, %d KV blocks of %d tokens "
                    "(%.0f MiB)", self.model_name, self.dtype, self.runner.backend.name,
                    num_blocks, block_size, self.runner.kv_cache_bytes / 2**20)
        self._log_expected_rss(baseline_rss_bytes, loaded.model, device)

    def _log_expected_rss(self, baseline_bytes: int, model: torch.nn.Module,
                          device: torch.device) -> None:
        """The pool's pages are touched as blocks are first used, so RSS climbs
        under load up to this figure; saying so at start-up tells an operator
        that the climb is expected and where it stops. Measured, not estimated:
        what the process holds now, less the pool's pages already touched, plus the
        whole pool. "runtime" is what loading added besides the weights (libraries
        initialised on first use, the tokenizer, kernel builds)."""
        from tokenmill.quant.model import dense_copy_bytes

        weights = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
        weights += dense_copy_bytes(model)  # plain attributes, not buffers
        on_cpu = device.type == "cpu"
        kv = self.runner.kv_cache_bytes if on_cpu else 0
        weights_host = weights if on_cpu else 0
        now = process_rss_bytes()
        touched = kv * self.block_manager.num_touched_blocks // max(
            1, self.block_manager.num_total_blocks)
        runtime = max(0, now - touched - baseline_bytes - weights_host)
        logger.info("expected steady-state RSS %.0f MiB = baseline %.0f MiB + weights "
                    "%.0f MiB + runtime %.0f MiB + KV pool %.0f MiB (now %.0f MiB; the pool "
                    "is touched as it fills, or at once with --kv-cache-prefault; under "
                    "load a working heap for the batch shapes comes on top, README: "
                    "memory arithmetic)",
                    (baseline_bytes + weights_host + runtime + kv) / 2**20,
                    baseline_bytes / 2**20, weights_host / 2**20, runtime / 2**20,
                    kv / 2**20, now / 2**20)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = self.model_config.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, [int(t) for t in prompt]
            vocab = self.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
            if max_tokens < 1:
                raise RequestError(
                    f"this model's maximum context length is {self.max_model_len} tokens"
                    f"{self._context_note}; "
                    f"the prompt has {len(ids)} tokens, leaving no room to generate", "prompt")
        total = len(ids) + max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens"
                f"{self._context_note}; "
                f"you requested {total} tokens ({len(ids)} in the prompt, {max_tokens} to "
                f"generate). Reduce the prompt or max_tokens.", "max_tokens")
        cache_tokens = self.block_manager.max_tokens_that_fit()
        # its n sequences share at most the prompt: a request that could never have
        # them all in the cache at once is refused rather than preempted forever
        needed = len(ids) + params.n * max_tokens if params.n > 1 else total
        if needed > cache_tokens:
            raise RequestError(
                f"the request needs {needed} tokens of KV cache (n={params.n}) but the whole "
                f"cache holds {cache_tokens}; raise --kv-cache-memory or reduce the request",
                "max_tokens")
        if max_tokens != params.max_tokens:
            params = _with_max_tokens(params, max_tokens)
        params = self._check_constraints(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.submit(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                err = grammar.exception()
                raise RequestError(str(err), getattr(err, "param", "structured_outputs"))
        now = time.monotonic() if arrival_time is None else arrival_time
        first = Sequence(request_id, ids, params, index=0, arrival_time=now)
        share_prompt = params.n > 1 and self.block_manager.enable_prefix_caching
        req = _Request(request_id, text, ids, params, [first],
                       params.n - 1 if share_prompt else 0, now, grammar)
        if not share_prompt:
            req.seqs += [Sequence(request_id, ids, params, index=i, arrival_time=now)
                         for i in range(1, params.n)]
        self.requests[request_id] = req
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[first.seq_id] = [None]  # the first token has no context
        if grammar is not None and not grammar.done():
            self._compiling[request_id] = req  # scheduled once compiled
        else:
            for seq in req.seqs:
                self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)

    def _check_constraints(self, params: SamplingParams) -> SamplingParams:
        """Token ids within the vocabulary; bad_words as token ids (as vLLM: the
        word and the word after a space)."""
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or {})),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            if any(t >= vocab for t in ids):
                raise RequestError(f"{name} token ids must be in [0, {vocab})", name)
        if not params.bad_words or params.bad_words_token_ids:
            return params
        words: set[tuple[int, ...]] = set()
        for word in params.bad_words:
            for variant in {word, " " + word.lstrip()}:
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids:
                    words.add(tuple(ids))
        return dataclasses.replace(params, bad_words_token_ids=[list(w) for w in sorted(words)])

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the constrained requests whose grammar has compiled; fail the
        ones whose grammar did not (the server checks first, so only offline)."""
        failed = []
        for req in list(self._compiling.values()):
            if req.grammar is None or not req.grammar.done():
                continue
            del self._compiling[req.request_id]
            err = req.grammar.exception()
            if err is None:
                for seq in req.seqs:
                    self.scheduler.add(seq)
                continue
            logger.warning("request %s: %s", req.request_id, err)
            for seq in req.seqs:
                seq.finish("abort")
            req.pending_siblings = 0
            failed.append(self._request_output(req))
            del self.requests[req.request_id]
        return failed

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            self._compiling.pop(rid, None)
            if req is not None:
                req.pending_siblings = 0
                self.prompt_logprobs.pop(req.seqs[0].seq_id, None)
                aborted = self.scheduler.abort(rid)
                if self.speculator is not None:
                    self.speculator.forget(aborted)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it advanced. Under async
        scheduling (engine/overlap.py) the outputs are those of the step before,
        learnt while this one ran."""
        outputs = self.overlap.step() if self.overlap is not None else self._step()
        self.heap.after_step(busy=self.has_unfinished_requests())
        return outputs

    def _step(self) -> list[RequestOutput]:
        timer = PhaseTimer(self.stats.time_s)
        failed = self._admit_compiled() if self._compiling else []
        with timer("schedule"):
            batch = self.scheduler.schedule()
        if not batch.scheduled:
            return failed
        self._count(batch)
        if self.speculator is not None:  # proposes drafts: widens decoding entries
            self.speculator.extend(batch, self.scheduler.num_running)
        with timer("prepare"):
            ids, pos, meta, rows = self.runner.prepare(batch.scheduled)
            extra = prompt_rows(batch.scheduled, self.prompt_logprobs)
        with timer("forward"):
            logits = self.runner.forward(ids, pos, meta, rows + extra.rows)
        if extra.rows:  # prompt rows come after the sampling rows
            record_prompt_logprobs(logits[len(rows):], extra, self.prompt_logprobs)
            logits = logits[:len(rows)]
        with timer("sample"):
            emitted = self._sample(batch, logits)
        with timer("postprocess"):
            outputs = self._postprocess(batch, emitted)
        if self.kv_events is not None:
            self.kv_events.publish()
        if self.config.debug_kv_integrity:
            self.check_kv_integrity()
        return failed + outputs

    def check_kv_integrity(self) -> None:
        """Raise KVCacheIntegrityError unless the KV books (ref counts, free list,
        prefix-cache hashes, live block tables) agree, the draft model's too.
        Run after every step under --debug-kv-integrity, and by the tests."""
        live = [*self.scheduler.waiting, *self.scheduler.running]
        self.block_manager.check_integrity(live)
        proposer = self.speculator.proposer if self.speculator is not None else None
        draft_bm = getattr(proposer, "block_manager", None)
        if draft_bm is not None:  # --speculative draft: its own cache and shadow sequences
            draft_bm.check_integrity(list(proposer.shadows.values()))

    def _sample(self, batch, logits) -> list[tuple[Sequence, list[int], list]]:
        """Per sampling sequence: the tokens to append and their logprobs."""
        if self.speculator is not None:  # accepted drafts + one token from the target
            return self.speculator.verify(batch, logits, self.sampler)
        seqs = [item.seq for item in batch.scheduled if item.sample]
        out = self.sampler(logits, seqs)
        return [(seq, [t], [lp]) for seq, t, lp in zip(seqs, out.token_ids, out.logprobs)]

    def _count(self, batch) -> None:
        st = self.stats
        st.num_steps += 1
        st.iteration_tokens.observe(sum(item.num_new_tokens for item in batch.scheduled))
        for item in batch.scheduled:  # before the step: computed counts are not advanced yet
            seq = item.seq
            if item.num_new_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                st.num_decode_tokens += 1
            else:
                st.num_prefill_tokens += item.num_new_tokens

    def _postprocess(self, batch, emitted: list[tuple[Sequence, list[int], list]]
                     ) -> list[RequestOutput]:
        touched = self._append(emitted)
        if self.speculator is not None:  # rejected drafts' KV slots go back
            self.speculator.rollback(batch)
        self.scheduler.finish_step(batch)
        return self._outputs(touched)

    def _append(self, emitted: list[tuple[Sequence, list[int], list]]) -> dict[str, _Request]:
        """Append each sampled token, detokenize, check stops; the requests touched."""
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for seq, token_ids, token_logprobs in emitted:
            for token_id, logprobs in zip(token_ids, token_logprobs):
                seq.append_token(token_id)
                if not self.constraints.accept(seq, token_id):
                    # the mask allowed only what the grammar accepts: a bug if reached
                    logger.error("%r: token %d breaks its grammar; stopping it", seq, token_id)
                    seq.finish("abort")
                if logprobs is not None:
                    if self.detokenizer is not None:
                        self.detokenizer.decode_logprob_tokens(logprobs)
                    seq.output_logprobs.append(logprobs)
                    seq.cumulative_logprob += logprobs[token_id].logprob
                if seq.first_token_time is None:
                    seq.first_token_time = now
                self.stop_checker.check(seq)
                self.stats.generation_tokens += 1
                if seq.is_finished:
                    break
            req = self.requests.get(seq.request_id)
            if req is not None:
                touched[req.request_id] = req
        return touched

    def _outputs(self, touched: dict[str, _Request]) -> list[RequestOutput]:
        """Siblings admitted, one output per touched request, finished ones dropped."""
        for req in touched.values():
            if req.pending_siblings:
                self._add_siblings(req)
        outputs = [self._request_output(req) for req in touched.values()]
        for out in outputs:
            if out.finished:
                req = self.requests.pop(out.request_id)
                self.prompt_logprobs.pop(req.seqs[0].seq_id, None)
        return outputs

    def _add_siblings(self, req: _Request) -> None:
        # the first sample's prompt blocks are now in the prefix cache: siblings share them
        n = req.params.n
        for i in range(n - req.pending_siblings, n):
            seq = Sequence(req.request_id, req.prompt_token_ids, req.params, index=i,
                           arrival_time=req.arrival_time)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        req.pending_siblings = 0

    def _request_output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            outs.append(CompletionOutput(
                index=seq.index,
                text=emittable_text(seq),
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.output_logprobs else None,
                logprobs=list(seq.output_logprobs) if req.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        finished = (not req.pending_siblings and len(req.seqs) == req.params.n
                    and all(s.is_finished for s in req.seqs))
        first = req.seqs[0]
        prompt_logprobs = self.prompt_logprobs.get(first.seq_id)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=min((s.first_token_time for s in req.seqs
                                      if s.first_token_time), default=None),
                finished_time=time.monotonic() if finished else None,
            ),
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        )

    def close(self) -> None:
        """Release what outlives a step (the KV-event sockets, the tensor-parallel
        workers); idempotent."""
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
            self.kv_events = None
        if getattr(self, "overlap", None) is not None:
            self.overlap.close()
        if getattr(self, "workers", None) is not None:
            self.workers.close()
            self.workers = None

    def parallel_failure(self) -> str | None:
        """Why the tensor-parallel group is broken (a local worker exited), or None."""
        return None if self.workers is None else self.workers.dead_worker()

    def get_stats(self) -> EngineStats:
        st = self.stats
        bm = self.block_manager
        st.num_running = self.scheduler.num_running
        st.num_waiting = self.scheduler.num_waiting
        st.num_free_blocks = bm.num_free_blocks
        st.num_total_blocks = bm.num_total_blocks
        st.kv_cache_committed_bytes = (st.kv_cache_bytes * bm.num_touched_blocks
                                       // max(bm.num_total_blocks, 1))
        st.kv_cache_usage = bm.usage
        st.prefix_cache_queries = bm.prefix_cache_queries
        st.prefix_cache_hits = bm.prefix_cache_hits
        st.num_preemptions = self.scheduler.num_preemptions
        if self.speculator is not None:
            spec = self.speculator.stats
            st.spec_proposed_tokens = spec.num_proposed_tokens
            st.spec_accepted_tokens = spec.num_accepted_tokens
            st.spec_verified_steps = spec.num_verified_steps
        return st


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=max_tokens)
