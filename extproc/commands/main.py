"""Command-line entry point: `prefix-epp <command>`.

Each command lives in its own module, which contributes an argparse sub-parser through an
`add_parser(subparsers)` function and sets `func` (args -> exit code) as its default.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from extproc.commands import envoy_config, serve
    from prefix_epp_sim import cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="prefix-epp",
        description="Prefix-cache-aware Endpoint Picker for Envoy ext_proc (Gateway API Inference Extension).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    envoy_config.add_parser(sub)
    sim_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
