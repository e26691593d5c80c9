"""Issue 21: the engine with --batched-linears w8a8 on the embedded model. Eight windows
decode together, so every scored step has 8 rows and takes the w8a8 linears (8+ rows,
tokenmill/quant/model.py); greedy choices are compared with the bf16 large-batch path.

The path does not pass issue 21's accuracy gate (benchmarks/accuracy.py: about 91% top-1
agreement with fp32 where bf16 has 97%; BENCHMARKS.md), which is why it is not the
default; this test holds the level it has (below the brief's 95% teacher-forced bar), so a
kernel regression shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.quant import QuantizedLinear
from tokenmill.quant import int8_dynamic as w8a8

TEXT = Path(__file__).resolve().parents[1] / "data" / "opticks_book1.txt"

pytestmark = pytest.mark.skipif(not w8a8.available(),
                                reason="int8 GEMM kernel not built (no compiler / no VNNI)")


@pytest.mark.slow
def test_w8a8_teacher_forced_top1_stays_close_to_bf16():
    from tokenmill.engine.core.teacher_forced import score_windows

    engines = {name: LLMEngine(EngineConfig(max_num_seqs=8, batched_linears=name))
               for name in ("bf16", "w8a8")}
    model = engines["w8a8"].runner.model
    assert all(isinstance(m.dense, w8a8.Int8DynamicWeight)
               for m in model.modules() if isinstance(m, QuantizedLinear))
    ids = engines["bf16"].tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    windows = [ids[i * 33:(i + 1) * 33] for i in range(8)]  # 8 x 32 = 256 scored positions
    bf16 = score_windows(engines["bf16"], windows)
    int8 = score_windows(engines["w8a8"], windows)
    assert sum(len(w) for w in int8.argmax) == 256
    # measured 2026-12-01: 84.8% top-1, perplexity 207.2 vs 199.4 (+3.9%; short windows
    # from their first token: an unsure model, many near-ties). Below issue 21's 95% bar
    assert int8.agreement(bf16) >= 0.80
    assert int8.perplexity() == pytest.approx(bf16.perplexity(), rel=0.06)
