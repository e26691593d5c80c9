"""Loading an MoE GGUF peaks at about the file plus its records, not twice that (#59).

The synthetic benchmark file (1.21 GiB) peaked at 3.6 GiB RSS while loading: every
layer's copied expert blocks stayed resident beside all the records repacked from
them until the load ended (the replaced `Experts` modules are freed only by a cyclic
GC). Here a file with 214 MB of Q8_0 experts in 8 layers is loaded by the engine and
its peak RSS (VmHWM, reset first) is held against what stays resident after it: the
gap is about one layer's blocks now; a float copy of the experts (2-4x their bytes),
the mapped file's pages or every layer's blocks kept at the peak each add the
experts' whole size.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill import malloc
from tokenmill.engine.runner.weights import load_engine_model
from tokenmill.kernels import q4q8_gemv
from tokenmill.loaders import resolve_model
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic
from tokenmill.quant.moe_experts import RecordExperts

pytestmark = [
    pytest.mark.skipif(q4q8_gemv.isa() not in ("avx512-vnni", "avx2"),
                       reason="experts run their records (gguf-a16) only with VNNI or AVX2"),
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's VmHWM"),
]

LAYERS, EXPERTS, HIDDEN, INTER = 8, 16, 512, 1024  # 26.7 MB of Q8_0 experts a layer


def _q8_0(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random Q8_0 blocks of a (..., rows, cols) weight: a small fp16 scale, random codes."""
    *lead, cols = shape
    blocks = rng.integers(-127, 128, (*lead, cols // 32, 34), dtype=np.int8).view(np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return blocks.reshape(*lead, cols // 32 * 34)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> tuple[Path, int]:
    """A Qwen3-MoE GGUF with large experts and a tiny rest; (path, expert bytes)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    path = tmp_path_factory.mktemp("gguf") / "qwen3moe-big-experts.gguf"
    heads, kv_heads, head_dim, vocab = 8, 4, 64, 256
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_expert_feed_forward_length(INTER)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(2)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    ones = np.ones(HIDDEN, np.float32)
    w.add_tensor("token_embd.weight", _q8_0(rng, vocab, HIDDEN), raw_dtype=Q.Q8_0)
    w.add_tensor("output.weight", _q8_0(rng, vocab, HIDDEN), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", ones)
    expert_bytes = 0
    for i in range(LAYERS):
        b = f"blk.{i}."
        for name, rows, cols in (("attn_q", heads * head_dim, HIDDEN),
                                 ("attn_k", kv_heads * head_dim, HIDDEN),
                                 ("attn_v", kv_heads * head_dim, HIDDEN),
                                 ("attn_output", HIDDEN, heads * head_dim)):
            w.add_tensor(f"{b}{name}.weight", _q8_0(rng, rows, cols), raw_dtype=Q.Q8_0)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"{b}{name}.weight", ones)
        for name in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"{b}{name}.weight", np.ones(head_dim, np.float32))
        w.add_tensor(f"{b}ffn_gate_inp.weight",
                     rng.standard_normal((EXPERTS, HIDDEN), dtype=np.float32))
        for name, rows, cols in (("ffn_gate_exps", INTER, HIDDEN),
                                 ("ffn_up_exps", INTER, HIDDEN),
                                 ("ffn_down_exps", HIDDEN, INTER)):
            blocks = _q8_0(rng, EXPERTS, rows, cols)
            expert_bytes += blocks.nbytes
            w.add_tensor(f"{b}{name}.weight", blocks, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expert_bytes


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _settled_rss_mib() -> float:
    """RSS once cyclic garbage is collected and the heap's free pages are returned."""
    gc.collect()
    malloc.trim()
    return _status_mib("VmRSS")


def test_moe_load_peak_is_one_layer_of_blocks_above_what_stays(moe_file):
    path, expert_bytes = moe_file
    source = resolve_model(str(path))
    before = _settled_rss_mib()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    except OSError as e:  # a sandbox may refuse it: the peak would include earlier tests
        pytest.skip(f"cannot reset VmHWM: {e}")
    loaded, method = load_engine_model(source, "auto", None, torch.device("cpu"))
    peak = _status_mib("VmHWM")
    after = _settled_rss_mib()
    records = sum(m.records_bytes() for m in loaded.model.modules()
                  if isinstance(m, RecordExperts))
    # the CPU's default arithmetic (gguf-a8 on AVX-512 VNNI, gguf-a16 on AVX2), the
    # experts on its records
    assert method == default_gguf_arithmetic().method and records >= expert_bytes
    experts_mib = expert_bytes / 2**20
    # what stays is the records and the small rest (the kernels' libraries, the dense
    # linears' copies: 36 MB measured), not a second copy of the experts
    assert after - before < 1.5 * records / 2**20, (before, after, records / 2**20)
    # at the peak: the blocks of the layers not yet repacked + the records of those that
    # are, so about one layer's blocks (26 MB) above what stays, with a repack's
    # temporaries and the heap's slack (41-53 MB measured); every layer's blocks kept
    # beside the records, the mapped file or a float copy of the experts each add at
    # least the experts' whole size (204 MB)
    assert peak - after < experts_mib / 2, (peak, after, experts_mib)
