"""The ring's bulk data path: RingChunk frames over a TCP socket (mutual TLS or plain), off grpcio.

grpcio's Python data path copies every message several times and hands it between threads on
both sides, which caps a ring over PushChunks well below gloo on a few cores. This module moves
the same frames over a socket of their own, with no copy on the way out (`sendmsg` of the
header and a view of the caller's buffer; under TLS one AES-GCM pass) and none beyond the
kernel's on the way in (payloads land, or are decrypted, in a preallocated buffer, or straight
in the ring buffer where a chunk is only copied).

Handshake (one connection per peer, sender = the left neighbour; kept across attempts, below):

1. The sender calls ``OpenBulk(job, round, attempt, from_node_id)`` on the receiver's
   PeerService. That RPC is authenticated exactly like PushChunks (under mutual TLS the caller's
   certificate must name ``from_node_id``; a known attempt must have it as left neighbour) and
   answers the `BulkListener`'s port and a one-time token (32 random bytes, valid
   ``token_ttl_s``), bound to (job, round, attempt, from_node_id). Tokens are issued only for
   attempts this node has a task of, to their left neighbour, at most `MAX_TOKENS_PER_PEER`
   unused ones per peer (RESOURCE_EXHAUSTED beyond).
2. The sender connects to that port on the host of the receiver's PeerService address. With
   identities the socket speaks TLS: the receiver presents its node certificate (the sender
   checks that it names the expected node id, as `peer_channel` does) and requires one from the
   sender, which must name the node the token was issued to. Without identities (``--insecure``
   agents) the socket is plaintext, as gRPC is then.
3. The sender sends ``MAGIC + token`` (under TLS followed by its 32-byte key share); the
   receiver answers OK (under TLS carrying its own key share), or an error reply (a wrong,
   used or expired token: UNAUTHENTICATED; another node's certificate: PERMISSION_DENIED) and
   closes. The TLS handshake and the token must arrive within `HANDSHAKE_TIMEOUT_S` of the
   accept, and at most `MAX_HANDSHAKES` connections may be that far at once (others are closed
   at once). Anything going wrong up to here makes the sender fall back to PushChunks for this
   attempt (`node_agent.ring.allreduce`).
4. Under TLS, both ends then leave TLS for AES-256-GCM records keyed from the two shares
   (`node_agent.ring.bulk_conn`): the frames and replies below travel sealed, at a fraction of
   the CPU that TLS records cost Python's `ssl`.

Frames (sender to receiver): ``<u32 head_len><u32 payload_len>`` then ``head`` (a serialized
RingChunk whose DataChunk carries the offset but no data: the same header bytes PushChunks
carries) and ``payload_len`` bytes of data. ``head_len`` is at most `MAX_HEAD_BYTES`, the payload
at most `MAX_CHUNK_BYTES`, else the frame is malformed. ``head_len == 0`` ends the stream.
The receiver routes the stream to the attempt's receive slot in the `RingMailbox` (waiting for it
like PushChunks does) and applies every chunk the moment it arrives.

Replies (receiver to sender): ``<u8 kind><u32 len>`` + body: OK (after the token), ACK (i64 of
payload bytes applied, after the end frame) or ERROR (u16 gRPC status code, u16 length + the
failed node's id, details); the receiver sends one final reply, ACK or ERROR. An ERROR that
names a failed node is what PushChunks says with its ``epochmesh-failed-node`` trailer, so the
sender learns who failed instead of blaming the receiver. The receiver reads on (and discards)
for a moment after an ERROR so that the reply is not lost to a TCP reset.

Kept connections. A receiver that says so in its OpenBulk answer (``keep_alive``) keeps the
connection open after an ACK, for `KEEP_IDLE_S`, waiting for the same sender's next stream:
``MAGIC_NEXT`` + ``<u16 job_len><i64 round><i64 attempt>`` + the job id, which it answers OK (or
ERROR, and closes) exactly as a token, then frames as above. The stream is bound to the node the
connection was opened for (under TLS its certificate, checked again against the revocation list
at every stream; plaintext: the node its token was issued to), and the attempt must have been
announced here (within `NEXT_STREAM_WAIT_S`) with that node as left neighbour, as for a token.
The sender (`node_agent.ring.transport`) keeps one idle connection per peer and uses it for
the next attempt while it is younger than `KEEP_REUSE_S`:
an attempt then costs one round trip instead of OpenBulk, a TCP connect, the TLS handshake and
the token (four round trips and, under TLS, ~4-5 ms of CPU each end). A kept connection that
turns out closed before its OK costs nothing but a fresh one. A sender of an older version
closes after the ACK, as before; at its connection limit the receiver closes its longest idle
kept connection rather than refuse a new one. Under TLS the sealed records go on with their
sequence numbers, so a kept connection is never reused past half its sealed-byte limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import secrets
import socket
import ssl
import struct
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import grpc

from epochmesh import identity as idm
from epochmesh.fsutil import write_private
from epochmesh.limits import MAX_CHUNK_BYTES
from node_agent.ring.bulk_conn import (
    KEY_SHARE_BYTES,
    MAX_SEALED_BYTES,
    BulkError,
    Conn,
    TlsConn,
)
from node_agent.ring.mailbox import AttemptExpired, ChunkRejected, RingMailbox
from node_agent.ring.wire import (
    ABORT_PHASE,
    MAX_ID_CHARS,
    RingKey,
    WireError,
    failed_id_of,
    parse_checked_ring_chunk,
    varint,
)

log = logging.getLogger(__name__)

MAGIC = b"EMB2"
MAGIC_NEXT = b"EMBN"  # the next stream on a kept connection
# How long a receiver keeps a connection open after a stream's ACK for the sender's next one,
# and how old an idle connection the sender still uses (well inside that, so that the receiver
# does not close it while the next stream starts).
KEEP_IDLE_S = 60.0
KEEP_REUSE_S = 30.0
# How long the next stream on a kept connection waits for its attempt to be announced here (as
# OpenBulk does for a token; under the sender's wait for the answer, RESUME_TIMEOUT_S in
# node_agent.ring.transport, so that a refusal reaches it).
NEXT_STREAM_WAIT_S = 1.5
_NEXT = struct.Struct("<Hqq")
# A connection must complete its TLS handshake and present its token within this many seconds
# of the accept, and at most MAX_HANDSHAKES connections may be at that stage at once: a caller
# that connects and says nothing holds a slot only that long.
HANDSHAKE_TIMEOUT_S = 3.0
MAX_HANDSHAKES = 16
# Unused bulk tokens one peer may hold at once (a left neighbour needs one per attempt).
MAX_TOKENS_PER_PEER = 4
TOKEN_BYTES = 32
MAX_HEAD_BYTES = 4096
MAX_DETAILS_BYTES = 2048
_FRAME = struct.Struct("<II")
_REPLY = struct.Struct("<BI")
_ACK = struct.Struct("<q")
_ERR = struct.Struct("<HH")
REPLY_OK = 0
REPLY_ACK = 1
REPLY_ERROR = 2
_END_FRAME = _FRAME.pack(0, 0)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class TooManyTokens(Exception):
    """A peer holds as many unused bulk tokens as it may (RESOURCE_EXHAUSTED)."""


class BulkHost(Protocol):
    """What a `BulkListener` uses of the PeerService it serves (`node_agent.ring.service`).

    Declared here so that the dependency runs one way: the service imports this module and
    hands itself to the listener; this module never imports the service. The listener reads
    `revoked` at each handshake, waits on `mailbox` for an attempt's receive slot (bounded by
    `join_timeout_s`) and adds every applied data chunk to the two counters, exactly as
    PushChunks does.
    """

    # Node ids whose certificates the coordinator revoked: refused at the handshake.
    revoked: frozenset[str]
    mailbox: RingMailbox
    join_timeout_s: float
    received_bytes: int  # payload bytes of data chunks applied, all time
    received_chunks: int


# ---------------------------------------------------------------------------------------------
# TLS contexts from an Identity (PEM bytes; `ssl` loads a key only from a file)


def _load_chain(ctx: ssl.SSLContext, identity: idm.Identity) -> None:
    with tempfile.TemporaryDirectory(prefix="epochmesh-tls-") as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        write_private(cert, identity.cert_pem)
        write_private(key, identity.key_pem)
        ctx.load_cert_chain(str(cert), str(key))
    ctx.load_verify_locations(cadata=identity.ca_pem.decode())
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2


@functools.lru_cache(maxsize=8)
def client_ssl_context(identity: idm.Identity) -> ssl.SSLContext:
    """Dial a peer's bulk socket: trust only our CA, present our node certificate, and check
    the peer's name (the expected node id, passed as server_hostname)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _load_chain(ctx, identity)
    return ctx


