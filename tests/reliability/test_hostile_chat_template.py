"""A GGUF's chat template is untrusted code: it is rendered in jinja's immutable
sandbox (through transformers), so a template that reaches for Python's
internals fails with a SecurityError (the server answers 400 naming
`messages`) and runs nothing."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError

from tokenmill.loaders import load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m"))


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__['os'].system('touch {marker}') }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append({{'role': 'system'}}) %}{{ x }}",  # the sandbox is immutable
    "{{ lipsum.__globals__.os.popen('touch {marker}').read() }}",
    "{{ (messages|attr('__class__')).__base__.__subclasses__() }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_template_escapes_are_blocked(tokenizer, tmp_path, template):
    marker = tmp_path / "escaped"
    source = template.replace("{marker}", str(marker)).replace("{{'", "{'").replace("'}}", "'}")
    with pytest.raises((SecurityError, Exception)) as e:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      chat_template=source)
    assert isinstance(e.value, SecurityError) or "undefined" in str(e.value).lower()
    assert not marker.exists()


def test_range_is_bounded(tokenizer):
    with pytest.raises(OverflowError):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      chat_template="{% for i in range(10**9) %}{% endfor %}")
