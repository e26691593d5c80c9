"""benchmarks/accuracy_gate: the KLD matches a hand computation on a tiny vocabulary,
the scored positions are llama-perplexity's, llama.cpp's log-prob file and report
read back, the bootstrap interval holds the mean, the rule decides as issue 57 says,
and FILE-f32.gguf holds the file's own weights dequantized. No model is run."""

from __future__ import annotations

import math
import struct
import types

import gguf
import numpy as np
import pytest

from benchmarks.accuracy_gate import figures, llama_files, llama_runs
from benchmarks.accuracy_gate.bootstrap import chunk_bootstrap
from benchmarks.accuracy_gate.chunks import Chunking
from benchmarks.accuracy_gate.f32_gguf import write_f32
from benchmarks.accuracy_gate.kld import (
    PositionFigures,
    decode_llama_rows,
    kld_rows,
    llama_row_width,
)


def test_kld_matches_a_hand_computation():
    ref = np.log([[0.5, 0.25, 0.25]])
    cur = np.log([[0.25, 0.5, 0.25]])
    # 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0.25 ln 1 = 0.25 ln 2
    assert kld_rows(ref, cur)[0] == pytest.approx(0.25 * math.log(2), rel=1e-12)
    assert kld_rows(ref, ref)[0] == 0.0
    fig = PositionFigures.of(ref, cur, np.array([1]))
    assert fig.nll[0] == pytest.approx(math.log(2))       # -ln 0.5 under the path
    assert fig.nll_ref[0] == pytest.approx(math.log(4))   # -ln 0.25 under the reference
    assert not fig.same_top[0]                            # argmax 1 vs 0


def test_kld_leaves_out_reference_tokens_below_e_minus_16_as_llama_cpp():
    tiny = math.exp(-17)
    ref = np.log([[1 - tiny, tiny]])
    cur = np.log([[0.5, 0.5]])
    expected = (1 - tiny) * (math.log(1 - tiny) - math.log(0.5))  # the tiny term skipped
    assert kld_rows(ref, cur)[0] == pytest.approx(expected, rel=1e-12)


def _llama_encode(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp's `log_softmax(n_vocab, logits, uint16_t *, tok)`, in numpy."""
    logits = logits.astype(np.float32)
    mx, mn = logits.max(), max(logits.min(), logits.max() - 16)
    lse = np.float32(math.log(np.exp((logits - mx).astype(np.float64)).sum()))
    scale = np.float32((mx - mn) / 65535.0)
    row = np.zeros(llama_row_width(len(logits)), np.uint16)
    row[:4] = np.array([scale, mn - mx - lse], np.float32).view(np.uint16)
    q = np.where(logits > mn, np.rint((logits - mn) / scale), 0)
    row[4:4 + len(logits)] = q.astype(np.uint16)
    return row


def test_llama_cpp_log_prob_rows_decode_to_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, 11).astype(np.float32)
    got = decode_llama_rows(_llama_encode(logits)[None], 11)[0]
    want = logits - logits.max() - math.log(np.exp(logits - logits.max()).sum())
    keep = logits > logits.max() - 16
    assert np.allclose(got[keep], want[keep], atol=16 / 65535)


def test_positions_are_llama_perplexity_chunks():
    ch = Chunking(512)
    assert (ch.first, ch.scored_per_chunk, ch.n_chunks(1100)) == (256, 255, 2)
    scored = ch.scored(1100)
    assert len(scored) == 510                       # the 76-token tail is dropped
    assert scored[0] == (256, 257) and scored[254] == (510, 511)
    assert scored[255] == (768, 769) and scored[-1] == (1022, 1023)
    tokens = list(range(100, 1200))
    chunks = ch.chunks(tokens, bos_id=1)
    assert [len(c) for c in chunks] == [512, 512]
    assert chunks[1][0] == 1 and chunks[1][1:] == tokens[513:1024]   # BOS over token 0
    assert ch.chunks(tokens, bos_id=None)[1] == tokens[512:1024]     # a vocab without BOS
    small = Chunking(8)                             # first 4: logits 4..6 predict 5..7
    assert small.scored(17) == [(4, 5), (5, 6), (6, 7), (12, 13), (13, 14), (14, 15)]


