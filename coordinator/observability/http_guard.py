"""What the HTTP port (coordinator/observability/http_server.py) checks before it serves a
request, apart from the serving: who may hold a connection, how long a request may take to
arrive, which Host names this server answers to without a login, and whether a browser's POST
comes from the dashboard's own origin.

- `ConnectionGuard`: connections open at once per client address (an IPv6 address counts by
  its /64, an IPv4-mapped one as its IPv4 address) and in all; the server refuses a
  connection over either cap before it gets a thread.
- `Deadlines`: one thread closes (``shutdown``) every connection whose request has not arrived
  in full by its deadline, however slowly its bytes trickle in (a per-read timeout would be
  renewed by every byte).
- `HostNames`: the Host header a request without a login may carry: a loopback name or
  address, the listen address, an ``--advertise`` name; any IP address when listening on all
  of them. A DNS-rebinding page names its own domain and is refused.
- `same_origin`: a POST's Origin (else its Referer) must name the Host it was sent to.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterable
from urllib.parse import urlsplit


def client_key(host: str) -> str:
    """The address a client's connections are counted under: the IPv4 address, the /64 of an
    IPv6 address (one host gets a whole /64), an IPv4-mapped IPv6 address as its IPv4."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ConnectionGuard:
    """Counts of open connections per client key and in all (thread-safe)."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client = per_client
        self.total = total
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self._count = 0

    def admit(self, host: str) -> str:
        """ "" when a connection from ``host`` may open (and it is counted), else why not."""
        key = client_key(host)
        with self._lock:
            if self._count >= self.total:
                return f"too many connections ({self.total} open): retry shortly"
            held = self._open.get(key, 0)
            if held >= self.per_client:
                return (
                    f"too many connections from {key} ({self.per_client} open at most per "
                    "client address): retry shortly"
                )
            self._open[key] = held + 1
            self._count += 1
            return ""

    def release(self, host: str) -> None:
        key = client_key(host)
        with self._lock:
            held = self._open.get(key, 0)
            if held <= 0:
                return
            if held == 1:
                del self._open[key]
            else:
                self._open[key] = held - 1
            self._count -= 1

    @property
    def open(self) -> int:
        with self._lock:
            return self._count


class Deadlines:
    """Connections waiting for a request, each with the monotonic time its request must have
    arrived by; a thread of its own shuts down those past it (the handler's blocked read then
    ends). `start` and `stop` it with the server."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, float] = {}
        self._expired: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, conn: socket.socket, within_s: float) -> None:
        with self._lock:
            self._expired.discard(conn)
            self._waiting[conn] = time.monotonic() + within_s

    def finish(self, conn: socket.socket) -> bool:
        """Stops watching ``conn``; False if its deadline had passed (it was shut down)."""
        with self._lock:
            self._waiting.pop(conn, None)
            if conn in self._expired:
                self._expired.discard(conn)
                return False
            return True

    def forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(conn, None)
            self._expired.discard(conn)

    def reap(self, now: float) -> int:
        """Shuts down the connections past their deadline at ``now``; how many."""
        with self._lock:
            late = [c for c, at in self._waiting.items() if at <= now]
            for conn in late:
                del self._waiting[conn]
                self._expired.add(conn)
        for conn in late:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile
        return len(late)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.reap(time.monotonic())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="http-deadlines", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def split_host(value: str) -> str:
    """The host of a Host header value (``name:port``, ``[v6]:port``), lowercased, without a
    trailing dot; "" when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1 :] and not value[end + 1 :].startswith(":")):
            return ""
        return value[1:end]
    host, _, port = value.partition(":")
    if port and not port.isdigit():
        return ""
    return host.rstrip(".")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class HostNames:
    """The Host header values a request without a login is served for."""

    def __init__(self, listen_host: str, names: Iterable[str] = ()) -> None:
        listen = listen_host.strip("[]").lower()
        address = _ip(listen)
        # Listening on every address: any address of the machine may be named.
        self.any_address = address is not None and address.is_unspecified
        self.names = {"localhost"} | {split_host(n) or n.lower() for n in names if n}
        if listen and address is None:
            self.names.add(listen.rstrip("."))
        self.addresses = {address} if address is not None else set()

    def allows(self, header: str | None) -> bool:
        """True for a missing Host (not a browser) or one naming this server."""
        if header is None:
            return True
        host = split_host(header)
        if not host:
            return False
        address = _ip(host)
        if address is None:
            return host in self.names
        return address.is_loopback or self.any_address or address in self.addresses


def same_origin(origin: str | None, referer: str | None, host: str | None) -> bool:
    """True unless a browser says the request comes from another origin: ``origin`` (else
    ``referer``) must name ``host``; neither header (not a browser): True."""
    source = origin if origin is not None else referer
    if source is None:
        return True
    if host is None or source.strip() == "null":
        return False
    parts = urlsplit(source.strip())
    if parts.scheme not in ("http", "https"):
        return False
    return parts.netloc.lower() == host.strip().lower()
