"""The rule's verdict per path per file, from the recorded gate results (kld_gate.py
records each file's run as a `kld-gate` result; the mean-KLD figures carry the verdict
and the perplexity ratio in their configuration): one markdown table, a row per path,
a column per file, each cell `PASS`/`FAIL` with the path's mean KLD beside llama.cpp's
on that file and the positions scored."""

from __future__ import annotations

FOOTNOTE = ("Rows scored at the gate's 256-row prompt steps run every GGUF linear on its "
            "large-batch weight (packed bf16 unless the path changes it), so a plain "
            "`gguf-a8` row there is the default's arithmetic; `(decode rows)` rows run "
            "the path's own per-row kernel (docs/accuracy_gate.md).")


def _latest_gate_results(results: list[dict]) -> list[dict]:
    latest: dict[tuple[str, str], dict] = {}
    for r in sorted(results, key=lambda r: (r["date"], r["name"])):
        if r["workload"] == "kld-gate":
            latest[(r["machine"]["class"], r["name"])] = r
    return [latest[k] for k in sorted(latest)]


def verdict_table(results: list[dict]) -> str:
    gates = _latest_gate_results(results)
    files: list[str] = []
    cells: dict[tuple[str, str], str] = {}
    paths: list[str] = []
    for r in gates:
        kld = [f for f in r["figures"] if f["metric"] == "mean KLD"]
        anchor = next((f for f in kld if f["engine"] == "llama.cpp"), None)
        for f in kld:
            cfg = f["config"]
            column = f"{cfg['model']} ({r['machine']['class']}, {cfg.get('positions')} pos.)"
            if column not in files:
                files.append(column)
            if f["engine"] == "llama.cpp":
                cells[("llama.cpp (anchor)", column)] = _kld(f)
                if "llama.cpp (anchor)" not in paths:
                    paths.insert(0, "llama.cpp (anchor)")
                continue
            if f["label"] not in paths:
                paths.append(f["label"])
            verdict = cfg.get("verdict") or _from_notes(r, f["label"])
            ratio = cfg.get("ppl_ratio")
            ppl = f", PPL x{ratio:.4f}" if isinstance(ratio, float) else ""
            cells[(f["label"], column)] = (f"**{verdict}** {_kld(f)}{ppl}"
                                           if anchor is not None else f"{_kld(f)}{ppl}")
    if not files:
        return "no kld-gate results recorded"
    lines = ["| path | " + " | ".join(files) + " |", "|---|" + "---|" * len(files)]
    for p in paths:
        lines.append(f"| {p} | " + " | ".join(cells.get((p, c), "-") for c in files) + " |")
    return "\n".join([*lines, "", FOOTNOTE])


def _from_notes(result: dict, label: str) -> str:
    """A verdict from the notes of results recorded before figures carried it
    ("LABEL: PASS (...)")."""
    for note in result.get("notes", []):
        head = f"{label}: "
        if note.startswith(head) and note[len(head):].split(" ")[0] in ("PASS", "FAIL"):
            return note[len(head):].split(" ")[0]
    return "?"


def _kld(f: dict) -> str:
    low, high = f["config"].get("ci95", [None, None])
    value = f["runs"][0]
    if low is None:
        return f"{value:.5f}"
    return f"{value:.5f} [{low:.5f}, {high:.5f}]"
