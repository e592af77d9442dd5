"""`prefix-epp serve`: run the picker. Its flags are the flag table (extproc/config/flags.py; the
reference is docs/cli.md): names and defaults follow the Go EPP where they exist, every default
comes from EppConfig (extproc/config/settings.py)."""

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
from extproc.core import logs


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the flag table (extproc/config/flags.py), in its groups."""
    flags.add_arguments(p)


def config_from_args(args: argparse.Namespace) -> EppConfig:
    """The EppConfig the parsed flags describe (every row of the flag table with a config field)."""
    return flags.config_from_args(args)


def _validate_ha(config: EppConfig) -> None:
    from extproc.core.datastore import split_host_port
    from extproc.sync.manager import load_secret

    y = config.sync  # the ranges of its numbers are checked with the others (extproc/config/validate.py)
    if (y.peers or y.peer_selector) and not y.port:
        raise SystemExit("prefix-epp serve: --peers and --peer-selector need --sync-port")
    if y.peer_selector and not config.pool_name:
        raise SystemExit("prefix-epp serve: --peer-selector needs Kubernetes discovery (--pool-name)")
    for peer in y.peers:
        try:
            split_host_port(peer)
        except ValueError as exc:
            raise SystemExit(f"prefix-epp serve: --peers: {exc}") from None
    if y.port:
        try:
            load_secret(y)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"prefix-epp serve: {exc}") from None


def validate(config: EppConfig) -> None:
    """Refuse to start on any invalid flag or config field, naming it (extproc/config/validate.py)."""
    from pathlib import Path

    from extproc.config.validate import check, overridden, profile_conflicts
    from extproc.config.values import ConfigError
    from extproc.discovery.pool import PoolError, pool_version
    from extproc.scheduling.config_loader import load_config

    if not config.endpoints and not config.pool_name:
        raise SystemExit("prefix-epp serve: give --endpoints or --pool-name")
    k = config.kv_events
    if k.tokenizer not in ("builtin", "remote") and not Path(k.tokenizer).is_file():
        raise SystemExit(f"prefix-epp serve: --tokenizer {k.tokenizer}: no such file (or builtin, remote)")
    problems = check(config)  # the flags as given: name the flag even if the config file would change it
    if problems:
        raise SystemExit("prefix-epp serve: " + "; ".join(problems))
    _validate_ha(config)
    try:
        if config.pool_name:
            pool_version(config.pool_group)
        loaded, profile = load_config(config)
    except (ConfigError, PoolError) as exc:
        raise SystemExit(f"prefix-epp serve: {exc}") from None
    problems = check(loaded)
    if problems:
        source = "--config-file" if config.config_file else "--config-text"
        raise SystemExit(f"prefix-epp serve: after applying {source}: " + "; ".join(problems))
    if profile is not None and (conflicts := profile_conflicts(config)):
        raise SystemExit(f"prefix-epp serve: {', '.join(conflicts)} cannot apply: the EndpointPickerConfig defines "
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
    await app.start()
    try:
        await stop.wait()
        cut = await app.drain(hurry)
    finally:
        await app.stop()
    return 1 if cut else 0


def run(args: argparse.Namespace) -> int:
    import sys

    from extproc.runtime.workers import supervise, worker_role
    from extproc.sync.manager import SECRET_ENV

    logs.setup(args.log_level)
    config = config_from_args(args)
    validate(config)
    if config.workers > 1 and worker_role() is None:
        have_secret = bool(config.sync.secret_file or os.environ.get(SECRET_ENV))
        return supervise(config.workers, sys.argv[1:], SECRET_ENV, have_secret)
    return asyncio.run(serve(config))


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the endpoint picker",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
