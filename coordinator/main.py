"""`epochmesh-coordinator`: the coordinator's command line.

    epochmesh-coordinator [serve] [--data-dir DIR] [--listen HOST:PORT] ...

    epochmesh-coordinator token create --role node|submitter|operator [--ttl 24h]
                                       [--uses N | --reusable] [--cert-ttl 30d]
                                       [--donor NAME] [--data-dir DIR]

    epochmesh-coordinator dev [--agents N] [--data-dir DIR]

Subcommands: ``serve`` (the default when the first argument is an option or absent; its
options are listed in the top-level ``--help`` too), ``token create``, which runs on the
coordinator's machine against its data dir (creating the CA if the coordinator never ran) and
prints one join token on stdout, and ``dev``, a coordinator and N agents on this machine with
a logged-in CLI (coordinator/local_cluster.py) until Ctrl-C.

gRPC's own C-core log lines (TLS handshake failures and the like) are silenced unless
``--debug``; the arguments are parsed before grpc is imported, which that needs
(epochmesh/grpc_logs.py).

TLS is on by default: the first start creates a CA in the data dir (ca.pem, ca.key) and a
server certificate it issues (server.pem, server.key), and refuses to start when only one of
the CA's files is there; ``--advertise HOST`` adds names to the server certificate; ``--insecure`` serves plaintext
without authentication (logged as a warning).

On PostgreSQL, coordinators sharing the database elect one active through a lease
(coordinator/ha/); the others stand by. ``--advertise HOST:PORT`` is the address the active
one tells standbys' callers to use (default: the listen address). One that loses the lease
stops serving at once and stands by again, in the same process, until it gets the lease back.
``--blob-dir DIR`` puts the blobs where every coordinator on the database reaches them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from coordinator.core.config import (
    DEFAULT_BLOB_QUOTA_BYTES,
    DEFAULT_DATA_DIR,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HTTP_LISTEN,
    DEFAULT_LEASE_TIMEOUT_S,
    DEFAULT_LISTEN,
    DEFAULT_MAX_HEARTBEATS_PER_S,
    LEASE_TTL_HEARTBEATS,
    CoordinatorConfig,
)
from coordinator.core.errors import CoordinatorError
from epochmesh.grpc_logs import quiet_grpc_core
from epochmesh.limits import DEFAULT_MAX_BLOB_BYTES, MAX_CHUNK_BYTES
from epochmesh.program.inspection import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MEMORY_BASE_BYTES,
    DEFAULT_TIMEOUT_S,
)
from epochmesh.timeutil import duration_seconds

if TYPE_CHECKING:  # grpc comes with it, and grpc may be imported only after the arguments
    from coordinator.engine.api import EngineFactory

log = logging.getLogger("coordinator")

DEFAULT_COMMAND = "serve"


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _inline_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes, got {text!r}") from None
    if not 0 <= value <= MAX_CHUNK_BYTES:
        raise argparse.ArgumentTypeError(f"must be 0..{MAX_CHUNK_BYTES}, got {text}")
    return value


# The default of --store, so that `serve` and `token create` find the same database.
STORE_ENV = "EPOCHMESH_STORE"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"state directory: database, blobs, address file (default ./{DEFAULT_DATA_DIR})",
    )
    parser.add_argument(
        "--store",
        default=os.environ.get(STORE_ENV, ""),
        metavar="URL",
        help="keep the coordinator's state in this PostgreSQL database: "
        "postgresql://USER@HOST:PORT/DB (default: $EPOCHMESH_STORE, else SQLite in the data "
        "directory; blobs and the CA stay in the data directory either way; a password is "
        "better given in PGPASSWORD or ~/.pgpass than on the command line)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="log verbosity (default INFO)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="log at DEBUG and keep gRPC's own C-core log lines on stderr (silenced "
        "otherwise, unless GRPC_VERBOSITY or GRPC_TRACE is set)",
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
        "--report-stalls",
        type=_non_negative_float,
        default=0.0,
        metavar="MS",
        help=(
            "log where the coordinator's event loop is when it runs nothing else for this many "
            "milliseconds (a stall delays every call); 0: off (default)"
        ),
    )
    parser.add_argument(
        "--max-heartbeats-per-second",
        type=_non_negative_float,
        default=DEFAULT_MAX_HEARTBEATS_PER_S,
        metavar="N",
        help=(
            "past this many heartbeats a second across all agents, agents are told to "
            "heartbeat less often and their leases last longer in proportion, so that a large "
            f"fleet cannot overload the coordinator; 0: never (default {DEFAULT_MAX_HEARTBEATS_PER_S:g})"
        ),
    )
    parser.add_argument(
        "--max-blob-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BLOB_BYTES,
        metavar="BYTES",
        help=f"largest blob accepted by UploadBlob (default {DEFAULT_MAX_BLOB_BYTES})",
    )
    parser.add_argument(
        "--blob-quota-bytes",
        type=_positive_int,
        default=DEFAULT_BLOB_QUOTA_BYTES,
        metavar="BYTES",
        help="bytes each identity may hold in uploaded blobs and partial uploads "
        f"(default {DEFAULT_BLOB_QUOTA_BYTES})",
    )
    parser.add_argument(
        "--max-upload-streams",
        type=_positive_int,
        default=8,
        metavar="N",
        help="concurrent UploadBlob streams per identity (default 8)",
    )
    parser.add_argument(
        "--max-upload-streams-total",
        type=_positive_int,
        default=256,
        metavar="N",
        help="concurrent UploadBlob streams in all (default 256)",
    )
    parser.add_argument(
        "--upload-idle-timeout",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="an upload stream silent this long is closed, its bytes kept (default 60)",
    )
    parser.add_argument(
        "--partial-upload-ttl",
        type=_positive_float,
        default=24 * 3600.0,
        metavar="SECONDS",
        help="a partial upload not written to this long is deleted (default 86400)",
    )
    parser.add_argument(
        "--max-watch-streams",
        type=_positive_int,
        default=32,
        metavar="N",
        help="concurrent WatchJob/WatchEvents streams per identity (default 32)",
    )
    parser.add_argument(
        "--max-watch-streams-total",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="concurrent WatchJob/WatchEvents streams in all (default 1024)",
    )
    parser.add_argument(
        "--max-fetch-streams",
        type=_positive_int,
        default=8,
        metavar="N",
        help="concurrent FetchBlob/DownloadResult streams per identity (default 8)",
    )
    parser.add_argument(
        "--max-fetch-streams-total",
        type=_positive_int,
        default=256,
        metavar="N",
        help="concurrent FetchBlob/DownloadResult streams in all (default 256)",
    )
    parser.add_argument(
        "--max-live-jobs",
        type=_positive_int,
        default=100,
        metavar="N",
        help="live jobs (queued, running, paused) one tenant may have; SubmitJob beyond is "
        "refused (default 100)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time calls in flight get to finish after SIGTERM (default 5)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext gRPC with no authentication (default: TLS with client "
        "certificates from the coordinator's own CA)",
    )
    parser.add_argument(
        "--advertise",
        action="append",
        default=[],
        metavar="HOST",
        help="host name or address clients use to reach this coordinator, written into the "
        "server certificate (repeatable); HOST:PORT also names the address a standby sends "
        "callers to while this coordinator is the active one on a shared PostgreSQL database "
        "(default: the listen address)",
    )
    parser.add_argument(
        "--blob-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the content-addressed blobs (programs, data sets, checkpoints) are kept "
        "(default DATA_DIR/blobs); coordinators sharing a PostgreSQL database give the same "
        "shared directory, and one holding another database's blobs is refused",
    )
    parser.add_argument(
        "--lease-timeout",
        type=float,
        default=DEFAULT_LEASE_TIMEOUT_S,
        metavar="SECONDS",
        help="on a shared PostgreSQL database: the active coordinator steps down when its lease "
        "connection is silent this long, and the server frees the lease of one it cannot hear "
        f"from after as long (default {DEFAULT_LEASE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--inline-params-max-bytes",
        type=_inline_bytes,
        default=MAX_CHUNK_BYTES,
        metavar="BYTES",
        help="parameter-server jobs whose parameters encode to at most this many bytes get "
        f"them inline with every task, saving agents a PullParameters call (0..{MAX_CHUNK_BYTES}"
        f", default {MAX_CHUNK_BYTES}; 0: never)",
    )
    parser.add_argument(
        "--program-check-timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="SubmitJob loads every program in a confined child process; a program that takes "
        f"longer is refused (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--program-check-memory",
        type=_positive_int,
        default=DEFAULT_MEMORY_BASE_BYTES,
        metavar="BYTES",
        help="memory that child may use, plus 4 x the program's and initial state's sizes "
        f"(default {DEFAULT_MEMORY_BASE_BYTES})",
    )
    parser.add_argument(
        "--program-check-concurrency",
        type=_positive_int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help=f"programs checked at once; later submissions wait (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument(
        "--no-program-check-spare",
        dest="program_check_spare",
        action="store_false",
        help="start each check's child on demand (about 3 s more per SubmitJob) instead of "
        "keeping one started (about 300 MB of memory) after the first submission",
    )
    parser.add_argument(
        "--program-check-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the checks' verdicts are kept by the program's and initial state's content, "
        "so that a program is not checked again after a restart (default "
        "DATA_DIR/program-checks); coordinators may share one",
    )
    parser.add_argument(
        "--scheduler-hold",
        type=_non_negative_float,
        default=None,
        metavar="SECONDS",
        help="a node a job just claimed stays with it this long against moves to jobs of the "
        "same priority (higher priorities may still take it); default: derived for each job "
        "and node, 3 of the job's rounds or 5 times the node's job benchmark, whichever is "
        "longer",
    )
    parser.add_argument(
        "--platform-fee",
        type=_fee_ppm,
        default=0,
        metavar="PERCENT",
        help="the platform's fee on what submitters pay donors, charged on top (donors earn "
        "their price), e.g. 2.5; default 0",
    )
    parser.add_argument(
        "--split",
        choices=("throughput", "equal"),
        default="throughput",
        help="how a round's global batch is split over nodes: in proportion to measured "
        "throughput (default), or equally (a baseline for benchmarks)",
    )
    parser.add_argument(
        "--http-listen",
        default=None,
        metavar="HOST:PORT",
        help=f"where to serve /metrics (Prometheus) and the read-only dashboard (default "
        f"{DEFAULT_HTTP_LISTEN}; port 0 picks a free one, written to DATA_DIR/http.addr; an "
        "empty value turns HTTP off). Any address but loopback requires a login with a "
        "submitter or operator join token",
    )
    parser.add_argument(
        "--http-login",
        action="store_true",
        help="require the dashboard login on a loopback address too",
    )
    parser.add_argument(
        "--metrics-retention",
        type=_non_negative_float,
        default=600.0,
        metavar="SECONDS",
        help="how long a finished job's metric series and round statistics are kept (default 600)",
    )
    add_retention_args(parser)


def _duration(text: str) -> float:
    value = duration_seconds(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a duration >= 0 such as 90, 30s, 15m, 2h or 30d, got {text!r}"
        )
    return value


def add_retention_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the garbage collector (coordinator/store/gc.py)."""
    parser.add_argument(
        "--keep-checkpoints",
        type=_positive_int,
        default=3,
        metavar="N",
        help="checkpoints kept per job not ended, besides the one a verification rollback may "
        "still need; an ended job keeps its last one and its result (default 3)",
    )
    parser.add_argument(
        "--event-retention",
        type=_duration,
        default=30 * 86400.0,
        metavar="DURATION",
        help="events older than this are deleted, except those of jobs not ended; 0 keeps "
        "them forever (default 30d)",
    )
    parser.add_argument(
        "--gc-interval",
        type=_duration,
        default=300.0,
        metavar="DURATION",
        help="garbage collection runs at start and this often (default 300s)",
    )
    parser.add_argument(
        "--gc-grace",
        type=_duration,
        default=24 * 3600.0,
        metavar="DURATION",
        help="a blob no job or checkpoint names is deleted once this old: an upload not yet "
        "submitted, the tensors of a checkpoint cut short by a crash (default 24h)",
    )
    parser.add_argument(
        "--gc-checkpoint-grace",
        type=_duration,
        default=10.0,
        metavar="DURATION",
        help="the tensors of a checkpoint the retention dropped are deleted this long after, "
        "when nothing names them again (default 10s)",
    )


