#!/usr/bin/env python3
"""Run emulated WAN links (userspace TCP relays on loopback) until SIGTERM or SIGINT.

One link:
    .venv/bin/python scripts/wan.py --listen 127.0.0.1:7071 --target 127.0.0.1:7070 \\
        --bandwidth 100mbit --rtt 50ms [--loss 0.01] [--jitter 5ms] [--return-bandwidth 20mbit]

Several links at once (repeat --link):
    .venv/bin/python scripts/wan.py \\
        --link agent1=127.0.0.1:0,127.0.0.1:7070,100mbit,50ms \\
        --link agent2=127.0.0.1:0,127.0.0.1:7070,100mbit,50ms,loss=1%,jitter=5ms

Link spec: NAME=LISTEN,TARGET,BANDWIDTH,RTT[,loss=P][,jitter=D][,return_bandwidth=B][,queue=D].
Bandwidth in bit/s with units kbit/mbit/gbit (0 or "inf": unlimited); durations in ms/s/us.
The model (latency, shared bandwidth, loss as retransmission delay) is described in
epochmesh/testing/wan.py.

Output on stdout, one JSON line each:
  {"event": "ready", "links": {NAME: {"listen": "127.0.0.1:PORT", "target": ...}}}
      once every link listens (also written to --ready-file, atomically, if given);
  {"event": "stats", "links": {NAME: {bytes_to_target, bytes_to_client, ...}}}
      on exit (also logged; --stats-interval S logs them every S seconds meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from epochmesh.testing.wan import (
    DEFAULT_QUEUE_MS,
    LinkSpec,
    WanLink,
    parse_bandwidth,
    parse_duration_ms,
    parse_link_spec,
    parse_loss,
    split_hostport,
)

log = logging.getLogger("wan")
T = TypeVar("T")


def _arg(parse: Callable[[str], T]) -> Callable[[str], T]:
    """Wrap a parser so argparse reports its ValueError text."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wan.py",
        description="Emulated WAN links: TCP relays with bandwidth, RTT, jitter and loss.",
    )
    p.add_argument(
        "--link",
        action="append",
        default=[],
        type=_arg(parse_link_spec),
        metavar="NAME=LISTEN,TARGET,BW,RTT[,k=v]",
        help="a link (repeatable)",
    )
    p.add_argument("--listen", help="listen HOST:PORT of the single link (port 0: any)")
    p.add_argument("--target", help="target HOST:PORT of the single link")
    p.add_argument("--name", default="link", help="name of the single link (default: link)")
    p.add_argument(
        "--bandwidth",
        type=_arg(parse_bandwidth),
        default=100e6,
        help="per-direction bandwidth, e.g. 100mbit (default 100mbit; 0: unlimited)",
    )
    p.add_argument(
        "--return-bandwidth",
        type=_arg(parse_bandwidth),
        default=None,
        help="target->client bandwidth if different (asymmetric link)",
    )
    p.add_argument(
        "--rtt",
        type=_arg(parse_duration_ms),
        default=50.0,
        help="round-trip time, e.g. 50ms (default 50ms)",
    )
    p.add_argument(
        "--loss",
        type=_arg(parse_loss),
        default=0.0,
        help="per-segment loss probability, e.g. 0.01 or 1%% (default 0)",
    )
    p.add_argument(
        "--jitter",
        type=_arg(parse_duration_ms),
        default=0.0,
        help="extra one-way delay, uniform in [0, JITTER] (default 0)",
    )
    p.add_argument(
        "--queue",
        type=_arg(parse_duration_ms),
        default=DEFAULT_QUEUE_MS,
        help=f"router buffer in time (default {DEFAULT_QUEUE_MS:g}ms)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of jitter and loss draws")
    p.add_argument(
        "--no-handshake",
        action="store_true",
        help="do not delay new connections by 1.5 RTT (TCP handshake)",
    )
    p.add_argument(
        "--no-loss-rate-cap",
        action="store_true",
        help="emulate loss as retransmission delay only, without capping each "
        "connection at the TCP throughput the loss rate allows",
    )
    p.add_argument("--ready-file", type=Path, help="write the ready JSON here too")
    p.add_argument(
        "--stats-interval",
        type=float,
        default=0.0,
        help="log stats every S seconds (default: only on exit)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def link_specs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[LinkSpec]:
    specs: list[LinkSpec] = list(args.link)
    if args.listen or args.target:
        if not (args.listen and args.target):
            parser.error("--listen and --target go together")
        try:
            split_hostport(args.listen)
            split_hostport(args.target)
        except ValueError as exc:
            parser.error(str(exc))
        specs.append(
            LinkSpec(
                name=args.name,
                listen=args.listen,
                target=args.target,
                bandwidth_bps=args.bandwidth,
                rtt_ms=args.rtt,
                loss=args.loss,
                jitter_ms=args.jitter,
                return_bandwidth_bps=args.return_bandwidth,
                queue_ms=args.queue,
            )
        )
    if not specs:
        parser.error("give --listen/--target or at least one --link")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        parser.error(f"link names must be unique: {names}")
    return specs


def emit(obj: dict[str, object], path: Path | None = None) -> None:
    line = json.dumps(obj, sort_keys=True)
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(line + "\n")
        os.replace(tmp, path)
    print(line, flush=True)


async def serve(args: argparse.Namespace, specs: list[LinkSpec]) -> int:
    seed = args.seed
    links = [
        s.build(
            seed=None if seed is None else seed + i,
            handshake=not args.no_handshake,
            loss_caps_rate=not args.no_loss_rate_cap,
        )
        for i, s in enumerate(specs)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started: list[WanLink] = []
    reporter: asyncio.Task[None] | None = None
    try:
        for link in links:
            await link.start()
            started.append(link)
        emit(
            {
                "event": "ready",
                "links": {lk.name: {"listen": lk.address, "target": lk.target} for lk in links},
            },
            args.ready_file,
        )
        if args.stats_interval > 0:
            reporter = asyncio.create_task(report(links, args.stats_interval))
        await stop.wait()
    finally:
        if reporter is not None:
            reporter.cancel()
        await asyncio.gather(*(lk.stop() for lk in started), return_exceptions=True)
    stats = {lk.name: lk.stats().to_dict() for lk in links}
    for name, st in stats.items():
        log.info(
            "link %s: %d bytes to target, %d bytes to client, %d connections, %d loss events",
            name,
            st["bytes_to_target"],
            st["bytes_to_client"],
            st["connections_total"],
            st["loss_events"],
        )
    emit({"event": "stats", "links": stats})
    return 0


async def report(links: list[WanLink], interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for lk in links:
            log.info("stats %s", json.dumps(lk.stats().to_dict(), sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    specs = link_specs(args, parser)
    try:
        return asyncio.run(serve(args, specs))
    except OSError as exc:
        log.error("cannot start the links: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
