"""Which part of an 8-bit batched-linear scheme costs accuracy (issue 21), emulated in torch.

SmolLM2-135M in bf16 with its GGUF linears (quantize_model "gguf"): every linear's
8+-row weight is replaced by a torch emulation of a scheme (weights rounded to int8 per
output channel or per group of 32 inputs; activations rounded to unsigned 8 bits per
token or per group of 32, with a zero point), and each `--windows` window of
`--context` tokens of the fixed text is scored in one prefill (so every linear has 8+
rows): perplexity and greedy top-1 agreement with the fp32 reference (the dequantized
weights in float32). This is the fast way to see why a scheme fails
benchmarks/accuracy.py's gate (within 1% perplexity of bf16, >= 97% top-1 with fp32)
before writing its kernel; the gate itself runs the real engine.

`a8s32` is gguf-a8's rounding (symmetric, per block of 32, the weights exact); with
`--keep16 F,...` each F also runs `a8s32` with the share F of every row's blocks kept at
gguf-a16's 16 bits: those whose step (amax / 127) squared times the block's weight energy
(sum of its weights squared) is largest, chosen per row as a kernel could from the
activations it quantizes. `--head16` keeps the LM head at 16 bits in those schemes.
`--windows 10` scores 5,120 positions (2 windows, 1,024, read a point apart run to run).

    .venv/bin/python benchmarks/w8a8_sensitivity.py [--schemes bf16,w8a8,w8,a8,a8g32,w8g32]
    .venv/bin/python benchmarks/w8a8_sensitivity.py --schemes bf16,a8s32 --keep16 0.12,0.25 \
        --windows 10 [--head16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "opticks_book1.txt"
# scheme -> (weight group or None for per channel or 0 for unrounded,
#            activation group or None for per token or 0 for unrounded)
SCHEMES = {"bf16": (0, 0), "w8a8": (None, None), "w8": (None, 0), "a8": (0, None),
           "a8g32": (0, 32), "w8g32": (32, 0), "w8g32a8g32": (32, 32), "a8s32": (0, "s32")}


def _round_weight(w: torch.Tensor, group: int | None) -> torch.Tensor:
    n, k = w.shape
    g = w.reshape(n, k // (group or k), group or k)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (torch.round(g / scale).clamp(-127, 127) * scale).reshape(n, k)


def _round_activations(x: torch.Tensor, group: int | None) -> torch.Tensor:
    m, k = x.shape
    g = x.float().reshape(m, k // (group or k), group or k)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(hi))
    zero = torch.round(-lo / scale)
    return ((torch.round(g / scale) + zero).clamp(0, 255) - zero).mul(scale).reshape(m, k)


def _round_symmetric(x: torch.Tensor, keep16: float, energy: torch.Tensor) -> torch.Tensor:
    """gguf-a8's rounding (per block of 32, v = round(x / d), d = amax / 127), each row's
    keep16 share of blocks with the largest d^2 * weight energy at 16 bits (amax / 32512)."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    vmax = torch.full_like(amax, 127.0)
    n16 = round(keep16 * (k // 32))
    if n16:
        top = (amax.squeeze(-1) ** 2 * energy).topk(n16, dim=1).indices
        vmax.squeeze(-1).scatter_(1, top, 32512.0)
    d = amax / vmax
    return (torch.round(g / d).clamp(-vmax, vmax) * d).reshape(m, k)


def _emulation(w: torch.Tensor, wgroup: int | None, agroup: int | str | None,
               keep16: float = 0.0):
    wq = w if wgroup == 0 else _round_weight(w, wgroup)
    # per input block, what picks _round_symmetric's 16-bit blocks
    energy = w.reshape(w.shape[0], -1, 32).pow(2).sum((0, 2)) if agroup == "s32" else None

    def run(x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if agroup == "s32":
            xq = _round_symmetric(x, keep16, energy)
        else:
            xq = x.float() if agroup == 0 else _round_activations(x, agroup)
        return (xq @ wq.t()).to(out_dtype)
    return run


def _shares(text: str) -> list[float]:
    """--keep16's comma-separated shares, each in [0, 1]."""
    try:
        shares = [float(f) for f in text.split(",") if f]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if any(not 0.0 <= f <= 1.0 for f in shares):
        raise argparse.ArgumentTypeError(f"each share must be in [0, 1]: {text!r}")
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--keep16", type=_shares, default=[], help="comma-separated shares of a row's blocks "
                    "kept at 16 bits, each run as an a8s32 variant")
    ap.add_argument("--head16", action="store_true",
                    help="the LM head at 16 bits in the a8s32 variants")
    args = ap.parse_args()
    from tokenmill.loaders import load_model
    from tokenmill.loaders.model_source import resolve_model
    from tokenmill.loaders.tokenizer import load_tokenizer
    from tokenmill.quant import QuantizedLinear, quantize_model

    source = resolve_model("smollm2-135m")
    ids = load_tokenizer(source).encode(TEXT.read_text(), add_special_tokens=False)
    t = args.context
    windows = [torch.tensor(ids[i * (t + 1):(i + 1) * (t + 1)]) for i in range(args.windows)]

    def logits(model, w):
        with torch.no_grad():
            return model.compute_logits(model(w[:-1], torch.arange(len(w) - 1))).float()

    reference = load_model(source, dtype="float32").model
    quantize_model(reference, "none")
    ref_argmax = [logits(reference, w).argmax(-1) for w in windows]
    del reference
    model = load_model(source, dtype="bfloat16").model
    quantize_model(model, "gguf")
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    dense = [m.dense for m in linears]
    # each linear's bf16 weight, read back through its packed copy
    weights = [d(torch.eye(m.in_features, dtype=torch.bfloat16)).float().t().contiguous()
               for m, d in zip(linears, dense)]
    runs = [(name, *SCHEMES[name], 0.0) for name in args.schemes.split(",")]
    runs += [(f"a8s32+{f:g}@16", 0, "s32", f) for f in args.keep16]
    head = max(linears, key=lambda m: m.out_features)  # the LM head (49,152 outputs)
    for name, wgroup, agroup, keep16 in runs:
        if agroup == "s32" and args.head16:
            name += " head16"
        for m, w in zip(linears, weights):
            head16 = agroup == "s32" and args.head16 and m is head
            m.dense = _emulation(w, wgroup, agroup, 1.0 if head16 else keep16)
        nll, agree = [], 0
        for w, ref in zip(windows, ref_argmax):
            lg = logits(model, w)
            agree += int((lg.argmax(-1) == ref).sum())
            nll.append(-torch.log_softmax(lg, -1).gather(1, w[1:, None]).squeeze(1))
        flat = torch.cat(nll).double()
        print(f"{name:12s} perplexity {float(flat.mean().exp()):.4f}  top-1 with fp32 "
              f"{100 * agree / len(flat):.1f}%  ({len(flat)} positions)", flush=True)
    for m, d in zip(linears, dense):
        m.dense = d


if __name__ == "__main__":
    main()
