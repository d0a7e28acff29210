"""The coordinator's gRPC server and its wiring.

`Coordinator(config, engine_factory=None)` owns everything: the data-dir lock, the SQLite
store, the event log, the blob store, the node registry (with its lease sweeper and heartbeat
flusher), the training engine (`NullEngine` unless a factory is given; see
coordinator/engine/api.py for the factory contract), and a grpc.aio server with AgentService,
JobService, SchedulerService, grpc.health.v1 and server reflection.

    coord = Coordinator(CoordinatorConfig(data_dir=Path("d"), listen="127.0.0.1:0"))
    await coord.start()          # coord.address == "127.0.0.1:PORT", DATA_DIR/coordinator.addr
    ...
    await coord.stop()           # health NOT_SERVING, stop accepting, grace, close the store

TLS is on unless ``config.insecure``: the CA in the data dir (coordinator/trust/tokens.py)
issues the server certificate (a key of its own); IdentityService (enrollment) is served; every
AgentService, JobService and SchedulerService call is authenticated and role-checked first
(coordinator/trust/auth.py), and the caller's principal is available to handlers through
``coordinator.core.principal.current_principal()``.

On PostgreSQL several coordinators may share one database (coordinator/ha/): each listens at
once, serving health NOT_SERVING and answering every other call UNAVAILABLE with the active
one's address (`ServingGate`) while it waits for the lease; the one holding the lease loads
the state and serves, as a restart does, and its store refuses every write once the lease is
lost (fencing epoch). Losing the lease (its connection ended, the database gone), it steps
down in the same process: health NOT_SERVING, calls refused, and what serving started (engine,
registry, collector, blob store, event log, HTTP port) stopped, `stepped_down` set; then it
stands by for the lease like any standby and serves again once it holds it. They share one CA,
kept in the database (coordinator/trust/shared_ca.py), and may share one blob directory
(``--blob-dir``, marked as the database's: coordinator/ha/blob_dir.py), in which only the
active one collects garbage.

Every RPC handler is wrapped (coordinator/api/handlers.py `service_handlers`): a request that
does not parse is answered INVALID_ARGUMENT, a `CoordinatorError` becomes its status code, any
other exception INTERNAL; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.api.agent_service import AgentService
from coordinator.api.handlers import (
    AGENT_SERVICE,
    HEALTH_SERVICE,
    IDENTITY_SERVICE,
    JOB_SERVICE,
    MARKET_SERVICE,
    SCHEDULER_SERVICE,
    SERVICE_NAMES,
)
from coordinator.api.identity_service import IdentityService
from coordinator.api.job_service import JobService
from coordinator.api.market_service import MarketService
from coordinator.api.queries import watch_caps
from coordinator.api.scheduler_service import SchedulerService
from coordinator.core.config import CoordinatorConfig, parse_listen
from coordinator.core.errors import FencedError
from coordinator.core.stream_caps import StreamCaps, fetch_caps
from coordinator.engine.api import CoordinatorContext, EngineFactory, NullEngine, TrainingEngine
from coordinator.ha.blob_dir import claim_blob_dir
from coordinator.ha.gate import ServingGate
from coordinator.ha.lease import LeaseRow, PostgresLease
from coordinator.market.credit_ledger import CreditLedger
from coordinator.nodes.registry import NodeRegistry
from coordinator.observability.cluster_view import ClusterView
from coordinator.observability.dashboard_access import is_loopback_host, login_required
from coordinator.observability.http_server import DashboardBackend, HttpServer
from coordinator.observability.metrics import CoordinatorMetrics
from coordinator.store.base import Store
from coordinator.store.blobs import BlobStore, UploadLimits
from coordinator.store.events import EventLog
from coordinator.store.gc import (
    GarbageCollector,
    engine_rollback_floor,
    retention_policy,
)
from coordinator.store.opening import POSTGRES_SCHEMES, open_store
from coordinator.store.postgres import PostgresStore, redact_url
from coordinator.trust.auth import Authorizer
from coordinator.trust.shared_ca import ensure_shared_ca
from coordinator.trust.tokens import (
    CertificateAuthority,
    ensure_ca,
    ensure_data_dir,
    ensure_server_certificate,
    issue_identity,
)
from epochmesh.grpc_util import SERVER_OPTIONS
from epochmesh.identity import Identity, coordinator_server_credentials

log = logging.getLogger(__name__)


# -- the coordinator --------------------------------------------------------------------------


class DataDirLock:
    """An exclusive flock on DATA_DIR/coordinator.lock (released by the OS on kill -9)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeError(
                f"data dir {self._path.parent} is in use by another coordinator (pid {holder})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Coordinator:
    """The whole coordinator, in-process. `start` then `stop`; `address` once started."""

    def __init__(
        self, config: CoordinatorConfig, engine_factory: EngineFactory | None = None
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self.address = ""
        self.shutdown = asyncio.Event()
        # Set while a coordinator that lost the lease on a shared database stands by again.
        self.stepped_down = asyncio.Event()
        self.gate = ServingGate()
        self.lease: PostgresLease | None = None
        self._cleanup = contextlib.AsyncExitStack()
        # What `_serve` started: closed when stepping down, and before `_cleanup` at the end.
        self._serving = contextlib.AsyncExitStack()
        self._lease_keeper: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False
        self.store: Store
        self.events: EventLog
        self.blobs: BlobStore
        self.registry: NodeRegistry
        self.credits: CreditLedger
        self.engine: TrainingEngine
        # WatchJob and WatchEvents streams open now (per identity, capped).
        self.watchers: StreamCaps
        self.fetchers: StreamCaps
        self.gc: GarbageCollector | None = None
        self.health: health.aio.HealthServicer
        self._served: tuple[str, ...] = ()
        self._server: grpc.aio.Server
        # None with --insecure.
        self.ca: CertificateAuthority | None = None
        self.authorizer: Authorizer | None = None
        # The HTTP port (--http-listen): None when off.
        self.metrics: CoordinatorMetrics | None = None
        self.http: HttpServer | None = None
        self.http_address = ""

    @property
    def context(self) -> CoordinatorContext:
        return CoordinatorContext(
            config=self.config,
            store=self.store,
            blobs=self.blobs,
            registry=self.registry,
            events=self.events,
            shutdown=self.shutdown,
            credits=self.credits,
        )

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("coordinator already started")
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self._serving.aclose()
            await self._cleanup.aclose()
            raise

    async def _start(self) -> None:
        cfg = self.config
        ensure_data_dir(cfg.data_dir)
        lock = DataDirLock(cfg.lock_file)
        lock.acquire()
        self._cleanup.callback(lock.release)
        shared = cfg.store.startswith(POSTGRES_SCHEMES)
        # The trust root first: an incomplete one stops the start before anything is touched.
        ca = None if cfg.insecure or shared else ensure_ca(cfg.data_dir)
        self.store = await open_store(cfg.store, cfg.db_path)
        self._cleanup.push_async_callback(self.store.close)
        if shared and not cfg.insecure:
            assert isinstance(self.store, PostgresStore)
            ca = await ensure_shared_ca(self.store, cfg.data_dir)
        if ca is not None:
            self.ca = ensure_server_certificate(cfg.data_dir, ca, cfg.advertise)
        database = redact_url(cfg.store) if shared else str(cfg.db_path)
        await claim_blob_dir(self.store, cfg.blob_dir, database)
        if cfg.http_listen:
            self.metrics = CoordinatorMetrics()
        await self._listen()
        if shared:
            self._make_lease()
            await self._acquire_lease()
        await self._serve()
        if self.lease is not None:
            self._lease_keeper = asyncio.create_task(self._keep_lease(), name="lease-keeper")

    async def _listen(self) -> None:
        """The gRPC server, its port open, every call but health refused (`ServingGate`)."""
        cfg = self.config
        host, _ = parse_listen(cfg.listen)
        interceptors = [self.metrics.grpc] if self.metrics is not None else []
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self._server = server
        server.add_generic_rpc_handlers((self.gate,))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self._served = SERVICE_NAMES if self.ca is not None else SERVICE_NAMES[:-1]
        for name in ("", *self._served):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (*self._served, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        try:
            if self.ca is None:
                log.warning(
                    "--insecure: serving PLAINTEXT gRPC on %s with no authentication; anyone "
                    "who can reach it can act as any node, submitter or operator",
                    cfg.listen,
                )
                port = server.add_insecure_port(cfg.listen)
            else:
                creds = coordinator_server_credentials(
                    self.ca.cert_pem, self.ca.server_key_pem, self.ca.server_cert_pem
                )
                port = server.add_secure_port(cfg.listen, creds)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {cfg.listen}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot listen on {cfg.listen}")
        await server.start()
        self._cleanup.push_async_callback(server.stop, 0)
        self.address = f"{host}:{port}"
        write_atomically(cfg.addr_file, self.address + "\n")
        self._cleanup.callback(cfg.addr_file.unlink, missing_ok=True)

    def _make_lease(self) -> None:
        cfg = self.config
        self.lease = PostgresLease(
            cfg.store,
            f"{socket.gethostname()}/{os.getpid()}",
            cfg.advertise_address or self.address,
            poll_s=cfg.lease_poll_s,
            timeout_s=cfg.lease_timeout_s,
        )
        self._cleanup.push_async_callback(self.lease.close)

    async def _acquire_lease(self) -> None:
        """Stand by until this coordinator holds the database's lease; then fence the store
        with it."""
        lease = self.lease
        assert lease is not None and isinstance(self.store, PostgresStore)
        log.info("waiting for the coordinator lease (standby until it is free) on %s", self.address)

        def standby(row: LeaseRow) -> None:
            self.gate.active_address = row.address

        await lease.acquire(standby)
        self.store.fence(lease.epoch, lease.held)

    async def _keep_lease(self) -> None:
        """While the coordinator runs: watch the lease; lost, step down, stand by for it
        again and serve again once it is back."""
        lease = self.lease
        assert lease is not None
        while not self._stopped:
            reason = await lease.watch()
            if self._stopped:
                return
            await self._step_down(reason)
            while not self._stopped:
                await self._acquire_lease()
                if self._stopped:
                    return
                try:
                    await self._serve()
                except Exception as exc:  # noqa: BLE001 - e.g. the database gone again
                    log.exception("serving again after taking the lease back failed")
                    await self._step_down(f"serving again failed ({exc})")
                    await asyncio.sleep(lease.poll_s)
                    continue
                self.stepped_down.clear()
                break

    async def _step_down(self, reason: str) -> None:
        """Stop serving at once (the store refuses writes already: fencing) and stop what
        serving started; the caller then stands by for the lease."""
        log.error("stepping down: %s; the store writes nothing more", reason)
        self.stepped_down.set()
        self.gate.close()
        for name in ("", *self._served):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.shutdown.set()  # long polls and watchers end
        if self.lease is not None:
            await self.lease.close()  # a lock held on a live connection goes too
        serving, self._serving = self._serving, contextlib.AsyncExitStack()
        try:
            await serving.aclose()
        except FencedError as exc:  # e.g. the last heartbeats: the next active one reloads
            log.warning("what this coordinator served could not write its last state: %s", exc)
        except Exception:  # the next takeover starts afresh all the same
            log.exception("stopping what this coordinator served failed")
        self.shutdown = asyncio.Event()
        log.info("standing by for the coordinator lease again on %s", self.address)

    async def _serve(self) -> None:
        """Load the state from the store and open the gate: what a start does, on a
        standby's takeover too."""
        cfg = self.config
        serving = self._serving
        self.events = EventLog(self.store)
        await self.events.start()
        serving.callback(self.events.close)
        self.blobs = BlobStore(
            cfg.blob_dir,
            self.store,
            max_blob_bytes=cfg.max_blob_bytes,
            events=self.events,
            limits=UploadLimits.from_config(cfg),
        )
        await self.blobs.start()
        serving.push_async_callback(self.blobs.stop)
        self.registry = NodeRegistry(
            self.store,
            self.events,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            lease_ttl_s=cfg.lease_ttl,
            max_heartbeats_per_s=cfg.max_heartbeats_per_s,
            flush_interval_s=cfg.heartbeat_flush_interval_s,
        )
        await self.registry.load()
        self.credits = CreditLedger(self.store)
        await self.credits.reload()

        factory: EngineFactory = self._engine_factory or NullEngine
        self.engine = factory(self.context)
        self.registry.add_offline_listener(self.engine.on_node_offline)

        if self.ca is not None:
            self.authorizer = Authorizer(self.ca.cert_pem, await self.store.list_revocations())
        auth = self.authorizer
        if self.metrics is not None:
            self.metrics.attach_event_drops(lambda: self.events.dropped_total)
        gate = self.gate
        fetchers = self.fetchers = fetch_caps(cfg.max_fetch_streams, cfg.max_fetch_streams_total)
        gate.install(
            AGENT_SERVICE, AgentService(self.registry, self.blobs, self.engine, fetchers), auth
        )
        watchers = self.watchers = watch_caps(cfg.max_watch_streams, cfg.max_watch_streams_total)
        gate.install(
            JOB_SERVICE,
            JobService(self.store, self.blobs, self.engine, watchers, fetchers, cfg.max_live_jobs),
            auth,
        )
        gate.install(
            SCHEDULER_SERVICE,
            SchedulerService(
                self.registry,
                self.store,
                self.blobs,
                self.events,
                self.engine,
                auth,
                watchers,
                fee_ppm=self.config.platform_fee_ppm,
            ),
            auth,
        )
        gate.install(MARKET_SERVICE, MarketService(self.store, self.credits, self.engine), auth)
        if self.ca is not None:
            # No role check: the join token is the credential.
            gate.install(
                IDENTITY_SERVICE,
                IdentityService(self.store, self.ca, self.events, self.authorizer),
            )

        self.registry.start()
        serving.push_async_callback(self.registry.stop)
        await self.engine.start()
        serving.push_async_callback(self.engine.stop)
        self.gc = GarbageCollector(
            self.store,
            self.blobs,
            retention_policy(cfg),
            interval_s=cfg.gc_interval_s,
            rollback_floor=engine_rollback_floor(self.engine),
            may_collect=self._may_collect,
        )
        self.gc.start()
        serving.push_async_callback(self.gc.stop)
        if self.metrics is not None:
            self._start_http(self.metrics)
        gate.open()
        for name in ("", *self._served):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        attrs = {"address": self.address, "schema_version": str(self.store.schema_version)}
        if self.lease is not None:
            attrs["lease_epoch"] = str(self.lease.epoch)
        await self.events.append(
            "coordinator.started",
            message=f"coordinator listening on {self.address}",
            attrs=attrs,
        )
        log.info(
            "coordinator serving on %s (data dir %s, %d nodes known)",
            self.address,
            cfg.data_dir,
            len(self.registry),
        )

    def _may_collect(self) -> bool:
        """Whether the garbage collector may delete: always alone, only with the lease held
        on a shared database (a shared blob directory included)."""
        return self.lease is None or self.lease.held()

    def _start_http(self, metrics: CoordinatorMetrics) -> None:
        """The metrics and dashboard port, in threads of its own (coordinator/observability/http_server.py)."""
        cfg = self.config
        host, port = parse_listen(cfg.http_listen)
        login = login_required(host, cfg.http_login, cfg.insecure)
        authorizer = self.authorizer
        backend = DashboardBackend(
            asyncio.get_running_loop(),
            ClusterView(
                self.registry,
                self.store,
                self.engine,
                self.credits,
                retention_s=cfg.metrics_retention_s,
            ),
            metrics,
            self.store,
            self.ca,
            login,
            authorizer.is_revoked if authorizer is not None else (lambda _: False),
            authorizer,
        )
        http = HttpServer(host, port, backend, cfg.advertise)
        try:
            http.start()
        except OSError as exc:
            if cfg.http_listen_strict:
                raise RuntimeError(
                    f"cannot listen on --http-listen {cfg.http_listen}: {exc}"
                ) from exc
            log.warning(
                "no metrics or dashboard: cannot listen on %s (%s); pass --http-listen HOST:PORT "
                "(or an empty value to turn HTTP off)",
                cfg.http_listen,
                exc,
            )
            return
        self.http = http
        self.http_address = http.address
        self._serving.push_async_callback(asyncio.to_thread, http.stop)
        write_atomically(cfg.http_addr_file, http.address + "\n")
        self._serving.callback(cfg.http_addr_file.unlink, missing_ok=True)
        log.info(
            "metrics and dashboard on http://%s/ (%s)",
            http.address,
            "login with a join token required" if login else "no login: loopback or --insecure",
        )
        if cfg.insecure and not is_loopback_host(host):
            log.warning("--insecure: the dashboard on %s asks nobody to log in", http.address)

    def issue_identity(self, role: str, principal: str = "") -> Identity:
        """A key and certificate for ``role`` straight from this coordinator's CA (tests and
        local tools; remote parties enroll with a join token instead)."""
        if self.ca is None:
            raise RuntimeError("the coordinator runs --insecure: it has no CA")
        return issue_identity(self.ca, role, principal)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: health NOT_SERVING for every service, the engine and watchers told
        to finish, no new calls, ``grace`` seconds (default config.shutdown_grace_s) for calls
        in flight, then engine, registry (final heartbeat flush) and store are closed."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        keeper, self._lease_keeper = self._lease_keeper, None
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        grace = self.config.shutdown_grace_s if grace is None else grace
        log.info("coordinator stopping (grace %.1fs)", grace)
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("health", self.health.enter_graceful_shutdown),
        ]
        if self.gate.active:  # the store is fenced once the lease is lost
            steps.append(
                ("event", lambda: self.events.append("coordinator.stopping", message="stopping"))
            )
        for what, step in steps:
            try:
                await step()
            except Exception:
                log.exception("shutdown step %s failed", what)
        self.shutdown.set()
        self.events.close()
        await self._server.stop(grace)
        await self._serving.aclose()
        await self._cleanup.aclose()
        log.info("coordinator stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