def test_llama_cpp_log_prob_file_reads_back(tmp_path):
    n_ctx, n_vocab, n_chunk = 8, 5, 2
    tokens = np.arange(n_ctx * n_chunk, dtype=np.int32) % n_vocab
    per_chunk = Chunking(n_ctx).scored_per_chunk
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(per_chunk * n_chunk, n_vocab)).astype(np.float32)
    path = tmp_path / "base.kld"
    with open(path, "wb") as f:
        f.write(b"_logits_" + struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        f.write(tokens.tobytes())
        f.writelines(_llama_encode(row).tobytes() for row in logits)
    got = llama_files.read(path)
    assert (got.n_ctx, got.n_vocab, got.n_chunk) == (n_ctx, n_vocab, n_chunk)
    assert got.targets().tolist() == [tokens[t] for _, t in Chunking(n_ctx).scored(16)]
    want = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert np.allclose(got.logprobs(0, len(logits)), want, atol=1e-3)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="expected"):
        llama_files.read(path)


REPORT = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  17.123456 ±   0.301234
Mean PPL(base)                :  16.900000 ±   0.298765
Cor(ln(PPL(Q)), ln(PPL(base))):  99.01%
Mean ln(PPL(Q)/PPL(base))     :   0.013134 ±   0.001234
Mean PPL(Q)/PPL(base)         :   1.013221 ±   0.001250
Mean PPL(Q)-PPL(base)         :   0.223456 ±   0.021000

