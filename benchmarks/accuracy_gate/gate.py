"""The gate on one file: llama.cpp's figures and every tokenmill path's, against the
fp32 logits of the file's own dequantized weights, at llama-perplexity's positions.

    reference   llama.cpp: FILE-f32.gguf (f32_gguf.py) through llama-perplexity;
                tokenmill: `--dtype float32` on FILE
    tokens      llama.cpp's own (read back from its log-prob file), so both score
                the same tokens; tokenmill's tokenizer only when llama.cpp is absent
    positions   llama-perplexity's chunks (chunks.py): n_ctx 512, BOS over each
                chunk's first token when the vocabulary adds BOS, logits of chunk
                positions 256..510 scored
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from benchmarks.accuracy_gate import figures, llama_runs
from benchmarks.accuracy_gate.chunks import Chunking
from benchmarks.accuracy_gate.f32_gguf import f32_path, write_f32
from benchmarks.accuracy_gate.kld import PositionFigures, decode_llama_rows
from benchmarks.accuracy_gate.tokenmill_runs import Comparison, ReferenceStore, score

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
# Public domain: Newton's Opticks (1730), and Pride and Prejudice (1813) chapters 1-8
# as packaged by Debian's r-cran-janeaustenr 1.0.0-1 (package MIT; the text Project
# Gutenberg's). ~23k SmolLM2 tokens: 45 chunks, 11,475 scored positions.
TEXTS = (DATA / "opticks_book1.txt", DATA / "pride_and_prejudice_ch1_8.txt")

# The paths judged (issue 57): label -> engine flags. "" is today's default. In
# prefill mode a step holds n_ctx/2 = 256 rows, so gguf-a16 and gguf-a8 both run their
# linears on the packed bf16 weights (rows >= VNNI_DENSE_MIN_ROWS, 20): the same
# arithmetic, the prompt's. Their own kernels (the per-row int16 / int8-activation
# ones, what their decode steps run) are judged with the scored half in 16-row steps
# (the gate's --scored-step-rows, tokenmill_runs.py); routes.py records which ran.
# mlp-int8 / w8a8 change only the large-batch linears (prompts; decode below 20 rows
# runs gguf-a16's kernel), so the 256-row steps are where they show.
PATHS = {
    "default": "",
    "gguf-a16 kernel (decode rows)": "--quantization gguf-a16 --scored-step-rows 16",
    "gguf-a8 kernel (decode rows)": "--quantization gguf-a8 --scored-step-rows 16",
    "mlp-int8": "--batched-linears mlp-int8",
    "int8 (prompt chunks)": "--batched-linears int8",
    "w8a8": "--batched-linears w8a8",
    "int8 KV": "--kv-cache-dtype int8",
    "fp8 KV": "--kv-cache-dtype fp8",
    # the GPU's fp8 weights (e4m3 per output channel, activations per token, LM head
    # bf16) computed on the CPU (tokenmill_runs.FP8_CPU_EMULATION_FLAG): issue 63
    "fp8 weights (CPU emulation)": "--quantization fp8 --fp8-cpu-emulation",
}
REFERENCE_FLAGS = "--dtype float32"


@dataclass
class GateConfig:
    model: str                                   # "smollm2-135m" or a .gguf path
    texts: tuple[Path, ...] = TEXTS
    paths: dict[str, str] = field(default_factory=lambda: dict(PATHS))
    n_ctx: int = 512
    max_chunks: int | None = None
    use_llama: bool = True
    resamples: int = 1000
    threads: int = 2
    mode: str = "prefill"                        # tokenmill_runs: prefill | decode
    keep_reference: bool = False                 # keep (and reuse) the fp32 reference


def log(msg: str) -> None:
    print(f"[gate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gguf_file(model: str) -> Path:
    if model == "smollm2-135m":
        from benchmarks.peers.model_files import embedded_gguf
        return embedded_gguf()
    return Path(model)


def work_dir() -> Path:
    from benchmarks.peers.model_files import peers_dir
    path = peers_dir() / "gate"
    path.mkdir(parents=True, exist_ok=True)
    return path


def joined_text(texts: tuple[Path, ...]) -> Path:
    body = "\n\n".join(Path(t).read_text() for t in texts)
    digest = hashlib.sha256(body.encode()).hexdigest()[:10]
    out = work_dir() / f"text-{digest}.txt"
    if not out.is_file():
        out.write_text(body)
    return out


def bos_policy(path: Path) -> tuple[bool, int | None]:
    """(add_bos, bos id) as llama.cpp reads them: tokenizer.ggml.add_bos_token, else
    on for SentencePiece vocabularies ("llama"), off for BPE ("gpt2")."""
    fields = gguf.GGUFReader(str(path)).fields

    def get(key, default=None):
        return fields[key].contents() if key in fields else default

    add = get("tokenizer.ggml.add_bos_token")
    if add is None:
        add = get("tokenizer.ggml.model") == "llama"
    return bool(add), get("tokenizer.ggml.bos_token_id")


def llama_side(cfg: GateConfig, model_file: Path, text: Path, digest: str):
    """llama.cpp's two log-prob files and its own report; None if it cannot run."""
    from benchmarks.peers.model_files import llama_tool
    try:
        binary = llama_tool("LLAMA_PERPLEXITY")
    except Exception as exc:  # noqa: BLE001 - the gate still runs tokenmill's side
        log(f"llama.cpp unavailable ({exc}); tokenmill's side only")
        return None
    ref_file = write_f32(model_file, f32_path(model_file, work_dir()))
    stem, n = model_file.stem, cfg.max_chunks
    tag = f"{digest}-c{n}" if n else digest
    base = llama_runs.write_logprobs(binary, ref_file, text,
                                     work_dir() / f"{stem}-f32-{tag}.logprobs",
                                     cfg.n_ctx, cfg.threads, n)
    quant = llama_runs.write_logprobs(binary, model_file, text,
                                      work_dir() / f"{stem}-{tag}.logprobs",
                                      cfg.n_ctx, cfg.threads, n)
    report = llama_runs.kld_report(binary, model_file, text, base.path, cfg.n_ctx, cfg.threads)
    return base, quant, report


