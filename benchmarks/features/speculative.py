"""Speculative decoding at batch 1 (issue 8): decode speedup over no speculation.

Two workloads on the embedded SmolLM2-135M-Instruct, chat template, greedy,
batch 1, up to --max-tokens new tokens each:
  (a) input-grounded: rewrite / fix / edit a given text or code, where the
      answer copies spans of the prompt (prompt lookup's home ground);
  (b) free-form chat, where it cannot copy (speculation must back off).
One engine, one set of weights: the baseline runs with the engine's
speculator switched off, and runs alternate (off, on, off, on, ...) so that
load drift on the machine hits both alike. Reported per workload: decode
tok/s (after the first token) off and on, their ratio, acceptance rate, mean
accepted length, and the distance to the W3 floor (weight bytes read per
step / memory bandwidth).

    python -m benchmarks run speculative --speculative ngram
    python -m benchmarks run speculative --speculative layerskip --draft-layers 8
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import results
from benchmarks.common import machine
from benchmarks.results import Figure

PASSAGE = (
    "The city council met on Tuesday to discuss the new budget. After a long debate, "
    "the members agreed to increase funding for public libraries by ten percent and to "
    "repair the old bridge over the river before winter. The mayor said that the changes "
    "would help families and small businesses, and that the council would review the "
    "results next year.")
CODE = '''def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total + total * tax
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
GROUNDED = [
    f"Rewrite the following text in the past tense, keeping everything else the same:\n\n{PASSAGE}",
    ("Fix the spelling mistakes in this text and return the whole corrected text:\n\n"
     + PASSAGE.replace("budget", "budgett").replace("libraries", "librarys")),
    ("Rename the function `total_price` to `order_total` in this code and return the full "
     f"code:\n\n```python\n{CODE}```"),
    ("Add a docstring to each function in this code and return the full code:\n\n"
     f"```python\n{CODE}```"),
]
CHAT = [
    "Write a short story about a dragon who is afraid of the dark.",
    "What are some good ways to stay focused while studying?",
    "Explain how rainbows form, for a ten-year-old.",
    "Give me five ideas for a birthday party for my grandmother.",
]


def decode_run(llm, prompt_ids: list[int], max_tokens: int) -> tuple[float, int]:
    """Decode tok/s after the first token, and the number of output tokens."""
    from tokenmill import SamplingParams

    engine = llm.engine
    engine.add_request("bench", prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    first = end = None
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if first is None and n:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return ((n - 1) / (end - first) if n > 1 else 0.0), n


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen and t.dim() >= 2:  # weights, not rotary tables / norms
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


def run_workload(llm, spec, prompts: list[str], args) -> dict:
    engine = llm.engine
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True)
           for p in prompts]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    off, on = [], []
    outputs_equal = 0
    before = engine.get_stats()
    proposed0, accepted0, steps0 = (before.spec_proposed_tokens, before.spec_accepted_tokens,
                                    before.spec_verified_steps)
    for _ in range(args.repeats):
        for p in ids:
            engine.speculator = None
            tok_s_off, n_off = decode_run(llm, p, args.max_tokens)
            engine.speculator = spec
            tok_s_on, n_on = decode_run(llm, p, args.max_tokens)
            off.append(tok_s_off)
            on.append(tok_s_on)
            outputs_equal += n_off == n_on
    st = engine.get_stats()
    proposed = st.spec_proposed_tokens - proposed0
    accepted = st.spec_accepted_tokens - accepted0
    steps = st.spec_verified_steps - steps0
    ratios = [b / a for a, b in zip(off, on)]
    return {
        "off_tok_s": statistics.median(off), "on_tok_s": statistics.median(on),
        "off_runs": off, "on_runs": on,
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": 1 + accepted / steps if steps else 0.0,
        "proposed": proposed, "accepted": accepted, "same_length": outputs_equal / len(off),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--speculative", default="ngram", choices=["ngram", "draft", "layerskip"])
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--workloads", default="grounded,chat")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--draft-layers", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="passes over each workload's prompts")
    ap.add_argument("--bandwidth-gb-s", type=float, default=None,
                    help="memory read bandwidth for the floor (default: tokenmill's CPU measurement)")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 avoids OpenMP spin-waits when other jobs share the cores)")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from tokenmill import LLM

    llm = LLM("smollm2-135m", dtype=args.dtype, speculative=args.speculative,
              num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
              ngram_min=args.ngram_min, ngram_max=args.ngram_max,
              draft_layers=args.draft_layers, enable_prefix_caching=False)
    spec = llm.engine.speculator
    decode_run(llm, llm.tokenizer.encode("Hello"), 8)  # warm-up
    if args.bandwidth_gb_s is not None:
        bandwidth = args.bandwidth_gb_s * 1e9
    else:
        from tokenmill.roofline.hardware import get_hardware

        bandwidth = get_hardware("cpu").memory_bandwidth_bytes_s
    wbytes = weight_bytes(llm.engine.runner.model)
    floor_ms = wbytes / bandwidth * 1e3

    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    print(f"model: smollm2-135m, weights {wbytes / 1e6:.0f} MB as loaded "
          f"({llm.engine.quantization or llm.engine.dtype}); W3 floor "
          f"{floor_ms:.2f} ms/token = {1e3 / floor_ms:.0f} tok/s at {bandwidth / 1e9:.1f} GB/s")
    print(f"speculative={args.speculative} k={args.num_speculative_tokens} "
          f"ngram={args.ngram_min}..{args.ngram_max} "
          f"max_tokens={args.max_tokens} repeats={args.repeats}")
    header = (f"{'workload':<16}{'off tok/s':>10}{'on tok/s':>10}{'ratio':>7}{'(min-max)':>13}"
              f"{'accept':>8}{'mean len':>9}{'on/floor':>9}")
    print(header)
    workloads = {"grounded": ("(a) grounded", GROUNDED), "chat": ("(b) chat", CHAT)}
    figures: list[Figure] = []
    cfg = {"model": "smollm2-135m", "speculative": args.speculative,
           "k": args.num_speculative_tokens, "max_tokens": args.max_tokens}
    for name, prompts in (workloads[w] for w in args.workloads.split(",")):
        r = run_workload(llm, spec, prompts, args)
        for mode in ("off", "on"):
            figures.append(Figure(f"speculation {mode}, {name}", "tokenmill",
                                  f"decode {name}", "tok/s", r[f"{mode}_runs"], True,
                                  {**cfg, "speculation": mode == "on",
                                   "acceptance_rate": round(r["acceptance_rate"], 3)}))
        # distance to the floor: how many floor-times one emitted token takes
        on_over_floor = (1e3 / r["on_tok_s"]) / floor_ms if r["on_tok_s"] else float("nan")
        print(f"{name:<16}{r['off_tok_s']:>10.1f}{r['on_tok_s']:>10.1f}{r['ratio']:>7.2f}"
              f"{r['ratio_min']:>6.2f}-{r['ratio_max']:<6.2f}{r['acceptance_rate']:>8.2f}"
              f"{r['mean_accepted_length']:>9.2f}{on_over_floor:>8.2f}x")
    print("ratio = median over prompts of (decode tok/s on) / (off); on/floor = time per "
          "emitted token / W3 floor (< 1 beats the batch-1 floor: several tokens per weight read)")
    if not args.no_result:
        results.write(results.build("speculative", "Speculative decoding at batch 1", figures,
                                    variant=args.speculative))


if __name__ == "__main__":
    main()
