"""This node's side of the ring: its mailbox plus channels and output streams to its peers.

`RingTransport` lives as long as the agent's PeerServer: it caches a channel per peer, opens each
attempt's `RingOutput` to the right neighbour (its bulk socket, `node_agent.ring.bulk`, else a
PushChunks call), pings, probes and reports aborts, and with an identity holds the seal signer
and verifier of the all-gather. It keeps one idle bulk connection per peer whose receiver keeps
them (`node_agent.ring.bulk`, "Kept connections") for that peer's next attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Collection
from typing import Protocol

import grpc

from epochmesh.identity import Identity, IdentityFollower, split_address
from epochmesh.ring.seal import (
    SegmentSigner,
    SegmentVerifier,
)
from epochmesh.v1 import peer_pb2
from node_agent.ring import bulk, client
from node_agent.ring.bulk import BulkError
from node_agent.ring.bulk_conn import Conn
from node_agent.ring.mailbox import RingMailbox, RingStatus
from node_agent.ring.service import PeerServer
from node_agent.ring.wire import (
    OPEN_BULK,
    PUSH_CHUNKS,
    RingKey,
    abort_chunk,
    failed_node_from_metadata,
    frame_ring_chunk,
)

NO_BULK_RETRY_S = 600.0  # after UNIMPLEMENTED: ask again (the peer may have been upgraded)

log = logging.getLogger(__name__)


BULK_FAILED_RETRY_S = 60.0  # after a bulk socket could not be set up
# The longest a kept bulk connection may take to take the next stream before a fresh one is
# opened instead (it answers within a round trip when it is alive).
RESUME_TIMEOUT_S = 2.0


class RingOutput(Protocol):
    """This node's stream to its right neighbour for one attempt: the bulk socket
    (`node_agent.ring.bulk.BulkOutput`) or a PushChunks call (`_GrpcOutput`)."""

    async def write_chunk(self, header: bytes, offset: int, payload: bytes | memoryview) -> None:
        """Send one chunk; one of `OUTPUT_ERRORS` when the stream is broken or refused."""

    async def finish(self) -> int:
        """End the stream; the payload bytes the receiver confirms (or `OUTPUT_ERRORS`)."""

    async def failure(self, exc: BaseException, timeout: float) -> BulkError:
        """What the receiver said when the stream failed: status, details, failed node."""

    def on_broken(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` if the stream breaks before `finish` while nothing is written."""

    def done(self) -> bool: ...

    def close(self) -> None: ...


OUTPUT_ERRORS = (grpc.aio.AioRpcError, asyncio.InvalidStateError, BulkError)


class _GrpcOutput:
    """A PushChunks client stream: the fallback when a peer has no (reachable) bulk socket."""

    def __init__(self, call: grpc.aio.StreamUnaryCall) -> None:
        self.call = call

    async def write_chunk(self, header: bytes, offset: int, payload: bytes | memoryview) -> None:
        await self.call.write(frame_ring_chunk(header, offset, payload))

    async def finish(self) -> int:
        await self.call.done_writing()
        ack = await self.call
        return int(ack.received_bytes)

    async def failure(self, exc: BaseException, timeout: float) -> BulkError:
        call = self.call
        try:
            async with asyncio.timeout(timeout):
                code = await call.code()
                details = await call.details()
                failed = failed_node_from_metadata(await call.trailing_metadata())
        except (TimeoutError, grpc.aio.AioRpcError):
            return BulkError(str(exc))
        return BulkError(details, code, failed)

    def on_broken(self, callback: Callable[[BaseException], None]) -> None:
        return None  # a broken call is noticed at the next write, as before the bulk path

    def done(self) -> bool:
        return bool(self.call.done())

    def close(self) -> None:
        self.call.cancel()


