"""Arrival processes and datasets: statistics, exact token counts, reproducibility."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.workload import (
    LengthSpec,
    WorkloadSpec,
    arrival_times,
    build_workload,
    load_prompts,
)

# the first 16 of ../shared/data/w2_prompts_128.json (PERFORMANCE.md's W2 prompts), shipped
# here so a clone without ../shared still runs the test
W2_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "w2_prompts_128_first16.json"


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gaps_have_mean_one_over_rate_and_cv2_one_over_burstiness(burstiness):
    t = arrival_times(40_001, 8.0, burstiness, np.random.default_rng(123))
    gaps = np.diff(t)
    assert t[0] == 0.0
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)


def test_burstier_means_more_variance():
    rng = np.random.default_rng
    var = {b: np.diff(arrival_times(5000, 2.0, b, rng(1))).var() for b in (0.5, 1.0, 2.0)}
    assert var[0.5] > var[1.0] > var[2.0]


def test_arrivals_repeat_with_the_seed_and_differ_without():
    a = arrival_times(100, 3.0, 1.0, np.random.default_rng(7))
    b = arrival_times(100, 3.0, 1.0, np.random.default_rng(7))
    c = arrival_times(100, 3.0, 1.0, np.random.default_rng(8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrival_times(5, math.inf, 1.0, np.random.default_rng(0)),
                          np.zeros(5))
    with pytest.raises(ValueError):
        arrival_times(5, 0.0, 1.0, np.random.default_rng(0))


def test_length_spec():
    rng = np.random.default_rng(0)
    assert LengthSpec.parse("128").sample(rng, 3) == [128, 128, 128]
    u = LengthSpec.parse("32:512").sample(rng, 2000)
    assert min(u) >= 32 and max(u) <= 512 and min(u) < 40 and max(u) > 500
    n = LengthSpec.parse("normal:100,10").sample(rng, 2000)
    assert np.mean(n) == pytest.approx(100, abs=1.5) and min(n) >= 1
    for bad in ("abc", "5:1", "0"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)


def test_random_prompts_have_exact_token_counts(smollm_tokenizer):
    tok = smollm_tokenizer
    spec = WorkloadSpec(input_len=LengthSpec.parse("1:300"), output_len=LengthSpec.parse("7"))
    reqs = build_workload(spec, 24, tok, seed=0)
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert r.output_len == 7
    lens = [r.prompt_len for r in reqs]
    assert len(set(lens)) > 10  # drawn from the range, and exact
    wanted = LengthSpec.parse("1:300").sample(np.random.default_rng([0, 0]), 24)
    assert lens == wanted


def test_random_workload_is_reproducible_and_fresh_per_run(smollm_tokenizer):
    spec = WorkloadSpec(input_len=LengthSpec.parse("64"))
    a = build_workload(spec, 4, smollm_tokenizer, seed=3)
    b = build_workload(spec, 4, smollm_tokenizer, seed=3)
    c = build_workload(spec, 4, smollm_tokenizer, seed=3, run_index=1)
    assert a == b
    assert not {r.prompt for r in a} & {r.prompt for r in c}


def test_prefix_workload_shares_prefixes_token_for_token(smollm_tokenizer):
    tok = smollm_tokenizer
    spec = WorkloadSpec(dataset="prefix", num_prefixes=2, prefix_len=100,
                        input_len=LengthSpec.parse("16"))
    reqs = build_workload(spec, 6, tok, seed=0)
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in reqs]
    for r, i in zip(reqs, ids):
        assert len(i) == r.prompt_len == 116
    assert ids[0][:100] == ids[2][:100] == ids[4][:100]
    assert ids[1][:100] == ids[3][:100]
    assert ids[0][:100] != ids[1][:100]
    assert len({tuple(i[100:]) for i in ids}) == 6  # distinct suffixes


def test_jsonl_and_json_list_prompts_in_file_order(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in
                              ["one two", {"prompt": "three", "output_len": 5},
                               {"text": "four"}]) + "\n")
    assert [p["prompt"] for p in load_prompts(str(path))] == ["one two", "three", "four"]
    spec = WorkloadSpec(dataset="jsonl", dataset_path=str(path))
    reqs = build_workload(spec, 2, None, seed=0)
    assert [(r.prompt, r.output_len, r.prompt_len) for r in reqs] == [
        ("one two", 128, None), ("three", 5, None)]
    # the next run continues in the file instead of reusing prompts
    assert [r.prompt for r in build_workload(spec, 2, None, 0, run_index=1)] == [
        "four", "one two"]


def test_w2_prompts_file_loads_with_128_tokens_each(smollm_tokenizer):
    spec = WorkloadSpec(dataset="jsonl", dataset_path=str(W2_PROMPTS),
                        output_len=LengthSpec.parse("128"))
    reqs = build_workload(spec, 16, smollm_tokenizer, seed=0)
    assert {r.prompt_len for r in reqs} == {128}
    assert len({r.prompt for r in reqs}) == 16


def test_sharegpt_filters_and_uses_reply_length(tmp_path, smollm_tokenizer):
    long = " ".join(["word"] * 50)
    data = [
        {"conversations": [{"from": "human", "value": "hi"},  # prompt too short
                           {"from": "gpt", "value": long}]},
        {"conversations": [{"from": "human", "value": long},
                           {"from": "gpt", "value": "a reply of some eight tokens here"}]},
        {"conversations": [{"from": "human", "value": long}]},  # no reply
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    spec = WorkloadSpec(dataset="sharegpt", dataset_path=str(path))
    reqs = build_workload(spec, 3, smollm_tokenizer, seed=0)
    assert {r.prompt for r in reqs} == {long}
    reply_len = len(smollm_tokenizer.encode("a reply of some eight tokens here",
                                            add_special_tokens=False))
    assert {r.output_len for r in reqs} == {reply_len}