@functools.lru_cache(maxsize=8)
def server_ssl_context(identity: idm.Identity) -> ssl.SSLContext:
    """Serve the bulk socket with our node certificate; require one of our CA from callers."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_chain(ctx, identity)
    return ctx


# The receiver lets the event loop run after this many chunks that arrived without a wait
# (after every chunk measured slower; 4 ranks on 2 cores, 64 MiB). Socket buffers are left to
# the kernel's autotuning (4 MiB fixed buffers measured slower too).
YIELD_EVERY_CHUNKS = 16


def _configure(sock: socket.socket) -> None:
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _read_reply(conn: Conn) -> tuple[int, bytes]:
    head = bytearray(_REPLY.size)
    await conn.recv_exactly(memoryview(head))
    kind, length = _REPLY.unpack(head)
    if kind not in (REPLY_OK, REPLY_ACK, REPLY_ERROR) or length > MAX_DETAILS_BYTES + 512:
        raise BulkError(f"malformed reply (kind {kind}, {length} bytes)")
    body = bytearray(length)
    if length:
        await conn.recv_exactly(memoryview(body))
    return kind, bytes(body)


def _error_reply(code: grpc.StatusCode, details: str, failed_node: str | None = None) -> bytes:
    failed = (failed_node or "").encode()[:1024]
    text = details.encode()[:MAX_DETAILS_BYTES]
    body = _ERR.pack(code.value[0], len(failed)) + failed + text
    return _REPLY.pack(REPLY_ERROR, len(body)) + body


def _parse_error(body: bytes) -> BulkError:
    if len(body) < _ERR.size:
        return BulkError("malformed error reply")
    code_value, flen = _ERR.unpack_from(body)
    failed = body[_ERR.size : _ERR.size + flen].decode(errors="replace") or None
    details = body[_ERR.size + flen :].decode(errors="replace")
    return BulkError(details, _CODES.get(code_value, grpc.StatusCode.UNKNOWN), failed)


# ---------------------------------------------------------------------------------------------
# Sender side


def chunk_head(header: bytes, offset: int) -> bytes:
    """The RingChunk head of a bulk frame: `header` plus a DataChunk holding only `offset`."""
    if not offset:
        return header
    inner = b"\x08" + varint(offset)
    return header + b"\x4a" + varint(len(inner)) + inner


class BulkOutput:
    """The sender's end of one stream (one ring attempt to the right neighbour) on a bulk
    connection. With `release`, a stream that ends with the receiver's ACK hands the connection
    to `release` (to be kept for the next attempt) instead of closing it."""

    def __init__(self, conn: Conn, release: Callable[[Conn], None] | None = None) -> None:
        self._conn = conn
        self._release = release
        self._closed = False
        self._reply: asyncio.Task[tuple[int, bytes]] = asyncio.get_running_loop().create_task(
            _read_reply(conn), name="bulk-reply"
        )
        self._reply.add_done_callback(self._reply_done)
        self._finishing = False
        self._on_broken: Callable[[BaseException], None] | None = None
        self.sent_bytes = 0

    def on_broken(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` (once) if the receiver closes or refuses the stream before `finish`:
        a dead receiver is noticed even while this node is not writing."""
        self._on_broken = callback
        if self._reply.done():
            asyncio.get_running_loop().call_soon(self._reply_done, self._reply)

    def _reply_done(self, task: asyncio.Task[tuple[int, bytes]]) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here: reported through this object, not logged
        if self._finishing or self._closed or self._on_broken is None:
            return
        self._on_broken(exc if exc is not None else self._final_error())

    async def write_chunk(self, header: bytes, offset: int, payload: bytes | memoryview) -> None:
        """Send one RingChunk (`header` from `ring_chunk_header`); BulkError if broken."""
        if self._reply.done():
            raise self._final_error()
        head = chunk_head(header, offset)
        n = memoryview(payload).nbytes
        try:
            await self._conn.sendall([_FRAME.pack(len(head), n) + head, payload])
        except OSError as exc:
            raise BulkError(f"connection broke: {exc}") from None
        self.sent_bytes += n

    async def finish(self) -> int:
        """End the stream and wait for the receiver's ACK: the payload bytes it applied."""
        self._finishing = True
        try:
            await self._conn.sendall([_END_FRAME])
        except OSError as exc:
            raise BulkError(f"connection broke: {exc}") from None
        try:
            kind, body = await asyncio.shield(self._reply)
        except BulkError:
            raise
        except Exception as exc:
            raise BulkError(f"connection broke: {exc!r}") from None
        if kind == REPLY_ACK and len(body) == _ACK.size:
            if self._release is not None and not self._closed and reusable(self._conn):
                self._closed = True
                self._release(self._conn)
            else:
                self.close()
            return int(_ACK.unpack(body)[0])
        raise self._final_error()

    def _final_error(self) -> BulkError:
        try:
            kind, body = self._reply.result()
        except BulkError as exc:
            return exc
        except (Exception, asyncio.CancelledError) as exc:
            return BulkError(f"connection broke: {exc!r}")
        if kind == REPLY_ERROR:
            return _parse_error(body)
        return BulkError(f"unexpected reply {kind} before the end of the stream")

    async def failure(self, exc: BaseException, timeout: float) -> BulkError:
        """What the receiver said when the stream failed with `exc` (waits up to `timeout` s
        for its reply)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._reply), timeout)
        if not self._reply.done():
            return BulkError(f"no reply after {exc}")
        return self._final_error()

    def done(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._reply.done():
                self._reply.cancel()
            self._conn.close()


def reusable(conn: Conn) -> bool:
    """Whether a connection whose stream ended with an ACK may carry another: under TLS, while
    it has sealed less than half its byte limit in each direction."""
    if isinstance(conn, TlsConn):
        return max(conn.sealed_bytes) < MAX_SEALED_BYTES // 2
    return True


def next_hello(key: RingKey) -> bytes:
    """What starts the stream of attempt `key` on a kept connection."""
    job_id, round_, attempt = key
    job = job_id.encode()
    return MAGIC_NEXT + _NEXT.pack(len(job), round_, attempt) + job


async def resume(
    conn: Conn, key: RingKey, release: Callable[[Conn], None] | None = None
) -> BulkOutput:
    """Start the stream of attempt `key` on a kept connection (the receiver answers OK, or
    ERROR and closes). BulkError / OSError / ssl.SSLError when it cannot carry it (closed by
    the receiver meanwhile, refused): the caller closes it and opens a fresh one; the caller
    bounds the time."""
    await conn.sendall([next_hello(key)])
    kind, body = await _read_reply(conn)
    if kind == REPLY_ERROR:
        raise _parse_error(body)
    if kind != REPLY_OK or body:
        raise BulkError(f"unexpected reply {kind} ({len(body)} bytes) to the next stream")
    return BulkOutput(conn, release)


async def connect(
    host: str,
    port: int,
    token: bytes,
    *,
    node_id: str,
    ssl_context: ssl.SSLContext | None,
    release: Callable[[Conn], None] | None = None,
) -> BulkOutput:
    """Open a bulk connection to node `node_id` (TLS with `ssl_context`, which checks the
    certificate names `node_id`) and present `token`; with `release`, the connection is handed
    to it after an ACK (see BulkOutput). Raises BulkError when refused, OSError / ssl.SSLError
    when the socket fails; the caller bounds the time."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise BulkError(f"cannot resolve {host!r}")
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    conn: Conn | None = None
    try:
        _configure(sock)
        await loop.sock_connect(sock, addr)
        if ssl_context is not None:
            conn = TlsConn(sock, ssl_context, server_hostname=node_id)
        else:
            conn = Conn(sock)
        await conn.handshake()
        if ssl_context is not None:
            principal = conn.peer_principal()
            if principal is None or principal.role != idm.ROLE_NODE or principal.id != node_id:
                raise BulkError(f"the peer's certificate does not name node {node_id!r}")
        share = secrets.token_bytes(KEY_SHARE_BYTES) if isinstance(conn, TlsConn) else b""
        await conn.sendall([MAGIC + token + share])
        kind, body = await _read_reply(conn)
        if kind == REPLY_ERROR:
            raise _parse_error(body)
        if kind != REPLY_OK or len(body) != len(share):
            raise BulkError(f"unexpected reply {kind} ({len(body)} bytes) to the token")
        if isinstance(conn, TlsConn):
            conn.seal(share, body)
        return BulkOutput(conn, release)
    except BaseException:
        if conn is not None:
            conn.close()
        else:
            sock.close()
        raise


