"""The coordinator's HTTP port (``--http-listen``, default 127.0.0.1:7080): ``/metrics`` in the
Prometheus text format, the read-only dashboard (static files from coordinator/dashboard/) and
its small JSON API.

    GET  /                      the cluster overview (nodes, jobs, events)
    GET  /jobs/JOB              a job's page; JOB is an id, an id prefix or a job name, as in
                                the CLI (404: no such job; 400: several, or not a reference)
    GET  /static/FILE           the dashboard's scripts and styles
    GET  /metrics               Prometheus text format (operators)
    GET  /api/overview          nodes, jobs, totals (JSON)
    GET  /api/jobs/JOB?since_round=N      the job, its rounds after N, its nodes
    GET  /api/events?since=ID&limit=N     the events feed
    GET  /api/whoami            the session's principal and role
    POST /api/login             {"token": "emt1..."} -> a session cookie
    POST /api/logout

The server runs in threads of its own (``ThreadingHTTPServer``): parsing, JSON encoding and
rendering the metrics never run on the coordinator's event loop. Reads of the registry, store
and engine are short coroutines sent to that loop (`asyncio.run_coroutine_threadsafe`), the
same objects the gRPC services read; the cluster read behind ``/metrics`` is shared by
callers within `STATE_MAX_AGE_S`. A bad request is answered (400, 401, 403, 404, 405, 411,
413, 415, 421, 503) and never disturbs the coordinator.

Slow and hostile clients:
- A connection is admitted only while its client address (an IPv6 one by its /64) holds fewer
  than `MAX_CONNECTIONS_PER_CLIENT` and the server fewer than `MAX_CONNECTIONS`; others get a
  503 and are closed at once, so connections (each a thread) are bounded.
- Every request (its line, headers and body), and the wait for the next one on a kept-alive
  connection, must arrive within `REQUEST_DEADLINE_S` in all, however slowly the bytes trickle;
  a connection past its deadline is closed. Only a request read in full takes one of the
  `MAX_CONCURRENT` slots a request is served in, so slow senders never hold a slot.
- Without a login (the trusted loopback path), the Host header must name this server: a
  loopback name or address, the listen address, or an ``--advertise`` name (a page of another
  site that rebinds its DNS name to 127.0.0.1 gets 421 and reads nothing).
- POSTs from a browser must come from the dashboard's own origin (Origin, else Referer, equal
  to the Host); the login takes ``application/json`` only (a cross-site form cannot log a
  browser in as someone else).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import TimeoutError as FutureTimeout
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlsplit

from coordinator.core.errors import CoordinatorError
from coordinator.observability.cluster_view import ClusterState, ClusterView, Viewer
from coordinator.observability.dashboard_access import (
    SESSION_COOKIE,
    SESSION_TTL_S,
    Session,
    Sessions,
    SessionsFull,
    UsedCodes,
    redeem_login_code,
    redeem_login_token,
)
from coordinator.observability.http_guard import (
    ConnectionGuard,
    Deadlines,
    HostNames,
    same_origin,
)
from coordinator.observability.metrics import CoordinatorMetrics
from coordinator.store.base import Store
from coordinator.trust.auth import Authorizer
from coordinator.trust.tokens import CertificateAuthority
from epochmesh.identity import LOGIN_CODE_PREFIX, ROLE_OPERATOR
from epochmesh.job_ref import check_job_ref

log = logging.getLogger(__name__)

T = TypeVar("T")

STATIC_DIR = Path(__file__).with_name("dashboard")
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATE_MAX_AGE_S = 0.5
LOOP_CALL_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 4096
MAX_CONCURRENT = 32
SOCKET_TIMEOUT_S = 15.0
MAX_QUERY_INT = 2**62
# A request (line, headers, body), or the wait for the next one on a kept-alive connection,
# arrives within this long in all, else its connection is closed.
REQUEST_DEADLINE_S = 10.0
# Connections open at once from one client address (an IPv6 one by its /64), and in all.
MAX_CONNECTIONS_PER_CLIENT = 16
MAX_CONNECTIONS = 128


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _int_param(query: dict[str, list[str]], name: str, default: int) -> int:
    values = query.get(name)
    if not values:
        return default
    text = values[-1]
    if not text.isdigit() or len(text) > 19 or int(text) > MAX_QUERY_INT:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"{name} must be a whole number >= 0")
    return int(text)


class DashboardBackend:
    """What the request handlers call: everything that touches the coordinator goes through
    `_on_loop`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        view: ClusterView,
        metrics: CoordinatorMetrics,
        store: Store,
        ca: CertificateAuthority | None,
        login: bool,
        is_revoked: Callable[[str], bool],
        authorizer: Authorizer | None = None,
    ) -> None:
        self.loop = loop
        self.authorizer = authorizer  # checks `epochmesh dashboard` login codes
        self.used_codes = UsedCodes()
        self.view = view
        self.metrics = metrics
        self.store = store
        self.ca = ca
        self.login = login
        self.is_revoked = is_revoked
        self.sessions = Sessions()
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        # The Host names served without a login (set by `HttpServer.start` from its address).
        self.hosts = HostNames("127.0.0.1")
        self._state_lock = threading.Lock()
        self._state: tuple[float, ClusterState] | None = None
        metrics.attach_cluster(self.cluster_state)

    def on_loop(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self.loop.is_closed():
            raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "the coordinator is stopping")
        future = asyncio.run_coroutine_threadsafe(make(), self.loop)
        try:
            return future.result(LOOP_CALL_TIMEOUT_S)
        except FutureTimeout:
            future.cancel()
            raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "the coordinator is busy") from None

    def cluster_state(self) -> ClusterState:
        """The latest read of the cluster, at most `STATE_MAX_AGE_S` old."""
        with self._state_lock:
            now = time.monotonic()
            if self._state is None or now - self._state[0] > STATE_MAX_AGE_S:
                self._state = (now, self.on_loop(self.view.state))
            return self._state[1]

    def session_viewer(self, secret: str) -> Viewer | None:
        """The viewer of a request: trusted (no login needed), its session's, or None."""
        if not self.login:
            return Viewer()
        session = self.sessions.get(secret)
        if session is None or self.is_revoked(session.principal):
            return None
        return session.viewer

    def log_in(self, token: str) -> tuple[str, Session]:
        if self.ca is None:
            raise HttpError(HTTPStatus.BAD_REQUEST, "this coordinator needs no login")
        ca, authorizer = self.ca, self.authorizer
        try:
            if token.strip().startswith(LOGIN_CODE_PREFIX) and authorizer is not None:
                session = self.on_loop(
                    lambda: redeem_login_code(authorizer, token, self.used_codes)
                )
            else:
                session = self.on_loop(lambda: redeem_login_token(self.store, ca, token))
        except CoordinatorError as exc:
            status = (
                HTTPStatus.FORBIDDEN if exc.code == "PERMISSION_DENIED" else HTTPStatus.UNAUTHORIZED
            )
            raise HttpError(status, str(exc)) from None
        try:
            secret = self.sessions.create(session.principal, session.role)
        except SessionsFull as exc:
            raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from None
        log.info("dashboard login: %s %s", session.role, session.principal)
        return secret, self.sessions.get(secret) or session


