"""Speculation stress: the engine in-process under `--speculative ngram` with a
randomized mix, hunting stalls (issue 64, item 3).

Each round builds an LLMEngine on the embedded SmolLM2 with a random small KV pool
(8-64 blocks: preemption), a random k, batch budget and max_num_seqs, prefix caching
on or off, --debug-kv-integrity; then feeds it requests: repetitive prompts (ngram
drafts a lot), random words, a shared prefix (cache hits), n = 1-3, greedy or seeded
sampling, stop strings, logprobs, max_tokens up to what the pool can hold, and
aborts between steps. Every step is timed. A stall is a step loop that runs no batch
(the engine's step count unchanged) for --stall-steps calls in a row while requests
are unfinished, steps that run for --stall-steps while no request gets a token, or
one request that gets none for 20x as many; each ends the round with the engine's
state dumped.

    python -m benchmarks run spec-stress --duration 600 --seed 1

Prints only (not a speed figure); not part of `make test`, whose fast reproducer is
tests/speculative/test_spec_stall.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hex", "every", "jolly", "mountain", "river"]
SHARED = " ".join(["Copy this line exactly and then copy it again:"] * 6)


class Stall(RuntimeError):
    """The engine stopped making progress."""


def random_config(rng: random.Random) -> dict:
    return {"num_kv_blocks": rng.choice((8, 10, 12, 16, 24, 40, 64)),
            "max_num_seqs": rng.choice((2, 3, 4, 8, 16)),
            "max_num_batched_tokens": rng.choice((32, 64, 128, 256, 2048)),
            "num_speculative_tokens": rng.choice((1, 2, 4, 6, 8)),
            "ngram_min": rng.choice((1, 2)),
            "spec_max_batch": rng.choice((2, 8, 64)),
            "prefix_caching": rng.random() < 0.6,
            "adaptive": rng.random() < 0.5}


def build(cfg: dict, seed: int, model: str = "smollm2-135m"):
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=model,
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        speculative="ngram", num_speculative_tokens=cfg["num_speculative_tokens"],
        ngram_min=cfg["ngram_min"], ngram_max=4, spec_max_batch=cfg["spec_max_batch"],
        debug_kv_integrity=True, seed=seed,
        cache=CacheConfig(num_kv_blocks=cfg["num_kv_blocks"],
                          enable_prefix_caching=cfg["prefix_caching"])))
    engine.speculator.adaptive = cfg["adaptive"]
    return engine


def fake_forward(engine, seed: int) -> None:
    """Replace the model's forward by a cheap deterministic one (for hunting logic bugs
    at thousands of steps a second): the next token is a function of the token and its
    position, cycling through a few word tokens and EOS, so that text repeats (ngram
    drafts, mostly accepted) but not forever (rejections, EOS). The scheduler, block
    manager, speculator, sampler and stop checks are the engine's own."""
    import torch

    tok = engine.tokenizer
    words = sorted({i for w in WORDS for i in tok.encode(" " + w)} | {tok.encode(",")[0]})
    eos = min(engine.eos_token_ids)
    vocab = engine.model_config.vocab_size
    table = torch.tensor(words + [eos])
    salt = seed * 7919

    def forward(ids, pos, meta, rows):
        ids_rows = ids[torch.tensor(rows, dtype=torch.long)].long()
        pos_rows = pos[torch.tensor(rows, dtype=torch.long)].long()
        # mostly a function of the token alone (repeats), sometimes of the position
        key = torch.where(pos_rows % 11 == 0, ids_rows * 31 + pos_rows + salt, ids_rows + salt)
        nxt = table[key % len(table)]
        logits = torch.zeros(len(rows), vocab)
        logits[torch.arange(len(rows)), nxt] = 8.0
        logits[torch.arange(len(rows)), table[(key + 1) % len(table)]] = 7.0
        return logits

    engine.runner.forward = forward