class RingTransport:
    """This node's side of the ring: its id, its mailbox, and cached channels to peers.

    `bulk` (default True): send ring chunks over the right neighbour's bulk socket
    (`node_agent.ring.bulk`) when it has one, else (and whenever setting it up fails) over
    PushChunks. With an `identity`, all-gather segments are sealed by their owner and checked
    on arrival (`signer`, `verifier`: against the identity's CA and `revoked()`, the node ids
    whose certificates the coordinator revoked).
    """

    def __init__(
        self,
        node_id: str,
        mailbox: RingMailbox,
        *,
        identity: Identity | None = None,
        bulk: bool = True,
        revoked: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        if not node_id:
            raise ValueError("node_id is required")
        self.node_id = node_id
        self.mailbox = mailbox
        self.bulk = bulk
        self._identity = identity
        # Followed in its directory: channels and bulk sockets opened after a renewal present
        # the renewed certificate (channels opened before are closed with the transport).
        self._follower = IdentityFollower(identity) if identity is not None else None
        self._retired: list[grpc.aio.Channel] = []
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        # Peers whose bulk socket is not to be tried again before a time (time.monotonic()).
        self._no_bulk: dict[tuple[str, str], float] = {}
        # One kept bulk connection per peer: (connection, time.monotonic() it went idle, the
        # identity it was opened with).
        self._kept: dict[tuple[str, str], tuple[Conn, float, Identity | None]] = {}
        self.bulk_streams = 0  # attempts sent over the bulk socket / over PushChunks
        self.grpc_streams = 0
        self.bulk_reused = 0  # of bulk_streams: sent on a kept connection
        self._closed = False
        self.signer: SegmentSigner | None = None
        self.verifier: SegmentVerifier | None = None
        if identity is not None:
            self.signer = SegmentSigner(self._signing_identity)
            self.verifier = SegmentVerifier(identity.ca_pem, revoked)

    @classmethod
    def for_server(
        cls,
        node_id: str,
        server: PeerServer,
        *,
        identity: Identity | None = None,
        bulk: bool = True,
    ) -> RingTransport:
        service = server.service
        return cls(
            node_id,
            server.mailbox,
            identity=identity,
            bulk=bulk,
            revoked=lambda: service.revoked,
        )

    async def open_output(
        self, address: str, node_id: str, key: RingKey, timeout: float
    ) -> RingOutput:
        """The stream for attempt `key` to node `node_id`: its bulk socket if it has one and
        it can be set up within `timeout` s, else a PushChunks call."""
        peer_key = (address, node_id)
        if self.bulk and self._no_bulk.get(peer_key, 0.0) <= time.monotonic():
            try:
                async with asyncio.timeout(timeout):
                    out = await self._open_bulk(address, node_id, key)
                self.bulk_streams += 1
                return out
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._no_bulk[peer_key] = time.monotonic() + NO_BULK_RETRY_S
                    log.info("peer %s has no bulk socket: ring chunks go over PushChunks", node_id)
                else:
                    log.warning(
                        "OpenBulk to %s failed (%s): PushChunks for attempt %s",
                        node_id,
                        exc.code().name,
                        key,
                    )
            except (TimeoutError, OSError, BulkError) as exc:
                # Unreachable (a firewall, NAT) or refused: do not pay for it every round.
                self._no_bulk[peer_key] = time.monotonic() + BULK_FAILED_RETRY_S
                log.warning(
                    "bulk socket of %s unusable (%r): PushChunks for attempt %s and for %.0fs",
                    node_id,
                    exc,
                    key,
                    BULK_FAILED_RETRY_S,
                )
        self.grpc_streams += 1
        return _GrpcOutput(self.push_call(address, node_id))

    async def _open_bulk(self, address: str, node_id: str, key: RingKey) -> bulk.BulkOutput:
        identity = self._current_identity()
        peer_key = (address, node_id)
        kept = self._kept.pop(peer_key, None)
        if kept is not None:
            conn, since, opened_with = kept
            if opened_with is identity and time.monotonic() - since < bulk.KEEP_REUSE_S:
                try:
                    async with asyncio.timeout(RESUME_TIMEOUT_S):
                        out = await bulk.resume(conn, key, self._keeper(peer_key, identity))
                    self.bulk_reused += 1
                    return out
                except (TimeoutError, OSError, ssl.SSLError, BulkError) as exc:
                    log.debug("kept bulk connection to %s unusable (%r): a fresh one", node_id, exc)
            conn.close()
        method = self.channel(address, node_id).unary_unary(
            OPEN_BULK,
            request_serializer=peer_pb2.OpenBulkRequest.SerializeToString,
            response_deserializer=peer_pb2.OpenBulkResponse.FromString,
        )
        job_id, round_, attempt = key
        reply = await method(
            peer_pb2.OpenBulkRequest(
                job_id=job_id, round=round_, attempt=attempt, from_node_id=self.node_id
            )
        )
        if not 0 < reply.port < 65536 or len(reply.token) != bulk.TOKEN_BYTES:
            raise BulkError("malformed OpenBulk reply")
        host, _ = split_address(address)
        ctx = bulk.client_ssl_context(identity) if identity is not None else None
        return await bulk.connect(
            host,
            reply.port,
            reply.token,
            node_id=node_id,
            ssl_context=ctx,
            release=self._keeper(peer_key, identity) if reply.keep_alive else None,
        )

    def _keeper(
        self, peer_key: tuple[str, str], identity: Identity | None
    ) -> Callable[[Conn], None]:
        """Where a stream to `peer_key` that ended with an ACK leaves its connection: kept for
        the peer's next attempt (one per peer; a second one is closed)."""

        def keep(conn: Conn) -> None:
            if self._closed or peer_key in self._kept:
                conn.close()
                return
            self._kept[peer_key] = (conn, time.monotonic(), identity)

        return keep

    def _drop_kept(self, peer_key: tuple[str, str] | None = None) -> None:
        """Close the kept bulk connection to `peer_key` (None: all of them)."""
        keys = list(self._kept) if peer_key is None else [peer_key]
        for k in keys:
            kept = self._kept.pop(k, None)
            if kept is not None:
                with contextlib.suppress(OSError):
                    kept[0].close()

    def _current_identity(self) -> Identity | None:
        """This node's identity, renewed certificate included (channels of an older one are
        retired: calls in flight finish on them)."""
        if self._follower is None:
            return None
        identity = self._follower.current()
        if identity is not self._identity:
            self._identity = identity
            self._retired.extend(self._channels.values())
            self._channels = {}
        return identity

    def _signing_identity(self) -> Identity:
        """`_current_identity` of a transport that has one (the seal signer's source)."""
        identity = self._current_identity()
        assert identity is not None
        return identity

    def channel(self, address: str, node_id: str) -> grpc.aio.Channel:
        """The (cached) channel to node `node_id`'s PeerService at `address`."""
        identity = self._current_identity()
        key = (address, node_id if identity is not None else "")
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = client.peer_channel(address, node_id, identity)
        return ch

    def push_call(self, address: str, node_id: str) -> grpc.aio.StreamUnaryCall:
        method = self.channel(address, node_id).stream_unary(
            PUSH_CHUNKS,
            request_serializer=None,  # frames are serialized RingChunks already
            response_deserializer=peer_pb2.RingAck.FromString,
        )
        return method()

    async def ping(self, address: str, node_id: str, timeout: float) -> float:
        return await client.ping(self.channel(address, node_id), timeout=timeout)

    async def ring_status(
        self, address: str, node_id: str, key: RingKey, timeout: float
    ) -> RingStatus:
        """A member's state in attempt `key` (starved? failed, naming whom?), by Ping."""
        return await client.ring_status(self.channel(address, node_id), key, timeout=timeout)

    async def probe(self, address: str, node_id: str) -> tuple[float, float]:
        """(rtt_s, bandwidth_bytes_per_s) to a peer, for the coordinator's ring order."""
        return await client.probe_link(self.channel(address, node_id))

    async def send_abort(
        self, address: str, node_id: str, key: RingKey, failed: str, timeout: float
    ) -> bool:
        """Report `failed` for attempt `key` to node `node_id`; True if it took it."""
        call = self.push_call(address, node_id)
        try:
            async with asyncio.timeout(timeout):
                await call.write(abort_chunk(key, self.node_id, failed))
                await call.done_writing()
                await call
            return True
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("abort report to %s failed: %s", address, exc)
            return False
        finally:
            call.cancel()

    async def drop_channel(self, address: str, node_id: str) -> None:
        """Close the channel to a peer that left (a later call opens a new one)."""
        self._no_bulk.pop((address, node_id), None)
        self._drop_kept((address, node_id))
        ch = self._channels.pop((address, node_id if self._identity is not None else ""), None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        self._closed = True
        self._drop_kept()
        channels, self._channels = [*self._retired, *self._channels.values()], {}
        self._retired = []
        for ch in channels:
            await ch.close()
