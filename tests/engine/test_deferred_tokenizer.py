"""The engine core process (detokenize=False) builds without loading its tokenizer
(issue 60: start-up); the tokenizer loads at first use and the engine behaves as
one that loaded it eagerly: same stop ids, grammars and text prompts."""

from __future__ import annotations

import pytest

from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.loaders import load_tokenizer, resolve_model
from tokenmill.loaders.deferred_tokenizer import DeferredTokenizer, resolve_tokenizer
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def core_engine():
    engine = LLMEngine(EngineConfig(model="smollm2-135m", max_model_len=256, max_num_seqs=4,
                                    cache=CacheConfig(kv_cache_memory_bytes=16 << 20)),
                       detokenize=False)
    yield engine
    engine.close()


def test_core_defers_its_tokenizer_and_keeps_the_eager_stop_ids(core_engine):
    tokenizer = core_engine.tokenizer
    assert isinstance(tokenizer, DeferredTokenizer) and tokenizer._tokenizer is None
    eager = load_tokenizer(resolve_model("smollm2-135m"))
    assert core_engine.eos_token_ids == {core_engine.model_config.eos_token_id,
                                         eager.eos_token_id}
    assert resolve_tokenizer(tokenizer) is eager  # loads on first use, the same object
    assert tokenizer.encode("Hello world") == eager.encode("Hello world")


def test_grammar_and_text_prompt_run_through_the_deferred_tokenizer(core_engine):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=spec)
    core_engine.add_request("r1", "Is the sky blue? Answer:", params)
    tokens = []
    while core_engine.has_unfinished_requests():
        for out in core_engine.step():
            tokens = out.outputs[0].token_ids
    text = resolve_tokenizer(core_engine.tokenizer).decode(tokens, skip_special_tokens=True)
    assert text in ("yes", "no")
