"""`epochmesh-coordinator`: the coordinator's command line.

    epochmesh-coordinator [serve] [--data-dir DIR] [--listen HOST:PORT] ...

Subcommands: ``serve`` (the default when the first argument is an option or absent). Later
issues add more (e.g. ``token create``) to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from coordinator.config import (
    DEFAULT_DATA_DIR,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_LISTEN,
    LEASE_TTL_HEARTBEATS,
    CoordinatorConfig,
)
from coordinator.engine_api import EngineFactory
from coordinator.store import CoordinatorError
from epochmesh.limits import DEFAULT_MAX_BLOB_BYTES

log = logging.getLogger("coordinator")

DEFAULT_COMMAND = "serve"


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"state directory: database, blobs, address file (default ./{DEFAULT_DATA_DIR})",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="log verbosity (default INFO)",
    )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help=f"HOST:PORT to serve gRPC on; port 0 picks a free one (default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=DEFAULT_HEARTBEAT_INTERVAL_S,
        metavar="SECONDS",
        help=f"how often agents heartbeat (default {DEFAULT_HEARTBEAT_INTERVAL_S})",
    )
    parser.add_argument(
        "--lease-ttl",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help=f"lease lifetime without a heartbeat (default {LEASE_TTL_HEARTBEATS:g} x interval)",
    )
    parser.add_argument(
        "--max-blob-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BLOB_BYTES,
        metavar="BYTES",
        help=f"largest blob accepted by UploadBlob (default {DEFAULT_MAX_BLOB_BYTES})",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time calls in flight get to finish after SIGTERM (default 5)",
    )
    parser.add_argument(
        "--split",
        choices=("throughput", "equal"),
        default="throughput",
        help="how a round's global batch is split over nodes: in proportion to measured "
        "throughput (default), or equally (a baseline for benchmarks)",
    )


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(
        data_dir=args.data_dir,
        listen=args.listen,
        heartbeat_interval_s=args.heartbeat_interval,
        lease_ttl_s=args.lease_ttl,
        max_blob_bytes=args.max_blob_bytes,
        shutdown_grace_s=args.shutdown_grace,
        split=args.split,
        log_level=args.log_level,
    )


def default_engine_factory() -> EngineFactory | None:
    """The training engine the console script runs with."""
    from coordinator.engine import Engine

    return Engine


async def serve(config: CoordinatorConfig, engine_factory: EngineFactory | None = None) -> int:
    from coordinator.server import Coordinator

    coordinator = Coordinator(config, engine_factory=engine_factory or default_engine_factory())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await coordinator.start()
    try:
        await stop.wait()
        log.info("signal received: shutting down")
    finally:
        await coordinator.stop()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    try:
        return asyncio.run(serve(config))
    except (RuntimeError, CoordinatorError, OSError) as exc:
        log.error("coordinator failed to start: %s", exc)
        return 1


SUBCOMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]
] = {
    "serve": ("run the coordinator (the default)", add_serve_args, run_serve),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epochmesh-coordinator",
        description="epochmesh coordinator: registers nodes, stores blobs, schedules training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, DEFAULT_COMMAND)
    args = build_parser().parse_args(args_list)
    if args.command is None:
        args = build_parser().parse_args([DEFAULT_COMMAND, *args_list])
    logging.basicConfig(
        level=getattr(logging, args.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _, _, run = SUBCOMMANDS[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