====== KL divergence statistics ======
Mean    KLD:   0.031234 ±   0.000456
Maximum KLD:   1.234567
99.9%   KLD:   0.812345
99.0%   KLD:   0.234567
95.0%   KLD:   0.101234
Same top p: 91.234 ± 0.265 %
"""


def test_llama_perplexity_report_is_parsed():
    got = llama_runs.parse_kld_report(REPORT)
    assert got["kld_mean"] == 0.031234 and got["kld_mean_pm"] == 0.000456
    assert got["kld_p99"] == 0.234567 and got["same_top_pct"] == 91.234
    assert got["ppl_ratio"] == 1.013221 and got["ppl_base"] == 16.9
    with pytest.raises(ValueError, match="kld_p99"):
        llama_runs.parse_kld_report(REPORT.replace("99.0%", "98.0%"))


def test_bootstrap_interval_contains_the_mean():
    rng = np.random.default_rng(2)
    values = rng.exponential(0.03, 20 * 50)
    value, low, high = chunk_bootstrap(20, 50, lambda i: values[i].mean(), resamples=300)
    assert value == pytest.approx(values.mean())
    assert low < value < high
    flat = chunk_bootstrap(4, 3, lambda i: 7.0, resamples=20)
    assert flat == (7.0, 7.0, 7.0)


def _row(kld: tuple[float, float, float], ratio: float) -> dict:
    return {"kld_mean": dict(zip(("value", "low", "high"), kld)),
            "ppl_ratio": {"value": ratio}}


def test_the_rule():
    llama = _row((0.030, 0.028, 0.032), 1.01)
    assert figures.verdict(_row((0.033, 0.031, 0.035), 1.004), llama)[0] is True  # overlaps
    ok, why = figures.verdict(_row((0.036, 0.033, 0.039), 1.004), llama)
    assert ok is False and "lies above llama.cpp's" in why
    ok, why = figures.verdict(_row((0.020, 0.018, 0.022), 1.012), llama)
    assert ok is False and "not within 1%" in why
    assert figures.verdict(_row((0.02, 0.01, 0.03), 1.0), None)[0] is None


def test_f32_file_holds_the_dequantized_weights_and_the_metadata(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.02, (4, 64)).astype(np.float32)
    src = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(src, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = write_f32(src, tmp_path / "tiny-f32.gguf")
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    assert r.fields["llama.block_count"].contents() == 1
    t = {x.name: x for x in r.tensors}
    assert t["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    want = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(t["blk.0.attn_q.weight"].data).reshape(4, 64), want)
    assert np.abs(want - w).max() < 1e-3                 # and that is close to w


def test_prefill_capture_keeps_only_the_scored_positions_of_each_chunk(monkeypatch):
    """The prompt rows of a step (two chunks, spans as prompt_rows gives them) go to
    the sink at their chunk-major row; the engine still records its prompt logprobs."""
    import torch

    from benchmarks.accuracy_gate import tokenmill_runs
    from tokenmill.engine.core import llm_engine

    seen_by_engine = []
    monkeypatch.setattr(llm_engine, "record_prompt_logprobs",
                        lambda logits, rows, rec: seen_by_engine.append(len(logits)))

    class Seq:
        def __init__(self, rid):
            self.request_id = rid

    ch = Chunking(8)                       # scored logit positions 4, 5, 6
    chunks = {"a": (0, list(range(8))), "b": (1, list(range(8)))}
    got = []

    # chunk a: positions 2..6 in this step; chunk b: positions 0..3
    rows = types.SimpleNamespace(spans=[(Seq("a"), 2, 5), (Seq("b"), 0, 4)])

    logits = torch.arange(9.0)[:, None].repeat(1, 3)   # row r holds r everywhere
    with tokenmill_runs._capture_prompt_logprobs(chunks, ch, lambda rows, lp: got.append(rows)):
        llm_engine.record_prompt_logprobs(logits, rows, {})
    assert got[0].tolist() == [0, 1, 2]    # a's positions 4, 5, 6; none of b's (0..3)
    assert seen_by_engine == [9]


def test_verdict_table_has_a_cell_per_path_per_file():
    """Two files' recorded runs (and two runs on one file: their paths merge into one
    column) give one row per path with the verdict and the KLD beside llama.cpp's."""
    from benchmarks.accuracy_gate.verdicts import verdict_table

    def fig(label, engine, value, verdict=None, model="a.gguf", positions=510):
        cfg = {"model": model, "positions": positions, "ci95": [value * 0.9, value * 1.1]}
        if verdict:
            cfg.update(verdict=verdict, ppl_ratio=1.001)
        return {"label": label, "engine": engine, "metric": "mean KLD", "runs": [value],
                "config": cfg}

    def result(name, date, figs):
        return {"workload": "kld-gate", "name": name, "date": date,
                "machine": {"class": "avx512-vnni"}, "figures": figs}

    table = verdict_table([
        result("kld-gate-a", "2026-12-06T01", [fig("llama.cpp", "llama.cpp", 0.003),
                                                fig("default", "tokenmill", 0.001, "PASS")]),
        result("kld-gate-a-kernels", "2026-12-06T02", [
            fig("llama.cpp", "llama.cpp", 0.003),
            fig("gguf-a8 kernel", "tokenmill", 0.005, "FAIL")]),
        result("kld-gate-b", "2026-12-06T03", [
            fig("llama.cpp", "llama.cpp", 0.004, model="b.gguf"),
            fig("default", "tokenmill", 0.002, "PASS", model="b.gguf")]),
    ]).splitlines()
    assert table[0].count("a.gguf") == 1 and "b.gguf" in table[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[2:] if line.startswith("|")}
    assert list(rows) == ["llama.cpp (anchor)", "default", "gguf-a8 kernel"]
    assert rows["default"].count("**PASS** 0.00") == 2
    assert "**FAIL** 0.00500 [0.00450, 0.00550], PPL x1.0010 | - |" in rows["gguf-a8 kernel"]