# ---------------------------------------------------------------------------------------------
# Receiver side


@dataclass(frozen=True)
class _Grant:
    key: RingKey
    from_node_id: str
    expires: float


class BulkListener:
    """A PeerServer's bulk socket: hands out tokens (via OpenBulk) and receives ring streams.

    `service` is the PeerService (a `BulkHost`) whose mailbox, join timeout and counters the
    streams use.
    With an `identity` the socket speaks mutual TLS with node certificates.
    """

    def __init__(
        self,
        service: BulkHost,
        host: str,
        *,
        identity: idm.Identity | None = None,
        token_ttl_s: float = 10.0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        idle_timeout_s: float = 600.0,
        max_connections: int = 64,
        max_tokens: int = 1024,
        max_tokens_per_peer: int = MAX_TOKENS_PER_PEER,
        max_handshakes: int = MAX_HANDSHAKES,
        keep_alive: bool = True,
        keep_idle_s: float = KEEP_IDLE_S,
    ) -> None:
        self.service = service
        self.host = host
        self.identity = identity
        self.token_ttl_s = token_ttl_s
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.max_tokens = max_tokens
        self.max_tokens_per_peer = max_tokens_per_peer
        self.max_handshakes = max_handshakes
        # Kept connections: offered in OpenBulk answers; how long one waits for its next stream.
        self.keep_alive = keep_alive
        self.keep_idle_s = keep_idle_s
        self.kept_streams = 0  # streams that came on a kept connection
        # Handlers of kept connections waiting for their next stream, longest idle first.
        self._idle: OrderedDict[asyncio.Task[None], None] = OrderedDict()
        self.handshaking = 0  # connections that have not presented a valid token yet
        self.port = 0
        self._grants: OrderedDict[bytes, _Grant] = OrderedDict()
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        # Followed in its directory: a connection after a renewal gets the renewed certificate.
        self._follower = idm.IdentityFollower(identity) if identity is not None else None

    # -- tokens --------------------------------------------------------------------------------

    def issue(self, key: RingKey, from_node_id: str) -> tuple[bytes, float]:
        """A one-time token for `from_node_id`'s stream of attempt `key`, and its lifetime;
        TooManyTokens when that node holds `max_tokens_per_peer` unused ones already."""
        now = time.monotonic()
        while self._grants:
            oldest = next(iter(self._grants.values()))
            if oldest.expires > now and len(self._grants) < self.max_tokens:
                break
            self._grants.popitem(last=False)
        held = sum(
            1 for g in self._grants.values() if g.from_node_id == from_node_id and g.expires > now
        )
        if held >= self.max_tokens_per_peer:
            raise TooManyTokens(
                f"node {from_node_id!r} holds {held} unused bulk tokens of this peer (at most "
                f"{self.max_tokens_per_peer} per peer)"
            )
        token = secrets.token_bytes(TOKEN_BYTES)
        self._grants[token] = _Grant(key, from_node_id, now + self.token_ttl_s)
        return token, self.token_ttl_s

    def _take(self, token: bytes) -> _Grant | None:
        grant = self._grants.pop(token, None)
        if grant is None or grant.expires < time.monotonic():
            return None
        return grant

    # -- socket --------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self.host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self._accept_task = loop.create_task(self._accept_loop(), name="bulk-accept")

    async def stop(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(BaseException):
                await self._accept_task
            self._accept_task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        handlers = list(self._handlers)
        for t in handlers:
            t.cancel()
        for t in handlers:
            with contextlib.suppress(BaseException):
                await t

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                log.warning("bulk socket accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if (
                len(self._handlers) >= self.max_connections
                and self._idle
                and self.handshaking < self.max_handshakes
            ):
                # A new connection goes before the longest idle kept one.
                oldest, _ = self._idle.popitem(last=False)
                oldest.cancel()
            elif (
                len(self._handlers) >= self.max_connections
                or self.handshaking >= self.max_handshakes
            ):
                log.debug(
                    "bulk connection refused: %d open, %d before their token (limits %d, %d)",
                    len(self._handlers),
                    self.handshaking,
                    self.max_connections,
                    self.max_handshakes,
                )
                sock.close()
                continue
            task = loop.create_task(self._serve(sock), name="bulk-stream")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, sock: socket.socket) -> None:
        _configure(sock)
        tls = self._follower is not None
        conn = (
            TlsConn(sock, server_ssl_context(self._follower.current()))
            if self._follower is not None
            else Conn(sock)
        )
        share_len = KEY_SHARE_BYTES if isinstance(conn, TlsConn) else 0
        # Counted from the accept: the TLS handshake and the token must come within
        # handshake_timeout_s, and at most max_handshakes connections wait for theirs.
        self.handshaking += 1
        try:
            try:
                async with asyncio.timeout(self.handshake_timeout_s):
                    await conn.handshake()
                    hello = bytearray(len(MAGIC) + TOKEN_BYTES + share_len)
                    await conn.recv_exactly(memoryview(hello))
            finally:
                self.handshaking -= 1
            if bytes(hello[: len(MAGIC)]) != MAGIC:
                return  # not our protocol: just close
            grant = self._take(bytes(hello[len(MAGIC) : len(MAGIC) + TOKEN_BYTES]))
            if grant is None:
                await self._refuse(
                    conn, grpc.StatusCode.UNAUTHENTICATED, "unknown, used or expired bulk token"
                )
                return
            if tls:
                principal = conn.peer_principal()
                if principal is not None and principal.id in self.service.revoked:
                    await self._refuse(
                        conn,
                        grpc.StatusCode.UNAUTHENTICATED,
                        f"the certificate of node {principal.id!r} has been revoked (the "
                        "coordinator's revocation list)",
                    )
                    return
                if (
                    principal is None
                    or principal.role != idm.ROLE_NODE
                    or principal.id != grant.from_node_id
                ):
                    who = str(principal) if principal is not None else "no certificate"
                    await self._refuse(
                        conn,
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"the bulk token of node {grant.from_node_id!r} was presented by {who}",
                    )
                    return
            if isinstance(conn, TlsConn):
                # Both shares went inside TLS: the stream leaves it for sealed records.
                share = secrets.token_bytes(KEY_SHARE_BYTES)
                await conn.sendall([_REPLY.pack(REPLY_OK, len(share)) + share])
                conn.seal(bytes(hello[len(MAGIC) + TOKEN_BYTES :]), share)
            else:
                await conn.sendall([_REPLY.pack(REPLY_OK, 0)])
            peer = grant.from_node_id  # the connection's node, for every stream on it
            next_grant: _Grant | None = grant
            while next_grant is not None and await self._receive(conn, next_grant):
                next_grant = await self._next_stream(conn, peer, tls)
        except (TimeoutError, OSError, ssl.SSLError, BulkError) as exc:
            log.debug("bulk connection ended: %r", exc)
        finally:
            conn.close()

    async def _next_stream(self, conn: Conn, peer: str, tls: bool) -> _Grant | None:
        """Wait (up to `keep_idle_s`) for `peer`'s next stream on a kept connection: its grant
        (answered OK), or None when the sender closes, stays idle or is refused (then closed)."""
        head = bytearray(len(MAGIC_NEXT) + _NEXT.size)
        view = memoryview(head)
        task = asyncio.current_task()
        assert task is not None
        self._idle[task] = None
        try:
            async with asyncio.timeout(self.keep_idle_s):
                got = await conn.recv_into(view)
        except TimeoutError:
            return None
        finally:
            self._idle.pop(task, None)
        if got == 0:
            return None  # the sender closed (an older one does after every stream)
        async with asyncio.timeout(self.handshake_timeout_s):
            await conn.recv_exactly(view[got:])
            if bytes(head[: len(MAGIC_NEXT)]) != MAGIC_NEXT:
                return None  # not our protocol: just close
            job_len, round_, attempt = _NEXT.unpack_from(head, len(MAGIC_NEXT))
            if not 0 < job_len <= 4 * MAX_ID_CHARS or round_ < 0 or attempt < 0:
                await self._refuse(
                    conn,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"malformed next stream (job id of {job_len} bytes, round {round_}, "
                    f"attempt {attempt})",
                )
                return None
            raw = bytearray(job_len)
            await conn.recv_exactly(memoryview(raw))
        try:
            job_id = raw.decode()
        except UnicodeDecodeError:
            job_id = ""
        if not job_id or len(job_id) > MAX_ID_CHARS:
            await self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, "malformed job id")
            return None
        if tls:
            principal = conn.peer_principal()
            if principal is None or principal.id in self.service.revoked:
                await self._refuse(
                    conn,
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the certificate of node {peer!r} has been revoked (the coordinator's "
                    "revocation list)",
                )
                return None
        key: RingKey = (job_id, round_, attempt)
        try:
            ann = await self.service.mailbox.wait_open(key, NEXT_STREAM_WAIT_S)
        except AttemptExpired as exc:
            await self._refuse(conn, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return None
        if ann is None or ann.left_node_id != peer:
            why = (
                f"was not announced to this node within {NEXT_STREAM_WAIT_S:.1f}s"
                if ann is None
                else f"has {ann.left_node_id!r}, not {peer!r}, as this node's left neighbour"
            )
            await self._refuse(
                conn, grpc.StatusCode.FAILED_PRECONDITION, f"ring attempt {key} {why}"
            )
            return None
        await conn.sendall([_REPLY.pack(REPLY_OK, 0)])
        self.kept_streams += 1
        return _Grant(key, peer, math.inf)

    async def _refuse(
        self,
        conn: Conn,
        code: grpc.StatusCode,
        details: str,
        failed_node: str | None = None,
    ) -> None:
        """Send an ERROR reply, then read on for a moment so that it is not lost to a reset."""
        with contextlib.suppress(OSError, ssl.SSLError, BulkError, TimeoutError):
            await conn.sendall([_error_reply(code, details, failed_node)])
            conn.shutdown_write()
            sink = memoryview(bytearray(64 * 1024))
            async with asyncio.timeout(2.0):
                while await conn.recv_into(sink):
                    pass

    async def _receive(self, conn: Conn, grant: _Grant) -> bool:
        """Route one stream to its attempt's receive slot; True when it ended with an ACK on a
        connection kept for the next stream."""
        service = self.service
        key = grant.key
        try:
            receiver = await service.mailbox.wait_for(key, service.join_timeout_s)
        except AttemptExpired as exc:
            await self._refuse(conn, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return False
        if receiver is None:
            await self._refuse(
                conn,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no ring all-reduce for attempt {key} started here within "
                f"{service.join_timeout_s:.1f}s",
            )
            return False
        if grant.from_node_id != receiver.left_node_id:
            await self._refuse(
                conn,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {grant.from_node_id!r} is not this node's left neighbour "
                f"({receiver.left_node_id!r}) in attempt {key}",
            )
            return False
        if receiver.attached:
            await self._refuse(
                conn, grpc.StatusCode.ALREADY_EXISTS, f"attempt {key} already has a stream"
            )
            return False
        receiver.attached = True
        prefix = bytearray(_FRAME.size)
        prefix_view = memoryview(prefix)
        head = bytearray(MAX_HEAD_BYTES)
        head_view = memoryview(head)
        scratch = memoryview(bytearray(MAX_CHUNK_BYTES))
        received = 0
        error: tuple[grpc.StatusCode, str, str | None] | None = None
        end_reason = "its stream ended early"
        try:
            while True:
                async with asyncio.timeout(self.idle_timeout_s):
                    await conn.recv_exactly(prefix_view)
                head_len, payload_len = _FRAME.unpack(prefix)
                if head_len == 0:
                    if payload_len:
                        raise WireError("an end frame carries no payload")
                    break
                if head_len > MAX_HEAD_BYTES or payload_len > MAX_CHUNK_BYTES:
                    raise WireError(
                        f"frame of {head_len} header and {payload_len} payload bytes is over "
                        f"the limits ({MAX_HEAD_BYTES}, {MAX_CHUNK_BYTES})"
                    )
                await conn.recv_exactly(head_view[:head_len])
                chunk = parse_checked_ring_chunk(bytes(head_view[:head_len]))
                if len(chunk.payload):
                    raise WireError("a bulk frame's header carries no data")
                failed = receiver.failed_node()
                if failed is not None:
                    error = (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"ring attempt {key} was aborted: node {failed!r} failed",
                        failed,
                    )
                    end_reason = "the attempt failed"
                    return False
                if chunk.phase == ABORT_PHASE:
                    data = scratch[:payload_len]
                    await conn.recv_exactly(data)
                    failed_id = failed_id_of(replace(chunk, payload=data))
                    if failed_id not in receiver.members:
                        raise WireError(
                            f"the abort names {failed_id!r}, not a member of attempt {key}"
                        )
                    receiver.on_abort(failed_id, grant.from_node_id)
                    end_reason = "it reported a failure"
                    break
                if chunk.key != key:
                    raise WireError(f"chunk for {chunk.key} on the stream of {key}")
                if chunk.from_node_id != grant.from_node_id:
                    raise WireError("from_node_id changed mid-stream")
                try:
                    target = receiver.bulk_target(chunk, payload_len, scratch)
                    await conn.recv_exactly(target)
                    receiver.bulk_received(target)
                except ChunkRejected as exc:
                    # The sender is the failed node: the refusal names it, so that it does not
                    # blame this node for ending its stream.
                    end_reason = f"sent a bad chunk: {exc}"
                    error = (exc.code, str(exc), exc.failed_node or grant.from_node_id)
                    return False
                received += payload_len
                service.received_bytes += payload_len
                service.received_chunks += 1
                if YIELD_EVERY_CHUNKS and not service.received_chunks % YIELD_EVERY_CHUNKS:
                    # Reads that find data never suspend: let the rest of the loop run now
                    # and then. (Not after every chunk: that costs more than it gains.)
                    await asyncio.sleep(0)
        except WireError as exc:
            end_reason = f"sent a malformed frame: {exc}"
            error = (grpc.StatusCode.INVALID_ARGUMENT, str(exc), None)
            return False
        except TimeoutError:
            end_reason = f"its stream was idle for {self.idle_timeout_s:.0f}s"
            raise
        finally:
            receiver.on_stream_end(end_reason)
            if error is not None:
                await self._refuse(conn, *error)
        failed = receiver.failed_node()
        if failed is not None and not receiver.complete:
            await self._refuse(
                conn,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ring attempt {key} was aborted: node {failed!r} failed",
                failed,
            )
            return False
        await conn.sendall([_REPLY.pack(REPLY_ACK, _ACK.size) + _ACK.pack(received)])
        if self.keep_alive:
            return True
        conn.shutdown_write()
        # Wait (briefly) for the sender to close first, so the ACK is not lost to a reset.
        with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
            async with asyncio.timeout(2.0):
                sink = memoryview(bytearray(4096))
                while await conn.recv_into(sink):
                    pass
        return False


def listen_host(listen: str) -> str:
    """The host to bind the bulk socket to: that of the PeerService's HOST:PORT."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    return host or "0.0.0.0"


__all__ = [
    "BulkError",
    "BulkHost",
    "BulkListener",
    "BulkOutput",
    "MAX_HEAD_BYTES",
    "chunk_head",
    "client_ssl_context",
    "connect",
    "listen_host",
    "server_ssl_context",
    "TooManyTokens",
]
