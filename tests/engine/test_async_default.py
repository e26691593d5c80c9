"""Async scheduling's default per device: on with CUDA, off on CPU; the flags
--async-scheduling / --no-async-scheduling override it, and `serve --help` says so."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args
from tokenmill.engine.core.async_default import resolve_async_scheduling


@pytest.mark.parametrize(("requested", "device", "tp", "spec", "want"), [
    (None, "cuda", 1, None, True),
    (None, "cpu", 1, None, False),
    (None, "cuda", 2, None, False),  # the workers need rank 0's ids each step
    (None, "cuda", 1, "ngram", False),  # drafts need the host's accepted tokens
    (False, "cuda", 1, None, False),
    (True, "cpu", 1, None, True),
])
def test_default_resolves_per_device(requested, device, tp, spec, want):
    assert resolve_async_scheduling(requested, device, tp, spec) is want


def test_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parse = lambda *a: engine_config_from_args(parser.parse_args(list(a)))
    assert parse().async_scheduling is None
    assert parse("--async-scheduling").async_scheduling is True
    assert parse("--no-async-scheduling").async_scheduling is False
    assert "default: on with CUDA, off on CPU" in " ".join(parser.format_help().split())


def test_a_cpu_engine_steps_synchronously_by_default(tiny_model):
    from tokenmill import LLM

    llm = LLM(tiny_model, dtype="float32", attention_backend="torch", num_kv_blocks=32,
              max_num_seqs=2, max_model_len=128)
    assert llm.engine.overlap is None and llm.engine.config.async_scheduling is False
