"""LoRA overhead: the embedded model served with adapters vs without (issue 61).

Writes N PEFT adapters (rank R on all 7 projections: q, k, v, o, gate, up, down; random
weights at the embedded SmolLM2-135M's shapes, no download), then serves the model
twice in turn, one server at a time, with the same W2 client (`tokenmill bench` on
../shared/data/w2_prompts_128.json, 128 prompt tokens, 128 output tokens, ignore_eos):

- the base: `tokenmill serve smollm2-135m` (no --enable-lora);
- with adapters: `--enable-lora --lora-modules a0=... a1=... --max-loras N
  --max-lora-rank R`, the requests naming the adapters in turn (`tokenmill bench
  --lora-names a0 a1 ...`: request i runs under adapter i mod N, spread evenly).

At concurrency C (W2's 16) it reports output tok/s of each and the overhead (target
<= 25% below the base); at batch 1 (concurrency 1, one adapter) the TPOT of each and
their ratio (target <= 1.15x). `--repeats K` alternates base / adapters K times on
fresh servers and reports medians. The result: benchmarks/results/<date>-<machine
class>-lora-overhead.json.

    python -m benchmarks run lora-overhead                  # the real run (~6 min quiet)
    python -m benchmarks run lora-overhead --num-requests 4 --batch1-requests 1 \\
        --output-len 8 --no-result                          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks import results
from benchmarks.common import machine
from benchmarks.results import Figure
from benchmarks.server import start_server
from benchmarks.workloads.w2_serving import W2_PROMPTS, warm_up

MODEL = "smollm2-135m"
# SmolLM2-135M: 30 layers, hidden 576, 9 heads / 3 KV heads of 64, FFN 1536
LAYERS, HIDDEN, Q, KV, FFN = 30, 576, 9 * 64, 3 * 64, 1536
SHAPES = {"q_proj": ("self_attn", HIDDEN, Q), "k_proj": ("self_attn", HIDDEN, KV),
          "v_proj": ("self_attn", HIDDEN, KV), "o_proj": ("self_attn", Q, HIDDEN),
          "gate_proj": ("mlp", HIDDEN, FFN), "up_proj": ("mlp", HIDDEN, FFN),
          "down_proj": ("mlp", FFN, HIDDEN)}


def write_adapter(path: Path, rank: int, seed: int, b_std: float = 0.01) -> None:
    """A PEFT LoRA adapter directory (what peft's save_pretrained writes) on every
    projection of every layer; weights small enough to keep the text coherent-ish."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, (parent, fan_in, fan_out) in SHAPES.items():
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) \
                * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(SHAPES), "bias": "none", "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": MODEL}))


def bench(base_url: str, concurrency: int, num_requests: int, output_len: int,
          loras: list[str], out: Path) -> dict:
    """One `tokenmill bench` run: its summary."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", base_url,
           "--dataset", "jsonl", "--dataset-path", str(W2_PROMPTS),
           "--output-len", str(output_len), "--num-requests", str(num_requests),
           "--concurrency", str(concurrency), "--tokenizer", MODEL, "--output", str(out),
           "--no-progress"]
    if loras:
        cmd += ["--lora-names", *loras]
    print("$ tokenmill " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def serve_and_measure(serve_args: list[str], loras: list[str], args: argparse.Namespace,
                      work: Path, tag: str) -> tuple[dict, dict]:
    """(the concurrency-C summary, the batch-1 summary) on one fresh server."""
    server = start_server(MODEL, "--max-num-seqs", str(max(args.concurrency, 1)),
                          *serve_args, *args.serve_args)
    try:
        warm_up(server.base_url)
        wide = bench(server.base_url, args.concurrency, args.num_requests, args.output_len,
                     loras, work / f"{tag}-c{args.concurrency}.json")
        one = bench(server.base_url, 1, args.batch1_requests, args.output_len, loras[:1],
                    work / f"{tag}-c1.json")
    finally:
        server.stop()
    for s in (wide, one):
        if s["num_failed"]:
            raise SystemExit(f"{tag}: {s['num_failed']} requests failed; see the server log")
    return wide, one


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=4, help="adapters served and mixed")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64, help="requests at --concurrency")
    ap.add_argument("--batch1-requests", type=int, default=8, help="requests at batch 1")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="base / adapters pairs")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    ap.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args(argv)
    print(f"LoRA overhead · {args.adapters} adapters of rank {args.rank} on all 7 "
          f"projections · {machine()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="lora-overhead-"))
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_adapter(work / name, args.rank, seed=i)
    lora_args = ["--enable-lora", "--lora-modules", *[f"{n}={work / n}" for n in names],
                 "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
    runs: dict[str, list[tuple[dict, dict]]] = {"base": [], "adapters": []}
    for k in range(args.repeats):
        runs["base"].append(serve_and_measure([], [], args, work, f"base{k}"))
        runs["adapters"].append(serve_and_measure(lora_args, names, args, work, f"lora{k}"))

    def med(mode: str, which: int, key: str) -> float:
        values = [pair[which][key] for pair in runs[mode]]
        return statistics.median(v["mean"] if isinstance(v, dict) else v for v in values)

    c = args.concurrency
    tok_s = {m: med(m, 0, "output_throughput_tok_s") for m in runs}
    tpot = {m: med(m, 1, "tpot_ms") for m in runs}
    overhead = 1 - tok_s["adapters"] / tok_s["base"]
    ratio = tpot["adapters"] / tpot["base"]
    print(f"{'':<28} {'base':>10} {'adapters':>10}")
    print(f"{f'output tok/s, c={c}':<28} {tok_s['base']:>10.1f} {tok_s['adapters']:>10.1f}"
          f"   {overhead * 100:+.1f}% below the base (target <= 25%)")
    print(f"{'TPOT mean ms, batch 1':<28} {tpot['base']:>10.2f} {tpot['adapters']:>10.2f}"
          f"   {ratio:.2f}x the base (target <= 1.15x)")
    if args.no_result:
        return
    cfg = {"model": MODEL, "adapters": args.adapters, "rank": args.rank,
           "targets": list(SHAPES), "output_len": args.output_len}
    label = {"base": "no adapters", "adapters": f"{args.adapters} adapters, rank {args.rank}"}
    figures = []
    for mode, pairs in runs.items():
        figures += [
            Figure(label[mode], "tokenmill", f"output throughput c={c}", "tok/s",
                   [p[0]["output_throughput_tok_s"] for p in pairs], True,
                   {**cfg, "concurrency": c, "requests": args.num_requests}),
            Figure(label[mode] if mode == "base" else "one adapter", "tokenmill",
                   "TPOT mean c=1", "ms", [p[1]["tpot_ms"]["mean"] for p in pairs], False,
                   {**cfg, "concurrency": 1, "requests": args.batch1_requests})]
    notes = [f"output tok/s at c={c}: {overhead * 100:.1f}% below the base (target <= 25%)",
             f"batch-1 TPOT with an adapter: {ratio:.2f}x the base's (target <= 1.15x)"]
    results.write(results.build("lora-overhead", "LoRA overhead", figures, notes=notes))


if __name__ == "__main__":
    main()
