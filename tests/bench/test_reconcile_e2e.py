"""The client's numbers against a real `tokenmill serve`'s own histograms, and
multi-turn conversations against its prefix cache (one run serves both)."""

import json

import pytest

from tokenmill.cli import main as cli_main

pytestmark = pytest.mark.slow  # a real model on a shared CPU
# long enough that the 0.1 s scrapes see requests running: at 8 tokens a turn the whole
# run could fall between two scrapes once decode got faster (gauges' running max 0 in a
# make test of 2026-12-06)
OUTPUT_LEN = 32


@pytest.fixture(scope="module")
def chat_run(server, tmp_path_factory):
    """2 multi-turn chat conversations of 3 turns (plus 1 warmup conversation), each
    reply OUTPUT_LEN tokens."""
    out = tmp_path_factory.mktemp("reconcile") / "mt.json"
    code = cli_main(["bench", "--base-url", server.base_url, "--endpoint", "chat",
                     "--dataset", "multiturn", "--turns", "3", "--input-len", "40",
                     "--output-len", str(OUTPUT_LEN), "--num-requests", "2",
                     "--concurrency", "2",
                     "--warmup", "1", "--no-progress", "--tokenizer", "smollm2-135m",
                     "--scrape-interval", "0.1", "--output", str(out)])
    assert code == 0
    return json.loads(out.read_text())


def test_client_and_server_means_agree_but_for_the_transport(chat_run):
    srv = chat_run["server"]
    assert srv["available"] and srv["scheme"] == "tokenmill"
    rows = {r["what"]: r for r in srv["reconciliation"]}
    for what in ("TTFT mean (ms)", "ITL mean (ms)", "E2E mean (ms)"):
        r = rows[what]  # within 5%, or within the 10 ms the transport costs (no warning)
        assert not r["warn"], r
        assert abs(r["diff_pct"]) < 5.0 or abs(r["client"] - r["server"]) < 10.0, r
    # the client's interval holds the server's: it sends before the server receives and
    # reads each token after the server made it
    assert rows["TTFT mean (ms)"]["client"] >= rows["TTFT mean (ms)"]["server"], rows
    # ...but the server stamps a request's end after it has flushed the last chunk, so a
    # client may read that chunk first: E2E may read up to a few ms under the server's
    # (1 ms under, in two full make test runs on 2026-12-06)
    e2e = rows["E2E mean (ms)"]
    assert e2e["client"] >= e2e["server"] - 5.0, e2e
    # counts agree exactly, and the warmup conversation fell outside the scrapes
    assert rows["requests finished"]["server"] == rows["requests finished"]["client"] == 6
    assert rows["output tokens"]["server"] == rows["output tokens"]["client"] == 6 * OUTPUT_LEN
    assert rows["input tokens"]["diff_pct"] == 0  # the chat template counted on both sides
    assert srv["gauges"]["running"]["max"] >= 1  # seen mid-run by the periodic scrapes
    assert 0 < srv["gauges"]["kv_cache_usage"]["max"] <= 1
    # the client measured itself on the server's host
    c = chat_run["client"]
    assert c["same_host"] is True and c["cpu_seconds"] > 0 and 0 < c["cpu_share"] < 1


def test_multiturn_conversations_hit_the_prefix_cache(chat_run):
    assert chat_run["summary"]["num_completed"] == 6  # 2 conversations x 3 turns
    by_conv: dict[int, list[dict]] = {}
    for r in chat_run["requests"]:
        by_conv.setdefault(r["conversation_id"], []).append(r)
    reused = 0
    for turns in by_conv.values():
        ins = [t["input_tokens_server"] for t in turns]
        outs = [t["output_tokens_server"] for t in turns]
        for k in (1, 2):  # history + reply + a new 40-token message, template included
            assert ins[k] >= ins[k - 1] + outs[k - 1] + 40
        reused += ins[0] + ins[1]  # what turns 2 and 3 re-send of the turn before
    hits = chat_run["server"]["counters"]["prefix_cache_hits"]
    # most of each earlier prompt is found in the cache (whole blocks only), far more
    # than the chat template's shared system prompt alone could give
    assert hits >= 0.6 * reused, (hits, reused)
    assert chat_run["server"]["prefix_cache_hit_rate"] > 0.3
