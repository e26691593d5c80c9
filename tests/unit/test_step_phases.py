"""The overlapped stepper (engine/core/overlap.py) drives LLMEngine through its
public step phases only (admit / schedule / resolve / end_step), as the
synchronous step does: no `engine._anything` in it, read with `ast`."""

import ast
import pathlib

from tokenmill.engine.core import overlap
from tokenmill.engine.core.llm_engine import LLMEngine


def test_overlap_touches_no_private_member_of_the_engine():
    tree = ast.parse(pathlib.Path(overlap.__file__).read_text())
    engine_names = {"eng", "engine"}
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if name in engine_names:
                private.append(f"line {node.lineno}: {name}.{node.attr}")
    assert not private, private


def test_llm_engine_stays_small():
    # issue #55: start-up wiring, admission and output building live beside it
    source = pathlib.Path(LLMEngine.__module__.replace(".", "/") + ".py")
    lines = (pathlib.Path(__file__).resolve().parents[2] / source).read_text().splitlines()
    assert len(lines) <= 250, len(lines)
