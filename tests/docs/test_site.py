"""The docs site builds with `mkdocs build --strict` (a broken link or anchor fails),
every page under docs/ is in mkdocs.yml's nav (mkdocs reports orphans only at INFO
level, so this checks it), README stays short, and the architecture page's layer table
is tests/unit/test_layering.py's LAYERS in order."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.docs.doc_commands import ROOT
from tests.unit.test_layering import LAYERS

DOCS = ROOT / "docs"
GENERATED = {"index.md", "results.md"}  # docs/_hooks/generated_pages.py: README, BENCHMARKS


def nav_files(nav: list) -> list[str]:
    """Every page file mkdocs.yml's nav names, depth first."""
    out: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += nav_files(value) if isinstance(value, list) else [value]
    return out


def orphans(nav: list[str], docs: Path) -> list[str]:
    """Markdown files under docs/ that the nav does not reach (hooks excluded)."""
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")
             if "_hooks" not in p.parts}
    return sorted(pages - set(nav))


def _config() -> dict:
    text = (ROOT / "mkdocs.yml").read_text()
    return yaml.safe_load(text)


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    site = tmp_path / "site"
    home = (site / "index.html").read_text()
    assert "Current numbers" in home and "getting-started.html" in home  # README, re-linked
    assert "W3 single-stream decode" in (site / "results.html").read_text()  # BENCHMARKS.md
    arch = (site / "architecture.html").read_text()
    assert "A request&rsquo;s route" in arch or "A request's route" in arch
    # nothing fetched when the page opens: no web fonts, no CDN scripts
    assert "fonts.googleapis" not in home and "fonts.gstatic" not in home


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = nav_files(_config()["nav"])
    assert not orphans(nav, DOCS), f"pages missing from mkdocs.yml's nav: {orphans(nav, DOCS)}"
    missing = [f for f in nav if f not in GENERATED and not (DOCS / f).exists()]
    assert not missing, missing
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def test_the_orphan_check_fails_on_an_unlisted_page(tmp_path):
    (tmp_path / "a.md").write_text("# a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# b")
    assert orphans(["a.md"], tmp_path) == ["sub/b.md"]


def test_the_pages_the_issue_asks_for_are_in_the_nav():
    nav = set(nav_files(_config()["nav"]))
    assert {"getting-started.md", "serving.md", "structured-output.md", "responses.md",
            "from-vllm.md", "models.md", "scale-out.md", "tensor-parallel.md", "gpu.md",
            "cpu-kernels.md", "bench.md", "roofline.md", "benchmarks.md", "architecture.md",
            "history.md", "moe.md", "sliding_window.md", "speculative.md"} <= nav


def test_nothing_fetches_at_build_time():
    config = _config()
    assert config["theme"]["font"] is False
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config.get("plugins", [])]
    assert plugins == ["search"], plugins  # no social cards, no remote plugins


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)


def test_architecture_lists_the_layers_in_the_enforced_order():
    page = (DOCS / "architecture.md").read_text()
    table = page.split("<!-- layers:start -->")[1].split("<!-- layers:end -->")[0]
    rows = re.findall(r"^\| `([a-z_0-9]+)` \|", table, re.MULTILINE)
    assert rows == LAYERS