def _fee_ppm(text: str) -> int:
    """A percentage with at most 4 decimals as parts per million (2.5 -> 25000)."""
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"the fee must be a percentage, got {text!r}") from None
    ppm = value * 10_000
    if not value.is_finite() or not 0 <= value <= 100 or ppm != ppm.to_integral_value():
        raise argparse.ArgumentTypeError(
            f"the fee must be a percentage within 0..100 with at most 4 decimals, got {text!r}"
        )
    return int(ppm)


def advertised_host(value: str) -> str:
    """The host of an --advertise value: HOST, [IPv6]:PORT or HOST:PORT (a bare IPv6 address
    stays whole)."""
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and (host.startswith("[") or ":" not in host):
        return host
    return value


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(
        data_dir=args.data_dir,
        store=args.store,
        listen=args.listen,
        heartbeat_interval_s=args.heartbeat_interval,
        lease_ttl_s=args.lease_ttl,
        max_heartbeats_per_s=args.max_heartbeats_per_second,
        report_stalls_ms=args.report_stalls,
        max_blob_bytes=args.max_blob_bytes,
        blob_quota_bytes=args.blob_quota_bytes,
        max_upload_streams=args.max_upload_streams,
        max_upload_streams_total=args.max_upload_streams_total,
        upload_idle_timeout_s=args.upload_idle_timeout,
        partial_upload_ttl_s=args.partial_upload_ttl,
        max_watch_streams=args.max_watch_streams,
        max_watch_streams_total=args.max_watch_streams_total,
        max_fetch_streams=args.max_fetch_streams,
        max_fetch_streams_total=args.max_fetch_streams_total,
        max_live_jobs=args.max_live_jobs,
        shutdown_grace_s=args.shutdown_grace,
        split=args.split,
        log_level=args.log_level,
        insecure=args.insecure,
        advertise=tuple(advertised_host(a) for a in args.advertise),
        advertise_address=next((a for a in args.advertise if advertised_host(a) != a), ""),
        lease_timeout_s=args.lease_timeout,
        blob_root=getattr(args, "blob_dir", None),
        inline_params_max_bytes=args.inline_params_max_bytes,
        program_check_timeout_s=args.program_check_timeout,
        program_check_memory_bytes=args.program_check_memory,
        program_check_concurrency=args.program_check_concurrency,
        program_check_spare=args.program_check_spare,
        program_check_cache_root=args.program_check_cache,
        scheduler_hold_s=args.scheduler_hold,
        platform_fee_ppm=args.platform_fee,
        http_listen=DEFAULT_HTTP_LISTEN if args.http_listen is None else args.http_listen.strip(),
        http_listen_strict=args.http_listen is not None,
        http_login=args.http_login,
        metrics_retention_s=args.metrics_retention,
        keep_checkpoints=args.keep_checkpoints,
        event_retention_s=args.event_retention,
        gc_interval_s=args.gc_interval,
        gc_blob_grace_s=args.gc_grace,
        gc_checkpoint_grace_s=args.gc_checkpoint_grace,
    )


