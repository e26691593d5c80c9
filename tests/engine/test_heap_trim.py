"""The engine hands its C heap's free pages back to the OS (engine/heap_trim.py):
what holds the soak's RSS flat (BENCHMARKS.md, "Soak"), on a schedule an operator
can set or turn off."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.runner import heap_trim
from tokenmill.engine.runner.heap_trim import ENV, HeapTrimmer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _trimmer(interval_s: float, calls: list[int]) -> tuple[HeapTrimmer, _Clock]:
    clock = _Clock()
    t = HeapTrimmer(interval_s, clock=clock)
    t._trim = lambda pad: calls.append(pad) or 1  # count calls, not glibc's work
    return t, clock


def test_busy_engine_trims_once_per_interval():
    calls: list[int] = []
    t, clock = _trimmer(10.0, calls)
    for _ in range(50):  # 50 steps of 0.1 s: 5 s, under the interval
        clock.now += 0.1
        assert not t.after_step(busy=True)
    clock.now += 5.1
    assert t.after_step(busy=True)
    assert calls == [0]  # malloc_trim(0): keep no padding
    clock.now += 1.0
    assert not t.after_step(busy=True)  # the interval counts from the last trim


def test_going_idle_trims_but_not_more_than_once_a_second():
    calls: list[int] = []
    t, clock = _trimmer(10.0, calls)
    clock.now += 2.0
    assert t.after_step(busy=False)  # the last request finished: give the pages back
    clock.now += 0.2
    assert not t.after_step(busy=False)  # sparse requests do not trim every step
    clock.now += 1.0
    assert t.after_step(busy=False)
    assert len(calls) == 2 and t.trims == 2


def test_interval_zero_turns_it_off(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    t = HeapTrimmer()
    assert not t.enabled and not t.after_step(busy=False)


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_bad_env_value_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=ENV):
        HeapTrimmer()


def test_glibc_malloc_trim_is_found_and_runs():
    trim = heap_trim._malloc_trim()
    if trim is None:
        pytest.skip("not glibc: nothing to trim with")
    assert trim(0) is True


def test_engine_trims_when_it_goes_idle(llm):
    heap = llm.engine.heap
    if not heap.enabled:
        pytest.skip("not glibc")
    before = heap.trims
    # the engine's clock stands still 5 s after the last trim: under the busy interval,
    # over the idle gap, however long this generate takes on a loaded machine
    now = heap._last + 5
    heap._clock = lambda: now
    llm.generate([[100, 200, 300]], SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    assert heap.trims == before + 1  # once, when the request finished: not per step


@pytest.mark.parametrize("raw, value", [("", 0), ("256K", 256 << 10), ("1M", 1 << 20), ("128k", 128 << 10),
                                        ("300000", 300000), ("0", 0)])
def test_mmap_threshold_reads_sizes(monkeypatch, raw, value):
    monkeypatch.setenv(heap_trim.MMAP_ENV, raw)
    assert heap_trim.mmap_threshold_from_env() == value


@pytest.mark.parametrize("raw", ["lots", "-1", "64M", "1.5M"])
def test_bad_mmap_threshold_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(heap_trim.MMAP_ENV, raw)
    with pytest.raises(ValueError, match=heap_trim.MMAP_ENV):
        heap_trim.mmap_threshold_from_env()


# malloc 4 MiB, touch it, free it, malloc it again: where did the second one come from?
_REUSE = r"""
import ctypes, json, os, sys
from tokenmill import malloc
from tokenmill.engine.runner.heap_trim import fix_mmap_threshold
fix_mmap_threshold()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 4 << 20
p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
before = malloc.heap_stats()
q = libc.malloc(n); ctypes.memset(q, 1, n)
during = malloc.heap_stats()
print(json.dumps({"mapped": during.mmapped_bytes - before.mmapped_bytes,
                  "arena": during.arena_bytes - before.arena_bytes}))
"""


def _second_allocation(threshold: str) -> dict:
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, heap_trim.MMAP_ENV: threshold}
    out = subprocess.run([sys.executable, "-c", _REUSE], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_fixed_threshold_keeps_large_blocks_out_of_the_arenas():
    """With a fixed threshold (256 KiB) a 4 MiB block freed and allocated again is its own mapping
    both times, so its pages go back to the OS on free; with glibc's dynamic threshold
    (the default) the first free raises the threshold and the second
    comes from the arenas, where a free leaves a hole only a trim returns."""
    if malloc_stats_missing():
        pytest.skip("not glibc: no mallopt / mallinfo2")
    fixed, dynamic = _second_allocation("256K"), _second_allocation("")
    assert fixed["mapped"] >= 4 << 20 and fixed["arena"] < 1 << 20
    assert dynamic["mapped"] < 1 << 20  # the test can tell the two apart


def malloc_stats_missing() -> bool:
    from tokenmill import malloc
    return malloc.heap_stats() is None or malloc._function("mallopt") is None
