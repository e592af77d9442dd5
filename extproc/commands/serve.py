"""`prefix-epp serve`: run the picker. Its flags are the flag table (extproc/config/flags.py; the
reference is docs/cli.md): names and defaults follow the Go EPP where they exist, every default
comes from EppConfig (extproc/config/settings.py). `--help` shows the flags a first deployment
sets (the rows marked `first`), `--help-all` every flag.

Start-up refuses a bad input with one line naming its flag and exit status 2 (`StartupError`,
printed by extproc/commands/main.py): a malformed value (argparse), an invalid value or
combination (`validate`), an unusable TLS file or a port that cannot be bound
(extproc/commands/preflight.py). With --secure-serving, a gateway that dials it in plaintext is
logged as such (extproc/transport/tls_mismatch.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from extproc.config import flags
from extproc.config.settings import EppConfig
from extproc.config.validate import StartupError
from extproc.core import logs

USAGE = "%(prog)s (--endpoints IP:PORT,... | --pool-name NAME) [flag ...]"
DESCRIPTION = "Run the endpoint picker: Envoy's ext_proc server on --grpc-port."
SHORT_EPILOG = ("These are the flags a first deployment sets; prefix-epp serve --help-all lists all of them, "
                "as does docs/cli.md.")


def add_arguments(p: argparse.ArgumentParser, *, first_only: bool = False) -> None:
    """The flags of the flag table (extproc/config/flags.py), in its groups (`first_only`: the help
    shows only the rows marked `first`)."""
    flags.add_arguments(p, first_only=first_only)


class _HelpAll(argparse.Action):
    """`--help-all`: the help of every flag (`--help` shows those a first deployment sets)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        full = argparse.ArgumentParser(prog=parser.prog, usage=USAGE, description=DESCRIPTION,
                                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_arguments(full)
        full.print_help()
        parser.exit()


def config_from_args(args: argparse.Namespace) -> EppConfig:
    """The EppConfig the parsed flags describe (every row of the flag table with a config field)."""
    return flags.config_from_args(args)


def _validate_ha(config: EppConfig) -> None:
    from extproc.core.datastore import split_host_port
    from extproc.sync.manager import load_secret

    y = config.sync  # the ranges of its numbers are checked with the others (extproc/config/validate.py)
    if (y.peers or y.peer_selector) and not y.port:
        raise StartupError("--peers and --peer-selector need --sync-port")
    if y.peer_selector and not config.pool_name:
        raise StartupError("--peer-selector needs Kubernetes discovery (--pool-name)")
    for peer in y.peers:
        try:
            split_host_port(peer)
        except ValueError as exc:
            raise StartupError(f"--peers: {exc}") from None
    if y.port:
        try:
            load_secret(y)
        except (OSError, ValueError) as exc:
            raise StartupError(str(exc)) from None


def validate(config: EppConfig) -> None:
    """Refuse to start on any invalid flag or config field, naming it (extproc/config/validate.py)."""
    from pathlib import Path

    from extproc.config.validate import check, overridden, profile_conflicts
    from extproc.config.values import ConfigError
    from extproc.discovery.pool import PoolError, pool_version
    from extproc.scheduling.config_loader import load_config

    if not config.endpoints and not config.pool_name:
        raise StartupError("give --endpoints IP:PORT,... (static endpoints) or --pool-name NAME (an InferencePool)")
    k = config.kv_events
    if k.tokenizer not in ("builtin", "remote") and not Path(k.tokenizer).is_file():
        raise StartupError(f"--tokenizer {k.tokenizer}: no such file (or builtin, remote)")
    problems = check(config)  # the flags as given: name the flag even if the config file would change it
    if problems:
        raise StartupError("; ".join(problems))
    if config.endpoint_roles:
        from extproc.discovery.static import parse_endpoints

        try:
            parse_endpoints(config.endpoints, config.endpoint_roles)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
    _validate_ha(config)
    try:
        if config.pool_name:
            pool_version(config.pool_group)
        loaded, profile = load_config(config)
    except (ConfigError, PoolError) as exc:
        raise StartupError(str(exc)) from None
    problems = check(loaded)
    if problems:
        source = "--config-file" if config.config_file else "--config-text"
        raise StartupError(f"after applying {source}: " + "; ".join(problems))
    if profile is not None and (conflicts := profile_conflicts(config)):
        raise StartupError(f"{', '.join(conflicts)} cannot apply: the EndpointPickerConfig defines "
                         "the scheduling profile; set the scorers and their weights there")
    for flag, given, final in overridden(config, loaded):
        logging.getLogger("prefix_epp").warning(
            "the EndpointPickerConfig overrides a flag", extra={"flag": flag, "flag_value": given,
                                                               "config_value": final})


async def serve(config: EppConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain (extproc/transport/streams.py); a second signal cuts the
    drain short. Returns the exit status: 1 when the drain cut open streams, else 0."""
    from extproc.runtime.app import App, freeze_startup_heap
    from extproc.runtime.workers import WorkerRole, worker_role

    app = App(config, role=worker_role() or WorkerRole())
    freeze_startup_heap()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def signalled() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, signalled)
    try:
        await app.start()
    except StartupError:  # a port taken since the check (preflight.py): close what did start
        await app.stop(grace=0)
        raise
    try:
        await stop.wait()
        cut = await app.drain(hurry)
    finally:
        await app.stop()
    return 1 if cut else 0


def run(args: argparse.Namespace) -> int:
    import sys

    from extproc.commands import preflight
    from extproc.runtime.workers import supervise, worker_role
    from extproc.sync.manager import SECRET_ENV
    from extproc.transport import tls_mismatch

    logs.setup(args.log_level)
    config = config_from_args(args)
    validate(config)
    if worker_role() is None:  # workers share the ext_proc port: their supervisor checks it before them
        preflight.check(config)
        if config.secure_serving:  # a plaintext gateway on the TLS port, recognised in gRPC's stderr
            tls_mismatch.start(args.log_level)
    if config.workers > 1 and worker_role() is None:
        have_secret = bool(config.sync.secret_file or os.environ.get(SECRET_ENV))
        return supervise(config.workers, sys.argv[1:], SECRET_ENV, have_secret)
    return asyncio.run(serve(config))


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the endpoint picker", usage=USAGE, description=DESCRIPTION,
                              epilog=SHORT_EPILOG, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--help-all", action=_HelpAll, help="show every flag and exit")
    add_arguments(p, first_only=True)
    p.set_defaults(func=run)
