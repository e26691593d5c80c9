"""`--dataset trace`: Mooncake-format traces turned into prompts that really share their
hash-id prefixes, sent at the trace's timestamps."""

import json

import numpy as np
import pytest

from tokenmill.bench.trace import load_trace, synthetic_trace, trace_arrivals, trace_requests
from tokenmill.cli import main as cli_main


def write_trace(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_shared_hash_ids_are_shared_token_prefixes(tmp_path, smollm_tokenizer):
    rows = [{"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [7, 8, 9]},
            {"timestamp": 250, "input_length": 30, "output_length": 5, "hash_ids": [7, 8, 3, 4]},
            {"timestamp": 100, "input_length": 20, "output_length": 6, "hash_ids": [5]}]
    write_trace(tmp_path / "t.jsonl", rows)
    reqs = trace_requests(load_trace(str(tmp_path / "t.jsonl")), smollm_tokenizer,
                          np.random.default_rng(0), block_size=16, time_scale=0.5)
    assert [r.arrival_s for r in reqs] == [0.0, 0.05, 0.125]  # time order, scaled
    assert [r.output_len for r in reqs] == [4, 6, 5]
    a, c, b = (smollm_tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs)
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    # a row with more ids than its blocks uses the first ones: 30 tokens = ids 7, 8, the
    # same 30 tokens that open the first prompt (give or take the re-tokenized end)
    assert common >= 27 and abs(len(b) - 30) <= 3
    assert a[:4] != c[:4]  # id 5 shares nothing with 7


def test_arrivals_start_at_the_first_measured_request():
    from tokenmill.bench.prompts import BenchRequest

    reqs = [BenchRequest("x", 1, 1, arrival_s=t) for t in (2.0, 2.5, 4.0)]
    it = trace_arrivals(reqs)
    assert [next(it) for _ in range(4)] == [0.0, 0.5, 2.0, 3.0]  # then the trace again
    assert trace_arrivals([BenchRequest("x", 1, 1)]) is None


BAD_ROWS = [
    ('{"timestamp": -1, "input_length": 3, "output_length": 2}', "timestamp"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": "ab"}', "hash_ids"),
    ("[1]", "object"),
]


@pytest.mark.parametrize("line, field", BAD_ROWS)
def test_bad_rows_name_the_line_and_field(tmp_path, line, field):
    (tmp_path / "t.jsonl").write_text('{"timestamp": 0, "input_length": 3, '
                                      '"output_length": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"t.jsonl:2: .*{field}"):
        load_trace(str(tmp_path / "t.jsonl"))


def test_trace_flags_without_the_trace_dataset_are_refused(capsys):
    assert cli_main(["bench", "--base-url", "http://127.0.0.1:9", "--time-scale", "2"]) == 2
    assert "--time-scale is for --dataset trace" in capsys.readouterr().err
    assert cli_main(["bench", "--base-url", "http://127.0.0.1:9", "--dataset", "trace",
                     "--trace-path", "x.jsonl", "--request-rate", "3"]) == 2
    assert "--time-scale" in capsys.readouterr().err


@pytest.mark.slow
def test_replay_50_requests_against_tokenmill_serve(server, tmp_path):
    """Arrival times honoured, and the shared hash ids show up as prefix-cache hits."""
    rows = synthetic_trace(50, np.random.default_rng(1), mean_gap_ms=120, num_prefixes=3,
                           prefix_blocks=2, block_size=64, max_extra_blocks=1,
                           output_length=4)
    write_trace(tmp_path / "trace.jsonl", rows)
    out = tmp_path / "r.json"
    assert cli_main(["bench", "--base-url", server.base_url, "--dataset", "trace",
                     "--trace-path", str(tmp_path / "trace.jsonl"), "--trace-block-size", "64",
                     "--time-scale", "0.5", "--tokenizer", "smollm2-135m", "--no-progress",
                     "--scrape-interval", "0.5", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["num_completed"] == 50
    assert res["config"]["workload"]["dataset"] == "trace"
    expected = sorted((r["timestamp"] - rows[0]["timestamp"]) / 1000 * 0.5 for r in rows)
    sent = [r["send_time_s"] for r in res["requests"]]
    # planned = the trace's time; the load generator keeps to it within a scheduler tick
    for want, got in zip(expected, sent):
        assert got == pytest.approx(want, abs=0.1)
    # 3 prefixes of 128 tokens over ~170-token prompts: most prompt tokens are cached
    hit = res["server"]["prefix_cache_hit_rate"]
    assert hit > 0.4, hit
    for r in res["requests"]:
        assert r["output_tokens_server"] == 4
