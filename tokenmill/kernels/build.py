"""Compile a kernel's C file once per machine and load it with ctypes.

The shared object lives in the tokenmill cache (`tokenmill.cache.cache_dir()`),
named by a hash of the source (the headers beside it and the .c files it
includes), the compiler, the flags and the CPU's flags, so an edit, a new compiler
or another CPU gets a fresh build and a warm start loads in milliseconds. No compiler, or a build that fails,
returns None: the caller keeps its plain-torch path. TOKENMILL_NATIVE=0 turns
native kernels off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.cache import cache_dir
from tokenmill.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

# (compile flags, link flags). -ffast-math lets gcc vectorise the loops' reductions and
# call glibc's vector expf (libmvec); the second set is for a libc without libmvec
# (scalar expf). The link step must not see -ffast-math: gcc then links crtfastmath.o,
# whose constructor turns on flush-to-zero for the whole process as the library loads.
FLAG_SETS = (
    (["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"],
     ["-shared", "-fopenmp", "-lmvec", "-lm"]),
    (["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC"],
     ["-shared", "-fopenmp", "-lm"]),
)
# Without AVX-512 (vec_math.h's explicit-intrinsic exp, norms and softmax sums), the
# kernels' plain loops are what runs, and -ffast-math compiles the same loop
# differently in each library that inlines it (vector expf on the body and scalar
# expf on the peeled elements, sums split by the buffer's alignment): decode_step.c's
# fused steps would no longer give the module path's bits. Such CPUs build with strict
# fp32 semantics (the second set) first.
STRICT_FIRST_WITHOUT = {"avx512f", "avx512bw", "avx512vl"}
BUILD_TIMEOUT_S = 120


def flag_sets() -> tuple[tuple[list[str], list[str]], ...]:
    """FLAG_SETS in the order to try on this CPU; TOKENMILL_SANITIZE=address adds
    AddressSanitizer (`make asan`; the process must preload libasan)."""
    sets = FLAG_SETS if STRICT_FIRST_WITHOUT <= cpu_flags() else FLAG_SETS[::-1]
    sanitizer = os.environ.get("TOKENMILL_SANITIZE")
    if sanitizer:
        extra = [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-g", "-O1"]
        sets = tuple(([f for f in c if f != "-O3"] + extra, link + [f"-fsanitize={sanitizer}"])
                     for c, link in sets)
    return sets


def enabled() -> bool:
    return os.environ.get("TOKENMILL_NATIVE", "1") not in ("0", "false", "no", "off")


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled `tokenmill/kernels/<name>.c`, or None where it cannot be built."""
    if not enabled():
        return None
    cc = compiler()
    if cc is None:
        logger.info("no C compiler found; native kernel %s not built", name)
        return None
    source = Path(__file__).with_name(f"{name}.c")
    for flags in flag_sets():
        path = _build(cc, source, flags)
        if path is not None:
            try:
                return ctypes.CDLL(str(path))
            except OSError as e:
                logger.warning("could not load native kernel %s: %s", path, e)
    return None


def _included_sources(source: Path) -> list[str]:
    """The text of the .c files `source` #includes from beside it (decode_step.c
    compiles q4q8_gemv.c and paged_decode.c into itself): an edit to one of them must
    rebuild it too."""
    names = re.findall(r'^#include "([\w.]+\.c)"', source.read_text(), flags=re.MULTILINE)
    return [source.with_name(n).read_text() for n in names]


def _build(compiler: str, source: Path, flags: tuple[list[str], list[str]]) -> Path | None:
    try:
        version = subprocess.run([compiler, "--version"], check=False, capture_output=True,
                                 text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    compile_flags, link_flags = flags
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # bf16.h
    key = hashlib.sha256("\0".join(
        [source.read_text(), *headers, *_included_sources(source), version,
         " ".join(compile_flags), " ".join(link_flags), " ".join(sorted(cpu_flags()))]
    ).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    path = out_dir / f"{source.stem}-{key}.so"
    if path.exists():
        return path
    tmp = obj = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        obj = tmp[:-3] + ".o"
        for cmd in ([compiler, "-c", str(source), "-o", obj, *compile_flags],
                    [compiler, obj, "-o", tmp, *link_flags]):
            result = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT_S * (5 if "-g" in cmd else 1))
            if result.returncode != 0:
                logger.info("building native kernel %s failed: %s\n%s", source.name,
                            " ".join(cmd), result.stderr[-2000:])
                return None
        os.replace(tmp, path)  # atomic: a concurrent build of the same key is harmless
        tmp = None
        return path
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("building native kernel %s failed: %s", source.name, e)
        return None
    finally:
        for leftover in (tmp, obj):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    os.unlink(leftover)


class Library:
    """A kernel's functions with their ctypes signatures, bound once per loaded library
    (`load` is cached; clearing its cache makes the next call bind a fresh build).

    signatures: function name -> (argument types, return type)."""

    def __init__(self, name: str, signatures: dict[str, tuple[list[Any], Any]]) -> None:
        self.name = name
        self.signatures = signatures
        self._bound: tuple[ctypes.CDLL | None, dict[str, Any]] = (None, {})

    def get(self, function: str) -> Any:
        """The bound function, or None where the kernel is not built."""
        lib = load(self.name)
        if lib is None:
            return None
        if self._bound[0] is not lib:
            fns = {}
            for fn_name, (argtypes, restype) in self.signatures.items():
                fn = getattr(lib, fn_name)
                fn.argtypes, fn.restype = argtypes, restype
                fns[fn_name] = fn
            self._bound = (lib, fns)
        return self._bound[1][function]