def test_verdict_table_judges_a_run_without_llama_against_the_files_recorded_anchor():
    """A `--no-llama` run (no anchor of its own) gets the rule's verdict against the
    llama.cpp figure recorded on the same file and positions, marked; the latest run of a
    path on a file replaces an earlier one whatever the results' names; a file with no
    anchor anywhere gets no verdict."""
    from benchmarks.accuracy_gate.verdicts import verdict_table

    def fig(label, engine, value, low, high, model="a.gguf", verdict=None, ratio=1.002):
        cfg = {"model": model, "positions": 510, "ci95": [low, high], "ppl_ratio": ratio}
        if verdict:
            cfg["verdict"] = verdict
        return {"label": label, "engine": engine, "metric": "mean KLD", "runs": [value],
                "config": cfg}

    def result(name, date, figs):
        return {"workload": "kld-gate", "name": name, "date": date,
                "machine": {"class": "avx512-vnni"}, "figures": figs}

    a8 = "gguf-a8 kernel"
    table = verdict_table([
        # the later run's name sorts first: date, not name, decides which form is shown
        result("kld-gate-a-zz-old-form", "2026-12-06T01", [
            fig("llama.cpp", "llama.cpp", 0.003, 0.0029, 0.0031),
            fig(a8, "tokenmill", 0.005, 0.0045, 0.0055, verdict="FAIL")]),
        result("kld-gate-a-new-form", "2026-12-06T02", [
            fig(a8, "tokenmill", 0.0025, 0.0024, 0.0026)]),
        result("kld-gate-a-too-far", "2026-12-06T03", [
            fig("far", "tokenmill", 0.004, 0.0035, 0.0045)]),
        result("kld-gate-a-ppl", "2026-12-06T04", [
            fig("ppl", "tokenmill", 0.001, 0.0009, 0.0011, ratio=1.02)]),
        result("kld-gate-b", "2026-12-06T05", [
            fig(a8, "tokenmill", 0.001, 0.0009, 0.0011, model="b.gguf")]),
    ]).splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[2:] if line.startswith("|")}
    assert "**PASS**\u2020 0.00250 [0.00240, 0.00260], PPL x1.0020 | 0.00100" in rows[a8]
    assert "FAIL" not in rows[a8]
    assert "**FAIL**\u2020 0.00400" in rows["far"]
    assert "**FAIL**\u2020 0.00100" in rows["ppl"]
    assert any(line.startswith("\u2020 judged against llama.cpp's figure") for line in table)


def test_report_prints_interval_ends_rounded():
    from benchmarks.report import _config

    assert _config({"ci95": [0.0028103541780858943, 0.0031261898127933428], "n": 3}) == \
        "ci95=[0.00281, 0.00313], n=3"


def test_the_fp8_path_runs_the_gpus_fp8_arithmetic_on_a_cpu():
    """`fp8 weights (CPU emulation)` (issue 63): the engine the gate builds has every
    linear but the LM head as Fp8Linear (e4m3 codes), where the same engine flags
    without the gate's own flag are refused on a CPU, naming fp8."""
    import torch

    from benchmarks.accuracy_gate import tokenmill_runs
    from benchmarks.accuracy_gate.gate import PATHS
    from tokenmill.quant.fp8 import Fp8Linear

    flags = PATHS["fp8 weights (CPU emulation)"]
    assert tokenmill_runs.FP8_CPU_EMULATION_FLAG in flags
    engine = tokenmill_runs.build_engine("smollm2-135m", f"{flags} --max-model-len 256")
    assert engine.quantization == "fp8"
    model = engine.runner.model
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(fp8) == 4 * 30  # SmolLM2's 30 layers: qkv, o, gate_up, down
    assert not any("lm_head" in n for n in fp8)
    assert all(m.weight_fp8.dtype == torch.float8_e4m3fn for m in fp8.values())
    plain = flags.replace(tokenmill_runs.FP8_CPU_EMULATION_FLAG, "")
    with pytest.raises(ValueError, match="fp8"):
        tokenmill_runs.build_engine("smollm2-135m", f"{plain} --max-model-len 256")
