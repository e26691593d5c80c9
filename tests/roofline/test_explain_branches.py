"""`tokenmill explain` lands in each branch docs/roofline.md names, with the levers it promises.

docs/roofline.md's worked example is asserted line for line (fixed `fake_cpu` figures, so the
numbers do not depend on the machine); synthetic results then put a run in each other
branch: memory-bound (bigger batch, int8/int4 weights, fp8 KV, speculative decoding at
batch <= 4), compute-bound, prefill-bound, and the prefix-caching rule (TTFT > 20% of E2E).
"""

import json

import pytest

from tokenmill.cli import main

DATA = "tests/roofline/data"


def explain(capsys, tmp_path, summary: dict, model: str = "llama-3-8b", hardware: str = "h100",
            **config) -> dict:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"config": {"model": model, "hardware": hardware, **config},
                                "summary": summary}))
    code = main(["explain", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def names(r: dict) -> list[str]:
    return [lever["name"] for lever in r["levers"]]


def test_readme_worked_example_line_for_line(capsys, fake_cpu):
    code = main(["explain", f"{DATA}/bench_result.json", "--bandwidth", "47", "--flops", "0.435"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [" ".join(line.split()) for line in out.splitlines()]
    # 15.6 sequences decoding while the others' 128-token prompts join: each step also
    # prefilled 15 prompt tokens, whose FLOPs the floor counts (10.1 ms without them)
    assert ("│ decode step (TPOT), batch 15.6, 192 tokens ctx │ 51 ms │ 17.4 ms │ 34% │ 14% │ 34% │"
            in lines)
    assert "│ prefill (TTFT p50), 128 tokens │ 4,300 ms │ 63.9 ms │ 1.5% │ │ 1.5% │" in lines
    text = " ".join(lines)  # rich wraps long lines at the terminal width
    assert ("Bottleneck: decode is overhead-bound: TPOT 51 ms is 2.9× its 17.4 ms floor "
            "(compute-bound at batch 15.6); it uses only 34% of peak FLOP/s") in text
    assert ("Next lever: fewer, fused ops per step (torch.compile or fused kernels): 33.6 ms "
            "of every 51 ms step is neither moving bytes nor doing math at full rate") in text
    assert ("each decode step also prefilled 15 prompt tokens on average (the other sequences' "
            "next prompts, 128 uncached tokens each, over 128 steps)") in text
    # chunked prefill is always on in tokenmill: the lever is its knob, with the flag
    assert ("then: smaller prefill chunks (tokenmill always chunks prompts): ITL p99 410 ms "
            "is 10.0× p50 41 ms") in text
    assert "try: --max-num-batched-tokens 512" in text
    assert "then: prefix caching (if prompts share a prefix): TTFT is 40% of end-to-end" in text
    assert "then: faster prefill kernels: prefill reaches 1.5% MFU" in text
    r = json.loads(_json(capsys, f"{DATA}/bench_result.json", "--bandwidth", "47",
                         "--flops", "0.435"))
    assert r["decode"]["floor_step_ms"] == pytest.approx(17.4, abs=0.05)
    assert r["decode"]["shared_prefill_tokens_per_step"] == pytest.approx(14.6 * 128 / 128)
    assert r["decode"]["measured_step_ms"] / r["decode"]["floor_step_ms"] == pytest.approx(
        2.9, abs=0.05)
    assert names(r) == ["fewer, fused ops per step (torch.compile or fused kernels)",
                        "smaller prefill chunks (tokenmill always chunks prompts)",
                        "prefill/decode disaggregation",
                        "prefix caching (if prompts share a prefix)",
                        "faster prefill kernels"]


def _json(capsys, *argv) -> str:
    assert main(["explain", *argv, "--json"]) == 0
    return capsys.readouterr().out


BASE = {"mean_input_tokens": 512, "mean_output_tokens": 256}


def test_memory_bound_at_batch_2_offers_batch_quantization_and_speculation(capsys, tmp_path):
    # llama-3-8b on an H100 at batch 2: floor 4.53 ms; measured 5 ms is 91% of bandwidth
    r = explain(capsys, tmp_path, {**BASE, "mean_in_flight": 2, "tpot_ms": {"mean": 5.0},
                                   "ttft_ms": {"p50": 20.0}, "e2e_ms": {"mean": 1300.0}})
    assert r["bottleneck"].startswith("decode is memory-bandwidth-bound: 91% of memory "
                                      "bandwidth at batch 2")
    assert r["decode"]["floor_step_ms"] == pytest.approx(4.53, abs=0.005)
    assert names(r) == ["bigger batch (2 → 8)", "int8 weights", "speculative decoding"]
    # TTFT 20 ms of 1,300 ms end to end (1.5% < 20%): no prefix-caching lever
    assert not any(n.startswith("prefix caching") for n in names(r))


def test_memory_bound_at_batch_8_drops_speculation(capsys, tmp_path):
    r = explain(capsys, tmp_path, {**BASE, "mean_in_flight": 8, "tpot_ms": {"mean": 5.0},
                                   "ttft_ms": {"p50": 20.0}, "e2e_ms": {"mean": 1300.0}})
    assert r["bottleneck"].startswith("decode is memory-bandwidth-bound")
    assert names(r) == ["bigger batch (8 → 32)", "int8 weights"]


def test_int8_weights_are_offered_int4(capsys, tmp_path):
    r = explain(capsys, tmp_path, {**BASE, "mean_in_flight": 8, "tpot_ms": {"mean": 3.0},
                                   "ttft_ms": {"p50": 20.0}, "e2e_ms": {"mean": 1300.0}},
                dtype="int8")
    assert r["dtype"] == "int8"
    assert r["bottleneck"].startswith("decode is memory-bandwidth-bound")
    assert "int4 weights" in names(r) and "int8 weights" not in names(r)


def test_long_context_memory_bound_offers_fp8_kv(capsys, tmp_path):
    # 32k-token prompts at batch 8: KV reads are 69% of the 48.7 GB a step moves
    r = explain(capsys, tmp_path, {"mean_input_tokens": 32000, "mean_output_tokens": 256,
                                   "mean_in_flight": 8, "tpot_ms": {"mean": 16.0},
                                   "ttft_ms": {"p50": 800.0}, "e2e_ms": {"mean": 5000.0}})
    assert r["bottleneck"].startswith("decode is memory-bandwidth-bound")
    assert r["decode"]["kv_bytes_per_step"] / r["decode"]["bytes_per_step"] == pytest.approx(
        0.69, abs=0.005)
    assert names(r)[0] == "fp8 KV cache"
    assert "speculative decoding" not in names(r)


def test_compute_bound_offers_a_smaller_batch(capsys, tmp_path, fake_cpu):
    # smollm2 at batch 64 on the 2-core CPU (ridge 435/47 = 9.3 FLOP/byte): compute-bound;
    # the CPU has no fp8 peak, so no fp8 lever
    r = explain(capsys, tmp_path, {**BASE, "mean_in_flight": 64, "tpot_ms": {"mean": 60.0},
                                   "ttft_ms": {"p50": 400.0}, "e2e_ms": {"mean": 16000.0}},
                model="smollm2-135m", hardware="cpu")
    assert r["decode"]["bound"] == "compute"
    assert r["bottleneck"].startswith("decode is compute-bound at batch 64: 77% of peak FLOP/s")
    assert names(r) == ["smaller batch for latency"]


def test_compute_bound_on_a_gpu_offers_fp8(capsys, tmp_path):
    # llama-3-8b at batch 1,024 with 24-token contexts: ~16 TFLOP per step, past the ridge
    r = explain(capsys, tmp_path, {"mean_input_tokens": 16, "mean_output_tokens": 16,
                                   "mean_in_flight": 1024, "tpot_ms": {"mean": 20.0},
                                   "ttft_ms": {"p50": 1.0}, "e2e_ms": {"mean": 400.0}})
    assert r["decode"]["bound"] == "compute"
    assert r["bottleneck"].startswith("decode is compute-bound")
    assert names(r)[:2] == ["fp8 weights and activations", "smaller batch for latency"]


def test_prefill_bound_offers_prefix_caching_when_ttft_is_over_a_fifth(capsys, tmp_path):
    # decode within 1.4x of its floor; TTFT 3 s against a 7.3 ms floor is 60% of E2E
    r = explain(capsys, tmp_path, {**BASE, "mean_in_flight": 32, "tpot_ms": {"mean": 7.0},
                                   "ttft_ms": {"p50": 3000.0}, "e2e_ms": {"mean": 5000.0}})
    assert r["bottleneck"].startswith("prefill: TTFT p50 3,000 ms against a 7.29 ms floor "
                                      "for 512 tokens")
    assert names(r) == ["prefix caching (if prompts share a prefix)", "faster prefill kernels"]
    assert "TTFT is 60% of end-to-end latency" in r["levers"][0]["why"]


def test_a_decode_floor_counts_the_prompts_that_join_its_steps(capsys, tmp_path, fake_cpu):
    # W2's shape on the CPU: 16 streams, 128-token prompts and outputs. In a long run each of
    # the other 15 slots takes its next request while a sequence decodes its 128 tokens, so
    # its TPOT also pays for 15 prompts of 128 tokens over 128 steps; one wave pays none
    shape = {"mean_input_tokens": 128, "mean_output_tokens": 128, "mean_in_flight": 16,
             "tpot_ms": {"mean": 50.0}, "ttft_ms": {"p50": 300.0}, "e2e_ms": {"mean": 7000.0}}
    wave = explain(capsys, tmp_path, {**shape, "num_completed": 16}, model="smollm2-135m",
                   hardware="cpu")
    run = explain(capsys, tmp_path, {**shape, "num_completed": 256}, model="smollm2-135m",
                  hardware="cpu")
    assert wave["decode"]["shared_prefill_tokens_per_step"] == 0
    assert run["decode"]["shared_prefill_tokens_per_step"] == pytest.approx(15)
    # 15 prompt tokens a step beside 16 decoded ones (a prompt token skips the LM head, a
    # fifth of this model's weights): ~1.7x the multiply-adds, compute-bound
    ratio = run["decode"]["flops_per_step"] / wave["decode"]["flops_per_step"]
    assert 1.65 < ratio < 1.8
    assert run["decode"]["floor_step_ms"] > 1.65 * wave["decode"]["floor_step_ms"]
    assert any("also prefilled 15 prompt tokens" in note for note in run["notes"])
    # prompts the prefix cache served are not prefilled again
    path = tmp_path / "cached.json"
    path.write_text(json.dumps({
        "config": {"model": "smollm2-135m", "hardware": "cpu"},
        "summary": {**shape, "num_completed": 256}, "server": {"prefix_cache_hit_rate": 0.75}}))
    assert main(["explain", str(path), "--json"]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert cached["decode"]["shared_prefill_tokens_per_step"] == pytest.approx(15 / 4)
    # and a prompt's own prefill floor is that of its 32 uncached tokens, not all 128
    assert (cached["prefill"]["prompt_tokens"], cached["prefill"]["uncached_tokens"]) == (128, 32)
    assert cached["prefill"]["floor_ttft_ms"] < run["prefill"]["floor_ttft_ms"] / 2
    # an offline run says it by the engine's counts
    path.write_text(json.dumps({
        "config": {"model": "smollm2-135m", "hardware": "cpu"},
        "summary": {**shape, "num_completed": 256},
        "engine": {"prefix_cache_hits": 96, "prefix_cache_queries": 128}}))
    assert main(["explain", str(path), "--json"]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert cached["decode"]["shared_prefill_tokens_per_step"] == pytest.approx(15 / 4)
    # a step time from the run's throughput holds every prompt: 16 of them in 128 steps
    path.write_text(json.dumps({
        "config": {"model": "smollm2-135m", "hardware": "cpu"},
        "summary": {**{k: v for k, v in shape.items() if k != "tpot_ms"},
                    "output_throughput_tok_s": 300.0, "num_completed": 256}}))
    assert main(["explain", str(path), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["decode"]["shared_prefill_tokens_per_step"] == pytest.approx(16)
