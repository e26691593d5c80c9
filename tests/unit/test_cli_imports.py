"""The CLI composes its commands by importing them: one whose dependency is missing
is an error naming the dependency, never a subcommand silently left out."""

import sys

import pytest

from tokenmill import cli


def test_a_missing_dependency_is_named(tmp_path, monkeypatch):
    (tmp_path / "needs_missing_dep.py").write_text(
        "import tokenmill_surely_missing_dependency\n\ndef register(sub):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "ghost", "needs_missing_dep")
    with pytest.raises(SystemExit) as exc:
        cli.main(["ghost"])
    assert "tokenmill_surely_missing_dependency" in str(exc.value)
    sys.modules.pop("needs_missing_dep", None)


def test_every_command_module_loads():
    parser = cli.build_parser([])  # all of them: none may fail to import here
    commands = parser._subparsers._group_actions[0].choices
    assert set(cli.COMMANDS) <= set(commands)
