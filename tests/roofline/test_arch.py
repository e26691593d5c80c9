"""Parameter, byte and KV counts against hand-computed values."""

import pytest

from tokenmill.roofline.arch import ModelArch, WeightBits
from tokenmill.roofline.presets import preset_config
from tokenmill.roofline.source import resolve


def arch(name: str, **overrides) -> ModelArch:
    return ModelArch.from_config({**preset_config(name), **overrides})


BF16 = WeightBits.from_name("bf16")


def test_llama3_8b_weights_and_kv():
    a = arch("llama-3-8b")
    # embed 128256·4096, untied head the same, 32 layers of 218,112,000, final norm 4096
    assert a.total_params() == 2 * 128256 * 4096 + 32 * 218_112_000 + 4096 == 8_030_261_248
    assert BF16.weight_bytes(a) == 16_060_522_496  # ≈ 16.06 GB
    assert a.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131_072


def test_gqa_vs_mha_kv():
    gqa = arch("llama-3-8b")
    mha = arch("llama-3-8b", num_key_value_heads=32)
    assert mha.kv_bytes_per_token(2) == 2 * 32 * 32 * 128 * 2 == 524_288
    assert mha.kv_bytes_per_token(2) == 4 * gqa.kv_bytes_per_token(2)
    # k and v projections grow from 4096×1024 to 4096×4096 in each of 32 layers
    assert mha.total_params() - gqa.total_params() == 32 * 2 * 4096 * (4096 - 1024)


def test_tied_embeddings_counted_once():
    tied = arch("smollm2-135m")
    untied = arch("smollm2-135m", tie_word_embeddings=False)
    assert tied.total_params() == 134_515_008
    assert untied.total_params() - tied.total_params() == 49152 * 576


def test_mixtral_active_bytes():
    a = arch("mixtral-8x7b")
    expert = 3 * 4096 * 14336
    assert a.total_params() == 46_702_792_704
    assert a.active_params() == a.total_params() - 32 * 6 * expert == 12_879_925_248
    # batch 1 reads 2 experts per layer, attention, routers, LM head, norms, one embedding row
    read = (32 * 2 * expert + 32 * 41_943_040 + 32 * 8 * 4096 + 32000 * 4096
            + 32 * 8192 + 4096 + 4096)
    assert BF16.bytes_read_per_step(a, 1) == pytest.approx(2 * read)
    assert a.expected_distinct_experts(1) == pytest.approx(2)
    assert a.expected_distinct_experts(2) == pytest.approx(8 * (1 - (6 / 8) ** 2))  # 3.5
    assert a.expected_distinct_experts(64) == pytest.approx(8, rel=1e-6)


def test_deepseek_v3_mla_and_moe():
    a = arch("deepseek-v3")
    # MLA caches the 512-wide latent and the 64-wide shared rope key, per layer
    assert a.kv_bytes_per_token(2) == (512 + 64) * 61 * 2 == 70_272
    assert a.kv_bytes_per_token(1) == 35_136  # fp8 KV
    assert a.total_params() == pytest.approx(671e9, rel=0.002)
    assert a.active_params() == pytest.approx(37.5e9, rel=0.01)


def test_sliding_window_caps_kv():
    a = arch("mistral-7b")  # window 4096 in every layer
    assert a.kv_bytes_at_context(1000, 2) == 1000 * 131_072
    assert a.kv_bytes_at_context(32768, 2) == 4096 * 131_072
    full = arch("mistral-7b", sliding_window=None)
    assert full.kv_bytes_at_context(32768, 2) == 32768 * 131_072


@pytest.mark.parametrize("dtype, bits", [("q4_1", 5.0), ("q8_0", 8.5), ("q4_0", 4.5),
                                         ("q4_k", 4.5), ("q6_k", 6.5625), ("bf16", 16.0),
                                         ("int4", 4.25)])
def test_bits_per_weight_include_scales(dtype, bits):
    assert WeightBits.from_name(dtype).linear == bits


