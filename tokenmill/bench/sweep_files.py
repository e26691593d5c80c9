"""`bench sweep --output run.json`: besides the combined result, one result file per point
(`run.c4.json`, `run.r2.json`), each a complete single-run result that `explain`,
`--compare` and the HTML report read as any other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.bench.report import write_json


def point_name(run: dict[str, Any], parameter: str) -> str:
    cfg = run["config"]
    if parameter == "concurrency":
        return f"c{cfg.get('concurrency')}"
    return f"r{cfg.get('request_rate'):g}"


def write_points(result: dict[str, Any], output: str) -> list[str]:
    out = Path(output)
    parameter = result["sweep"]["parameter"]
    paths = []
    for run in result["runs"]:
        path = out.with_name(f"{out.stem}.{point_name(run, parameter)}{out.suffix or '.json'}")
        write_json(run, str(path))
        paths.append(str(path))
    return paths
