"""W2's target at concurrency 16 against llama-server on the same file, per class of
model file: one table, so that a run prints the target its file was given, or none.

The embedded SmolLM2 Q4_1 file keeps round 2's ≥ 4× (issue 21); an MoE file is held
to ≥ 2× (issue 59), a Gemma 3 file to ≥ 3× (issue 58), and a SmolLM2 K-quant file to
a ratio no lower than the embedded file's (issue 56). Any other file (the ~1B random
Llama, SmolLM2's Q8_0) was given no W2 target: its run prints the ratios only.
The class is read from the file's metadata (gguf's reader: no weights read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks import results as results_mod

EMBEDDED_RESULT = "w2"  # the embedded file's W2 result name (no variant)
LLAMA_METRIC = "output throughput c=16"


@dataclass(frozen=True)
class W2Target:
    file_class: str
    source: str  # the issue that set it
    ratio: float | None  # >= ratio x llama-server output tok/s; None: the embedded file's

    def describe(self) -> str:
        what = (f">= {self.ratio:g}x llama-server" if self.ratio is not None
                else ">= the embedded Q4_1 file's ratio vs llama-server")
        return f"{what} output tok/s ({self.file_class}, {self.source})"


TARGETS = {
    "embedded": W2Target("the embedded SmolLM2-135M Q4_1 file", "issue 21", 4.0),
    "moe": W2Target("a Mixture-of-Experts file", "issue 59", 2.0),
    "gemma3": W2Target("a Gemma 3 file", "issue 58", 3.0),
    "smollm2-kquant": W2Target("a SmolLM2 K-quant file", "issue 56", None),
}


def file_class(path: Path, embedded: Path) -> str | None:
    """Which row of TARGETS a GGUF file falls in; None where none does."""
    from gguf import GGUFReader, LlamaFileType

    if path.resolve() == embedded.resolve():
        return "embedded"
    fields = GGUFReader(path).fields  # the header only: tensors stay unread
    meta = {key: field.contents() for key, field in fields.items()
            if key.startswith("general.") or key.endswith(".expert_count")}
    arch = meta.get("general.architecture")
    if arch == "qwen3moe" or meta.get(f"{arch}.expert_count"):
        return "moe"
    if arch == "gemma3":
        return "gemma3"
    file_type = meta.get("general.file_type")
    k_quant = file_type is not None and "_K" in LlamaFileType(int(file_type)).name
    named = f"{meta.get('general.basename', '')} {meta.get('general.name', '')}".lower()
    if k_quant and "smollm2" in named:
        return "smollm2-kquant"
    return None


def target_for(path: Path, embedded: Path) -> W2Target | None:
    kind = file_class(path, embedded)
    return None if kind is None else TARGETS[kind]


def recorded_embedded_ratio(machine_class: str, results_dir: Path = results_mod.RESULTS_DIR
                            ) -> tuple[float, str] | None:
    """The newest recorded W2 ratio of the embedded file vs llama-server at c=16 on this
    machine class, and its result's date; None where no such result was recorded."""
    found = None
    for path in sorted(results_dir.glob(f"*-{machine_class}-{EMBEDDED_RESULT}.json")):
        result = results_mod.load(path)
        for r in result["ratios"]:
            # the default server's ("tokenmill"), not a second one of --also-serve
            if r["metric"] == LLAMA_METRIC and r["peer"].startswith("llama-server") \
                    and r["tokenmill"] == "tokenmill":
                found = (float(r["ratio"]), result["date"][:10])
    return found


def target_line(target: W2Target | None, ratio: float,
                embedded_ratio: tuple[float, str] | None = None) -> str | None:
    """The line a run prints for its ratio vs llama-server at c=16; None: no target."""
    if target is None:
        return None
    if target.ratio is not None:
        met = "met" if ratio >= target.ratio else "missed"
        return f"target at c=16: {target.describe()} -> {ratio:.2f}x: {met}"
    if embedded_ratio is None:
        return (f"target at c=16: {target.describe()} -> {ratio:.2f}x; no recorded W2 of the "
                "embedded file against llama-server on this machine class to compare: run "
                "`python -m benchmarks run w2 --peers llama` in the same session")
    want, date = embedded_ratio
    met = "met" if ratio >= want else "missed"
    return (f"target at c=16: {target.describe()} -> {ratio:.2f}x vs the embedded file's "
            f"{want:.2f}x (recorded {date}, not this run): {met}")
