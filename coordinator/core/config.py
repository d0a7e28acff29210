"""Coordinator configuration: one immutable value built from the command line (or by tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epochmesh.limits import DEFAULT_MAX_BLOB_BYTES, MAX_CHUNK_BYTES
from epochmesh.program.inspection import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MEMORY_BASE_BYTES,
    DEFAULT_TIMEOUT_S,
)

DEFAULT_DATA_DIR = Path(".epochmesh")
DEFAULT_LISTEN = "127.0.0.1:7070"
DEFAULT_HTTP_LISTEN = "127.0.0.1:7080"
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_BLOB_QUOTA_BYTES = 50 << 30
DEFAULT_LEASE_TIMEOUT_S = 8.0

# A lease survives this many missed heartbeats, minus one.
LEASE_TTL_HEARTBEATS = 3.0
# Past this many heartbeats a second across the fleet, the coordinator stretches the interval
# (and the lease) it gives agents: about 0.45 of a core for the heartbeats themselves, TLS
# included, on the machine the control-plane benchmark ran on (docs/benchmarks.md).
DEFAULT_MAX_HEARTBEATS_PER_S = 500.0


@dataclass(frozen=True)
class CoordinatorConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    # Where the state lives: "" for SQLite in data_dir, or a postgresql://USER@HOST:PORT/DB URL.
    store: str = ""
    listen: str = DEFAULT_LISTEN
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    # None: LEASE_TTL_HEARTBEATS x heartbeat_interval_s (see `lease_ttl`).
    lease_ttl_s: float | None = None
    # Both stretched alike while the leased nodes would heartbeat more often than this a
    # second in all (0: never stretched; coordinator/nodes/registry.py).
    max_heartbeats_per_s: float = DEFAULT_MAX_HEARTBEATS_PER_S
    # Log the event loop's stack when it runs nothing for this long (0: off).
    report_stalls_ms: float = 0.0
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES
    # Heartbeat times are kept in memory and written to the store in batches this often.
    heartbeat_flush_interval_s: float = 1.0
    # How long in-flight calls may run on after SIGTERM before they are cancelled.
    shutdown_grace_s: float = 5.0
    # Upper bound of a NextTask long poll.
    max_long_poll_s: float = 30.0
    # Verification: the least time a node has for a checked part's sketches (a ring member for
    # its evidence of a round), and a checker for its recomputation, in seconds; more when
    # rounds are long (three and four rounds' time). A late checker is replaced without a
    # strike; a node late with its sketches is struck.
    sketch_wait_s: float = 10.0
    check_wait_s: float = 15.0
    # "throughput": b_i in proportion to measured speed; "equal": the baseline of benchmarks.
    split: str = "throughput"
    log_level: str = "INFO"
    # Plaintext gRPC without authentication (explicit opt-out of TLS).
    insecure: bool = False
    # Extra host names / addresses for the server certificate (--advertise).
    advertise: tuple[str, ...] = ()
    # On a shared PostgreSQL database (coordinator/ha/): the HOST:PORT standbys send callers to
    # while this coordinator is active ("": the listen address); the lease's silence limit and
    # how often a standby tries to take it.
    advertise_address: str = ""
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    lease_poll_s: float = 1.0
    # The content-addressed blob store (coordinator/store/blobs.py); None: DATA_DIR/blobs.
    # Coordinators sharing a database may share one (a shared filesystem), `blob_dir` below.
    blob_root: Path | None = None
    # Parameter-server rounds: parameters up to this many bytes (encoded) travel inline with
    # every task instead of through a PullParameters call; 0: always PullParameters.
    inline_params_max_bytes: int = MAX_CHUNK_BYTES
    # SubmitJob checks and loads every program in a confined child process (program_inspection):
    # wall-clock limit, memory (this + 4 x program and state sizes), children at once, and
    # whether one child is kept started for the next submission.
    program_check_timeout_s: float = DEFAULT_TIMEOUT_S
    program_check_memory_bytes: int = DEFAULT_MEMORY_BASE_BYTES
    program_check_concurrency: int = DEFAULT_CONCURRENCY
    program_check_spare: bool = True
    # Where the check's verdicts are kept by content (coordinator/engine/program_check_cache.py);
    # None: DATA_DIR/program-checks. Coordinators may share one.
    program_check_cache_root: Path | None = None
    # Cluster scheduler: a node a job just claimed stays with it this long against moves within
    # its priority tier (a higher tier may still take it). None: derived per job and node from
    # the job's round time and the node's job benchmark (coordinator/scheduling.hold_seconds).
    scheduler_hold_s: float | None = None
    # The market: the platform's fee in parts per million of what submitters pay donors,
    # charged on top (donors earn exactly their price).
    platform_fee_ppm: int = 0
    # The HTTP port: /metrics and the dashboard (coordinator/observability/http_server.py); empty: none.
    # A port taken is an error when ``http_listen_strict``, else a warning (the command line's
    # default address: a second coordinator on the machine still starts).
    http_listen: str = ""
    http_listen_strict: bool = True
    # Ask for a login (a join token) even when listening on loopback.
    http_login: bool = False
    # Per-job metric series and round statistics outlive their job by this long.
    metrics_retention_s: float = 600.0
    # Uploads (coordinator/store/blobs.py): bytes each identity may hold in blobs it uploaded plus
    # its partial uploads; concurrent UploadBlob streams per identity and in all; an upload
    # stream silent this long is closed (its bytes kept for a resume); a partial upload not
    # written to for this long is deleted (swept at start and every ttl/4, at most 10 min).
    blob_quota_bytes: int = DEFAULT_BLOB_QUOTA_BYTES
    max_upload_streams: int = 8
    max_upload_streams_total: int = 256
    upload_idle_timeout_s: float = 60.0
    partial_upload_ttl_s: float = 24 * 3600.0
    # WatchJob and WatchEvents streams open at once, per identity and in all.
    max_watch_streams: int = 32
    max_watch_streams_total: int = 1024
    # FetchBlob (nodes) and DownloadResult (submitters) streams open at once, per identity
    # and in all.
    max_fetch_streams: int = 8
    max_fetch_streams_total: int = 256
    # Live jobs (queued, running, paused) one tenant may have; SubmitJob beyond: refused.
    max_live_jobs: int = 100
    # Retention (coordinator/store/gc.py, a pass at start and every gc_interval_s):
    # checkpoints kept per job not ended (and the newest one a verification rollback may still
    # need; an ended job keeps its last); unreferenced blobs deleted after gc_blob_grace_s
    # (gc_checkpoint_grace_s for the tensors of a dropped checkpoint); events older than
    # event_retention_s deleted, except those of jobs not ended (0: kept forever).
    keep_checkpoints: int = 3
    gc_interval_s: float = 300.0
    gc_blob_grace_s: float = 24 * 3600.0
    gc_checkpoint_grace_s: float = 10.0
    event_retention_s: float = 30 * 86400.0

    def __post_init__(self) -> None:
        if self.store and not self.store.startswith(("postgresql://", "postgres://")):
            raise ValueError("--store must be a postgresql://USER@HOST:PORT/DB URL")
        if not 0 <= self.platform_fee_ppm <= 1_000_000:
            raise ValueError("the platform fee must be within 0..100 %")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat interval must be positive")
        if not (self.sketch_wait_s > 0 and self.check_wait_s > 0):
            raise ValueError("sketch_wait_s and check_wait_s must be positive")
        if not self.report_stalls_ms >= 0:
            raise ValueError("report_stalls_ms must be >= 0")
        if not self.max_heartbeats_per_s >= 0:
            raise ValueError("the heartbeat rate limit must be >= 0 (0: none)")
        if self.lease_timeout_s <= 0 or self.lease_poll_s <= 0:
            raise ValueError("the lease timeout and poll interval must be positive")
        if self.advertise_address:
            parse_listen(self.advertise_address)
        if self.scheduler_hold_s is not None and not self.scheduler_hold_s >= 0:
            raise ValueError("the scheduler's hold time must be >= 0")
        if self.lease_ttl_s is not None and self.lease_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"lease TTL ({self.lease_ttl_s}s) must exceed the heartbeat interval "
                f"({self.heartbeat_interval_s}s)"
            )
        if self.max_blob_bytes <= 0:
            raise ValueError("max blob bytes must be positive")
        if self.heartbeat_flush_interval_s <= 0:
            raise ValueError("heartbeat flush interval must be positive")
        if self.split not in ("throughput", "equal"):
            raise ValueError(f"split must be 'throughput' or 'equal', not {self.split!r}")
        if not 0 <= self.inline_params_max_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"inline params max bytes must be 0..{MAX_CHUNK_BYTES}")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown grace must not be negative")
        if not self.program_check_timeout_s > 0:
            raise ValueError("program check timeout must be positive")
        if self.program_check_memory_bytes <= 0:
            raise ValueError("program check memory must be positive")
        if self.program_check_concurrency < 1:
            raise ValueError("program check concurrency must be at least 1")
        parse_listen(self.listen)
        if self.http_listen:
            parse_listen(self.http_listen)
        if not self.metrics_retention_s >= 0:
            raise ValueError("the metrics retention must be >= 0")
        if self.blob_quota_bytes <= 0:
            raise ValueError("the blob quota must be positive")
        if min(self.max_upload_streams, self.max_upload_streams_total) < 1:
            raise ValueError("the upload stream caps must be at least 1")
        if min(self.max_watch_streams, self.max_watch_streams_total) < 1:
            raise ValueError("the watch stream caps must be at least 1")
        if min(self.max_fetch_streams, self.max_fetch_streams_total) < 1:
            raise ValueError("the fetch stream caps must be at least 1")
        if self.max_live_jobs < 1:
            raise ValueError("the cap on live jobs per tenant must be at least 1")
        if not self.upload_idle_timeout_s > 0:
            raise ValueError("the upload idle timeout must be positive")
        if self.keep_checkpoints < 1:
            raise ValueError("at least one checkpoint per job must be kept")
        if not self.gc_interval_s > 0:
            raise ValueError("the garbage collection interval must be positive")
        if not min(self.gc_blob_grace_s, self.gc_checkpoint_grace_s, self.event_retention_s) >= 0:
            raise ValueError("grace and retention periods must be >= 0")
        if not self.partial_upload_ttl_s > 0:
            raise ValueError("the partial upload TTL must be positive")

    @property
    def lease_ttl(self) -> float:
        if self.lease_ttl_s is not None:
            return self.lease_ttl_s
        return LEASE_TTL_HEARTBEATS * self.heartbeat_interval_s

    @property
    def db_path(self) -> Path:
        return self.data_dir / "coordinator.db"

    @property
    def program_check_cache(self) -> Path:
        if self.program_check_cache_root is not None:
            return self.program_check_cache_root
        return self.data_dir / "program-checks"

    @property
    def blob_dir(self) -> Path:
        return self.blob_root if self.blob_root is not None else self.data_dir / "blobs"

    @property
    def addr_file(self) -> Path:
        return self.data_dir / "coordinator.addr"

    @property
    def http_addr_file(self) -> Path:
        return self.data_dir / "http.addr"

    @property
    def ca_cert_path(self) -> Path:
        return self.data_dir / "ca.pem"

    @property
    def lock_file(self) -> Path:
        return self.data_dir / "coordinator.lock"


def parse_listen(listen: str) -> tuple[str, int]:
    """Split HOST:PORT (IPv6 as [::1]:PORT); port 0 means any free port."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"listen address must be HOST:PORT, got {listen!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"listen port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"listen port out of range: {port}")
    return host, port
