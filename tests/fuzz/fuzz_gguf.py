"""The long GGUF loader fuzz (not part of `make test`; test_hostile_gguf.py runs a
bounded one). Seeds: tiny valid models written by tests/reliability/gguf_files.py
(several shapes and alignments). Each example mutates one seed (overwritten
ranges, extreme integers at aligned offsets, truncation, spliced duplicates)
and loads it with tokenmill's loader under an address-space limit; anything
but success or a ModelLoadError naming the file is a finding, saved with its
traceback under --out. Per-example time is recorded; the slowest is printed.

    python tests/fuzz/fuzz_gguf.py --minutes 5 --out /tmp/gguf-findings
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.gguf_files import write_model_gguf
from tokenmill.loaders import ModelLoadError, load_model

EXTREMES = [b"\xff" * 8, b"\x00" * 8, b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80",
            b"\x01\x00\x00\x00\x00\x00\x00\x00", b"\x00\x00\x00\x00\x00\x00\x00\x40",
            b"\x63\x00\x00\x00", b"\x09\x00\x00\x00", b"\x08\x00\x00\x00"]


def seeds(folder: Path) -> list[bytes]:
    variants = [{}, {"alignment": 64}, {"key_length": False}, {"seed": 1, "kv_heads": 4}]
    return [write_model_gguf(folder / f"seed{i}.gguf", **v).read_bytes()
            for i, v in enumerate(variants)]


def mutation() -> st.SearchStrategy:
    edit = st.one_of(
        st.tuples(st.just("put"), st.integers(0, 1 << 16), st.sampled_from(EXTREMES)),
        st.tuples(st.just("put"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("bit"), st.integers(0, 1 << 16), st.integers(0, 7)),
        st.tuples(st.just("cut"), st.integers(0, 1 << 16), st.just(b"")),
        st.tuples(st.just("dup"), st.integers(0, 1 << 16), st.integers(1, 64)),
    )
    return st.lists(edit, min_size=1, max_size=6)


def apply(data: bytes, edits: list) -> bytes:
    buf = bytearray(data)
    header = 2048  # most edits land on the header, where the parsing is
    for kind, at, arg in edits:
        at = at % (header if at % 4 else max(len(buf), 1))
        if kind == "put":
            buf[at:at + len(arg)] = arg
        elif kind == "bit" and at < len(buf):
            buf[at] ^= 1 << arg
        elif kind == "cut":
            del buf[at:]
        elif kind == "dup":
            buf[at:at] = buf[at:at + arg]
    return bytes(buf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=Path("gguf-findings"))
    ap.add_argument("--memory-gb", type=float, default=12.0, help="address-space limit")
    args = ap.parse_args()
    limit = int(args.memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    corpus = seeds(work)
    load_model(work / "seed0.gguf")  # builds the native kernels once, outside the timings
    stats = {"loaded": 0, "rejected": 0, "findings": 0, "slowest_s": 0.0}
    deadline = time.monotonic() + args.minutes * 60
    counter = [0]

    @settings(max_examples=500, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, len(corpus) - 1), edits=mutation())
    def one(seed: int, edits: list) -> None:
        if time.monotonic() > deadline:
            raise _Done
        counter[0] += 1
        path = work / f"case{counter[0]}.gguf"
        path.write_bytes(apply(corpus[seed], edits))
        start = time.monotonic()
        try:
            load_model(path)
            stats["loaded"] += 1
        except ModelLoadError as e:
            stats["rejected"] += 1
            if path.name not in str(e):
                _finding(args.out, path, f"error does not name the file: {e}")
                stats["findings"] += 1
        except Exception:  # noqa: BLE001 - anything else is what we look for
            _finding(args.out, path, traceback.format_exc())
            stats["findings"] += 1
        took = time.monotonic() - start
        if took > stats["slowest_s"]:  # kept, to rerun alone: a slow file is a finding too
            stats["slowest_s"] = took
            (args.out / "slowest.gguf").write_bytes(path.read_bytes())
        path.unlink()

    with contextlib.suppress(_Done):
        while time.monotonic() < deadline:
            one()  # 500 examples a round, new random choices each round
    print(f"{counter[0]} files: {stats['loaded']} loaded, {stats['rejected']} rejected with "
          f"a ModelLoadError, {stats['findings']} findings (in {args.out}); slowest "
          f"{stats['slowest_s']:.2f} s")
    sys.exit(1 if stats["findings"] else 0)


class _Done(Exception):
    """The time is up (hypothesis itself has no time budget)."""


def _finding(out: Path, path: Path, what: str) -> None:
    n = len(list(out.glob("*.gguf")))
    (out / f"finding{n}.gguf").write_bytes(path.read_bytes())
    (out / f"finding{n}.txt").write_text(what)
    print(f"finding {n}: {what.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
