"""The embedded SmolLM2-135M GGUF: tokenmill generates what transformers generates from the
same file (fp32), token for token."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.attention import get_backend
from tokenmill.attention.metadata import AttentionMetadata, attention_metadata
from tokenmill.kvcache.pool import KVPool
from tokenmill.loaders import load_model, load_tokenizer, resolve_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread_on_small_machines():
    # on a small shared box two OpenMP threads spin against other processes: 10x slower
    before = torch.get_num_threads()
    if (os.cpu_count() or 1) <= 4:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def source():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(source):
    return load_tokenizer(source)


@pytest.fixture(scope="module")
def ours(source):
    return load_model(source)


@pytest.fixture(scope="module")
def reference(source):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32).eval()


def _greedy_with_paged_cache(model, prompt_ids: list[int], eos: int):
    """Prefill once, then decode one token per step through the paged KV cache."""
    block_size, num_blocks = 16, 8
    cpu = torch.device("cpu")
    KVPool.for_model(model, get_backend("cpu", cpu, torch.float32), num_blocks, block_size,
                     torch.float32, cpu, zeroed=True)
    block_table = torch.arange(num_blocks, dtype=torch.int32).flip(0)[None]  # reversed blocks
    tokens, first_logits = list(prompt_ids), None
    fed = 0
    while len(tokens) - len(prompt_ids) < NEW_TOKENS:
        new = tokens[fed:]
        positions = torch.arange(fed, len(tokens))
        slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.tensor([0, len(new)], dtype=torch.int32),
            seq_lens=torch.tensor([len(tokens)], dtype=torch.int32), block_tables=block_table,
            block_size=block_size, max_query_len=len(new), max_seq_len=len(tokens),
            query_lens_list=[len(new)], seq_lens_list=[len(tokens)])
        with attention_metadata(meta):
            hidden = model(torch.tensor(new), positions)
        logits = model.compute_logits(hidden[-1:])[0]
        first_logits = logits if first_logits is None else first_logits
        fed = len(tokens)
        tokens.append(int(logits.argmax()))
        if tokens[-1] == eos:
            break
    return tokens[len(prompt_ids):], first_logits


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def test_tokenizer_adds_no_bos_and_is_cached(source, tokenizer):
    ids = tokenizer("Hello world")["input_ids"]
    assert ids and ids[0] != tokenizer.bos_token_id
    assert tokenizer.decode(ids) == "Hello world"
    assert load_tokenizer(source) is tokenizer


def test_raw_quantized_blocks_are_kept(ours):
    import gguf

    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert [s.qtype for s in qkv.gguf_quantized] == [gguf.GGMLQuantizationType.Q4_1] * 3
    assert ours.model.lm_head.gguf_quantized[0].qtype == gguf.GGMLQuantizationType.Q8_0


@pytest.mark.slow  # two model loads and 5 x 2 x 32 decode steps: about a minute on 2 cores
@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"prompt{i}" for i in range(len(PROMPTS))])
def test_greedy_tokens_and_logits_match_transformers(ours, reference, tokenizer, prompt):
    model = ours.model
    prompt_ids = _prompt_ids(tokenizer, prompt)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        ref_out = reference.generate(torch.tensor([prompt_ids]), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                     pad_token_id=eos, output_logits=True,
                                     return_dict_in_generate=True)
        expected_tokens = ref_out.sequences[0, len(prompt_ids):].tolist()

        got_tokens, first_logits = _greedy_with_paged_cache(model, prompt_ids, eos)
    torch.testing.assert_close(first_logits, ref_out.logits[0][0].float(), atol=1e-3, rtol=0)
    assert got_tokens == expected_tokens, (tokenizer.decode(got_tokens),
                                           tokenizer.decode(expected_tokens))
