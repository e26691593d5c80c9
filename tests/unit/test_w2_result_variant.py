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
