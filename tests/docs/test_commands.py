"""The commands README's quick start and the getting-started page show still run
(and every other page's shell lines still parse).

Long-running ones (serve, bench, chat) are run to `--help`: the command must exist and
every flag the page gives it must be in its help, so renaming or dropping a documented
flag fails here. Quick ones (`tokenmill roofline`) run for real; `make` lines name
targets the Makefile has; the Python blocks compile.

Checked against a deliberate break: `--max-num-seqs` renamed to `--max-num-sequences`
in tokenmill/cli/engine_args.py made test_documented_commands_still_parse fail on
getting-started.md's `tokenmill serve ... --max-num-seqs 128` line (reverted).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.docs.doc_commands import ROOT, Command, _env, check, commands, shell_lines

PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
EVERY_PAGE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_pages_show_the_quick_start():
    readme = [c.argv for c in commands(ROOT / "README.md")]
    assert ["make", "serve"] in readme and ["make", "test"] in readme
    tokenmill = [c for p in PAGES for c in commands(p) if c.argv[0].endswith("tokenmill")]
    subcommands = {c.argv[1] for c in tokenmill}
    assert {"serve", "bench", "roofline", "explain", "generate"} <= subcommands, subcommands


@pytest.mark.parametrize("page", EVERY_PAGE, ids=lambda p: p.name)
def test_documented_commands_still_parse(page):
    problems = [p for cmd in commands(page) for p in check(cmd)]
    assert not problems, "\n".join(problems)


def test_a_renamed_flag_is_caught():
    """The checker itself: a flag the command does not have is named, with its page."""
    cmd = Command("page.md", "tokenmill serve smollm2-135m --prot 8000",
                  ["tokenmill", "serve", "smollm2-135m", "--prot", "8000"])
    expected = ("page.md: `tokenmill serve smollm2-135m --prot 8000`: --prot is "
                "not in `tokenmill serve smollm2-135m --help`")
    assert check(cmd) == [expected]
    gone = Command("page.md", "tokenmill frobnicate", ["tokenmill", "frobnicate"])
    assert "exited 2" in check(gone)[0]
    assert check(Command("page.md", "make servee", ["make", "servee"])) == [
        "page.md: `make servee`: no make target 'servee'"]


def test_continuations_comments_and_console_prompts_are_read():
    text = ("```bash\ntokenmill bench --base-url http://x \\\n    --concurrency 4  # note\n"
            "# a comment line\n```\n\n```console\n$ tokenmill roofline m --batch 1\n"
            "output, not a command\n```\n")
    assert shell_lines(text) == ["tokenmill bench --base-url http://x --concurrency 4  # note",
                                 "tokenmill roofline m --batch 1"]
    assert commands_of(text)[0] == ["tokenmill", "bench", "--base-url", "http://x",
                                    "--concurrency", "4"]
    multi = "```bash\ncurl -d '{\"a\": 1,\n  \"b\": 2}' http://x\n```\n"
    assert shell_lines(multi) == ["curl -d '{\"a\": 1,\n\"b\": 2}' http://x"]


def commands_of(text: str) -> list[list[str]]:
    import shlex

    return [shlex.split(line, comments=True) for line in shell_lines(text)]


def test_roofline_lines_run_for_real():
    """`tokenmill roofline` is quick: the documented line runs and prints its table."""
    lines = [c for p in PAGES for c in commands(p) if c.argv[:2] == ["tokenmill", "roofline"]]
    assert lines
    for cmd in lines:
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", *cmd.argv[1:]], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=_env(),
                              check=False)
        assert done.returncode == 0, (cmd.line, done.stderr[-500:])
        assert "Decode floor per step" in done.stdout, done.stdout[:500]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_compile(page):
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)
    assert blocks or page.name == "README.md"
    for i, block in enumerate(blocks):
        compile(block, f"{page.name} python block {i}", "exec")