def random_request(rng: random.Random, capacity: int):
    """(prompt, SamplingParams fields, capacity): a random request of the mix."""

    kind = rng.choice(("repeat", "repeat", "words", "shared", "digits"))
    if kind == "repeat":  # a span said several times: the model (and ngram) copy it
        span = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        prompt = ", ".join([span] * rng.randint(2, 8))
    elif kind == "words":
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    elif kind == "shared":
        prompt = SHARED + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
    else:
        prompt = " ".join(str(i) for i in range(rng.randint(1, 30)))
    greedy = rng.random() < 0.5
    params = {
        "n": rng.choice((1, 1, 1, 2, 3)),
        "temperature": 0.0 if greedy else rng.choice((0.5, 0.9, 1.3)),
        "seed": None if greedy or rng.random() < 0.3 else rng.randrange(1 << 30),
        "ignore_eos": rng.random() < 0.5,
        "logprobs": rng.choice((None, None, 0, 2)),
        "stop": rng.choice(([], [], [","], ["fox"], ["\n\n", "dog"])),
        "top_k": rng.choice((-1, -1, 5)),
    }
    return prompt, params, capacity


def fit_max_tokens(engine, prompt: str, n: int, rng: random.Random) -> int:
    """max_tokens up to what the pool can hold for n samples (the engine's admission
    rule) or the context: at that limit a third of the time."""
    num_prompt = len(engine.tokenizer.encode(prompt))
    cap = engine.block_manager.max_tokens_that_fit() - num_prompt
    limit = min(cap // n, engine.max_model_len - num_prompt)
    if limit < 1:
        return 0
    return limit if rng.random() < 0.3 else rng.randint(1, min(limit, 96))


def run_round(cfg: dict, seed: int, num_requests: int, stall_steps: int,
              log_every: int = 0, model: str = "smollm2-135m", fake: bool = False) -> dict:
    from tokenmill import SamplingParams
    from tokenmill.engine.core.validation import RequestError

    rng = random.Random(seed)
    engine = build(cfg, seed, model)
    if fake:
        fake_forward(engine, seed)
    capacity = engine.block_manager.max_tokens_that_fit()
    added = rejected = aborted = finished = 0
    step_times: list[float] = []
    idle_calls = 0
    last_token_step: dict[str, int] = {}  # request -> steps run when it last got a token
    num_tokens: dict[str, int] = {}
    steps_run = last_progress = 0
    while added < num_requests or engine.has_unfinished_requests():
        # arrivals: a few at a time, so that the queue and the batch both move
        while added < num_requests and engine.get_num_unfinished_requests() < \
                cfg["max_num_seqs"] + 2 and rng.random() < 0.5:
            prompt, p, _ = random_request(rng, capacity)
            max_tokens = fit_max_tokens(engine, prompt, p["n"], rng)
            rid = f"r{added}"
            added += 1
            if max_tokens < 1:
                continue
            try:
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **p))
            except RequestError as e:
                rejected += 1
                if rejected <= 3:
                    print(f"    rejected {rid}: {e}", flush=True)
                continue
            last_token_step[rid] = steps_run
            num_tokens[rid] = 0
        if engine.requests and rng.random() < 0.01:  # a client leaves
            rid = rng.choice(sorted(engine.requests))
            engine.abort_request(rid)
            last_token_step.pop(rid, None)
            aborted += 1
        steps_before = engine.stats.num_steps
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if engine.stats.num_steps == steps_before and not outputs:
            idle_calls += 1
            if idle_calls >= stall_steps and engine.has_unfinished_requests():
                raise Stall(f"no batch for {idle_calls} calls\n{describe(engine)}")
            continue
        idle_calls = 0
        steps_run += 1
        step_times.append(elapsed)
        for out in outputs:
            n = sum(len(c.token_ids) for c in out.outputs)
            if n != num_tokens.get(out.request_id, 0):
                num_tokens[out.request_id] = n
                last_token_step[out.request_id] = last_progress = steps_run
            if out.finished:
                finished += 1
                last_progress = steps_run
                last_token_step.pop(out.request_id, None)
        if engine.has_unfinished_requests() and steps_run - last_progress > stall_steps:
            raise Stall(f"no request got a token for {stall_steps} steps that ran\n"
                        f"{describe(engine)}")
        starved = [r for r, s in last_token_step.items() if steps_run - s > 20 * stall_steps]
        if starved:  # FIFO behind long requests in a tiny pool takes a while; not forever
            raise Stall(f"{starved} got no token for {20 * stall_steps} steps\n"
                        f"{describe(engine)}")
        if log_every and steps_run % log_every == 0:
            print(f"    step {steps_run}: {elapsed * 1e3:.1f} ms, "
                  f"{engine.scheduler.num_running} running, "
                  f"{engine.scheduler.num_waiting} waiting", flush=True)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    stats = engine.get_stats()
    return {"added": added, "rejected": rejected, "aborted": aborted, "finished": finished,
            "steps": steps_run, "preemptions": engine.scheduler.num_preemptions,
            "drafts": engine.speculator.stats.num_proposed_tokens,
            "accepted": engine.speculator.stats.num_accepted_tokens,
            "step_ms_median": 1e3 * statistics.median(step_times) if step_times else 0.0,
            "step_ms_max": 1e3 * max(step_times, default=0.0),
            "prefix_hits": getattr(stats, "prefix_cache_hits", 0)}


