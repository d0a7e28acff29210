"""Command line and configuration of the node agent (`epochmesh-agent`)."""

from __future__ import annotations

import argparse
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from epochmesh.coordinators import AddressError, parse_addresses
from epochmesh.money import parse_credits

BENCHMARK_MODES = ("full", "quick", "off")
DEFAULT_PEER_LISTEN = "127.0.0.1:0"
DEFAULT_CACHE_MAX_BYTES = 20 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs to know at start; built by `parse_args`."""

    coordinator: str  # the first of `coordinators`
    data_dir: Path
    device: str = "auto"
    name: str = field(default_factory=socket.gethostname)
    # Every --coordinator address (an active coordinator and its standbys); () = (coordinator,).
    coordinators: tuple[str, ...] = ()
    slowdown: float = 1.0
    # The donor's asking price in micro-credits per node-hour (--price); 0: donated.
    price_micro_per_hour: int = 0
    memory_limit_bytes: int | None = None
    benchmark: str = "full"
    log_level: str = "INFO"
    # --debug: DEBUG logs and gRPC's own C-core log lines (silenced otherwise).
    debug: bool = False
    # Seconds a drain (SIGTERM, operator drain) waits for the current task before abandoning it.
    drain_grace_seconds: float = 10.0
    # Long-poll bound sent with NextTask; the coordinator may cap it.
    poll_wait_ms: int = 5_000
    labels: dict[str, str] = field(default_factory=dict)
    # CPU threads torch may use for one operation (None: torch's default, one per core).
    threads: int | None = None
    # Join token for the first start (enrollment); later starts reuse DATA_DIR's certificate.
    token: str = ""
    # Plaintext gRPC without certificates (against an --insecure coordinator).
    insecure: bool = False
    # PeerService (ring all-reduce, state transfer): where it listens, the address other agents
    # dial (empty: derived from the listen address and the bound port), or none at all.
    peer_listen: str = DEFAULT_PEER_LISTEN
    peer_advertise: str = ""
    no_peer: bool = False
    # Where to serve Prometheus metrics (--metrics-listen); empty: nowhere.
    metrics_listen: str = ""
    # The blob cache's size cap (--cache-max-bytes; least recently used entries go first).
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES

    @property
    def cache_dir(self) -> Path:
        return self.data_dir / "cache"

    @property
    def slowdown_file(self) -> Path:
        return self.data_dir / "slowdown"

    @property
    def price_file(self) -> Path:
        return self.data_dir / "price"

    @property
    def benchmark_file(self) -> Path:
        return self.data_dir / "benchmark.json"


def parse_size(text: str) -> int:
    """Parse a byte count such as `1048576`, `512M`, `1.5GiB` (binary units)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"not a byte size: {text!r} (examples: 1048576, 512M, 2GiB)")
    number, unit, _ = match.groups()
    value = int(float(number) * _SIZE_UNITS[unit.lower()])
    if value <= 0:
        raise ValueError(f"byte size must be positive: {text!r}")
    return value


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slowdown must be a number, got {text!r}") from None
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--slowdown must be a finite number >= 1, got {text!r}")
    return value


def parse_price(text: str) -> int:
    """Micro-credits per hour of a price in credits per hour ("2.5"). ValueError with a clear
    message for a negative, non-finite or non-numeric price."""
    return parse_credits(text.strip(), "the price")


def _price(text: str) -> int:
    try:
        return parse_price(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (credits per hour; 0 donates the node)") from None


def _device(text: str) -> str:
    if text in ("auto", "cpu") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"--device must be auto, cpu or cuda:N, got {text!r}")


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label must be KEY=VALUE, got {text!r}")
    return key, value