def default_engine_factory() -> EngineFactory | None:
    """The training engine the console script runs with."""
    from coordinator.engine.engine import Engine

    return Engine


async def serve(config: CoordinatorConfig, engine_factory: EngineFactory | None = None) -> int:
    from coordinator.app import Coordinator

    coordinator = Coordinator(config, engine_factory=engine_factory or default_engine_factory())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A standby's start lasts until it holds the lease: a signal meanwhile ends it.
    starting = asyncio.create_task(coordinator.start())
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("signal received while standing by: shutting down")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    signalled.cancel()
    starting.result()
    # What the process holds once serving (its modules, torch among them: some 200,000
    # objects) lives as long as it does: moved out of the collector's sight, so that a full
    # collection scans only what came after (at 10,000 agents, full collections had taken
    # 150-330 ms each, every few seconds, stalling every call meanwhile).
    gc.collect()
    gc.freeze()
    watch = None
    if config.report_stalls_ms > 0:
        from coordinator.observability.stall_watch import StallWatch

        watch = StallWatch(config.report_stalls_ms / 1000)
        watch.start()
    try:
        # Losing the lease, the coordinator stands by again on its own (coordinator/app.py).
        await stop.wait()
        log.info("signal received: shutting down")
    finally:
        if watch is not None:
            await watch.stop()
        await coordinator.stop()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    try:
        if config.store:
            # Before the coordinator's own imports (seconds): a database it cannot use is
            # reported at once.
            from coordinator.store.postgres import probe

            asyncio.run(probe(config.store))
        return asyncio.run(serve(config))
    except (RuntimeError, CoordinatorError, OSError) as exc:
        log.error("coordinator failed to start: %s", exc)
        return 1


