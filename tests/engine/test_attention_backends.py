"""The attention-backend seam seen from the engine: the torch reference and the
cpu backend give the same greedy tokens, a bad --attention-backend stops the
start-up with the list of available ones, and --debug-kv-integrity checks the
KV books after every step."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import BackendUnavailable
from tokenmill.kvcache.block_manager import KVCacheIntegrityError


def _prompts() -> list[list[int]]:
    """Six prompts: four share a 32-token system prefix (prefix-cache hits once the
    first has run), two do not; lengths differ so blocks end mid-way."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 49000, (32,), generator=g).tolist()
    own = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (3, 9, 17, 25, 6, 30)]
    return [system + own[i] if i < 4 else own[i] for i in range(6)]


def _run(model: str, backend: str):
    # 12 blocks of 16 tokens for six sequences of up to 69 tokens: they preempt;
    # 48 tokens per step: prefill chunks share steps with decodes
    llm = LLM(model, dtype="float32", attention_backend=backend, num_kv_blocks=12,
              max_num_seqs=6, max_num_batched_tokens=48)
    assert llm.engine.runner.backend.name == backend
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    stats = llm.engine.get_stats()
    llm.engine.check_kv_integrity()
    return outs, stats


def test_torch_and_cpu_backends_give_identical_greedy_tokens(tiny_model):
    ref, ref_stats = _run(tiny_model, "torch")
    cpu, cpu_stats = _run(tiny_model, "cpu")
    for stats in (ref_stats, cpu_stats):  # the run exercised what it claims to
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits >= 2 * 16
    assert [o.outputs[0].token_ids for o in cpu] == [o.outputs[0].token_ids for o in ref]
    assert all(len(o.outputs[0].token_ids) == 12 for o in cpu)


@pytest.mark.parametrize("name", ["nope", "triton"])
def test_a_bad_attention_backend_fails_at_start_up_with_the_list(tiny_model, name):
    with pytest.raises(BackendUnavailable, match=r"available.*: torch, cpu"):
        LLM(tiny_model, dtype="float32", attention_backend=name, num_kv_blocks=8)


def test_the_cli_rejects_a_bad_attention_backend_without_a_traceback():
    for command in (["serve"], ["generate", "hi"]):
        res = subprocess.run([sys.executable, "-m", "tokenmill.cli", *command,
                              "--attention-backend", "nope"],
                             check=False, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stderr
        assert "unknown attention backend 'nope'" in res.stderr
        assert "available on cpu: torch, cpu" in res.stderr
        assert "Traceback" not in res.stderr


def test_debug_kv_integrity_stops_the_step_that_finds_a_violation(tiny_model):
    llm = LLM(tiny_model, dtype="float32", num_kv_blocks=16, debug_kv_integrity=True)
    engine = llm.engine
    llm.generate([_prompts()[0]], SamplingParams(max_tokens=3), use_tqdm=False)  # clean
    engine.add_request("r", _prompts()[1], SamplingParams(max_tokens=8))
    engine.step()
    held = engine.scheduler.running[0].block_table[0]
    engine.block_manager.ref_counts[held] += 1  # as a missed free() would leave it
    with pytest.raises(KVCacheIntegrityError, match=f"block {held} has ref count 2"):
        engine.step()
    engine.block_manager.ref_counts[held] -= 1  # repaired, so the after-test check passes
    engine.abort_request("r")
