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

TLS is on unless ``config.insecure``: the CA in the data dir (coordinator/trust/tokens.py) issues the
server certificate (a key of its own); IdentityService (enrollment) is served; every AgentService, JobService and
SchedulerService call is authenticated and role-checked first (coordinator/trust/auth.py), and the
caller's principal is available to handlers through ``coordinator.trust.auth.current_principal()``.

Every RPC handler is wrapped (`service_handlers`): a request that does not parse is answered
INVALID_ARGUMENT; a `CoordinatorError` becomes its status code with its message; the shared
library's input errors (epochmesh.errors SpecError, CodecError, ProgramError) become
INVALID_ARGUMENT; any other exception is logged and answered INTERNAL — the server keeps
serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.api.agent_service import AgentService
from coordinator.api.identity_service import IdentityService
from coordinator.api.job_service import JobService, watch_caps
from coordinator.api.market_service import MarketService
from coordinator.api.scheduler_service import SchedulerService
from coordinator.core.config import CoordinatorConfig, parse_listen
from coordinator.core.stream_caps import StreamCaps, fetch_caps
from coordinator.engine.api import CoordinatorContext, EngineFactory, NullEngine, TrainingEngine
from coordinator.market.credit_ledger import CreditLedger
from coordinator.nodes.registry import NodeRegistry
from coordinator.observability.cluster_view import ClusterView
from coordinator.observability.dashboard_access import is_loopback_host, login_required
from coordinator.observability.http_server import DashboardBackend, HttpServer
from coordinator.observability.metrics import CoordinatorMetrics
from coordinator.store.base import CoordinatorError, InvalidArgumentError
from coordinator.store.blobs import BlobStore, UploadLimits
from coordinator.store.events import EventLog
from coordinator.store.gc import (
    GarbageCollector,
    engine_rollback_floor,
    retention_policy,
)
from coordinator.store.sqlite import SqliteStore
from coordinator.trust.auth import Authorizer, set_principal
from coordinator.trust.tokens import (
    CertificateAuthority,
    ensure_ca,
    ensure_data_dir,
    ensure_server_certificate,
    issue_identity,
)
from epochmesh.errors import CodecError, ProgramError, SpecError
from epochmesh.grpc_util import SERVER_OPTIONS
from epochmesh.identity import Identity, coordinator_server_credentials
from epochmesh.v1 import agent_pb2, identity_pb2, job_pb2, market_pb2, scheduler_pb2

log = logging.getLogger(__name__)

AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
JOB_SERVICE = job_pb2.DESCRIPTOR.services_by_name["JobService"]
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"]
MARKET_SERVICE = market_pb2.DESCRIPTOR.services_by_name["MarketService"]
IDENTITY_SERVICE = identity_pb2.DESCRIPTOR.services_by_name["IdentityService"]
# The identity service last: a coordinator without TLS does not serve it.
SERVICE_NAMES = tuple(
    s.full_name
    for s in (AGENT_SERVICE, JOB_SERVICE, SCHEDULER_SERVICE, MARKET_SERVICE, IDENTITY_SERVICE)
)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# -- handler wrapping -------------------------------------------------------------------------

# Errors of the shared library that mean "the caller sent bad data".
INPUT_ERRORS = (SpecError, CodecError, ProgramError)


