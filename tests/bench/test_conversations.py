"""Multi-turn and agentic workloads: what is generated, and what the server receives
(each turn's prompt = every earlier message + the server's actual reply)."""

import itertools
import json

import pytest

from tests.bench.fakes import FakeServer, WordTokenizer
from tokenmill.bench import runner
from tokenmill.bench.client import ClientOptions
from tokenmill.bench.workload import (
    BenchRequest,
    FollowUp,
    LengthSpec,
    WorkloadSpec,
    build_workload,
)


def test_seeded_multiturn_has_exact_user_messages_and_no_system(smollm_tokenizer):
    tok = smollm_tokenizer
    spec = WorkloadSpec(dataset="multiturn", turns=3, input_len=LengthSpec.parse("12"),
                        output_len=LengthSpec.parse("5"))
    convs = build_workload(spec, 4, tok, seed=0)
    assert len(convs) == 4
    for c in convs:
        assert c.system == "" and c.num_turns == 3
        for text in [c.prompt] + [f.user for f in c.follow_ups]:
            assert len(tok.encode(text, add_special_tokens=False)) == 12
        assert [c.output_len] + [f.output_len for f in c.follow_ups] == [5, 5, 5]
    assert len({c.prompt for c in convs}) == 4
    assert build_workload(spec, 4, tok, seed=0) == convs  # seeded


def test_agentic_conversations_share_one_long_system_prompt(smollm_tokenizer):
    tok = smollm_tokenizer
    spec = WorkloadSpec(dataset="agentic", prefix_len=200, input_len=LengthSpec.parse("8"),
                        output_len=LengthSpec.parse("4"))
    convs = build_workload(spec, 3, tok, seed=1)
    assert len({c.system for c in convs}) == 1
    assert len(tok.encode(convs[0].system, add_special_tokens=False)) == 200
    assert all(c.num_turns == 8 for c in convs)  # the agentic default


def test_sharegpt_multiturn_follows_the_conversation(tmp_path, smollm_tokenizer):
    long = " ".join(["word"] * 20)
    conv = [{"from": "human", "value": long}, {"from": "gpt", "value": "one two three four"},
            {"from": "human", "value": "and then what happened next"},
            {"from": "gpt", "value": "five six seven"},
            {"from": "human", "value": "unanswered last question here"}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": conv}]))
    spec = WorkloadSpec(dataset="sharegpt", dataset_path=str(path), turns=4)
    (c,) = build_workload(spec, 1, smollm_tokenizer, seed=0)
    assert c.prompt == long
    assert [f.user for f in c.follow_ups] == ["and then what happened next"]
    reply_lens = [len(smollm_tokenizer.encode(t, add_special_tokens=False))
                  for t in ("one two three four", "five six seven")]
    assert [c.output_len, c.follow_ups[0].output_len] == reply_lens


@pytest.fixture(scope="module")
def fake():
    with FakeServer() as srv:
        yield srv


def conversations(n: int = 3) -> list[BenchRequest]:
    return [BenchRequest(f"hello {i}", None, 4, system="tools: a b c",
                         follow_ups=(FollowUp(f"next {i} x", 3), FollowUp(f"last {i}", 2)))
            for i in range(n)]


def run(fake, endpoint: str):
    fake.bodies.clear()
    opts = ClientOptions(base_url=fake.base_url, model="fake", endpoint=endpoint,
                         extra_body={"fake": {"ttft_ms": 5, "gap_ms": 2}})
    plan = runner.BenchPlan(runner.HttpTarget(opts, WordTokenizer()), {"model": "fake"},
                            lambda i: conversations())
    return runner.run_once(plan, runner.LoadSpec(concurrency=2))


def test_completions_turns_grow_by_the_reply_and_the_next_message(fake):
    res = run(fake, "completions")
    s = res["summary"]
    assert (s["num_requests"], s["num_completed"]) == (9, 9)  # 3 conversations x 3 turns
    by_conv: dict[int, list[dict]] = {}
    for r in res["requests"]:
        by_conv.setdefault(r["conversation_id"], []).append(r)
    assert sorted(by_conv) == [0, 1, 2]
    for turns in by_conv.values():
        assert [t["turn"] for t in turns] == [0, 1, 2]
        for prev, cur in itertools.pairwise(turns):
            assert cur["send_time_s"] >= prev["end_time_s"]  # sent after the reply came
            # words: the previous prompt + its reply + the next user message
            assert cur["input_tokens_server"] > prev["input_tokens_server"] + \
                prev["output_tokens_server"]
            assert cur["input_tokens_client"] == cur["input_tokens_server"]
    def sent(ending: str) -> str:
        return next(b["prompt"] for b in fake.bodies if b["prompt"].endswith(ending))

    assert sent("hello 0") == "tools: a b c\n\nhello 0"
    assert sent("next 0 x") == sent("hello 0") + " w w w w" + "\n\nnext 0 x"
    assert sent("last 0") == sent("next 0 x") + " w w w" + "\n\nlast 0"


def test_chat_turns_resend_the_history_with_the_servers_reply(fake):
    res = run(fake, "chat")
    assert res["summary"]["num_completed"] == 9
    last = next(b for b in fake.bodies if b["messages"][-1]["content"] == "last 1")
    assert [m["role"] for m in last["messages"]] == ["system", "user", "assistant", "user",
                                                     "assistant", "user"]
    assert last["messages"][0]["content"] == "tools: a b c"
    assert last["messages"][2]["content"] == " w w w w"  # the fake's actual 4-token reply
    assert last["messages"][3]["content"] == "next 1 x"
    assert last["max_tokens"] == 2
