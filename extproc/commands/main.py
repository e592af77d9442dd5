"""Command-line entry point: `prefix-epp <command>`.

Each command lives in its own module, which contributes an argparse sub-parser through an
`add_parser(subparsers)` function and sets `func` (args -> exit code) as its default.

An input refused at start-up is one line on stderr and exit status 2, never a traceback nor the
usage block: a malformed flag value (`Parser.error`: `prefix-epp serve: error: --grpc-port:
invalid int value: 'x' (see prefix-epp serve --help)`) and whatever a command refuses by raising
`StartupError` (extproc/config/validate.py: `prefix-epp serve: error: <message>`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from extproc.config.validate import StartupError


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line naming the flag, without the usage block (which for
    `serve` would list every flag before the error)."""

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from extproc.commands import envoy_config, serve, sidecar
    from prefix_epp_sim import cli as sim_cli

    parser = Parser(
        prog="prefix-epp",
        description="Prefix-cache-aware Endpoint Picker for Envoy ext_proc (Gateway API Inference Extension).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")  # sub-parsers are Parsers too
    serve.add_parser(sub)
    envoy_config.add_parser(sub)
    sidecar.add_parser(sub)
    sim_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's parser, which has the flags the user meant
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        result: int = args.func(args)
    except StartupError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
