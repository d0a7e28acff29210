"""WAN emulation: a userspace TCP relay on loopback that puts emulated links (bandwidth, RTT,
jitter, loss) between a client and a server.

Donated GPUs sit behind home and office links (10-1000 Mbit/s, 20-200 ms RTT). ``tc netem`` is
not available on our machines, so latency is emulated here, in userspace::

    async with WanLink(target="127.0.0.1:7070", bandwidth_bps=100e6, rtt_ms=50) as link:
        channel = grpc.aio.insecure_channel(link.address)   # 127.0.0.1:<ephemeral port>
        ...
        print(link.stats().bytes_to_target)

Synchronous code (tests that start subprocesses, benchmarks) runs links on a private event loop
thread: ``with WanThread(WanLink(...), WanLink(...)) as wan: ...``. ``scripts/wan.py`` runs links
as a process until SIGTERM.

The model (all times on the event loop's monotonic clock)
---------------------------------------------------------
The relay terminates TCP on both sides (a split-TCP proxy). It reads whatever bytes a side has
sent, in reads of up to ``read_size`` bytes (16-256 KiB, about 5 ms of wire time), and schedules
each read *chunk* through a path of :class:`Wire` objects:

* **Bandwidth** (serialization delay). A wire carries one chunk at a time at ``bandwidth_bps``
  (payload bits per second; real links lose ~5 % of that to TCP/IP headers, so a "100 Mbit/s"
  link here carries 100 Mbit/s of payload). A chunk occupies the wire for ``8 * n /
  bandwidth_bps`` seconds starting when it arrives and the wire is free. Every connection
  through the same wire competes for it, FIFO in the order chunks were read, so a link's
  bandwidth is shared by all its connections, as a home uplink is.
* **Latency.** A chunk leaves the far end of a wire ``delay_s`` (one-way delay, ``rtt / 2`` for
  a :class:`WanLink`) after it finished serialization; it is then written to the other side.
  A small request/response therefore takes ``rtt`` plus serialization time.
* **Jitter.** Each chunk gets an extra one-way delay drawn uniformly from ``[0, jitter_ms]``
  per wire; TCP never reorders, so a chunk is never delivered before the previous one of its
  connection (the mean RTT grows by ``jitter_ms``).
* **Queue (router buffer).** The relay stops reading from a side while the first wire of its
  path has more than ``queue_ms`` of backlog, or while more than a bandwidth-delay product's
  worth of that connection's bytes is in flight inside the relay; the sender's kernel buffers
  then fill and TCP flow control slows it down, so memory stays bounded.
* **Loss.** TCP is reliable, so a lost segment is emulated by its *effect*, not by dropping
  bytes. (1) Retransmission delay: a chunk of ``k = ceil(n / 1448)`` segments is hit with
  probability ``1 - (1 - p)^k`` per wire; a hit chunk (and, because TCP delivers in order,
  everything of that connection behind it) arrives ``rto_ms`` later (default
  ``max(200 ms, 2 * rtt)``: Linux's minimum RTO; a bulk flow's losses are often repaired
  by fast retransmit in ~1 RTT instead, so this is pessimistic for latency, right for the
  tail losses that hit small RPCs). (2) Congestion control: each connection direction is
  capped at the Mathis et al. TCP throughput ``MSS * 8 * sqrt(3/2) / (rtt * sqrt(p))`` (e.g.
  ~2.8 Mbit/s for p = 1 %, 50 ms): what a Reno/CUBIC flow sustains under random loss.
  Retransmitted bytes do not use wire bandwidth again; multiple losses in one chunk cost one
  RTO.
* **Handshake.** The kernel accepts the client's connection at once, but the relay connects
  to the target only ``1.5 * rtt`` later (SYN, SYN-ACK, ACK), and holds the client's first
  bytes until then, so a new connection costs what it costs on a real link. A refused
  target connection is seen by the client as a closed/reset connection, not as a refused
  ``connect()``. Disable with ``handshake=False``.

Not modelled: TCP slow start (a fresh connection gets the full bandwidth at once), packet
reordering, MTU/header overhead, byte-level streaming within a chunk (a chunk is delivered as
a whole at the end of its serialization, which adds at most ~5 ms). FIN and half-close are
forwarded in order after the data (with the one-way delay); a connection reset or error on
either side closes both sides at once.

Topologies: a :class:`WanLink` built from ``bandwidth_bps`` / ``rtt_ms`` owns its wires. To
make several relays share a donor's access link (its uplink carries its traffic to the
coordinator and to its ring peers alike), build a :class:`Site` per donor and use
:meth:`WanLink.between`: the path client->target is ``client.up`` then ``server.down`` and the
RTT is the sum of both sites' RTTs. Wires may only be shared by links on one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any, Self

log = logging.getLogger(__name__)

MSS_BYTES = 1448  # TCP payload bytes per segment on a 1500-byte-MTU path
MIN_RTO_MS = 200.0  # Linux TCP_RTO_MIN
DEFAULT_QUEUE_MS = 50.0
_MIN_READ = 16 << 10
_MAX_READ = 256 << 10
_EPS = 1e-9

# -- units ----------------------------------------------------------------------------------

_BW_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|bps|b)?(/s|ps)?\s*$")
_DUR_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(us|ms|s|m|min)?\s*$")
_DUR_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "min": 60e3, None: 1.0}


def parse_bandwidth(text: str) -> float | None:
    """Bits per second from ``100mbit``, ``1.5gbit``, ``500kbit``, ``20mbps``, ``100Mbit/s``
    or a plain number of bit/s (units are bits, case-insensitive, decimal prefixes). ``0``,
    ``inf``, ``none`` or ``unlimited`` mean no bandwidth limit (``None``)."""
    t = text.strip().lower()
    if t in ("inf", "none", "unlimited", "0"):
        return None
    m = _BW_RE.match(t)
    if not m:
        raise ValueError(
            f"bad bandwidth {text!r}: expected a number with an optional unit "
            "(bit, kbit, mbit, gbit; e.g. 100mbit)"
        )
    if m.group(2) and not m.group(3):
        raise ValueError(f"bad bandwidth {text!r}: write {m.group(1)}{m.group(2)}bit")
    value = float(m.group(1)) * _BW_UNITS[m.group(2)]
    if value == 0:
        return None
    if not math.isfinite(value):
        raise ValueError(f"bad bandwidth {text!r}")
    return value


def parse_duration_ms(text: str) -> float:
    """Milliseconds from ``50ms``, ``0.2s``, ``500us`` or a plain number of milliseconds."""
    m = _DUR_RE.match(text.strip().lower())
    if not m:
        raise ValueError(f"bad duration {text!r}: expected e.g. 50ms or 0.05s")
    return float(m.group(1)) * _DUR_UNITS_MS[m.group(2)]


def parse_loss(text: str) -> float:
    """A probability from ``0.01`` or ``1%``; must lie in [0, 1)."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"bad loss {text!r}: expected a probability like 0.01 or 1%") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"bad loss {text!r}: must be in [0, 1)")
    return value