def test_same_model_from_preset_config_json_and_gguf(smollm2_gguf):
    from_preset = resolve("smollm2-135m").arch
    from_json = resolve("tests/roofline/data/smollm2_config.json").arch
    from_gguf = resolve(smollm2_gguf)
    for a in (from_json, from_gguf.arch):
        assert a.total_params() == from_preset.total_params() == 134_515_008
        assert a.kv_bytes_per_token(2) == from_preset.kv_bytes_per_token(2) == 23_040
    # bytes from the file's tensor types (Q4_1 layers, Q8_0 embedding, F32 norms) add up
    assert from_gguf.default_bits.linear == 5.0
    assert from_gguf.default_bits.embedding == 8.5
    assert from_gguf.default_bits.weight_bytes(from_gguf.arch) == 96_576_768
    assert from_gguf.notes == ()


def test_gemma3_presets_count_their_window_pattern():
    """Gemma 3: every 6th layer global, the others keep W tokens; 270M has 268M parameters
    (the issue's figure for the real file) and its q/k norms and four norms per layer."""
    small = ModelArch.from_config(preset_config("gemma3-270m"))
    assert round(small.total_params() / 1e6) == 268
    assert sum(w is None for w in small.layer_windows) == 3
    per_layer = small.kv_elements_per_token_per_layer() * 2  # bf16: 1 KiB
    assert small.kv_bytes_at_context(4096, 2) == (3 * 4096 + 15 * 512) * per_layer
    big = ModelArch.from_config(preset_config("gemma-3-27b"))
    assert sum(w is None for w in big.layer_windows) == 10 and big.head_dim == 128
    assert big.kv_bytes_at_context(32768, 2) < 0.2 * big.kv_bytes_per_token(2) * 32768


def test_gemma3_released_config_with_only_a_pattern():
    cfg = {k: v for k, v in preset_config("gemma-3-1b").items() if k != "layer_types"}
    arch = ModelArch.from_config({**cfg, "sliding_window_pattern": 6})
    assert arch.layer_windows == ModelArch.from_config(preset_config("gemma-3-1b")).layer_windows


def test_phi3_presets():
    mini = ModelArch.from_config(preset_config("phi-3-mini"))
    assert round(mini.total_params() / 1e9, 2) == 3.82
    assert set(mini.layer_windows) == {2047}
    medium = ModelArch.from_config(preset_config("phi-3-medium"))
    assert round(medium.total_params() / 1e9, 1) == 14.0 and medium.num_kv_heads == 10


@pytest.mark.parametrize("name, layers, kv_heads, head_dim, window", [
    ("gemma-3-1b", 26, 1, 256, 512),
    ("gemma-3-4b", 34, 4, 256, 1024),
    ("gemma-3-12b", 48, 8, 256, 1024),
    ("gemma-3-27b", 62, 16, 128, 1024),
])
def test_gemma3_presets_cap_local_layers_at_their_window(name, layers, kv_heads, head_dim,
                                                         window):
    """5 local : 1 global: at a 32k context a local layer holds `window` tokens of K and V,
    a global one all 32k (bf16: 2 bytes each)."""
    arch = ModelArch.from_config(preset_config(name))
    n_global = layers // 6
    assert sum(w is None for w in arch.layer_windows) == n_global
    per_token_layer = 2 * kv_heads * head_dim * 2
    context = 32768
    expected = (n_global * context + (layers - n_global) * window) * per_token_layer
    assert arch.kv_bytes_at_context(context, 2) == expected
    # below the window every layer holds the whole context
    assert arch.kv_bytes_at_context(window, 2) == layers * window * per_token_layer


def test_phi3_128k_and_phi4_mini_presets():
    mini_128k = ModelArch.from_config(preset_config("phi-3-mini-128k"))
    assert mini_128k.total_params() == ModelArch.from_config(
        preset_config("phi-3-mini")).total_params()
    # its window (262144) is past the context: no layer is capped
    assert mini_128k.kv_bytes_at_context(131072, 2) == mini_128k.kv_bytes_per_token(2) * 131072
    phi4 = ModelArch.from_config(preset_config("phi4-mini"))
    assert round(phi4.total_params() / 1e9, 2) == 3.84  # tied 200k embedding counted once
    assert (phi4.num_kv_heads, phi4.head_dim) == (8, 128)
    assert phi4.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2