class _Malformed:
    """Stands in for a request whose bytes are not a valid message of the expected type."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error

    def exception(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"malformed {self.type_name} message: {self.error}")


def _deserializer(cls: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            return _Malformed(cls.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)

    return parse


async def _abort_for(exc: Exception, ctx: grpc.aio.ServicerContext, method: str) -> NoReturn:
    if isinstance(exc, INPUT_ERRORS):
        log.debug("%s -> INVALID_ARGUMENT: %s", method, exc)
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, CoordinatorError):
        code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed: %s", method, exc)
        else:
            log.debug("%s -> %s: %s", method, code.name, exc)
        await ctx.abort(code, str(exc))
    log.exception("unexpected error in %s", method, exc_info=exc)
    await ctx.abort(
        grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"
    )
    raise AssertionError("unreachable: abort raises")


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            raise request.exception()
        yield request


def _wrap(
    method: str,
    fn: Callable[..., Any],
    client_stream: bool,
    server_stream: bool,
    authorizer: Authorizer | None = None,
) -> Any:
    def authorize(ctx: grpc.aio.ServicerContext) -> None:
        if authorizer is not None:
            set_principal(authorizer.check(method, ctx))

    if server_stream:

        async def stream_handler(request: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                authorize(ctx)
                if client_stream:
                    request = _checked_stream(request)
                elif isinstance(request, _Malformed):
                    raise request.exception()
                async for response in fn(request, ctx):
                    yield response
            except grpc.aio.BaseError:
                raise
            except Exception as exc:
                await _abort_for(exc, ctx, method)

        return stream_handler

    async def unary_handler(request: Any, ctx: grpc.aio.ServicerContext) -> Any:
        try:
            authorize(ctx)
            if client_stream:
                request = _checked_stream(request)
            elif isinstance(request, _Malformed):
                raise request.exception()
            return await fn(request, ctx)
        except grpc.aio.BaseError:
            raise
        except Exception as exc:
            await _abort_for(exc, ctx, method)

    return unary_handler


def service_handlers(
    service: ServiceDescriptor, servicer: object, authorizer: Authorizer | None = None
) -> dict[str, grpc.RpcMethodHandler]:
    """Method handlers for ``service`` calling ``servicer.<RpcName>(request, context)``,
    wrapped with the role check (when ``authorizer`` is given), malformed-input checks and
    error mapping."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        fn = getattr(servicer, method.name, None)
        if fn is None:
            raise TypeError(f"{type(servicer).__name__} does not implement {method.name}")
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        full = f"{service.full_name}/{method.name}"
        cs, ss = method.client_streaming, method.server_streaming
        wrapped = _wrap(full, fn, cs, ss, authorizer)
        kwargs: dict[str, Any] = {
            "request_deserializer": _deserializer(req_cls),
            "response_serializer": resp_cls.SerializeToString,
        }
        if cs and ss:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(wrapped, **kwargs)
        elif cs:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(wrapped, **kwargs)
        elif ss:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(wrapped, **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(wrapped, **kwargs)
    return handlers


def add_service(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    servicer: object,
    authorizer: Authorizer | None = None,
) -> None:
    handlers = service_handlers(service, servicer, authorizer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


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
        self._cleanup = contextlib.AsyncExitStack()
        self._started = False
        self._stopped = False
        self.store: SqliteStore
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
            await self._cleanup.aclose()
            raise

    async def _start(self) -> None:
        cfg = self.config
        host, _ = parse_listen(cfg.listen)
        ensure_data_dir(cfg.data_dir)
        lock = DataDirLock(cfg.lock_file)
        lock.acquire()
        self._cleanup.callback(lock.release)
        # The trust root first: an incomplete one stops the start before anything is touched.
        ca = None if cfg.insecure else ensure_ca(cfg.data_dir)

        self.store = await SqliteStore.open(cfg.db_path)
        self._cleanup.push_async_callback(self.store.close)
        self.events = EventLog(self.store)
        await self.events.start()
        self._cleanup.callback(self.events.close)
        self.blobs = BlobStore(
            cfg.blob_dir,
            self.store,
            max_blob_bytes=cfg.max_blob_bytes,
            events=self.events,
            limits=UploadLimits.from_config(cfg),
        )
        await self.blobs.start()
        self._cleanup.push_async_callback(self.blobs.stop)
        self.registry = NodeRegistry(
            self.store,
            self.events,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            lease_ttl_s=cfg.lease_ttl,
            flush_interval_s=cfg.heartbeat_flush_interval_s,
        )
        await self.registry.load()
        self.credits = CreditLedger(self.store)
        await self.credits.reload()

        factory: EngineFactory = self._engine_factory or NullEngine
        self.engine = factory(self.context)
        self.registry.add_offline_listener(self.engine.on_node_offline)

        if ca is not None:
            self.ca = ensure_server_certificate(cfg.data_dir, ca, cfg.advertise)
            self.authorizer = Authorizer(self.ca.cert_pem, await self.store.list_revocations())
        auth = self.authorizer
        if cfg.http_listen:
            self.metrics = CoordinatorMetrics()
        interceptors = [self.metrics.grpc] if self.metrics is not None else []
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self._server = server
        fetchers = self.fetchers = fetch_caps(cfg.max_fetch_streams, cfg.max_fetch_streams_total)
        add_service(
            server,
            AGENT_SERVICE,
            AgentService(self.registry, self.blobs, self.engine, fetchers),
            auth,
        )
        watchers = self.watchers = watch_caps(cfg.max_watch_streams, cfg.max_watch_streams_total)
        add_service(
            server,
            JOB_SERVICE,
            JobService(self.store, self.blobs, self.engine, watchers, fetchers),
            auth,
        )
        add_service(
            server,
            SCHEDULER_SERVICE,
            SchedulerService(
                self.registry, self.store, self.blobs, self.events, self.engine, auth, watchers
            ),
            auth,
        )
        add_service(
            server, MARKET_SERVICE, MarketService(self.store, self.credits, self.engine), auth
        )
        if self.ca is not None:
            # No role check: the join token is the credential.
            identity_service = IdentityService(self.store, self.ca, self.events, self.authorizer)
            add_service(server, IDENTITY_SERVICE, identity_service)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        served = SERVICE_NAMES if self.ca is not None else SERVICE_NAMES[:-1]
        reflection.enable_server_reflection(
            (*served, HEALTH_SERVICE, reflection.SERVICE_NAME), server
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

        self.registry.start()
        self._cleanup.push_async_callback(self.registry.stop)
        await self.engine.start()
        self._cleanup.push_async_callback(self.engine.stop)
        self.gc = GarbageCollector(
            self.store,
            self.blobs,
            retention_policy(cfg),
            interval_s=cfg.gc_interval_s,
            rollback_floor=engine_rollback_floor(self.engine),
        )
        self.gc.start()
        self._cleanup.push_async_callback(self.gc.stop)
        if self.metrics is not None:
            self._start_http(self.metrics)
        for name in ("", *served):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.events.append(
            "coordinator.started",
            message=f"coordinator listening on {self.address}",
            attrs={"address": self.address, "schema_version": str(self.store.schema_version)},
        )
        write_atomically(cfg.addr_file, self.address + "\n")
        self._cleanup.callback(cfg.addr_file.unlink, missing_ok=True)
        log.info(
            "coordinator serving on %s (data dir %s, %d nodes known)",
            self.address,
            cfg.data_dir,
            len(self.registry),
        )

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
        http = HttpServer(host, port, backend)
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
        self._cleanup.push_async_callback(asyncio.to_thread, http.stop)
        write_atomically(cfg.http_addr_file, http.address + "\n")
        self._cleanup.callback(cfg.http_addr_file.unlink, missing_ok=True)
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
        grace = self.config.shutdown_grace_s if grace is None else grace
        log.info("coordinator stopping (grace %.1fs)", grace)
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("health", self.health.enter_graceful_shutdown),
            ("event", lambda: self.events.append("coordinator.stopping", message="stopping")),
        ]
        for what, step in steps:
            try:
                await step()
            except Exception:
                log.exception("shutdown step %s failed", what)
        self.shutdown.set()
        self.events.close()
        await self._server.stop(grace)
        await self._cleanup.aclose()
        log.info("coordinator stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
