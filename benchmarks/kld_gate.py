"""The accuracy gate on KL divergence (issue 57), one command per file:

    .venv/bin/python -m benchmarks.kld_gate                          # the embedded Q4_1
    .venv/bin/python -m benchmarks.kld_gate --model ~/.cache/tokenmill-peers/models/smollm2-135m-Q4_K_M.gguf
    .venv/bin/python -m benchmarks.kld_gate --model FILE --paths "default,int8 KV" --max-chunks 8

For FILE: llama.cpp's `llama-perplexity` on FILE against FILE-f32.gguf (every tensor
dequantized to F32), and every tokenmill path against tokenmill's `--dtype float32`
on FILE, at exactly llama-perplexity's scored positions of llama.cpp's own tokens
(n_ctx 512, the second half of each chunk). Per path: mean KLD and its p99, same-top %,
perplexity ratio to the reference, each with a 95% bootstrap interval over chunks,
and the rule's verdict: a path may be the default when its mean KLD's interval does
not lie above llama.cpp's on the same file and its perplexity is within 1% of the
reference. Prints a markdown table; --output writes JSON (date, commit, machine,
command, the table). Builds llama.cpp on first use (benchmarks/peers/build_llama_cpp.sh);
--no-llama runs tokenmill's side alone (no verdicts then).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from benchmarks.accuracy_gate.gate import PATHS, TEXTS, GateConfig, render, run


def parse_paths(spec: str | None) -> dict[str, str]:
    """--paths: labels of PATHS, comma-separated, or label=flags entries separated by ';'."""
    if not spec:
        return dict(PATHS)
    if "=" in spec:
        out = {}
        for item in spec.split(";"):
            label, _, flags = item.partition("=")
            out[label.strip()] = flags.strip()
        return out
    labels = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in labels if s not in PATHS]
    if unknown:
        raise SystemExit(f"--paths: unknown {', '.join(unknown)}; known: {', '.join(PATHS)}")
    return {s: PATHS[s] for s in labels}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m (the embedded Q4_1) or a .gguf file")
    ap.add_argument("--text", action="append", default=None,
                    help="text file(s), joined (default: the shipped public-domain texts)")
    ap.add_argument("--paths", default=None,
                    help=f"comma-separated labels of {', '.join(PATHS)} (default: all), "
                    "or 'label=engine flags;label=flags'")
    ap.add_argument("--max-chunks", type=int, default=None,
                    help="score at most this many chunks (default: all the text gives)")
    ap.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    ap.add_argument("--mode", choices=["prefill", "decode"], default="prefill",
                    help="tokenmill scores each chunk by prefill (its second half one "
                    "chunk reading the first half from the KV cache; default) or by a "
                    "decode step per position (the serving decode path; ~20x slower)")
    ap.add_argument("--no-llama", action="store_true", help="tokenmill's side only")
    ap.add_argument("--keep-reference", action="store_true",
                    help="keep the fp32 reference's log-probs in the work folder (2.2 GB "
                    "at 45 chunks of SmolLM2) and reuse them on a later run of the same "
                    "file, text and chunks: paths can then be scored in several runs")
    ap.add_argument("--tag", default="",
                    help="appended to the recorded result's name (kld-gate-MODEL-TAG), so a "
                    "run of some paths does not replace another run's result on the file")
    ap.add_argument("--note", action="append", default=[],
                    help="a line for the recorded result's notes (repeatable)")
    ap.add_argument("--output", help="write the results as JSON")
    ap.add_argument("--verdicts", action="store_true",
                    help="run nothing: print the rule's verdict per path per file from "
                    "the recorded results (benchmarks/results/*kld-gate*)")
    args = ap.parse_args(argv)
    if args.verdicts:
        from benchmarks.accuracy_gate.verdicts import verdict_table
        from benchmarks.results import load_all
        print(verdict_table(load_all()))
        return 0

    from benchmarks.common import machine

    cfg = GateConfig(model=args.model, texts=tuple(Path(t) for t in args.text) if args.text
                     else TEXTS, paths=parse_paths(args.paths), max_chunks=args.max_chunks,
                     use_llama=not args.no_llama, resamples=args.resamples,
                     mode=args.mode, keep_reference=args.keep_reference)
    result = run(cfg)
    print(render(result))
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(),
           "machine": machine(), "command": " ".join(["python -m benchmarks.kld_gate",
                                                       *map(shlex.quote, argv or sys.argv[1:])]),
           "notes": args.note, "tag": args.tag, "gate": result}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(doc, indent=2, default=str))
    print(f"recorded {record(doc)}")
    return 0


def record(doc: dict) -> Path:
    """The gate's table as a benchmark result (benchmarks/results.py): per path its mean
    KLD, KLD p99 and same-top share with their 95% intervals in `config.ci95`, llama.cpp's
    row as the peer; the rule's verdicts in the notes."""
    from benchmarks import results

    gate = doc["gate"]
    figures, notes = [], list(doc.get("notes", []))
    notes.append(f"{gate['positions']} positions ({gate['chunks']} chunks of {gate['n_ctx']}), "
                 f"tokens: {gate.get('tokens_source')}; {gate.get('tokenizer_agreement', '')}")
    for row in gate["rows"]:
        engine = "llama.cpp" if row.get("anchor") else "tokenmill"
        for key, metric, unit, higher in (("kld_mean", "mean KLD", "nats", False),
                                          ("kld_p99", "KLD p99", "nats", False),
                                          ("same_top_pct", "same top", "%", True)):
            fig = row.get(key)
            if not fig:
                continue
            config = {"model": Path(str(gate.get("file", gate["model"]))).name,
                      "positions": row.get("positions"), "ci95": [fig["low"], fig["high"]],
                      "flags": row.get("flags", "")}
            if key == "kld_mean" and "passes" in row:  # the rule's inputs, for verdicts.py
                config["verdict"] = {True: "PASS", False: "FAIL", None: "none"}[row["passes"]]
                config["ppl_ratio"] = row["ppl_ratio"]["value"]
            figures.append(results.Figure(
                label=row["path"], engine=engine, metric=metric, unit=unit,
                runs=[fig["value"]], higher_is_better=higher, config=config))
        if "passes" in row:
            verdict = {True: "PASS", False: "FAIL", None: "no verdict"}[row["passes"]]
            used = ", ".join(f"{k} {v:g}%" for k, v in (row.get("routes") or {}).items())
            notes.append(f"{row['path']}: {verdict} ({row.get('why', '')}; PPL ratio "
                         f"{row['ppl_ratio']['value']:.4f}; linear rows: {used or '-'})")
    result = results.build("kld-gate", "KLD accuracy gate against llama-perplexity",
                           figures, variant="-".join(filter(None, (
                               Path(str(gate["model"])).stem, doc.get("tag")))), notes=notes,
                           command=doc["command"])
    result.update(date=doc["date"], commit=str(doc["commit"])[:7])
    return results.write(result)


if __name__ == "__main__":
    sys.exit(main())