class DashboardHandler(BaseHTTPRequestHandler):
    server_version = "epochmesh-dashboard"
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S
    backend: DashboardBackend  # set on the subclass the server makes
    _body: bytes = b""  # the request's body, read before it takes a slot

    # -- plumbing --------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        log.debug("http %s: " + format, self.client_address[0], *args)

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'",
        )
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: HTTPStatus, data: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
        self._send(status, body, "application/json", headers)

    def _page(self, status: HTTPStatus, name: str = "index.html") -> None:
        self._send(status, (STATIC_DIR / name).read_bytes(), STATIC_TYPES[".html"])

    def _error(self, status: HTTPStatus, message: str, api: bool) -> None:
        if api:
            self._json(status, {"error": message, "status": int(status)})
        elif status == HTTPStatus.UNAUTHORIZED:
            self._page(status, "login.html")
        else:
            body = (
                "<!doctype html><meta charset=utf-8><title>epochmesh: "
                f"{int(status)}</title><h1>{int(status)} {status.phrase}</h1>"
                f"<p>{_escape(message)}</p><p><a href='/'>the cluster</a></p>"
            ).encode()
            self._send(status, body, STATIC_TYPES[".html"])

    def _cookie(self) -> str:
        raw = self.headers.get("Cookie", "")
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :].strip()
        try:
            jar = SimpleCookie(raw)
        except CookieError:
            return ""
        morsel = jar.get(SESSION_COOKIE)
        return morsel.value if morsel is not None else ""

    def _viewer(self) -> Viewer:
        viewer = self.backend.session_viewer(self._cookie())
        if viewer is None:
            raise HttpError(HTTPStatus.UNAUTHORIZED, "log in with a join token first")
        return viewer

    def handle_one_request(self) -> None:
        """One request, read within `REQUEST_DEADLINE_S` (the wait for it included)."""
        deadlines = cast(_Server, self.server).deadlines
        deadlines.arm(self.connection, REQUEST_DEADLINE_S)
        try:
            super().handle_one_request()
        finally:
            deadlines.forget(self.connection)

    def _read_body(self) -> bytes:
        """The request's body (at most `MAX_BODY_BYTES`; none without a Content-Length)."""
        if "Transfer-Encoding" in self.headers:
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            return b""
        if not length_text.strip().isdigit():
            raise HttpError(HTTPStatus.BAD_REQUEST, "malformed Content-Length")
        length = int(length_text)
        if length > MAX_BODY_BYTES:
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "the body is too large")
        body = self.rfile.read(length)
        if len(body) != length:
            raise HttpError(HTTPStatus.BAD_REQUEST, "the body ended early")
        return body

    def _admit(self, with_body: bool) -> bytes:
        """Checks that need no slot, and the body read in full (before a slot is taken)."""
        if not self.backend.login and not self.backend.hosts.allows(self.headers.get("Host")):
            raise HttpError(
                HTTPStatus.MISDIRECTED_REQUEST,
                "this dashboard answers only to its own names (a loopback address, localhost "
                "or an --advertise name) in the Host header",
            )
        if self.command == "POST" and not same_origin(
            self.headers.get("Origin"), self.headers.get("Referer"), self.headers.get("Host")
        ):
            raise HttpError(HTTPStatus.FORBIDDEN, "cross-origin request refused")
        return self._read_body() if with_body else b""

    def _dispatch(
        self, run: Callable[[str, dict[str, list[str]]], None], with_body: bool = False
    ) -> None:
        api = self.path.startswith("/api/") or self.path.startswith("/metrics")
        deadlines = cast(_Server, self.server).deadlines
        try:
            self._body = self._admit(with_body)
        except HttpError as exc:
            self.close_connection = True  # a body may be left unread
            if deadlines.finish(self.connection):
                self._error(exc.status, exc.message, api)
            return
        except OSError:
            self.close_connection = True
            return
        if not deadlines.finish(self.connection):
            self.close_connection = True  # past its deadline: shut down, answer nothing
            return
        if not self.backend.slots.acquire(blocking=False):
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "too many requests at once", api)
            return
        try:
            parts = urlsplit(self.path)
            if len(self.path) > 2048:
                raise HttpError(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
            try:
                query = parse_qs(parts.query, strict_parsing=False, max_num_fields=20)
            except ValueError as exc:
                raise HttpError(HTTPStatus.BAD_REQUEST, f"malformed query: {exc}") from None
            run(parts.path, query)
        except HttpError as exc:
            self._error(exc.status, exc.message, api)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:
            log.exception("dashboard request %s %s failed", self.command, self.path[:200])
            try:
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", api)
            except OSError:
                pass
        finally:
            self.backend.slots.release()

    # -- methods ---------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._dispatch(self._get)

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch(self._get)

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch(self._post, with_body=True)

    def _refuse_method(self) -> None:
        self._dispatch(self._not_allowed)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method  # noqa: N815

    def _not_allowed(self, path: str, query: dict[str, list[str]]) -> None:
        raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, "the dashboard is read-only")

    # -- routes ----------------------------------------------------------------------------

    def _get(self, path: str, query: dict[str, list[str]]) -> None:
        backend = self.backend
        if path.startswith("/static/"):
            self._static(path.removeprefix("/static/"))
            return
        if path in ("/", "/index.html"):
            self._viewer()
            self._page(HTTPStatus.OK)
            return
        if path == "/login":
            self._page(HTTPStatus.OK, "login.html")
            return
        if path.startswith("/jobs/"):
            viewer = self._viewer()
            self._job_id(viewer, path.removeprefix("/jobs/"))
            self._page(HTTPStatus.OK)
            return
        if path == "/metrics":
            viewer = self._viewer()
            if viewer.role != ROLE_OPERATOR:
                raise HttpError(HTTPStatus.FORBIDDEN, "the metrics are for operators")
            self._send(HTTPStatus.OK, backend.metrics.render(), PROMETHEUS_TYPE)
            return
        if path == "/api/whoami":
            viewer = self._viewer()
            self._json(HTTPStatus.OK, {**viewer.to_dict(), "login": backend.login})
            return
        if path == "/api/overview":
            viewer = self._viewer()
            self._json(HTTPStatus.OK, backend.on_loop(lambda: backend.view.overview(viewer)))
            return
        if path == "/api/events":
            viewer = self._viewer()
            since = _int_param(query, "since", 0)
            limit = _int_param(query, "limit", 50)
            self._json(
                HTTPStatus.OK, backend.on_loop(lambda: backend.view.events(viewer, since, limit))
            )
            return
        if path.startswith("/api/jobs/"):
            viewer = self._viewer()
            since = _int_param(query, "since_round", 0)
            job_id = self._job_id(viewer, path.removeprefix("/api/jobs/"))
            detail = backend.on_loop(lambda: backend.view.job_detail(viewer, job_id, since))
            if detail is None:
                raise HttpError(HTTPStatus.NOT_FOUND, f"no job {job_id}")
            self._json(HTTPStatus.OK, detail)
            return
        raise HttpError(HTTPStatus.NOT_FOUND, f"nothing at {path[:200]}")

    def _post(self, path: str, query: dict[str, list[str]]) -> None:
        if path == "/api/logout":
            self.backend.sessions.end(self._cookie())
            self._json(
                HTTPStatus.OK,
                {"ok": True},
                {"Set-Cookie": f"{SESSION_COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict"},
            )
            return
        if path != "/api/login":
            raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, "the dashboard is read-only")
        token = self._login_token()
        secret, session = self.backend.log_in(token)
        cookie = (
            f"{SESSION_COOKIE}={secret}; Path=/; Max-Age={int(SESSION_TTL_S)}; HttpOnly; "
            "SameSite=Strict"
        )
        self._json(
            HTTPStatus.OK,
            {**session.viewer.to_dict(), "session": secret},
            {"Set-Cookie": cookie},
        )

    def _login_token(self) -> str:
        if self.headers.get("Content-Length") is None:
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "a body with the token is required")
        content_type = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise HttpError(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                'the login takes Content-Type: application/json, {"token": "..."}',
            )
        body = self._body
        try:
            data = json.loads(body.decode())
        except (UnicodeDecodeError, ValueError):
            raise HttpError(HTTPStatus.BAD_REQUEST, 'the body must be {"token": "..."}') from None
        if not isinstance(data, dict) or not isinstance(data.get("token"), str):
            raise HttpError(HTTPStatus.BAD_REQUEST, 'the body must be {"token": "..."}')
        return str(data["token"])

    def _job_id(self, viewer: Viewer, text: str) -> str:
        """The id of the one job the viewer sees that the path's reference names: an id, an
        id prefix or a job name, as the CLI takes them (epochmesh/job_ref.py)."""
        try:
            ref = check_job_ref(unquote(text))
        except ValueError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        backend = self.backend
        jobs = backend.on_loop(lambda: backend.view.find_jobs(viewer, ref))
        if not jobs:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no job {ref[:100]!r}")
        if len(jobs) > 1:
            ids = ", ".join(j.job_id for j in jobs[:5])
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"{ref[:100]!r} names {len(jobs)} jobs ({ids}): give the full job id",
            )
        return str(jobs[0].job_id)

    def _static(self, name: str) -> None:
        path = STATIC_DIR / name
        if "/" in name or name.startswith(".") or path.suffix not in STATIC_TYPES:
            raise HttpError(HTTPStatus.NOT_FOUND, "no such file")
        try:
            body = path.read_bytes()
        except OSError:
            raise HttpError(HTTPStatus.NOT_FOUND, "no such file") from None
        self._send(HTTPStatus.OK, body, STATIC_TYPES[path.suffix])


