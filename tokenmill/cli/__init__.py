"""`tokenmill serve | generate | chat | bench | roofline | explain | export-tokenizer | worker`.

Each module of this package registers one command family (`register(subparsers)`);
this file only composes them, importing each lazily so `tokenmill roofline` never
pays for torch or FastAPI.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing `register(subparsers)`; the parser it adds sets `func`
COMMANDS = {
    "serve": "tokenmill.cli.serve",
    "generate": "tokenmill.cli.generate",
    "chat": "tokenmill.cli.generate",
    "bench": "tokenmill.cli.bench",
    "roofline": "tokenmill.cli.roofline",
    "explain": "tokenmill.cli.roofline",
    "export-tokenizer": "tokenmill.cli.export_tokenizer",
    "worker": "tokenmill.cli.worker",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="Serve an LLM, load it like production traffic, and hold what you "
        "measured against what the hardware allows.",
    )
    from tokenmill.version import __version__

    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = [a for a in argv if a in COMMANDS][:1] or list(COMMANDS)
    for module_name in dict.fromkeys(COMMANDS[c] for c in wanted):
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:  # an error naming it, not a subcommand that vanished
            raise SystemExit(f"tokenmill: error: a dependency is missing: {e} "
                             f"(needed by {module_name})") from e
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except Exception as e:
        # a start-up choice that cannot run here (e.g. --attention-backend) is a usage
        # error, not a crash: one line naming what is available. Looked up, not
        # imported: commands that never touch attention never load torch.
        base = sys.modules.get("tokenmill.attention.base")
        if base is not None and isinstance(e, base.BackendUnavailable):
            parser.exit(2, f"tokenmill: error: {e}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
