"""Tensor parallelism without processes: what splits, what is refused, and that a
rank's slice of a checkpoint tensor is exactly that slice of the whole."""

import pytest
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.launch import LaunchConfig
from tokenmill.engine.executor.worker_group import check_shapes, check_tensor_parallel


def _config(heads: int, kv: int, **kw) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=kw.get("vocab", 49152), hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=64)


def test_heads_that_do_not_divide_are_refused_with_the_dimension_named():
    with pytest.raises(ValueError, match=r"does not divide the model's num_attention_heads \(9\)"):
        check_shapes(_config(9, 3), 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
        check_shapes(_config(12, 3), 2)  # 12 heads split in 2, 3 KV heads do not
    with pytest.raises(ValueError, match=r"vocab_size \(49153\)"):
        check_shapes(_config(8, 2, vocab=49153), 2)
    check_shapes(_config(9, 3), 3)
    check_shapes(_config(8, 2), 4)  # fewer KV heads than ranks: each one replicated


def test_the_embedded_model_refuses_two_ranks_before_anything_starts():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide .*"
                       r"num_attention_heads \(9\)"):
        check_tensor_parallel(EngineConfig(tensor_parallel_size=2))


def test_launch_flags_are_checked():
    with pytest.raises(ValueError, match="multiple of --nnodes"):
        LaunchConfig(world_size=3, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match="needs --master-port"):
        LaunchConfig(world_size=2, nnodes=2)
    with pytest.raises(ValueError, match="--node-rank"):
        LaunchConfig(world_size=2, nnodes=2, node_rank=2, master_port=1234)
    launch = LaunchConfig(world_size=4, nnodes=2, node_rank=1, master_port=1234)
    assert list(launch.local_ranks) == [2, 3] and launch.local_index(3) == 1
    with pytest.raises(ValueError, match="speculative decoding does not run under tensor"):
        EngineConfig(tensor_parallel_size=2, speculative="ngram")


def test_a_gguf_slice_is_the_slice_of_the_whole_tensor_and_cuts_on_blocks():
    from tokenmill.loaders import resolve_model
    from tokenmill.loaders.gguf import iter_gguf_tensors

    tensors = {t.hf_name: t for t, _ in zip(iter_gguf_tensors(resolve_model("smollm2-135m")
                                                              .path), range(12))}
    q = tensors["model.layers.0.self_attn.q_proj.weight"]  # rows permuted by llama.cpp
    down = tensors["model.layers.0.mlp.down_proj.weight"]  # Q4_1, blocks of 32 columns
    full_q, full_down = q.dequantize(), down.dequantize()
    assert torch.equal(q.narrow(0, 192, 192).dequantize(), full_q[192:384])
    assert torch.equal(q.narrow(0, 192, 192).raw_blocks(), q.raw_blocks()[192:384])
    assert torch.equal(down.narrow(1, 512, 512).dequantize(), full_down[:, 512:1024])
    with pytest.raises(ValueError, match="blocks hold 32 columns"):
        down.narrow(1, 16, 512)


def test_a_safetensors_slice_reads_that_slice(tmp_path):
    from safetensors.torch import save_file

    from tokenmill.loaders.safetensors import iter_safetensors

    w = torch.arange(24.0).reshape(4, 6)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    for _, t in iter_safetensors(tmp_path):
        assert t.shape == (4, 6)
        assert torch.equal(t.narrow(0, 2, 2).load(), w[2:4])
        assert torch.equal(t.narrow(1, 3, 3).load(), w[:, 3:6])
        assert torch.equal(t.load(), w)


def test_fewer_kv_heads_than_ranks_replicate_each_kv_head_over_its_query_heads(monkeypatch):
    """4 heads, 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1,
    and each rank's query head is one that attends with that KV head."""
    from tokenmill.distributed import parallel_state
    from tokenmill.models.parallel_layers import QKVParallelLinear

    head_dim = 8
    for rank in range(4):  # rank r holds query head r, which attends with KV head r // 2
        monkeypatch.setattr(parallel_state, "_state",
                            parallel_state.ParallelState(rank=rank, world_size=4))
        qkv = QKVParallelLinear(32, head_dim, num_heads=4, num_kv_heads=2, bias=False)
        assert (qkv.num_heads, qkv.num_kv_heads) == (1, 1)
        kv_head = rank // 2  # Hugging Face's GQA: head h uses KV head h // (heads / kv_heads)
        assert qkv.checkpoint_slice("q", "weight") == (0, rank * head_dim, head_dim)
        assert qkv.checkpoint_slice("k", "weight") == (0, kv_head * head_dim, head_dim)
        assert qkv.checkpoint_slice("v", "weight") == (0, kv_head * head_dim, head_dim)


@pytest.mark.parametrize("extra", [{"speculative": "ngram"}, {"async_scheduling": True}],
                         ids=["speculative", "async-scheduling"])
def test_what_tensor_parallelism_cannot_run_yet_is_refused_by_name(extra):
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(model="smollm2-135m", tensor_parallel_size=2, **extra)


def test_an_already_fused_checkpoint_tensor_gives_each_rank_its_rows_of_every_part(
        monkeypatch):
    """Phi-3's qkv_proj / gate_up_proj (shard FUSED): rank r's fused rows are the rows it
    would take from separate q, k, v (gate, up) tensors."""
    from tokenmill.distributed import parallel_state
    from tokenmill.models.parallel_layers import (
        FUSED,
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )

    head_dim, heads, kv_heads = 4, 4, 2
    q = torch.randn(heads * head_dim, 8)
    k, v = torch.randn(kv_heads * head_dim, 8), torch.randn(kv_heads * head_dim, 8)
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_state",
                            parallel_state.ParallelState(rank=rank, world_size=2))
        fused, split = (QKVParallelLinear(8, head_dim, heads, kv_heads, bias=False)
                        for _ in range(2))
        fused.weight.weight_loader(fused.weight, torch.cat((q, k, v)), FUSED)
        for shard, t in (("q", q), ("k", k), ("v", v)):
            _, start, rows = split.checkpoint_slice(shard, "weight")
            split.weight.weight_loader(split.weight, t[start:start + rows], shard)
        assert fused.checkpoint_slice(FUSED, "weight") is None
        assert fused.shard_cover(FUSED) == {"q", "k", "v"}
        assert torch.equal(fused.weight, split.weight)
        mlp = MergedColumnParallelLinear(8, [12, 12])
        mlp.weight.weight_loader(mlp.weight, torch.cat((gate, up)), FUSED)
        half = slice(rank * 6, rank * 6 + 6)
        assert torch.equal(mlp.weight, torch.cat((gate[half], up[half])))
        with pytest.raises(ValueError, match="fused tensor of 23 rows"):
            mlp.weight.weight_loader(mlp.weight, torch.cat((gate, up))[:23], FUSED)
