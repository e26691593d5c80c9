import pytest


@pytest.fixture(scope="module")
def llm():
    """The embedded SmolLM2 on the exact fp32 reference path, with a roomy cache."""
    from tokenmill import LLM

    return LLM("smollm2-135m", dtype="float32", num_kv_blocks=1024, max_num_seqs=32)


def assert_no_leak(engine) -> None:
    """Nothing runs any more and the KV books agree (check_integrity: with no live
    sequence, every ref count is 0 and every block is free or evictable)."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    engine.check_kv_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"


def small_engine(kv_cache_mib: int = 16, kv_cache_dtype: str = "auto", **config):
    """An LLMEngine on the embedded model with a 16 MiB KV cache (unless kv_cache_mib
    says) of kv_cache_dtype, 4 sequences (unless config says) and no prefix caching: for
    tests that compare kernels on a few short prompts."""
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**{"max_num_seqs": 4, **config}, cache=CacheConfig(
        enable_prefix_caching=False, kv_cache_memory_bytes=kv_cache_mib * 2**20,
        kv_cache_dtype=kv_cache_dtype)))


def greedy_text(engine, prompt: str, n: int) -> str:
    """The text of `engine`'s greedy completion of `prompt`, n tokens (request id "g")."""
    from tokenmill.sampling_params import SamplingParams

    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=n))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    return text
