import pytest


def write_tiny_llama(path, num_layers: int = 4, seed: int = 0) -> str:
    """A random-weight Llama with SmolLM2's tokenizer and vocabulary, small
    enough that a forward takes well under a millisecond per token. The LM head
    is scaled up so its next-token distributions are peaked, as a trained
    model's are (a random one's are nearly uniform over 49k tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenmill.loaders import load_tokenizer, resolve_model

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(path)
    return str(path)


def make_llm(model: str, **kwargs):
    """An fp32 LLM whose KV caches start zeroed.

    Zeroed because the decode attention path reads every slot of a
    sequence's last block and masks the unwritten ones; a masked score is
    -inf, but an uninitialized V that happens to hold NaN still poisons
    0 * NaN. Small caches come from recycled heap memory, where that happens.
    """
    from tokenmill import LLM

    kwargs.setdefault("dtype", "float32")
    llm = LLM(model, **kwargs)
    runners = [llm.engine.runner]
    spec = llm.engine.speculator
    if spec is not None:  # what is proposed must not depend on timings or back-off here
        spec.adaptive = False
    if spec is not None and hasattr(spec.proposer, "runner"):
        runners.append(spec.proposer.runner)
    for runner in runners:
        for k, v in runner.kv_caches:
            k.zero_()
            v.zero_()
    return llm


def assert_no_leak(engine) -> None:
    from tests.engine.conftest import assert_no_leak as engine_no_leak

    engine_no_leak(engine)  # checks the draft model's cache too
    proposer = engine.speculator.proposer if engine.speculator else None
    bm = getattr(proposer, "block_manager", None)
    if bm is not None:  # the draft model's own cache
        assert not proposer.shadows
        assert bm.num_free_blocks == bm.num_total_blocks, "draft KV blocks leaked"


@pytest.fixture(scope="session")
def tiny_draft(tiny_model, tmp_path_factory) -> str:
    """The tiny model cut to its first 2 layers: a draft that is often but not
    always right, so both acceptances and rejections happen."""
    from transformers import LlamaForCausalLM

    from tokenmill.loaders import load_tokenizer, resolve_model

    model = LlamaForCausalLM.from_pretrained(tiny_model)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    path = tmp_path_factory.mktemp("tiny-draft")
    model.save_pretrained(path)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(path)
    return str(path)
