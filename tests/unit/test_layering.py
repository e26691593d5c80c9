"""tokenmill's packages import one way: down the layers of docs/architecture.md.

Every import statement under tokenmill/ is read with `ast` — absolute and
relative, at module level, inside functions and under `if TYPE_CHECKING:` — and
mapped to the top-level package (or top-level module) it names. The test fails on
an import from a lower layer to a higher one, on any cycle between packages, and on
a top-level package that no layer lists (a new package says where it sits).

Checked against deliberate breaks: a function-level
`from tokenmill.engine.core.llm_engine import LLMEngine` added inside
tokenmill/kvcache/block_manager.py fails `test_imports_run_down_the_layers` and
`test_no_package_cycle` (kvcache -> engine -> kvcache); the walker's own test below
shows a relative import (`from ..engine import x`) and a TYPE_CHECKING one are seen.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tokenmill"

# Lowest first. A package may import only packages listed before it (and itself).
# Keep in step with docs/architecture.md.
LAYERS = [
    "version",  # __version__
    "cache",  # where built kernels and downloads live
    "startup_timer",  # start-up phase marks (standard library only)
    "cpuinfo",  # what this CPU can do
    "malloc",  # glibc's heap: trim, mallinfo2
    "config_gemma3",  # Gemma 3's config.json spellings -> ModelConfig fields
    "config",  # the engine's dataclasses
    "sampling_params",  # what a request asks for
    "lora_request",  # which LoRA adapter a request runs under
    "sequence",  # one request's tokens and state, shared by the engine's parts
    "kernels",  # native C and Triton kernels, KernelSpec
    "attention",  # attention backends over the paged KV cache
    "distributed",  # process group, counted collectives, where ranks meet
    "models",  # torch modules of the supported architectures
    "quant",  # quantized linears that replace a model's
    "loaders",  # GGUF / safetensors / tokenizer -> a model
    "kvcache",  # blocks, prefix cache, KV events
    "structured",  # grammar-constrained decoding
    "tools",  # tool-call formats
    "engine",  # core loop, runner, executor, front end, speculation, offline LLM
    "server",  # the OpenAI-compatible HTTP server
    "roofline",  # hardware limits and `explain`
    "bench",  # load generator and reports
    "cli",  # `tokenmill ...`
    "tokenmill",  # the package's own __init__: LLM, SamplingParams
]
RANK = {name: i for i, name in enumerate(LAYERS)}


def module_name(path: pathlib.Path, root: pathlib.Path) -> tuple[str, bool]:
    """('tokenmill.engine.core.llm_engine', is_package) for a file under root."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a module imports, wherever the statement is."""
    found = []
    for node in ast.walk(tree):  # every statement: function bodies, TYPE_CHECKING blocks
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from tokenmill import engine` names the package engine, not the root
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def top_level(dotted: str, root: pathlib.Path) -> str | None:
    """The top-level package/module of tokenmill that a dotted name lands in."""
    parts = dotted.split(".")
    if parts[0] != root.name:
        return None
    if len(parts) > 1 and ((root / parts[1]).is_dir() or (root / f"{parts[1]}.py").exists()):
        return parts[1]
    return root.name  # a name defined in tokenmill/__init__.py


def package_imports(root: pathlib.Path) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) top-level pairs -> where each import is written."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        module, is_package = module_name(path, root)
        source = top_level(module, root) if module != root.name else root.name
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in imported_modules(tree, module, is_package):
            target = top_level(name, root)
            if target is not None and target != source:
                edges[(source, target)].append(f"{path.relative_to(root.parent)}:{line} {name}")
    return edges


def cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_layer():
    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tops |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    missing = sorted(tops - set(LAYERS))
    assert not missing, f"place these in LAYERS and docs/architecture.md: {missing}"


def test_imports_run_down_the_layers():
    upward = [f"{a} -> {b}: {where}"
              for (a, b), places in sorted(package_imports(ROOT).items())
              if RANK[b] > RANK[a] for where in places]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_package_cycle():
    edges = package_imports(ROOT)
    found = cycles(edges)
    detail = [f"{a} -> {b}: {edges[(a, b)][0]}" for c in found for a in c for b in c
              if (a, b) in edges]
    assert not found, f"package cycles {found}:\n" + "\n".join(detail)


def test_the_walker_sees_relative_function_level_and_type_checking_imports(tmp_path):
    """The checks above are only as good as the walk: a fake tokenmill with a low
    package importing a higher one three hidden ways is caught all three times."""
    fake = tmp_path / "tokenmill"
    (fake / "low").mkdir(parents=True)
    (fake / "high").mkdir()
    for init in (fake / "__init__.py", fake / "low" / "__init__.py", fake / "high" / "__init__.py"):
        init.write_text("")
    (fake / "high" / "x.py").write_text("from tokenmill.low import y\n")
    (fake / "low" / "y.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tokenmill.high.x import X\n"
        "def f():\n    from ..high import x\n    import tokenmill.high.x\n")
    edges = package_imports(fake)
    assert len(edges[("low", "high")]) == 3
    assert cycles(edges) == [["high", "low"]]
