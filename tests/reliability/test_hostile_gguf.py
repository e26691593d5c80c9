"""Hostile GGUF files: each case is a valid tiny model with one field patched,
and each must end in a ModelLoadError naming the file and the field, never a
crash, a hang or a read outside the file (the checks: loaders/gguf_checks.py)."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.gguf_files import (
    key_value_offset,
    tensor_fields,
    write_model_gguf,
)
from tokenmill.loaders import ModelLoadError, load_model

_names = itertools.count()


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = write_model_gguf(tmp_path_factory.mktemp("gguf") / "valid.gguf")
    load_model(path)  # the unpatched file is a model that loads
    return path.read_bytes()


def _patched(tmp_path: Path, data: bytes, at: int, fmt: str, value: object) -> Path:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, at, value)
    path = tmp_path / f"hostile{next(_names)}.gguf"  # a new name: the reader cache is per path
    path.write_bytes(bytes(buf))
    return path


def _fails(path: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match) as e:
        load_model(path)
    assert path.name in str(e.value)


@pytest.mark.parametrize(("where", "fmt", "value", "match"), [
    ("tensor_count", "<Q", 1 << 62, "tensor count"),
    ("tensor_count", "<Q", 12, "past the end|tensor #11|dimensions"),
    ("kv_count", "<Q", (1 << 64) - 1, "metadata count"),
    ("version", "<I", 7, "version"),
])
def test_header_counts(valid, tmp_path, where, fmt, value, match):
    at = {"version": 4, "tensor_count": 8, "kv_count": 16}[where]
    _fails(_patched(tmp_path, valid, at, fmt, value), match)


def test_string_length_past_the_file(valid, tmp_path):
    at = key_value_offset(valid, "general.name") + 4  # the value's length
    _fails(_patched(tmp_path, valid, at, "<Q", 1 << 63), "'general.name'.*more than")


def test_key_length_past_the_file(valid, tmp_path):
    at = valid.index(b"general.name") - 8
    _fails(_patched(tmp_path, valid, at, "<Q", (1 << 64) - 2), "metadata key #.*more than")


@pytest.mark.parametrize(("field", "fmt", "value", "match"), [
    ("n_dims", "<I", 1000, "1000 dimensions"),
    ("n_dims", "<I", 0, "0 dimensions"),
    ("dim0", "<Q", 1 << 62, "int64|truncated|offset"),
    ("dim1", "<Q", 1 << 40, "truncated|starts at data offset"),
    ("dim1", "<Q", 0, "empty dimension"),
    ("dim0", "<Q", 33, "whole number of Q4_1 blocks"),
    ("type", "<I", 99, "GGML type 99"),
    ("type", "<I", 4, "GGML type 4"),  # Q4_2, removed from GGML
    ("type", "<I", 8, "starts at data offset"),  # Q4_1 -> Q8_0: the bytes no longer fit
    ("type", "<I", 2, "starts at data offset"),  # Q4_1 -> Q4_0: a gap before the next
    ("offset", "<Q", 0, "blk.0.attn_k.weight.*overlaps"),
    ("offset", "<Q", 1 << 50, "attn_q.weight.*starts at data offset"),
])
def test_tensor_info(valid, tmp_path, field, fmt, value, match):
    at = tensor_fields(valid, "blk.0.attn_q.weight" if field != "offset" or value
                       else "blk.0.attn_k.weight")[field]
    _fails(_patched(tmp_path, valid, at, fmt, value), match)


def test_last_tensor_past_the_file(valid, tmp_path):
    at = tensor_fields(valid, "output_norm.weight")["dim0"]
    _fails(_patched(tmp_path, valid, at, "<Q", 1 << 20), "truncated.*output_norm")


def test_last_tensor_type_too_small(valid, tmp_path):
    at = tensor_fields(valid, "output_norm.weight")["type"]
    _fails(_patched(tmp_path, valid, at, "<I", 1), "follow the last tensor 'output_norm")  # F16


@pytest.mark.parametrize("cut", [3, 10, 40, 200, 1000, -1])
def test_truncated_anywhere(valid, tmp_path, cut):
    path = tmp_path / f"cut{cut}.gguf"
    path.write_bytes(valid[:cut])
    _fails(path, "past the end|truncated|magic|more than|follow")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"heads": 0}, "head_count' is 0"),
    ({"heads": 3, "key_length": False}, "head_count 3 does not divide.*embedding_length 64"),
    ({"kv_heads": 3}, "head_count_kv 3 does not divide"),
    ({"vocab": 300}, "token_embd.weight' has 256 rows but the vocabulary has 300"),
    ({"skip_keys": ("block_count",)}, "'llama.block_count' is missing"),
    ({"skip_keys": ("embedding_length",)}, "'llama.embedding_length' is missing"),
])
def test_metadata_that_makes_no_model(tmp_path, kwargs, match):
    _fails(write_model_gguf(tmp_path / f"meta{next(_names)}.gguf", **kwargs), match)


@pytest.mark.parametrize("alignment", [0, 48])
def test_alignment_not_a_power_of_two(tmp_path, alignment):
    path = write_model_gguf(tmp_path / "align.gguf", alignment=32)
    data = path.read_bytes()
    at = key_value_offset(data, "general.alignment") + 4
    _fails(_patched(tmp_path, data, at, "<I", alignment), "alignment.*power of two")


def test_metadata_of_the_wrong_type(valid, tmp_path):
    at = key_value_offset(valid, "llama.block_count")
    _fails(_patched(tmp_path, valid, at, "<I", 8), "block_count")  # u32 -> string


def test_unknown_value_type(valid, tmp_path):
    at = key_value_offset(valid, "general.name")
    _fails(_patched(tmp_path, valid, at, "<I", 77), "unknown value type 77")


# --- a bounded fuzz in make test (tools/fuzz_gguf.py runs the long one) ---------------------


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, 2000), st.sampled_from(
    [b"\xff" * 8, b"\x00" * 8, b"\x7f\xff\xff\xff\xff\xff\xff\xff", b"\x01", b"\x63\x00\x00\x00"])),
    min_size=1, max_size=3), cut=st.one_of(st.none(), st.integers(0, 4000)))
def test_random_header_edits_load_or_fail_cleanly(valid, tmp_path, edits, cut):
    """Any patch to the header or the first tensors: the model loads or a ModelLoadError
    says why; no other exception escapes the loader."""
    buf = bytearray(valid)
    for at, value in edits:
        buf[at:at + len(value)] = value
    path = tmp_path / f"fuzz{next(_names)}.gguf"
    path.write_bytes(bytes(buf[:cut] if cut is not None else buf))
    try:
        load_model(path)
    except ModelLoadError as e:
        assert path.name in str(e)


def test_a_huge_block_count_fails_at_once(valid, tmp_path):
    """The fuzzer's slowest file: 13M layers claimed (the check once built a set of them)."""
    at = key_value_offset(valid, "llama.block_count") + 4
    _fails(_patched(tmp_path, valid, at, "<I", (1 << 31) - 1),
           "block_count is 2147483647 but no tensor of layer 1")
