"""Tensor parallelism end to end on CPU with gloo: the same greedy tokens as one
rank, through `LLM` and through `tokenmill serve`, each rank holding ~1/N of
the weights and 1/N of the KV heads, two all-reduces per layer per step, a
two-"node" launch on loopback, and a dead rank ending the server cleanly."""

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.serving import child_pids, free_port, pid_alive, start_server, wait_until
from tokenmill import LLM, SamplingParams
from tokenmill.distributed.parallel_state import TensorParallelError, get_tp

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = {"dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A random Llama with 4 heads and 2 KV heads, 2 layers."""
    from tests.speculative.conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tp-llama"), num_layers=2)


def _generate(model: str, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, **ENGINE, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def tiny_one_rank(tiny) -> dict:
    """One rank's tokens and texts, and the sizes two ranks split."""
    llm = LLM(tiny, **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.engine.close()
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "texts": [o.outputs[0].text for o in outs],
            "bytes": _weight_bytes(llm.engine.runner.model),
            "kv_pool_bytes": llm.engine.runner.kv_cache_bytes}


def _weight_bytes(model) -> tuple[int, int]:
    """(the model's bytes, the bytes every rank holds whole: norms and rotary tables)."""
    params = dict(model.named_parameters())  # a tied head is one parameter
    replicated = sum(p.nbytes for n, p in params.items() if "norm" in n)
    replicated += sum(b.nbytes for b in model.buffers())
    return sum(p.nbytes for p in params.values()) + sum(
        b.nbytes for b in model.buffers()), replicated


def test_two_ranks_give_one_rank_s_tokens_with_half_the_weights_and_two_all_reduces_per_layer(
        tiny, tiny_one_rank):
    total, norms = tiny_one_rank["bytes"]
    llm = LLM(tiny, **ENGINE, tensor_parallel_size=2)
    try:
        engine = llm.engine
        calls, steps = get_tp().all_reduce_calls, engine.stats.num_steps
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == tiny_one_rank["tokens"]
        layers = engine.model_config.num_hidden_layers
        # two per layer (o_proj, down_proj) and one for the vocab-parallel embedding
        assert get_tp().all_reduce_calls - calls == (2 * layers + 1) * (
            engine.stats.num_steps - steps)
        assert engine.workers.rank_parameter_bytes == [(total - norms) // 2 + norms] * 2
        # each rank's pool holds one of the two KV heads
        assert engine.runner.kv_cache_bytes == tiny_one_rank["kv_pool_bytes"] // 2
        (worker,) = engine.workers.procs.values()
        worker.kill()
        worker.wait()
        with pytest.raises(TensorParallelError, match="rank 1 .* exited"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # at once, not in a collective
    finally:
        llm.engine.close()
    assert get_tp().world_size == 1  # closed: this process is a single rank again


def test_rank_0_failing_inside_a_step_breaks_the_group_for_good(tiny, monkeypatch):
    """The workers wait in that step's all-reduces: a later step would pair with them
    out of order, so the engine refuses to run another and close() ends them."""
    llm = LLM(tiny, **ENGINE, tensor_parallel_size=2)
    (worker,) = llm.engine.workers.procs.values()
    try:
        norm = llm.engine.runner.model.model.norm

        def boom(*args):
            raise RuntimeError("injected")

        monkeypatch.setattr(norm, "add_forward", boom)
        with pytest.raises(TensorParallelError, match="rank 0 failed inside .*injected"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        monkeypatch.undo()
        with pytest.raises(TensorParallelError, match="rank 0 failed inside"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()
    assert worker.poll() is not None  # ended, not left waiting in a collective
    assert get_tp().world_size == 1


@pytest.fixture(scope="module")
def smollm2_reference() -> tuple[list[list[int]], list[str], tuple[int, int]]:
    """One rank's tokens, texts and weight bytes for the embedded SmolLM2 (9 heads,
    3 KV heads)."""
    llm = LLM("smollm2-135m", **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    sizes = _weight_bytes(llm.engine.runner.model)
    llm.engine.close()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs], sizes


def test_three_ranks_of_smollm2_give_one_rank_s_tokens(smollm2_reference):
    one, _, (total, norms) = smollm2_reference
    three, llm = _generate("smollm2-135m", tensor_parallel_size=3)  # one KV head per rank
    try:
        assert three == one
        # the tied embedding / LM head is one tensor, counted once on every rank
        assert llm.engine.workers.rank_parameter_bytes == [(total - norms) // 3 + norms] * 3
    finally:
        llm.engine.close()


def test_three_ranks_on_the_default_quantized_path_give_one_rank_s_tokens():
    # the default weights (GGUF blocks run natively: gguf-a8 on AVX-512 VNNI, gguf-a16 on
    # AVX2) shard too, and the fused SiLU MLP all-reduces its row-parallel down
    # projection like LlamaMLP
    engine = {"num_kv_blocks": 64, "max_num_seqs": 4}
    outs = []
    for tp in (1, 3):
        llm = LLM("smollm2-135m", tensor_parallel_size=tp, **engine)
        try:
            outs.append([o.outputs[0].token_ids
                         for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
        finally:
            llm.engine.close()
    assert outs[1] == outs[0]


def test_two_nodes_on_loopback_give_the_same_tokens(tiny, tiny_one_rank):
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "worker", "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--device", "cpu"])
    try:
        tokens, llm = _generate(tiny, tensor_parallel_size=2, nnodes=2, node_rank=0,
                                master_addr="127.0.0.1", master_port=port)
        assert llm.engine.workers.procs == {}  # node 0 runs rank 0 only
        llm.engine.close()
        assert tokens == tiny_one_rank["tokens"]
        assert worker.wait(30) == 0  # told to stop, it stops
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_size_that_does_not_split_fails_at_start_up_with_the_reason():
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "smollm2-135m",
                        "--tensor-parallel-size", "2", "--port", str(free_port())],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--tensor-parallel-size 2 does not divide the model's num_attention_heads (9)" \
        in r.stderr
    assert "Traceback" not in r.stderr


def _complete_texts(srv) -> list[str]:
    """PROMPTS as one batched request, greedy."""
    r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                   json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_serve_with_two_ranks_answers_like_one_and_a_killed_rank_is_503_not_a_hang(
        tiny, tiny_one_rank):
    expected = tiny_one_rank["texts"]
    # the 503 answer is the --keep-serving-after-engine-death behaviour (by default the
    # server exits ~4 s after its engine core: whether stop() below saw 0 or 1 was a race)
    srv = start_server(tiny, "--tensor-parallel-size", "2", "--dtype", "float32",
                       "--num-kv-blocks", "64", "--max-num-seqs", "4",
                       "--keep-serving-after-engine-death")
    try:
        assert _complete_texts(srv) == expected
        (core,) = child_pids(srv.proc.pid)
        (worker,) = child_pids(core)
        events: list = []
        streaming = threading.Event()

        def read() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        streaming.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert streaming.wait(30), "no token streamed"
        os.kill(worker, signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{srv.base_url}/health").status_code == 503,
                          10.0), "/health is not 503 after a rank died"
        reader.join(30)
        assert not reader.is_alive(), "the stream hangs after a rank died"
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert wait_until(lambda: not pid_alive(core), 10.0)
    finally:
        assert srv.stop() == 0


def test_serve_with_three_ranks_of_smollm2_answers_like_one_and_an_idle_dead_rank_is_503(
        smollm2_reference):
    _, expected, _ = smollm2_reference
    # the 503 answer a dead rank gives is the --keep-serving-after-engine-death behaviour;
    # by default the server now exits so that a supervisor restarts it
    srv = start_server("smollm2-135m", "--tensor-parallel-size", "3", "--dtype", "float32",
                       "--num-kv-blocks", "64", "--max-num-seqs", "4",
                       "--keep-serving-after-engine-death")
    try:
        assert _complete_texts(srv) == expected
        (core,) = child_pids(srv.proc.pid)
        assert len(child_pids(core)) == 2  # ranks 1 and 2
        info = httpx.get(f"{srv.base_url}/server_info").json()
        assert info["tensor_parallel_size"] == 3
        assert len(set(info["tensor_parallel_weight_bytes"])) == 1  # an equal share each
        # a rank that dies while nothing runs: the core's heartbeat thread sees it
        os.kill(child_pids(core)[0], signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{srv.base_url}/health").status_code == 503,
                          10.0), "/health is not 503 after an idle rank died"
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=30,
                       json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert wait_until(lambda: not child_pids(core) and not pid_alive(core), 10.0)
    finally:
        assert srv.stop() == 0
