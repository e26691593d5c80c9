"""Offline batch inference from Python, shaped like vLLM's `LLM`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tokenmill.config import CacheConfig, EngineConfig, KVEventsConfig
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """`LLM(model="smollm2-135m").generate(prompts, SamplingParams(...))`.

    Engine keywords (dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
    kv_cache_memory, num_kv_blocks, block_size, enable_prefix_caching, kv_cache_dtype,
    gpu_memory_utilization, kv_cache_prefault, seed, quantization, device) are named as
    the CLI flags; `kv_events_config` is vLLM's (a KVEventsConfig, its dict, or its JSON
    text).
    """

    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "auto",
                 kv_cache_memory: int | None = None, num_kv_blocks: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", gpu_memory_utilization: float | None = None,
                 kv_cache_prefault: bool = False,
                 kv_events_config: KVEventsConfig | dict | str | None = None,
                 **engine_kwargs: Any) -> None:
        if isinstance(kv_events_config, str):
            kv_events_config = KVEventsConfig.from_json(kv_events_config)
        elif isinstance(kv_events_config, dict):
            kv_events_config = KVEventsConfig(**kv_events_config)
        cache = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                            kv_cache_memory_bytes=kv_cache_memory,
                            memory_utilization=gpu_memory_utilization,
                            enable_prefix_caching=enable_prefix_caching,
                            kv_events=kv_events_config, kv_cache_dtype=kv_cache_dtype,
                            prefault=kv_cache_prefault)
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, cache=cache,
                                             **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None) -> list[RequestOutput]:
        """Text prompts or token-id lists; one SamplingParams or one per prompt;
        lora_request (vLLM's): one LoRARequest, or one per prompt (None: the base).
        Returns one RequestOutput per prompt, in the order given."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} "
                                 "SamplingParams; pass one, or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else \
            [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora_request; "
                             "pass one, or one per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for p in params:  # compile errors raise here (GrammarError, a ValueError)
            if p.structured_outputs is not None:
                self.engine.grammars.submit(p.structured_outputs).result()
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras):
                self.engine.add_request(rid, prompt, p, lora_request=lora)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        while len(done) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text the model's chat template makes of these messages."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **template_kwargs)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        """One conversation, or a list of them; each rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(conv, **template_kwargs) for conv in conversations]
        # the template already holds any special tokens: do not add a BOS twice
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_ids, sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs
