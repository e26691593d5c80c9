"""Structured output and token constraints through `LLM` on the embedded model (fp32)."""

import json
import re

import jsonschema
import pytest

from tests.engine.conftest import assert_no_leak
from tokenmill.sampling_params import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams as Structured

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"]}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT = "The capital of France is"


def _chat(llm, params, messages=ASK):
    return llm.chat(messages, params, use_tqdm=False)[0]


def test_json_schema_samples_at_temperature_one_all_validate(llm):
    out = _chat(llm, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=120,
                                    structured_outputs=Structured(json=PERSON)))
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert_no_leak(llm.engine)


def test_json_object_regex_and_choice(llm):
    obj = _chat(llm, SamplingParams(temperature=0, max_tokens=80,
                                    structured_outputs=Structured(json_object=True)),
                [{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}])
    assert json.loads(obj.outputs[0].text) == {"ok": True}
    regex = r"\d{3}-[a-z]{2,4}"
    rx = _chat(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                   structured_outputs=Structured(regex=regex)))
    assert re.fullmatch(regex, rx.outputs[0].text)
    choices = ["yes", "no", 'maybe "so"']
    ch = _chat(llm, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10,
                                   structured_outputs=Structured(choice=choices)))
    assert all(c.text in choices for c in ch.outputs)
    ebnf = 'root ::= "The answer is " [0-9]+ "."'
    gr = _chat(llm, SamplingParams(temperature=0, max_tokens=20,
                                   structured_outputs=Structured(grammar=ebnf)))
    assert re.fullmatch(r"The answer is \d+\.", gr.outputs[0].text)


def test_unconstrained_rows_keep_their_greedy_tokens_in_a_mixed_batch(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0, max_tokens=12, logit_bias={11: 5.0},
                                 structured_outputs=Structured(json=PERSON))
    mixed = llm.generate([PROMPT, PROMPT, "Hello"], [greedy, constrained, greedy],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text.startswith("{")


def test_logit_bias_forces_and_bans_and_allowed_token_ids_limit(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4,
                                                   logit_bias={42: 100}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [42] * 4
    banned = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4,
                                                   logit_bias={base[0]: -100}), use_tqdm=False)
    assert banned[0].outputs[0].token_ids[0] != base[0]
    allowed = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, seed=0,
                                                    allowed_token_ids=[42, 43]), use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {42, 43}


def test_bad_words_never_appear(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)[0].outputs[0].text
    assert "Paris" in plain  # else this test proves nothing
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                bad_words=["Paris"]), use_tqdm=False)
    assert "Paris" not in out[0].outputs[0].text


def test_stop_string_inside_the_grammar_truncates_cleanly(llm):
    out = _chat(llm, SamplingParams(temperature=0, max_tokens=80, stop=[","],
                                    structured_outputs=Structured(json=PERSON)))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "," and c.text.startswith("{")
    assert_no_leak(llm.engine)


def test_preempted_constrained_sequence_recomputes_to_the_same_output(llm):
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=Structured(json=PERSON))
    expected = _chat(llm, params).outputs[0].text
    engine = llm.engine
    prompt = llm.tokenizer.encode(llm.render_chat(ASK), add_special_tokens=False)
    engine.add_request("preempt-me", prompt, params)
    done = None
    for step in range(200):
        if step == 5:  # mid-output: recompute as the scheduler would
            seq = engine.scheduler.running.pop()
            engine.scheduler._preempt(seq)
        for out in engine.step():
            if out.finished:
                done = out
        if done:
            break
    assert engine.scheduler.num_preemptions >= 1
    assert done.outputs[0].text == expected
    jsonschema.validate(json.loads(expected), PERSON)
    assert_no_leak(engine)


@pytest.mark.parametrize("spec,param", [
    (Structured(json={"type": "objectx"}), "structured_outputs.json"),
    (Structured(regex="(ab"), "structured_outputs.regex"),
    (Structured(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_invalid_constraints_raise_naming_the_field(llm, spec, param):
    with pytest.raises(ValueError) as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=spec),
                     use_tqdm=False)
    assert info.value.param == param
    assert_no_leak(llm.engine)


def test_parameter_checks():
    with pytest.raises(ValueError, match="exactly one"):
        Structured(json=PERSON, regex="a")
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=Structured(regex="a+"))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