def llama_figures(base, quant, n_rows: int, block: int = 256) -> PositionFigures:
    """llama.cpp's per-position figures (FILE against FILE-f32) from its two log-prob
    files (both uint16-encoded, as llama.cpp itself stores the reference)."""
    targets = base.targets()
    parts = []
    for lo in range(0, n_rows, block):
        hi = min(n_rows, lo + block)
        parts.append(PositionFigures.of(base.logprobs(lo, hi), quant.logprobs(lo, hi),
                                        targets[lo:hi]))
    return PositionFigures.concat(parts)


def run(cfg: GateConfig) -> dict:
    model_file = gguf_file(cfg.model)
    text = joined_text(cfg.texts)
    digest = text.stem.removeprefix("text-")
    chunking = Chunking(cfg.n_ctx)
    add_bos, bos_id = bos_policy(model_file)
    result: dict = {"model": cfg.model, "file": str(model_file),
                    "texts": [str(t) for t in cfg.texts], "n_ctx": cfg.n_ctx,
                    "add_bos": add_bos, "mode": cfg.mode, "rows": []}

    from tokenmill.loaders.model_source import resolve_model
    from tokenmill.loaders.tokenizer import load_tokenizer
    own = load_tokenizer(resolve_model(cfg.model)).encode(text.read_text(),
                                                          add_special_tokens=False)
    if add_bos:
        own = [bos_id, *own]

    llama = llama_side(cfg, model_file, text, digest) if cfg.use_llama else None
    if llama is not None:
        base, quant, report = llama
        tokens = [int(t) for t in base.tokens]
        agree = sum(a == b for a, b in zip(tokens, own))
        result["tokens_source"] = "llama.cpp"
        result["tokenizer_agreement"] = f"{agree}/{len(tokens)} of tokenmill's tokens equal llama.cpp's"
        if base.n_ctx != cfg.n_ctx:
            raise ValueError(f"{base.path}: n_ctx {base.n_ctx}, expected {cfg.n_ctx}")
    else:
        tokens = own
        result["tokens_source"] = "tokenmill's tokenizer"
    chunks = chunking.chunks(tokens, bos_id if add_bos else None)
    if cfg.max_chunks:
        chunks = chunks[:cfg.max_chunks]
    n_rows = len(chunks) * chunking.scored_per_chunk
    targets = np.array([tokens[t] for _, t in chunking.scored(len(chunks) * cfg.n_ctx)])
    result["chunks"], result["positions"] = len(chunks), n_rows
    log(f"{model_file.name}: {len(tokens)} tokens ({result['tokens_source']}), "
        f"{len(chunks)} chunks, {n_rows} scored positions")

    per_chunk = chunking.scored_per_chunk
    llama_row = None
    if llama is not None:
        lf = llama_figures(base, quant, n_rows)
        llama_row = {"path": "llama.cpp", "engine": "llama-perplexity, FILE vs FILE-f32",
                     "anchor": True, **figures.summarize(lf, per_chunk, cfg.resamples),
                     "llama_printed": report}
        result["rows"].append(llama_row)

    ref_path = work_dir() / f"reference-{model_file.stem}-{digest}-c{len(chunks)}.npy"
    cross = None
    if llama is not None:
        cross = Comparison(base.rows, targets,
                           ref_transform=lambda r: decode_llama_rows(r, base.n_vocab))
    reference, desc = _kept_reference(ref_path, n_rows, _vocab(model_file)) \
        if cfg.keep_reference else (None, "")
    if reference is not None:
        log(f"reference: reusing {ref_path.name} ({desc})")
        secs = 0.0
        if cross is not None:
            for lo in range(0, n_rows, per_chunk):
                rows = np.arange(lo, min(n_rows, lo + per_chunk))
                cross(rows, torch.from_numpy(np.array(reference[rows])))
    else:
        _done(ref_path).unlink(missing_ok=True)
        store = ReferenceStore(ref_path, n_rows, _vocab(model_file))

        def sink(rows, logp):
            store(rows, logp)
            if cross is not None:
                cross(rows, logp)

        desc, secs, _ = score(cfg.model, REFERENCE_FLAGS, chunks, chunking, sink, cfg.mode)
        store.check_complete()
        reference = store.logp
        if cfg.keep_reference:
            reference.flush()
            _done(ref_path).write_text(desc)
        log(f"reference ({desc}) in {secs:.0f} s")
    result["reference"] = {"flags": REFERENCE_FLAGS, "engine": desc, "seconds": secs}
    if cross is not None:
        row = {"path": "tokenmill fp32 vs llama.cpp f32", "engine": desc, "anchor": True,
               **figures.summarize(cross.figures(), per_chunk, cfg.resamples)}
        result["references_agree"] = row
    try:
        for label, flags in cfg.paths.items():
            comp = Comparison(reference, targets)
            try:
                desc, secs, used = score(cfg.model, flags, chunks, chunking, comp, cfg.mode)
            except (ValueError, RuntimeError) as exc:
                log(f"{label}: not run ({exc})")
                result["rows"].append({"path": label, "flags": flags, "error": str(exc)})
                continue
            row = {"path": label, "flags": flags, "engine": desc, "seconds": secs,
                   "routes": used, **figures.summarize(comp.figures(), per_chunk, cfg.resamples)}
            row["passes"], row["why"] = figures.verdict(row, llama_row)
            log(f"{label} ({desc}) in {secs:.0f} s: KLD {row['kld_mean']['value']:.5f}, "
                f"same top {row['same_top_pct']['value']:.2f}%, "
                f"PPL ratio {row['ppl_ratio']['value']:.4f}: {row['why']}; linear rows {used}")
            result["rows"].append(row)
    finally:  # 2 GB: not left behind (the open memmap outlives the unlink)
        if not cfg.keep_reference:
            ref_path.unlink(missing_ok=True)
    return result


