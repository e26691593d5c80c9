"""Issue 59: explain on an MoE run names the routed-expert bytes per token (the engine's
measured count against the active-expert floor) and says why batching helps an MoE decode
less than a dense one: experts are amortized only when tokens share them."""

from __future__ import annotations

import json

from tokenmill.cli import main
from tokenmill.roofline.arch import ModelArch, WeightBits
from tokenmill.roofline.moe_explain import expert_bytes_per_token
from tokenmill.roofline.presets import PRESETS


def test_expert_bytes_per_token_fall_only_as_tokens_share_experts():
    arch = ModelArch.from_config(PRESETS["mixtral-8x7b"])
    bits = WeightBits.from_name("bf16")
    one = expert_bytes_per_token(arch, bits, 1)
    assert one == arch.num_moe_layers * 2 * arch.expert_params() * 2  # k=2 experts, 2 bytes
    # 8 tokens over 8 experts top-2: ~7 distinct experts, not 16: per token ~7/16 of batch 1's
    assert 0.40 < expert_bytes_per_token(arch, bits, 8) / one < 0.46


def test_explain_names_expert_bytes_and_the_sharing_lever(tmp_path, capsys):
    floor = expert_bytes_per_token(ModelArch.from_config(PRESETS["mixtral-8x7b"]),
                                   WeightBits.from_name("bf16"), 1)
    result = {"config": {"model": "mixtral-8x7b", "dtype": "bf16"},
              "summary": {"mean_in_flight": 2, "mean_input_tokens": 128,
                          "mean_output_tokens": 256, "tpot_ms": {"mean": 14.0, "p50": 14.0},
                          "ttft_ms": {"mean": 300.0, "p50": 300.0}},
              "engine": {"num_steps": 100, "num_prefill_tokens": 100, "num_decode_tokens": 300,
                         "mean_decode_batch": 2.0, "moe_expert_bytes": int(1.5 * floor * 400),
                         "time_s": {"forward": 5.0}, "wall_time_s": 6.0}}
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(result))
    assert main(["explain", str(path), "--hardware", "h200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    note = next(n for n in out["notes"] if n.startswith("MoE: routed-expert bytes per token"))
    assert "k=2 of 8" in note and "(1.50× the floor)" in note
    levers = [lv["name"] + ": " + lv["why"] for lv in out["levers"]]
    assert any(lv.startswith("bigger batch") and "only when tokens share them" in lv
               for lv in levers), levers