def add_token_args(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="token_action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="print a new join token")
    add_common_args(create)
    create.add_argument(
        "--role",
        required=True,
        choices=("node", "submitter", "operator"),
        help="what the token's holder becomes: a node agent, a job submitter, or an operator",
    )
    create.add_argument(
        "--ttl",
        default="24h",
        metavar="DURATION",
        help="how long the token stays valid, e.g. 30m, 24h, 7d (default 24h)",
    )
    uses = create.add_mutually_exclusive_group()
    uses.add_argument(
        "--uses",
        type=int,
        default=None,
        metavar="N",
        help="may enroll at most N holders until it expires (default: 1, a single use)",
    )
    uses.add_argument(
        "--reusable",
        action="store_true",
        help="may enroll any number of holders until it expires (prefer --uses N)",
    )
    create.add_argument(
        "--cert-ttl",
        default=None,
        metavar="DURATION",
        help="lifetime of the certificates it enrolls, e.g. 12h, 7d (default 30d, at most 90d, "
        "the coordinator's maximum); agents renew theirs before it ends",
    )
    create.add_argument(
        "--donor",
        default=None,
        metavar="NAME",
        help="role node only: the earnings of every node enrolled with this token go to "
        "the account donor:NAME (1-64 of A-Z a-z 0-9 . _ -; default: each node's own id)",
    )


async def _create_token(
    data_dir: Path,
    role: str,
    ttl_s: float,
    reusable: bool,
    donor: str,
    max_uses: int = 0,
    cert_ttl_s: float | None = None,
    store_url: str = "",
) -> str:
    from coordinator.core.config import CoordinatorConfig
    from coordinator.store.opening import open_store
    from coordinator.trust.tokens import DEFAULT_CERT_TTL_S, create_token, ensure_ca

    config = CoordinatorConfig(data_dir=data_dir, store=store_url)
    ca = None if store_url else ensure_ca(data_dir)
    store = await open_store(config.store, config.db_path)
    try:
        if ca is None:  # the CA every coordinator on the database shares
            from coordinator.store.postgres import PostgresStore
            from coordinator.trust.shared_ca import ensure_shared_ca

            assert isinstance(store, PostgresStore)
            ca = await ensure_shared_ca(store, data_dir)
        return await create_token(
            store,
            ca,
            role,
            ttl_s,
            reusable,
            donor,
            max_uses=max_uses,
            cert_ttl_s=DEFAULT_CERT_TTL_S if cert_ttl_s is None else cert_ttl_s,
        )
    finally:
        await store.close()


def run_token(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``token create``: the token on ``out`` (default stdout), errors logged; the exit code."""
    from coordinator.trust.tokens import check_donor, check_uses, parse_cert_ttl, parse_ttl

    try:
        ttl_s = parse_ttl(args.ttl)
    except ValueError as exc:
        log.error("invalid --ttl: %s", exc)
        return 2
    if args.uses is not None:
        try:
            check_uses(args.uses)
        except ValueError as exc:
            log.error("invalid --uses: %s", exc)
            return 2
    cert_ttl_s = None
    if args.cert_ttl is not None:
        try:
            cert_ttl_s = parse_cert_ttl(args.cert_ttl)
        except ValueError as exc:
            log.error("invalid --cert-ttl: %s", exc)
            return 2
    donor = ""
    if args.donor is not None:
        if args.role != "node":
            log.error("--donor is for node tokens only (--role node), not for --role %s", args.role)
            return 2
        try:
            donor = check_donor(args.donor)
        except ValueError as exc:
            log.error("invalid --donor: %s", exc)
            return 2
    try:
        token = asyncio.run(
            _create_token(
                args.data_dir,
                args.role,
                ttl_s,
                args.reusable,
                donor,
                args.uses or 0,
                cert_ttl_s,
                store_url=args.store,
            )
        )
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    except (RuntimeError, CoordinatorError, OSError) as exc:
        log.error("cannot create a token in %s: %s", args.data_dir, exc)
        return 1
    stream = sys.stdout if out is None else out
    stream.write(token + "\n")
    stream.flush()
    return 0


DEFAULT_DEV_DIR = Path(".epochmesh-dev")
DEFAULT_DEV_AGENTS = 2


def add_dev_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--agents",
        type=_positive_int,
        default=DEFAULT_DEV_AGENTS,
        metavar="N",
        help=f"agents to start (default {DEFAULT_DEV_AGENTS})",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DEV_DIR,
        metavar="DIR",
        help="everything of the cluster: DIR/coordinator (the coordinator's data dir), "
        "DIR/agent-N (each agent's), DIR/cli-config (the logged-in CLI's XDG_CONFIG_HOME) "
        f"and the logs; kept after it stops, reused by the next start (default ./{DEFAULT_DEV_DIR})",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where the coordinator serves gRPC (default 127.0.0.1:0: a free port, printed)",
    )
    parser.add_argument(
        "--http-listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="the dashboard and /metrics (default 127.0.0.1:0: a free port, printed; an empty "
        "value turns HTTP off)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="verbosity of this command's own log (default INFO); each process logs to its file",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="run the coordinator and the agents with --debug (DEBUG logs and gRPC's own log "
        "lines in their log files)",
    )


def run_dev(args: argparse.Namespace) -> int:
    from coordinator.local_cluster import run_dev as run_local_cluster

    return run_local_cluster(
        args.data_dir,
        args.agents,
        listen=args.listen,
        http_listen=args.http_listen.strip(),
        debug=args.debug,
    )


DEV_HELP = (
    "a coordinator and N agents on this machine (TLS, node tokens made here), a logged-in "
    "CLI, and the commands to use it printed; Ctrl-C stops them all"
)

SUBCOMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]
] = {
    "serve": ("run the coordinator (the default)", add_serve_args, run_serve),
    "token": ("manage join tokens (token create --role ROLE)", add_token_args, run_token),
    "dev": (DEV_HELP, add_dev_args, run_dev),
}


def serve_options_help() -> str:
    """The `serve` command's options as its own help shows them, for the top-level help."""
    serve = argparse.ArgumentParser(
        prog=f"epochmesh-coordinator [{DEFAULT_COMMAND}]", add_help=False
    )
    add_serve_args(serve)
    text = serve.format_help()
    return text[text.index("\n\n") + 2 :]  # the options, without the long usage line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epochmesh-coordinator",
        description="epochmesh coordinator: registers nodes, stores blobs, schedules training.\n"
        f"Without a command it serves: epochmesh-coordinator [{DEFAULT_COMMAND}] [OPTIONS], "
        "with the options below.",
        epilog=f"{DEFAULT_COMMAND} (the default command) takes these {serve_options_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    # Before anything imports grpc: its C core reads its log settings once, at import.
    quiet_grpc_core(args.debug)
    level = "DEBUG" if args.debug else args.log_level
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _, _, run = SUBCOMMANDS[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
