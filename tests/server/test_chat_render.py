"""The server front end's tokenizer (loaders/fast_tokenizer.py: the `tokenizers` library
alone) and chat rendering (loaders/chat_render.py: jinja2's sandbox alone) against
transformers' on the real tokenizers: the same ids, text, prompts and errors, so that
dropping transformers from the front end (issue 60) changes nothing a client sees."""

from __future__ import annotations

import random
from pathlib import Path

import jinja2
import pytest

from tokenmill.loaders import resolve_model
from tokenmill.loaders import tokenizer as tok
from tokenmill.loaders.chat_templates import GEMMA3_CHAT_TEMPLATE
from tokenmill.loaders.fast_tokenizer import FastTokenizer, unsupported_keys

QWEN3_TEMPLATE = (Path(__file__).parent.parent / "data" / "qwen3_chat_template.jinja").read_text()
TEXTS = ["Hello, world!", " leading space", "<|im_start|>user\nhi<|im_end|>",
         "<bos>x<eos><start_of_turn>user", "naïve café 日本語 🤖 ∑x²", "a  b\t\tc\n\n", "",
         " don't . , isn't", "<think>x</think>", "def f(x):\n    return x ** 2"]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! ", "tool_calls": None},
        {"role": "user", "content": [{"type": "text", "text": "and  then?"}]}]
PLAIN = [*CHAT[:3], {"role": "user", "content": "and  then?"}]  # string content only
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city (°C)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [{"type": "function", "id": "c1", "function": {
         "name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21"},
    {"role": "user", "content": "Thanks"}]

# whitespace control: trim_blocks / lstrip_blocks change what this renders
BLOCKS_TEMPLATE = ("{% for m in messages %}\n    {% if m.role == 'user' %}\nU: {{ m.content }}\n"
                   "    {% elif m.reasoning is defined %}\nR: {{ m.thinking }}\n    {% endif %}\n"
                   "{% endfor %}\n{{ strftime_now('%Y') | length }} {{ dict(a=1) | tojson }}")
# the assistant's reasoning after the last user turn: Qwen3's template shows it
REASONING_CHAT = [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning": "add them"}]


def _pair(name: str) -> tuple[FastTokenizer, object]:
    source = resolve_model(name)
    reference = tok.load_tokenizer(source)  # transformers'; writes the cache on a miss
    tok._load_front_end_tokenizer.cache_clear()
    fast = tok.load_front_end_tokenizer(source)
    assert isinstance(fast, FastTokenizer), "the cache hit was not read without transformers"
    return fast, reference


@pytest.fixture(scope="module")
def smollm2() -> tuple[FastTokenizer, object]:
    return _pair("smollm2-135m")


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the error itself is what is compared
        return type(e).__name__, str(e)[:200]


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_front_end_tokenizer_equals_transformers(name, smollm2):
    fast, ref = smollm2 if name == "smollm2-135m" else _pair(name)
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == \
                ref.encode(text, add_special_tokens=special), (text, special)
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randint(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(ref.all_special_ids))
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert fast.get_vocab() == ref.get_vocab() and len(fast) == len(ref)
    assert fast.special_tokens_map == ref.special_tokens_map
    assert fast.all_special_ids == ref.all_special_ids
    assert (fast.bos_token_id, fast.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert fast.chat_template == ref.chat_template  # Gemma's: the built-in default
    for chat, kwargs in ((PLAIN, {"add_generation_prompt": True}), (CHAT, {}),
                         (CHAT[:3], {"continue_final_message": True})):
        got = _outcome(lambda c=chat, k=kwargs: fast.apply_chat_template(c, tokenize=False, **k))
        assert got == _outcome(
            lambda c=chat, k=kwargs: ref.apply_chat_template(c, tokenize=False, **k))
    assert isinstance(got, str)  # SmolLM2's template concatenates content: a list is a TypeError


@pytest.mark.parametrize("template", ["qwen3", "gemma3", "smollm2", "blocks"])
def test_templates_render_and_fail_as_transformers(smollm2, template):
    fast, ref = smollm2
    text = {"qwen3": QWEN3_TEMPLATE, "gemma3": GEMMA3_CHAT_TEMPLATE,
            "smollm2": ref.chat_template, "blocks": BLOCKS_TEMPLATE}[template]
    cases = [
        {"conversation": CHAT, "add_generation_prompt": True},
        {"conversation": PLAIN, "add_generation_prompt": True},
        {"conversation": TOOL_CHAT, "tools": TOOLS, "add_generation_prompt": True},
        {"conversation": TOOL_CHAT, "tools": TOOLS, "add_generation_prompt": True,
             "enable_thinking": False},
        {"conversation": CHAT[:3], "continue_final_message": True},
        {"conversation": REASONING_CHAT, "continue_final_message": True},
        {"conversation": REASONING_CHAT, "continue_final_message": "reasoning"},
        {"conversation": [{"role": "assistant", "content": "x"}],  # Gemma: must alternate
             "add_generation_prompt": True},
        {"conversation": [], "add_generation_prompt": True},
        {"conversation": CHAT, "add_generation_prompt": True, "continue_final_message": True},
    ]
    rendered = 0
    for case in cases:
        got = _outcome(lambda c=case: fast.apply_chat_template(
            chat_template=text, tokenize=False, **c))
        want = _outcome(lambda c=case: ref.apply_chat_template(
            chat_template=text, tokenize=False, **c))
        if isinstance(want, tuple):  # an error: the same kind (and, for templates, words)
            assert isinstance(got, tuple), (case, got)
            assert got[0] == want[0] or {got[0], want[0]} <= {"ValueError", "TemplateError"}
            if want[0] == "TemplateError":
                assert got == want
        else:
            assert got == want, case
            rendered += 1
    assert rendered >= 3  # not only errors compared
    ids = fast.apply_chat_template(PLAIN, chat_template=text, add_generation_prompt=True)
    assert ids == ref.encode(ref.apply_chat_template(
        PLAIN, chat_template=text, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)


def test_the_sandbox_refuses_what_transformers_refuses(smollm2):
    fast, _ = smollm2
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        fast.apply_chat_template(CHAT, chat_template=escape, tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        fast.apply_chat_template(CHAT, tokenize=False,
                                 chat_template="{% set ns = namespace(_x=1) %}{{ ns }}")
    assert fast.apply_chat_template(  # tojson: no HTML escaping, unicode kept, indent
        CHAT, tokenize=False, chat_template="{{ tools | tojson(indent=2) }}", tools=TOOLS
    ).count("°C") == 1


def test_a_config_asking_for_more_falls_back_to_transformers():
    assert unsupported_keys({"bos_token": "<s>", "add_prefix_space": None,
                             "tokenizer_class": "GemmaTokenizer"}) == []
    assert unsupported_keys({"add_bos_token": True, "legacy": False}) == \
        ["add_bos_token", "legacy"]
