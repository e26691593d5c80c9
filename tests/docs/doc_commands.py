"""The shell commands a docs page shows, read out of its fenced blocks, and the check
that each still parses: its command exists and every flag it names is in that
command's `--help` (so a renamed or removed flag fails the docs test, not a reader)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# how a documented line starts -> the argv prefix that runs it from this checkout
LAUNCHERS = {"tokenmill": [sys.executable, "-m", "tokenmill.cli"],
             ".venv/bin/tokenmill": [sys.executable, "-m", "tokenmill.cli"],
             "python": [sys.executable], "python3": [sys.executable]}


@dataclass(frozen=True)
class Command:
    page: str
    line: str
    argv: list[str]  # as written, shell-split, the environment assignments dropped


def shell_lines(text: str) -> list[str]:
    """Every command line of the page's shell blocks: backslash continuations and
    quotes left open across lines (curl -d '{...}') joined, `$ ` prompts dropped,
    output lines of console blocks and comment-only lines skipped."""
    lines: list[str] = []
    for lang, block in FENCE.findall(text):
        pending = ""
        for raw in block.splitlines():
            if lang == "console" and not pending:
                if not raw.startswith("$ "):
                    continue
                raw = raw[2:]
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1].rstrip() + " "
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an open quote: the command goes on on the next line
                pending = line + "\n"
                continue
            pending = ""
            if words:
                lines.append(line)
        if pending:
            raise AssertionError(f"a shell block ends inside a command: {pending!r}")
    return lines


def commands(page: Path) -> list[Command]:
    out = []
    for line in shell_lines(page.read_text(encoding="utf-8")):
        argv = shlex.split(line, comments=True)
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            argv = argv[1:]  # HF_HUB_OFFLINE=1 tokenmill ...
        if argv:
            out.append(Command(page.name, line, argv))
    return out


def flags_of(argv: list[str]) -> list[str]:
    """The long options an argv names (`--port 9000`, `--port=9000`)."""
    return [a.split("=", 1)[0] for a in argv if re.fullmatch(r"--[a-z0-9][a-z0-9-]*(=.*)?", a)]


def help_argv(argv: list[str]) -> list[str] | None:
    """The argv that prints this command's --help: its launcher and the words before
    its first option (the subcommand, a positional model), then --help. None for a
    line that is not a tokenmill or python command (curl, make: checked elsewhere)."""
    launcher = LAUNCHERS.get(argv[0])
    if launcher is None or not _ours(argv):
        return None
    words = []
    for a in argv[1:]:
        if a.startswith("-") and not (argv[0].startswith("python") and a == "-m"):
            break
        words.append(a)
    return launcher + words + ["--help"]


_HELP: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def _help(argv: list[str]) -> subprocess.CompletedProcess:
    """`argv` run once per session: many documented lines share a command's help."""
    key = tuple(argv)
    if key not in _HELP:
        _HELP[key] = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                    timeout=120, env=_env(), check=False)
    return _HELP[key]


def _ours(argv: list[str]) -> bool:
    """tokenmill's own commands: `tokenmill ...`, `python -m tokenmill|benchmarks...`,
    `python benchmarks/x.py` (pip's or pytest's flags are not ours to check)."""
    if not argv[0].startswith("python"):
        return True
    if len(argv) > 2 and argv[1] == "-m":
        return argv[2].split(".")[0] in ("tokenmill", "benchmarks")
    return len(argv) > 1 and (ROOT / argv[1]).is_file()


def check(cmd: Command, run=_help) -> list[str]:
    """What is wrong with one documented command: [] when it still parses."""
    if cmd.argv[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        targets = [a for a in cmd.argv[1:] if "=" not in a and not a.startswith("-")]
        return [f"{cmd.page}: `{cmd.line}`: no make target {t!r}" for t in targets
                if not re.search(rf"^{re.escape(t)}:", makefile, re.MULTILINE)]
    argv = help_argv(cmd.argv)
    if argv is None:
        return []
    shown = " ".join([cmd.argv[0], *argv[len(LAUNCHERS[cmd.argv[0]]):]])  # as the page has it
    done = run(argv)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip()[-300:]
        return [f"{cmd.page}: `{cmd.line}`: `{shown}` exited {done.returncode}: {why}"]
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", done.stdout))
    return [f"{cmd.page}: `{cmd.line}`: {flag} is not in `{shown}`"
            for flag in flags_of(cmd.argv) if flag not in known]


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
