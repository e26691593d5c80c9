"""Tensor-parallel step time on a CPU (gloo), and the share of it rank 0 spends in
all-reduces. For the record: on a CPU, TP is for correctness, not speed.

A random-weight Llama at SmolLM2-135M's widths but 8 heads / 4 KV heads of 64 (so
that 2 ranks split it; SmolLM2's own 9 heads split only in 3) is written with
SmolLM2's tokenizer and loaded with `--load-format dummy`; each TP size runs
the same greedy batch through `LLM`, and the decode steps are timed from the
engine's own phase timers. The all-reduce share is rank 0's time inside
`dist.all_reduce` (counted in tokenmill/distributed/parallel_state.py), which
includes waiting for the slower rank.

    .venv/bin/python benchmarks/tensor_parallel.py [--tp 1,2] [--batch 1,8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.distributed.parallel_state import get_tp


def write_model(path: Path, layers: int) -> str:
    from tokenmill.loaders import load_tokenizer, resolve_model

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
              "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(path)
    return str(path)


def run(model: str, tp: int, batch: int, tokens: int, dtype: str) -> dict:
    llm = LLM(model, dtype=dtype, load_format="dummy", num_kv_blocks=256,
              max_num_seqs=max(batch, 1), tensor_parallel_size=tp)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[1, 100 + i, 200 + i, 300 + i] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        st = llm.engine.stats
        steps0, fwd0, ar0 = st.num_steps, st.time_s["forward"], get_tp().all_reduce_s
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = st.num_steps - steps0
        forward = st.time_s["forward"] - fwd0
        all_reduce = get_tp().all_reduce_s - ar0
        return {"tp": tp, "batch": batch, "steps": steps, "step_ms": 1e3 * wall / steps,
                "forward_ms": 1e3 * forward / steps, "all_reduce_ms": 1e3 * all_reduce / steps,
                "all_reduce_share_of_forward": all_reduce / forward if forward else 0.0}
    finally:
        llm.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = write_model(Path(d), args.layers)
        print("| TP | batch | step ms | forward ms | all-reduce ms | all-reduce share |")
        print("|---|---|---|---|---|---|")
        for batch in (int(b) for b in args.batch.split(",")):
            for tp in (int(t) for t in args.tp.split(",")):
                r = run(model, tp, batch, args.tokens, args.dtype)
                print(f"| {r['tp']} | {r['batch']} | {r['step_ms']:.1f} | "
                      f"{r['forward_ms']:.1f} | {r['all_reduce_ms']:.1f} | "
                      f"{r['all_reduce_share_of_forward']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
