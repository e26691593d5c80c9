"""W2's result names the extra serve flags it ran with (issue 58: Gemma's W2 under
`-- --quantization gguf-a8` must not overwrite the default's result)."""

from benchmarks import results
from benchmarks.workloads.w2_serving import result_variant


def test_serve_flags_name_the_result_beside_the_default():
    stem = "gemma-3-270m-q4_k_m"
    assert result_variant(None, []) is None
    assert result_variant(stem, []) == stem
    variant = result_variant(stem, ["--quantization", "gguf-a8"])
    assert variant == f"{stem} --quantization gguf-a8"
    assert results.slug(variant) == "gemma-3-270m-q4_k_m-quantization-gguf-a8"
    assert result_variant(None, ["--max-num-seqs", "32"]) == "--max-num-seqs 32"


def test_a_second_tokenmill_server_counts_as_tokenmill_in_the_ratios():
    """`--also-serve "--quantization gguf-a16"` (issue 57's A/B in one run): its figures
    are tokenmill's, each held against the peers, not a peer of the default."""
    from benchmarks.workloads.w2_serving import figures_of

    summary = {"output_throughput_tok_s": 100.0, "ttft_ms": {"p50": 50.0},
               "tpot_ms": {"mean": 10.0}, "num_failed": 0}
    slower = {**summary, "output_throughput_tok_s": 50.0}
    figures = figures_of({"tokenmill": [summary], "tokenmill --quantization gguf-a16": [summary],
                          "llama-server -np 16": [slower]}, [16], {"model": "m"})
    assert {f.label: f.engine for f in figures}["tokenmill --quantization gguf-a16"] == \
        "tokenmill"
    pairs = {(r["tokenmill"], r["peer"]) for r in results.ratios(figures)
             if r["metric"] == "output throughput c=16"}
    assert pairs == {("tokenmill", "llama-server -np 16"),
                     ("tokenmill --quantization gguf-a16", "llama-server -np 16")}


def test_repeats_keep_every_run_and_the_targets_read_medians(capsys):
    """`--repeats 3`: each figure holds the three runs (the result's median is theirs),
    the table and the target read each column's median, and a server's failures add up."""
    from benchmarks.workloads.w2_serving import figures_of, median_summaries, print_targets
    from benchmarks.workloads.w2_targets import TARGETS

    def summary(tok_s: float, ttft: float, failed: int = 0) -> dict:
        return {"output_throughput_tok_s": tok_s, "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
                "tpot_ms": {"mean": 1000 / tok_s}, "num_failed": failed}

    per_repeat = [
        {"tokenmill": [summary(440.0, 400.0)], "llama-server -np 16": [summary(140.0, 2900.0)]},
        {"tokenmill": [summary(375.0, 450.0, 1)], "llama-server -np 16": [summary(150.0, 2600.0)]},
        {"tokenmill": [summary(410.0, 370.0)], "llama-server -np 16": [summary(155.0, 2800.0)]},
    ]
    med = median_summaries(per_repeat, [16])
    assert med["tokenmill"][0]["output_throughput_tok_s"] == 410.0
    assert med["llama-server -np 16"][0]["output_throughput_tok_s"] == 150.0
    assert med["tokenmill"][0]["ttft_ms"] == {"p50": 400.0, "p99": 800.0}
    assert med["tokenmill"][0]["num_failed"] == 1
    assert median_summaries(per_repeat[:1], [16]) == per_repeat[0]
    figures = figures_of(per_repeat, [16], {"model": "m", "repeats": 3})
    tok_s = {f.label: f.runs for f in figures if f.metric == "output throughput c=16"}
    assert tok_s == {"tokenmill": [440.0, 375.0, 410.0],
                     "llama-server -np 16": [140.0, 150.0, 155.0]}
    ratio = next(r for r in results.ratios(figures) if r["metric"] == "output throughput c=16")
    assert abs(ratio["ratio"] - 410.0 / 150.0) < 1e-4
    print_targets(med, [16], TARGETS["gemma3"])
    out = capsys.readouterr().out
    assert "2.73x" in out and "missed" in out  # 410 / 150: the medians, not one repeat's
    print_targets(per_repeat[0], [16], TARGETS["gemma3"], verdicts=False)
    assert "target" not in capsys.readouterr().out
