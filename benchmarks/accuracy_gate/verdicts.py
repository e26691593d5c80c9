"""The rule's verdict per path per file, from the recorded gate results (kld_gate.py
records each file's run as a `kld-gate` result; the mean-KLD figures carry the verdict
and the perplexity ratio in their configuration): one markdown table, a row per path,
a column per file, each cell `PASS`/`FAIL` with the path's mean KLD beside llama.cpp's
on that file and the positions scored.

Results are read in date order, so a later run of a path on a file replaces an earlier
one (a path whose arithmetic changed is judged on its last form). A run recorded with
`--no-llama` (llama.cpp's side takes ~30 min) carries no anchor of its own: it is judged
against the latest llama.cpp figure recorded on the same file, machine class and
positions (the same text scored the same way: llama.cpp's figure does not depend on
tokenmill's code), and its cell says so with a dagger."""

from __future__ import annotations

from benchmarks.accuracy_gate.figures import verdict

FOOTNOTE = ("Rows scored at the gate's 256-row prompt steps run every GGUF linear on its "
            "large-batch weight (packed bf16 unless the path changes it), so a plain "
            "`gguf-a8` row there is the default's arithmetic; `(decode rows)` rows run "
            "the path's own per-row kernel (docs/accuracy_gate.md).")


BORROWED = ("† judged against llama.cpp's figure from another recorded run on the same "
            "file, machine class and positions (this run was recorded without llama.cpp).")


def _latest_gate_results(results: list[dict]) -> list[dict]:
    """The last result of each name, oldest first."""
    latest: dict[tuple[str, str], dict] = {}
    for r in sorted(results, key=lambda r: (r["date"], r["name"])):
        if r["workload"] == "kld-gate":
            latest[(r["machine"]["class"], r["name"])] = r
    return sorted(latest.values(), key=lambda r: (r["date"], r["name"]))


def _column(r: dict, f: dict) -> str:
    cfg = f["config"]
    return f"{cfg['model']} ({r['machine']['class']}, {cfg.get('positions')} pos.)"


def _borrowed_verdict(f: dict, anchor: dict) -> str:
    """The rule (figures.verdict) on recorded figures: each KLD interval from its ci95,
    the perplexity ratio from the path's configuration."""
    ours, theirs = f["config"].get("ci95"), anchor["config"].get("ci95")
    ratio = f["config"].get("ppl_ratio")
    if not ours or not theirs or None in (*ours, *theirs) or not isinstance(ratio, float):
        return "?"
    passes, _ = verdict({"kld_mean": {"low": ours[0], "high": ours[1]},
                         "ppl_ratio": {"value": ratio}},
                        {"kld_mean": {"low": theirs[0], "high": theirs[1]}})
    return "PASS" if passes else "FAIL"


def verdict_table(results: list[dict]) -> str:
    gates = _latest_gate_results(results)
    files: list[str] = []
    cells: dict[tuple[str, str], str] = {}
    paths: list[str] = []
    anchors = {_column(r, f): f for r in gates for f in r["figures"]
               if f["metric"] == "mean KLD" and f["engine"] == "llama.cpp"}
    borrowed = False
    for r in gates:
        kld = [f for f in r["figures"] if f["metric"] == "mean KLD"]
        anchor = next((f for f in kld if f["engine"] == "llama.cpp"), None)
        for f in kld:
            cfg = f["config"]
            column = _column(r, f)
            if column not in files:
                files.append(column)
            if f["engine"] == "llama.cpp":
                cells[("llama.cpp (anchor)", column)] = _kld(f)
                if "llama.cpp (anchor)" not in paths:
                    paths.insert(0, "llama.cpp (anchor)")
                continue
            if f["label"] not in paths:
                paths.append(f["label"])
            ratio = cfg.get("ppl_ratio")
            ppl = f", PPL x{ratio:.4f}" if isinstance(ratio, float) else ""
            if anchor is not None:
                verdict = cfg.get("verdict") or _from_notes(r, f["label"])
                cells[(f["label"], column)] = f"**{verdict}** {_kld(f)}{ppl}"
            elif column in anchors:
                borrowed = True
                verdict = _borrowed_verdict(f, anchors[column])
                cells[(f["label"], column)] = f"**{verdict}**\u2020 {_kld(f)}{ppl}"
            else:
                cells[(f["label"], column)] = f"{_kld(f)}{ppl}"
    if not files:
        return "no kld-gate results recorded"
    lines = ["| path | " + " | ".join(files) + " |", "|---|" + "---|" * len(files)]
    for p in paths:
        lines.append(f"| {p} | " + " | ".join(cells.get((p, c), "-") for c in files) + " |")
    return "\n".join([*lines, "", FOOTNOTE, *([BORROWED] if borrowed else [])])


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