def _escape(text: str) -> str:
    return (
        text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    )


class _Server(ThreadingHTTPServer):
    """A thread per connection, admitted by its `ConnectionGuard`; its `Deadlines` close the
    connections whose request is late."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    guard: ConnectionGuard
    deadlines: Deadlines

    def verify_request(self, request: Any, client_address: Any) -> bool:
        reason = self.guard.admit(str(client_address[0]))
        if not reason:
            return True
        log.debug("http %s: connection refused: %s", client_address[0], reason)
        body = json.dumps({"error": reason, "status": 503}).encode()
        try:
            request.setblocking(False)  # never wait on a client that does not read
            request.send(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
        except OSError:
            pass
        return False

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.guard.release(str(client_address[0]))
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.deadlines.forget(request)
            self.guard.release(str(client_address[0]))


class HttpServer:
    """The HTTP port in a thread of its own; `start` binds (raises OSError), `stop` ends it."""

    def __init__(
        self, host: str, port: int, backend: DashboardBackend, names: tuple[str, ...] = ()
    ) -> None:
        """``names``: host names this server also answers to without a login (--advertise)."""
        self._host = host
        self._port = port
        self._backend = backend
        self._names = names
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self) -> None:
        handler = type("BoundDashboardHandler", (DashboardHandler,), {"backend": self._backend})
        family_host = self._host.strip("[]")
        server_cls = _Server
        if ":" in family_host:
            server_cls = cast(
                type[_Server], type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
            )
        self._backend.hosts = HostNames(family_host, self._names)
        server = self._server = server_cls((family_host, self._port), handler)
        server.guard = ConnectionGuard(MAX_CONNECTIONS_PER_CLIENT, MAX_CONNECTIONS)
        server.deadlines = Deadlines()
        server.deadlines.start()
        port = server.server_address[1]
        self.address = f"[{family_host}]:{port}" if ":" in family_host else f"{family_host}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="http-dashboard",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops accepting and waits for the serving thread (not for requests in flight; they
        end when the loop they wait on closes)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.deadlines.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