def format_bandwidth(bps: float | None) -> str:
    if bps is None:
        return "unlimited"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def split_hostport(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


# -- the model (pure: no I/O, time is passed in) --------------------------------------------


class Wire:
    """One direction of a bottleneck: serialization at ``bandwidth_bps`` (None: unlimited),
    then ``delay_s`` of propagation, optional ``jitter_s`` and ``loss`` (per segment).

    Shared by every flow routed over it. Busy time is kept as a calendar of reserved intervals,
    so a chunk that reaches the wire later in time than one reserved before it (several wires in
    series) may still use an earlier gap."""

    def __init__(
        self,
        bandwidth_bps: float | None,
        delay_s: float = 0.0,
        *,
        loss: float = 0.0,
        jitter_s: float = 0.0,
        name: str = "",
    ) -> None:
        if bandwidth_bps is not None and not bandwidth_bps > 0:
            raise ValueError(f"bandwidth must be > 0 or None, got {bandwidth_bps}")
        if delay_s < 0 or jitter_s < 0:
            raise ValueError("delay and jitter must be >= 0")
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        self.bandwidth_bps = bandwidth_bps
        self.delay_s = delay_s
        self.loss = loss
        self.jitter_s = jitter_s
        self.name = name
        self.bytes = 0  # bytes scheduled over this wire so far
        self._busy: list[list[float]] = []  # sorted, disjoint [start, end] reservations

    def serialization_s(self, nbytes: int) -> float:
        return 0.0 if self.bandwidth_bps is None else nbytes * 8.0 / self.bandwidth_bps

    def backlog_s(self, now: float) -> float:
        """Seconds of reserved serialization still ahead of ``now``."""
        return self._busy[-1][1] - now if self._busy and self._busy[-1][1] > now else 0.0

    def reserve(self, arrival: float, nbytes: int, now: float) -> float:
        """Reserve the wire for ``nbytes`` arriving at ``arrival``; returns when the last bit
        has been serialized (the earliest fit in the calendar at or after ``arrival``)."""
        self.bytes += nbytes
        duration = self.serialization_s(nbytes)
        if duration == 0.0:
            return arrival
        busy = self._busy
        drop = 0
        while drop < len(busy) and busy[drop][1] <= now:
            drop += 1
        if drop:
            del busy[:drop]
        start = arrival
        idx = 0
        while idx < len(busy):
            s, e = busy[idx]
            if e <= start + _EPS:
                idx += 1
                continue
            if s >= start + duration - _EPS:
                break
            start = e
            idx += 1
        end = start + duration
        # insert [start, end] at idx, merging with touching neighbours
        if idx > 0 and busy[idx - 1][1] >= start - _EPS:
            busy[idx - 1][1] = end
            idx -= 1
        else:
            busy.insert(idx, [start, end])
        if idx + 1 < len(busy) and busy[idx + 1][0] <= end + _EPS:
            busy[idx][1] = busy[idx + 1][1]
            del busy[idx + 1]
        return end


class Site:
    """A donor's (or datacenter's) access link: an uplink and a downlink wire, each with half
    of ``rtt_ms`` as one-way delay. Share one Site between the relays of all connections that
    leave or enter that place."""

    def __init__(
        self,
        name: str,
        bandwidth_bps: float | None,
        rtt_ms: float,
        *,
        down_bandwidth_bps: float | None = None,
        loss: float = 0.0,
        jitter_ms: float = 0.0,
    ) -> None:
        down = bandwidth_bps if down_bandwidth_bps is None else down_bandwidth_bps
        one_way = rtt_ms / 2000.0
        jitter = jitter_ms / 1000.0
        self.name = name
        self.rtt_ms = rtt_ms
        self.up = Wire(bandwidth_bps, one_way, loss=loss, jitter_s=jitter, name=f"{name}.up")
        self.down = Wire(down, one_way, loss=loss, jitter_s=jitter, name=f"{name}.down")


def mathis_rate_bps(rtt_s: float, loss: float) -> float | None:
    """Throughput a loss-based TCP flow sustains under random loss ``loss`` (Mathis et al.,
    1997): MSS * 8 * sqrt(3/2) / (RTT * sqrt(p)). None when there is no loss."""
    if loss <= 0:
        return None
    return MSS_BYTES * 8.0 * math.sqrt(1.5) / (max(rtt_s, 1e-3) * math.sqrt(loss))


class FlowShaper:
    """One direction of one connection: routes its chunks over ``path`` and keeps TCP order.

    ``rtt_s`` is the connection's round-trip propagation time (both directions' delays); it
    sets the retransmission delay and the loss-limited rate cap."""

    def __init__(
        self,
        path: Sequence[Wire],
        rtt_s: float,
        *,
        rng: random.Random,
        rto_s: float | None = None,
        loss_caps_rate: bool = True,
        not_before: float = 0.0,
    ) -> None:
        self.path = tuple(path)
        self.rtt_s = rtt_s
        self.rng = rng
        self.rto_s = rto_s if rto_s is not None else max(MIN_RTO_MS / 1000.0, 2.0 * rtt_s)
        survive = 1.0
        for w in self.path:
            survive *= 1.0 - w.loss
        self.path_loss = 1.0 - survive
        rate = mathis_rate_bps(rtt_s, self.path_loss) if loss_caps_rate else None
        self.cap = Wire(rate, name="flow-cap") if rate is not None else None
        self.last_delivery = not_before
        self.one_way_s = sum(w.delay_s for w in self.path)
        self.loss_events = 0

    def backlog_s(self, now: float) -> float:
        """Backlog of the flow's first bottleneck (its own rate cap or the first wire)."""
        b = self.cap.backlog_s(now) if self.cap is not None else 0.0
        if self.path:
            b = max(b, self.path[0].backlog_s(now))
        return b

    def schedule(self, now: float, nbytes: int) -> tuple[float, bool]:
        """When ``nbytes`` read at ``now`` are delivered to the other side, and whether a
        (emulated) loss delayed them."""
        t = now
        if self.cap is not None:
            t = self.cap.reserve(t, nbytes, now)
        lost = False
        segments = -(-nbytes // MSS_BYTES)
        for w in self.path:
            t = w.reserve(t, nbytes, now) + w.delay_s
            if w.jitter_s:
                t += self.rng.uniform(0.0, w.jitter_s)
            if w.loss and self.rng.random() < 1.0 - (1.0 - w.loss) ** segments:
                lost = True
        if lost:
            t += self.rto_s
            self.loss_events += 1
        t = max(t, self.last_delivery)
        self.last_delivery = t
        return t, lost

    def schedule_eof(self, now: float) -> float:
        """When a FIN read at ``now`` reaches the other side (after all data, one-way later)."""
        t = max(now + self.one_way_s, self.last_delivery)
        self.last_delivery = t
        return t


# -- the relay ------------------------------------------------------------------------------


@dataclass
class LinkStats:
    """Counters of one link. ``bytes_to_target``: client->target (a donor's upload when the
    donor is the client); ``bytes_to_client``: target->client. Bytes are counted when
    delivered to the far side."""

    name: str
    listen: str
    target: str
    bytes_to_target: int = 0
    bytes_to_client: int = 0
    connections_total: int = 0
    connections_active: int = 0
    connect_failures: int = 0
    loss_events: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _ConnectionLost(Exception):
    pass


@dataclass
class _Direction:
    """Delay queue of one direction of one connection."""

    shaper: FlowShaper
    read_size: int
    pending_cap: int
    queue_s: float
    stats: LinkStats
    to_target: bool
    items: deque[tuple[float, bytes | None]] = field(default_factory=deque)
    pending: int = 0
    has_items: asyncio.Event = field(default_factory=asyncio.Event)
    has_room: asyncio.Event = field(default_factory=asyncio.Event)

    async def pump(self, reader: asyncio.StreamReader) -> None:
        """Read from one side and schedule what was read; ends after queuing EOF."""
        loop = asyncio.get_running_loop()
        while True:
            while True:  # flow control: bounded backlog and bytes in flight
                if self.pending > self.pending_cap:
                    self.has_room.clear()
                    await self.has_room.wait()
                    continue
                excess = self.shaper.backlog_s(loop.time()) - self.queue_s
                if excess > 0:
                    await asyncio.sleep(excess)
                    continue
                break
            data = await reader.read(self.read_size)
            now = loop.time()
            if not data:
                self.items.append((self.shaper.schedule_eof(now), None))
                self.has_items.set()
                return
            at, lost = self.shaper.schedule(now, len(data))
            if lost:
                self.stats.loss_events += 1
            self.items.append((at, data))
            self.pending += len(data)
            self.has_items.set()

    async def deliver(self, writer: asyncio.StreamWriter) -> None:
        """Write each chunk to the other side when it is due; ends after forwarding EOF."""
        loop = asyncio.get_running_loop()
        items = self.items
        while True:
            if not items:
                self.has_items.clear()
                await self.has_items.wait()
                continue
            now = loop.time()
            wait = items[0][0] - now
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            chunks: list[bytes] = []
            eof = False
            while items and items[0][0] <= now:
                _, data = items.popleft()
                if data is None:
                    eof = True
                    break
                chunks.append(data)
            if chunks:
                if writer.transport.is_closing():
                    raise _ConnectionLost("peer closed")
                blob = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                writer.write(blob)
                await writer.drain()
                self.pending -= len(blob)
                if self.to_target:
                    self.stats.bytes_to_target += len(blob)
                else:
                    self.stats.bytes_to_client += len(blob)
                self.has_room.set()
            if eof:
                if writer.can_write_eof() and not writer.transport.is_closing():
                    writer.write_eof()
                return


def _read_size(bandwidth_bps: float | None) -> int:
    """About 5 ms of wire time per read, as a power of two in [16 KiB, 256 KiB]."""
    if bandwidth_bps is None:
        return _MAX_READ
    want = bandwidth_bps / 8.0 * 0.005
    size = _MIN_READ
    while size < want and size < _MAX_READ:
        size *= 2
    return size


class WanLink:
    """A TCP relay from ``listen`` to ``target`` through an emulated link.

    ``bandwidth_bps`` limits each direction (``return_bandwidth_bps`` for target->client when
    asymmetric; None: same as ``bandwidth_bps``), shared by all connections through this link;
    ``bandwidth_bps=None`` means unlimited.
    ``rtt_ms`` is the round-trip propagation time (``rtt_ms / 2`` each way), ``jitter_ms``
    extra one-way delay per chunk in [0, jitter_ms], ``loss`` a per-segment loss probability
    emulated as retransmission delay (``rto_ms``, default max(200 ms, 2 * rtt)) plus a TCP
    throughput cap (see the module docstring; ``loss_caps_rate=False`` keeps only the delay).
    ``handshake`` delays new connections by 1.5 RTT. ``queue_ms`` bounds the backlog the relay
    accepts in front of a wire (router buffer). ``seed`` makes jitter and loss draws
    reproducible. Start with ``await link.start()`` (or ``async with``), read the bound
    ``address`` afterwards, ``await link.stop()`` to close the listener and every connection.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        target: str = "",
        bandwidth_bps: float | None = 100e6,
        rtt_ms: float = 50.0,
        loss: float = 0.0,
        jitter_ms: float = 0.0,
        *,
        name: str = "link",
        return_bandwidth_bps: float | None = None,
        rto_ms: float | None = None,
        queue_ms: float = DEFAULT_QUEUE_MS,
        handshake: bool = True,
        loss_caps_rate: bool = True,
        seed: int | None = None,
    ) -> None:
        site = Site(
            name,
            bandwidth_bps,
            rtt_ms,
            down_bandwidth_bps=return_bandwidth_bps,
            loss=loss,
            jitter_ms=jitter_ms,
        )
        self._init(
            listen,
            target,
            name=name,
            to_target=[site.up],
            to_client=[site.down],
            rtt_ms=rtt_ms,
            rto_ms=rto_ms,
            queue_ms=queue_ms,
            handshake=handshake,
            loss_caps_rate=loss_caps_rate,
            seed=seed,
        )

    @classmethod
    def between(
        cls,
        listen: str,
        target: str,
        *,
        client: Site | None = None,
        server: Site | None = None,
        name: str = "link",
        rto_ms: float | None = None,
        queue_ms: float = DEFAULT_QUEUE_MS,
        handshake: bool = True,
        loss_caps_rate: bool = True,
        seed: int | None = None,
    ) -> WanLink:
        """A relay whose connections leave ``client``'s site and enter ``server``'s (either may
        be None: a datacenter without limits). Client->target goes over ``client.up`` then
        ``server.down``; the RTT is the sum of both sites' RTTs. Sites are shared objects:
        every relay built over the same Site competes for its bandwidth."""
        self = cls.__new__(cls)
        c_up, c_down = (client.up, client.down) if client else (None, None)
        s_up, s_down = (server.up, server.down) if server else (None, None)
        to_target = [w for w in (c_up, s_down) if w is not None]
        to_client = [w for w in (s_up, c_down) if w is not None]
        rtt_ms = (client.rtt_ms if client else 0.0) + (server.rtt_ms if server else 0.0)
        self._init(
            listen,
            target,
            name=name,
            to_target=to_target,
            to_client=to_client,
            rtt_ms=rtt_ms,
            rto_ms=rto_ms,
            queue_ms=queue_ms,
            handshake=handshake,
            loss_caps_rate=loss_caps_rate,
            seed=seed,
        )
        return self

    def _init(
        self,
        listen: str,
        target: str,
        *,
        name: str,
        to_target: list[Wire],
        to_client: list[Wire],
        rtt_ms: float,
        rto_ms: float | None,
        queue_ms: float,
        handshake: bool,
        loss_caps_rate: bool,
        seed: int | None,
    ) -> None:
        if not target:
            raise ValueError("WanLink needs a target HOST:PORT")
        if rtt_ms < 0 or queue_ms < 0 or (rto_ms is not None and rto_ms < 0):
            raise ValueError("rtt_ms, queue_ms and rto_ms must be >= 0")
        self._listen_host, self._listen_port = split_hostport(listen)
        self._target_host, self._target_port = split_hostport(target)
        self.name = name
        self.target = target
        self.to_target = to_target
        self.to_client = to_client
        self.rtt_s = rtt_ms / 1000.0
        self.rto_s = None if rto_ms is None else rto_ms / 1000.0
        self.queue_s = queue_ms / 1000.0
        self.handshake = handshake
        self.loss_caps_rate = loss_caps_rate
        self._rng = random.Random(seed)
        self._stats = LinkStats(name=name, listen=listen, target=target)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._address = ""

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` the link listens on (valid after start)."""
        if not self._address:
            raise RuntimeError(f"link {self.name!r} is not started")
        return self._address

    @property
    def port(self) -> int:
        return split_hostport(self.address)[1]

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"link {self.name!r} already started")
        limit = 2 * max(self._read_size(self.to_target), self._read_size(self.to_client))
        self._server = await asyncio.start_server(
            self._on_connect, self._listen_host, self._listen_port, limit=limit
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._stats.listen = self._address
        log.info(
            "wan link %s: %s -> %s (%s, rtt %.1f ms)",
            self.name,
            self._address,
            self.target,
            "/".join(format_bandwidth(w.bandwidth_bps) for w in self.to_target) or "unlimited",
            self.rtt_s * 1000,
        )

    async def stop(self) -> None:
        """Stop accepting, close every connection through the link, wait for its tasks."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in list(self._writers):
            w.transport.abort()
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def stats(self) -> LinkStats:
        """A snapshot of the link's counters."""
        return LinkStats(**asdict(self._stats))

    # -- connections ----------------------------------------------------------------------

    @staticmethod
    def _read_size(path: Sequence[Wire]) -> int:
        bws = [w.bandwidth_bps for w in path if w.bandwidth_bps is not None]
        return _read_size(min(bws) if bws else None)

    def _pending_cap(self, path: Sequence[Wire], read_size: int) -> int:
        """Bytes of one connection direction allowed inside the relay: about twice the
        bandwidth-delay product (including the queue and an RTO), at least 1 MiB."""
        bws = [w.bandwidth_bps for w in path if w.bandwidth_bps is not None]
        if not bws:
            return 4 << 20
        horizon = self.rtt_s + self.queue_s + (self.rto_s or max(0.2, 2 * self.rtt_s))
        return max(1 << 20, int(min(bws) / 8.0 * horizon * 2) + 4 * read_size)

    def _direction(self, path: list[Wire], not_before: float, to_target: bool) -> _Direction:
        shaper = FlowShaper(
            path,
            self.rtt_s,
            rng=self._rng,
            rto_s=self.rto_s,
            loss_caps_rate=self.loss_caps_rate,
            not_before=not_before,
        )
        read_size = self._read_size(path)
        return _Direction(
            shaper=shaper,
            read_size=read_size,
            pending_cap=self._pending_cap(path, read_size),
            queue_s=self.queue_s,
            stats=self._stats,
            to_target=to_target,
        )

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:  # stopping
            writer.transport.abort()
            return
        task = asyncio.get_running_loop().create_task(self._relay(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        stats = self._stats
        stats.connections_total += 1
        stats.connections_active += 1
        self._writers.add(c_writer)
        accepted = loop.time()
        setup = 1.5 * self.rtt_s if self.handshake else 0.0
        up = self._direction(self.to_target, accepted + setup, to_target=True)
        down = self._direction(self.to_client, 0.0, to_target=False)
        tasks: list[asyncio.Task[None]] = [loop.create_task(up.pump(c_reader))]
        t_writer: asyncio.StreamWriter | None = None
        clean = False
        try:
            if setup > 0:
                await asyncio.sleep(setup)
            try:
                t_reader, t_writer = await asyncio.open_connection(
                    self._target_host,
                    self._target_port,
                    limit=2 * max(up.read_size, down.read_size),
                )
            except OSError as exc:
                stats.connect_failures += 1
                log.info("wan link %s: cannot connect to %s: %s", self.name, self.target, exc)
                return
            self._writers.add(t_writer)
            tasks += [
                loop.create_task(up.deliver(t_writer)),
                loop.create_task(down.pump(t_reader)),
                loop.create_task(down.deliver(c_writer)),
            ]
            pending: set[asyncio.Task[None]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    failure = t.exception()
                    if failure is not None:
                        raise failure
            clean = True
        except (ConnectionError, _ConnectionLost, OSError) as exc:
            log.debug("wan link %s: connection ended: %r", self.name, exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("wan link %s: relay failed", self.name)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (c_writer, t_writer):
                if w is None:
                    continue
                self._writers.discard(w)
                if clean:
                    w.close()
                else:
                    w.transport.abort()
            stats.connections_active -= 1


# -- running links on a private event loop thread -------------------------------------------


class WanThread:
    """Runs links on a private event loop in a daemon thread, for synchronous callers::

    with WanThread(WanLink(target=addr, bandwidth_bps=20e6, rtt_ms=50)) as wan:
        relay_address = wan.links[0].address
        ...
        wan.stats()  # [LinkStats, ...]
    """

    def __init__(self, *links: WanLink) -> None:
        self.links = list(links)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> Self:
        if self._loop is not None:
            raise RuntimeError("WanThread already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="wan-relay", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start_all(), loop).result(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def add(self, link: WanLink, timeout: float = 10.0) -> WanLink:
        """Start one more link on the running thread (e.g. a relay to a port that a process
        started behind the other links only chose later); `stats` and `stop` include it."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("WanThread is not started")
        asyncio.run_coroutine_threadsafe(link.start(), loop).result(timeout)
        self.links.append(link)
        return link

    async def _start_all(self) -> None:
        for link in self.links:
            await link.start()

    async def _stop_all(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links), return_exceptions=True)

    def stats(self) -> list[LinkStats]:
        return [link.stats() for link in self.links]

    def stop(self, timeout: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        try:
            asyncio.run_coroutine_threadsafe(self._stop_all(), loop).result(timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
            if not thread.is_alive():
                loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# -- link specs (command line) --------------------------------------------------------------


@dataclass(frozen=True)
class LinkSpec:
    """One link as given on a command line."""

    name: str
    listen: str
    target: str
    bandwidth_bps: float | None
    rtt_ms: float
    loss: float = 0.0
    jitter_ms: float = 0.0
    return_bandwidth_bps: float | None = None
    queue_ms: float = DEFAULT_QUEUE_MS

    def build(
        self, *, seed: int | None = None, handshake: bool = True, loss_caps_rate: bool = True
    ) -> WanLink:
        return WanLink(
            self.listen,
            self.target,
            self.bandwidth_bps,
            self.rtt_ms,
            self.loss,
            self.jitter_ms,
            name=self.name,
            return_bandwidth_bps=self.return_bandwidth_bps,
            queue_ms=self.queue_ms,
            handshake=handshake,
            loss_caps_rate=loss_caps_rate,
            seed=seed,
        )


_SPEC_KEYS = ("loss", "jitter", "return_bandwidth", "queue")


def parse_link_spec(text: str) -> LinkSpec:
    """``NAME=LISTEN,TARGET,BANDWIDTH,RTT[,loss=P][,jitter=D][,return_bandwidth=B][,queue=D]``,
    e.g. ``agent1=127.0.0.1:0,127.0.0.1:7070,100mbit,50ms,loss=1%``."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(
            f"bad link {text!r}: expected NAME=LISTEN,TARGET,BANDWIDTH,RTT[,key=value...] "
            "(NAME of letters, digits, _ . -)"
        )
    parts = [p.strip() for p in rest.split(",")]
    if len(parts) < 4 or any("=" in p for p in parts[:4]):
        raise ValueError(f"bad link {text!r}: expected NAME=LISTEN,TARGET,BANDWIDTH,RTT first")
    listen, target, bw, rtt = parts[:4]
    split_hostport(listen)
    split_hostport(target)
    extra: dict[str, str] = {}
    for p in parts[4:]:
        key, sep, value = p.partition("=")
        if not sep or key not in _SPEC_KEYS:
            raise ValueError(f"bad link option {p!r} in {text!r}: use {', '.join(_SPEC_KEYS)}")
        extra[key] = value
    bandwidth = parse_bandwidth(bw)
    return LinkSpec(
        name=name,
        listen=listen,
        target=target,
        bandwidth_bps=bandwidth,
        rtt_ms=parse_duration_ms(rtt),
        loss=parse_loss(extra["loss"]) if "loss" in extra else 0.0,
        jitter_ms=parse_duration_ms(extra["jitter"]) if "jitter" in extra else 0.0,
        return_bandwidth_bps=(
            parse_bandwidth(extra["return_bandwidth"]) if "return_bandwidth" in extra else None
        ),
        queue_ms=parse_duration_ms(extra["queue"]) if "queue" in extra else DEFAULT_QUEUE_MS,
    )