def split_host_port(text: str, *, port_optional: bool = False) -> tuple[str, int]:
    """("host", port) of `HOST:PORT` (IPv6 hosts in brackets: `[::1]:7000`); with
    `port_optional`, a bare `HOST` gives port 0. ValueError for anything else."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"not HOST:PORT: {text!r}")
        port_text = rest[1:] if rest else ""
        has_port = bool(rest)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        has_port = True
    elif ":" not in text:
        host, port_text, has_port = text, "", False
    else:
        raise ValueError(f"not HOST:PORT: {text!r} (put an IPv6 address in brackets)")
    if not host:
        raise ValueError(f"not HOST:PORT: {text!r} (the host is missing)")
    if not has_port:
        if not port_optional:
            raise ValueError(f"not HOST:PORT: {text!r} (the port is missing)")
        return host, 0
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"not HOST:PORT: {text!r} (the port must be 0..65535)")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_peer_address(listen: str, advertise: str, bound_port: int) -> str:
    """The PeerService address to register: `advertise` (its port, or the bound port when it
    names none or 0), else the listen host with the bound port; a wildcard listen host
    (0.0.0.0, ::) becomes 127.0.0.1, which only agents on this machine can reach."""
    if advertise:
        host, port = split_host_port(advertise, port_optional=True)
        return join_host_port(host, port or bound_port)
    host, _ = split_host_port(listen)
    if host in ("0.0.0.0", "::", "*"):
        host = "127.0.0.1"
    return join_host_port(host, bound_port)


def _listen_address(text: str) -> str:
    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--peer-listen: {exc}") from None
    return text.strip()


def _coordinator_addresses(text: str) -> tuple[str, ...]:
    try:
        return parse_addresses(text)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: write HOST:PORT or HOST:PORT,HOST:PORT") from None


def _metrics_address(text: str) -> str:
    if not text.strip():
        return ""
    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--metrics-listen: {exc}") from None
    return text.strip()


def _advertise_address(text: str) -> str:
    try:
        host, port = split_host_port(text, port_optional=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--peer-advertise: {exc}") from None
    if host in ("0.0.0.0", "::", "*"):
        raise argparse.ArgumentTypeError(
            f"--peer-advertise must name a host other agents can dial, not {host!r}"
        )
    return join_host_port(host, port) if port else host


def _positive_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epochmesh-agent",
        description="epochmesh node agent: registers this machine's device with a coordinator, "
        "benchmarks it and trains the rounds it is given.",
    )
    parser.add_argument(
        "--coordinator",
        required=True,
        type=_coordinator_addresses,
        metavar="HOST:PORT",
        help="the coordinator's address, or several as HOST:PORT,HOST:PORT (an active "
        "coordinator and its standbys on one database: the agent talks to the one that serves "
        "and follows a takeover)",
    )
    parser.add_argument(
        "--data-dir",
        required=True,
        type=Path,
        metavar="DIR",
        help="node identity, blob cache, slowdown and price control files",
    )
    parser.add_argument("--device", default="auto", type=_device, help="auto | cpu | cuda:N")
    parser.add_argument("--name", default=None, help="display name (default: host name)")
    parser.add_argument(
        "--slowdown",
        default=1.0,
        type=_slowdown,
        metavar="F",
        help="make every training step take F times its compute time (emulates a slower "
        "device); changeable at run time by writing a number to DATA_DIR/slowdown",
    )
    parser.add_argument(
        "--price",
        default=0,
        type=_price,
        metavar="CREDITS_PER_HOUR",
        help="the price asked for this node, in credits per node-hour (default 0: donated); "
        "changeable at run time by writing a number to DATA_DIR/price (sent with the next "
        "heartbeat, or at once on SIGUSR1)",
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        type=_size_arg,
        metavar="BYTES",
        help="emulate a smaller device: a batch whose peak memory exceeds this counts as OOM",
    )
    parser.add_argument(
        "--cache-max-bytes",
        default=DEFAULT_CACHE_MAX_BYTES,
        type=_size_arg,
        metavar="BYTES",
        help="cap of the blob cache in DATA_DIR/cache, e.g. 20GiB (the default): the least "
        "recently used blobs are deleted past it (those in use stay)",
    )
    parser.add_argument(
        "--benchmark",
        default="full",
        choices=BENCHMARK_MODES,
        help="reference benchmark at start: full (default), quick (tests: job benchmarks "
        "of a few steps too), off",
    )
    parser.add_argument(
        "--drain-grace",
        default=10.0,
        type=_positive_float,
        metavar="SECONDS",
        help="on SIGTERM, how long to let the current task finish before abandoning it",
    )
    parser.add_argument("--poll-wait-ms", default=5_000, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--label", action="append", default=[], type=_label, metavar="KEY=VALUE")
    parser.add_argument(
        "--threads",
        default=None,
        type=_positive_int,
        metavar="N",
        help="CPU threads per torch operation (default: one per core); several agents "
        "sharing one machine run far steadier with --threads 1",
    )
    parser.add_argument(
        "--token",
        default="",
        metavar="TOKEN",
        help="join token (epochmesh-coordinator token create --role node): on the first start "
        "the agent makes its key pair in DATA_DIR and enrolls for a certificate; later starts "
        "reuse it",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="talk plaintext gRPC without a certificate (to an --insecure coordinator)",
    )
    peer = parser.add_argument_group(
        "ring all-reduce",
        'Jobs with aggregation = "ring" exchange gradients directly between agents over '
        "their PeerService (mutual TLS with the node certificates of the coordinator's CA; "
        "plaintext with --insecure).",
    )
    peer.add_argument(
        "--peer-listen",
        default=None,
        type=_listen_address,
        metavar="HOST:PORT",
        help="where the PeerService listens (default 127.0.0.1:0: a free port, reachable "
        "from this machine only). A donor on the internet passes 0.0.0.0:PORT with a port "
        "open to the other agents, and --peer-advertise PUBLIC_HOST:PORT",
    )
    peer.add_argument(
        "--peer-advertise",
        default=None,
        type=_advertise_address,
        metavar="HOST[:PORT]",
        help="the address other agents dial to reach this PeerService, sent to the "
        "coordinator (default: the --peer-listen host with the bound port; without a port, "
        "the bound port)",
    )
    peer.add_argument(
        "--no-peer",
        action="store_true",
        help="run no PeerService (for a node that cannot accept inbound connections): in a "
        "ring job it takes part through the coordinator",
    )
    parser.add_argument(
        "--metrics-listen",
        default="",
        type=_metrics_address,
        metavar="HOST:PORT",
        help="serve Prometheus metrics (tasks, steps, samples, bytes, device memory, cache "
        "size) at http://HOST:PORT/metrics (default: none; port 0 picks a free one, logged "
        "and written to DATA_DIR/metrics.addr)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="log at DEBUG and keep gRPC's own C-core log lines on stderr (silenced "
        "otherwise, unless GRPC_VERBOSITY or GRPC_TRACE is set)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_peer and (args.peer_listen is not None or args.peer_advertise):
        parser.error("--no-peer runs no PeerService: drop --peer-listen/--peer-advertise")
    return AgentConfig(
        coordinator=args.coordinator[0],
        coordinators=args.coordinator,
        data_dir=args.data_dir.expanduser().resolve(),
        device=args.device,
        name=args.name or socket.gethostname(),
        slowdown=args.slowdown,
        price_micro_per_hour=args.price,
        memory_limit_bytes=args.memory_limit,
        benchmark=args.benchmark,
        log_level=args.log_level,
        debug=args.debug,
        drain_grace_seconds=args.drain_grace,
        poll_wait_ms=max(0, args.poll_wait_ms),
        labels=dict(args.label),
        threads=args.threads,
        token=args.token,
        insecure=args.insecure,
        peer_listen=args.peer_listen or DEFAULT_PEER_LISTEN,
        peer_advertise=args.peer_advertise or "",
        no_peer=args.no_peer,
        metrics_listen=args.metrics_listen,
        cache_max_bytes=args.cache_max_bytes,
    )
