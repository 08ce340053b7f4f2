"""The `kiln` command: one entry point, one subcommand module per area (each exposes `register`)."""

from __future__ import annotations

import argparse
import importlib
import sys

from kiln import __version__
from kiln.errors import KilnError

# Each module defines register(subparsers) and sets `func` on its parsers; func(args) -> exit code.
COMMAND_MODULES = [
    "kiln.cli.train_cmds",  # run, torchrun, train, eval, export, data prepare
    "kiln.cli.spec_cmds",  # validate, render, crd
    "kiln.cli.cluster_cmds",  # submit, status, wait, logs, operator
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="Declarative, fault-tolerant distributed training. One TrainingSpec runs on this machine "
        "(kiln run) or on Kubernetes (kiln submit, with the kiln operator).",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # that area is not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command(args.func, args)


def run_command(func, args: argparse.Namespace) -> int:
    """func(args) as `kiln` runs every command: its exit code; a KilnError is one line `kiln: error: ...` and
    its exit code, Ctrl-C 130; any other exception one line naming it and the file holding its traceback (the
    traceback itself with --debug). For entry points that call a command with more than args (e.g. hooks)."""
    try:
        return int(func(args) or 0)
    except KilnError as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - not a KilnError: a bug or a library's failure
        if getattr(args, "debug", False):
            raise
        from kiln.cli.failure import unexpected

        name = f"{getattr(args, 'command', None) or 'kiln'}.traceback"
        print(f"kiln: error: {unexpected(err, folder=None, name=name)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
