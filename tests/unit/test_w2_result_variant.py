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