def _done(ref_path: Path) -> Path:
    return ref_path.with_suffix(".complete")


def _kept_reference(ref_path: Path, n_rows: int, n_vocab: int):
    """(log-probs, engine description) of a reference a --keep-reference run finished,
    or (None, "") when there is none of this shape."""
    if not (ref_path.is_file() and _done(ref_path).is_file()):
        return None, ""
    logp = np.load(ref_path, mmap_mode="r")
    if logp.shape != (n_rows, n_vocab):
        return None, ""
    return logp, _done(ref_path).read_text()


def _vocab(path: Path) -> int:
    fields = gguf.GGUFReader(str(path)).fields
    return len(fields["tokenizer.ggml.tokens"].data)


def render(result: dict) -> str:
    bos = "first" if result["add_bos"] else "not added (the vocabulary adds none)"
    title = (f"## {Path(result['file']).name}: {result['positions']:,} positions "
             f"({result['chunks']} chunks of {result['n_ctx']}, second halves scored, "
             f"BOS {bos}; tokens: {result['tokens_source']}; tokenmill scored by "
             f"{result['mode']})")
    out = [title]
    rows = list(result["rows"])
    if "references_agree" in result:
        rows.insert(1, result["references_agree"])
    out.append(figures.table(rows))
    llama = next((r for r in result["rows"] if r.get("path") == "llama.cpp"), None)
    if llama is not None:
        p = llama["llama_printed"]
        out.append(f"llama-perplexity's own report: mean KLD {p['kld_mean']:.6f} ± "
                   f"{p['kld_mean_pm']:.6f}, p99 {p['kld_p99']:.6f}, same top "
                   f"{p['same_top_pct']:.3f}%, PPL(Q)/PPL(base) {p['ppl_ratio']:.6f}")
    return "\n".join(out)