def describe(engine) -> str:
    """The scheduler's and block manager's state, for a stall report."""
    s, bm = engine.scheduler, engine.block_manager
    lines = [(f"free blocks {bm.num_free_blocks}/{bm.num_total_blocks}, "
             f"max_model_len {engine.max_model_len}")]
    for name, seqs in (("running", s.running), ("waiting", list(s.waiting))):
        for seq in seqs:
            lines.append(f"  {name} {seq.request_id}#{seq.index}: tokens {seq.num_tokens} "
                         f"(prompt {seq.num_prompt_tokens}), computed {seq.num_computed_tokens}, "
                         f"blocks {len(seq.block_table)}, hashes {len(seq.block_hashes)}, "
                         f"max_tokens {seq.sampling_params.max_tokens}, "
                         f"finished {seq.is_finished}")
    lines.append(f"  requests {sorted(engine.requests)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of rounds")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--fake-forward", action="store_true",
                    help="a cheap deterministic stand-in for the model's forward: the "
                         "engine's logic at thousands of steps a second (hunting only)")
    ap.add_argument("--seed", type=int, default=0, help="the first round's seed")
    ap.add_argument("--requests", type=int, default=40, help="requests per round")
    ap.add_argument("--stall-steps", type=int, default=500,
                    help="calls without a batch (or steps without a request's token) "
                         "that count as a stall")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared, loaded machine's 2 threads spin)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    deadline = time.monotonic() + args.duration
    seed, totals, stalls = args.seed, {}, []
    while time.monotonic() < deadline:
        cfg = random_config(random.Random(seed))
        start = time.monotonic()
        try:
            out = run_round(cfg, seed, args.requests, args.stall_steps, model=args.model,
                            fake=args.fake_forward)
        except Stall as e:
            print(f"STALL seed {seed} {cfg}:\n{e}", flush=True)
            stalls.append(seed)
            seed += 1
            continue
        for key, value in out.items():
            if key.startswith("step_ms"):
                totals[key] = max(totals.get(key, 0.0), value)
            else:
                totals[key] = totals.get(key, 0) + value
        print(f"seed {seed}: {time.monotonic() - start:.0f} s {cfg} -> {out}", flush=True)
        seed += 1
    print(f"rounds {seed - args.seed}, stalls {len(stalls)} {stalls}; totals {totals}")
    return 1 if stalls else 0


if __name__ == "__main__":
    raise SystemExit(main())
