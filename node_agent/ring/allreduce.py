"""Chunked, pipelined ring all-reduce between agents over their PeerServices.

    transport = RingTransport.for_server(node_id, peer_server)     # once per agent
    summed = await ring_allreduce(flat_grads, ring, transport, deadline_s,
                                  job_id=job_id, round=round_)     # every round

`ring_allreduce` sums a flat float32 CPU buffer over the ring in place (the schedule, and why
every rank ends with bit-identical sums, is in `epochmesh.ring.schedule`). It sends to its right
neighbour on ONE stream per attempt and the left neighbour's stream lands in this node's
`RingMailbox`, where every chunk is added (reduce-scatter) or copied (all-gather) into the buffer
the moment it arrives. The stream is the right neighbour's bulk socket (`node_agent.ring.bulk`: the
same RingChunk frames on a TCP connection of their own, TLS with node certificates when the ring
runs with identities, set up through the OpenBulk RPC); when the neighbour has none
(UNIMPLEMENTED: an older agent) or it cannot be set up in time (a firewall, say), it is a
PushChunks call on the gRPC channel kept open across rounds, for that attempt. Both carry the
same chunks with the same checks and failure reports. Chunk c of step t leaves as soon as chunk
c of step t-1 has arrived, so both phases pipeline at 1 MiB granularity. The caller pre-scales
its gradient (e.g. by b_i / B) so that the sum is the weighted mean.

Failures never hang. Every wait is bounded by `deadline_s` (the first step also by
`join_timeout_s`, for neighbours still computing their gradient):

- the right neighbour does not take a chunk in time (gRPC flow control or a full socket buffer
  holds the sender back), or refuses or breaks the stream and does not answer a ping: it
  failed (if it answers naming the node its attempt found failed: that one; else wait up to
  `deadline_s` for a report naming the node that failed further along, then blame it);
- the left neighbour's stream breaks or ends early, or sends a malformed chunk: it failed;
- while a node waits for its left neighbour, it asks it for its state in this attempt (a Ping
  naming the attempt) every `deadline_s` (at least 0.5 s): three unanswered in a row, or one
  after the wait: it failed (also during the join wait); it names a failed node: that one.
  Nothing in time: if it is starved itself (waiting on its own left), keep waiting for the
  report of the node next to the real failure (up to the join timeout plus a deadline per
  member); if it is alive and not waiting on anyone, yet sends nothing: blame it after one
  more `deadline_s`;
- a report arrives (an abort chunk, in-band or broadcast, or a refusal naming a node in the
  trailing metadata): that node failed.

The node that detects a failure itself reports it to every other member (a one-chunk abort
stream each) and all nodes pass it on in-band on their own stream, so that every survivor
raises `RingPeerFailed` naming the same node, typically within about `deadline_s`. After a
failure the buffer holds partial sums: retry with a fresh copy of the gradient, the new ring and
attempt + 1.

Wire codecs ("fp16", "bf16", "int8"): every chunk is encoded on the wire and accumulated in
float32; the owner of a segment replaces its sum by decode(encode(sum)) and the all-gather
forwards those encoded bytes untouched, so the result stays bit-identical across ranks.

Cost. Everything that depends only on (ring size, buffer size, codec, rank) is planned once and
cached (`_plan`): a round only prefixes the chunk headers with (job, round, attempt, sender).
Over the bulk socket a chunk costs no copy in Python on the way out (`sendmsg` of its header and
a view of the buffer) and none beyond the kernel's on the way in (into a preallocated buffer,
reduced from there with numpy; a chunk that is only copied lands in the buffer directly), plus
the reduction and per attempt one OpenBulk call and a connect (a TLS handshake with
identities). With 4 ranks on 2 cores, 64 MiB, plaintext, `scripts/bench_allreduce.py` measures
it at roughly 0.8-1.0 of gloo's bus bandwidth on a quiet machine (0.6-0.75 at load average 5-7:
gloo's threads cope better with shared cores) for about 1.2-1.4x gloo's CPU; with TLS (AES-GCM
on this process's event loop) it is about as fast as PushChunks over TLS, roughly 0.25-0.3 of
gloo, for a little less CPU. PushChunks (the fallback, `--transport grpc`)
reaches about 0.45 of gloo plaintext: grpcio's Python data path copies every message twice on
the way out and three times or more on the way in, with a thread hand-off per message each side
(`--floor` times that transport alone). With identities the all-gather is sealed
(docs/ring-rounds.md, "Sealed all-gather"): per attempt one SHA-256 pass over the buffer (about
1.4 GB/s on this machine, on the event loop), one signature and n-1 signature checks
(`scripts/bench_ring_seal.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np
import torch

from epochmesh.errors import CodecError
from epochmesh.identity import Identity, IdentityFollower, split_address
from epochmesh.ring.schedule import ALL_GATHER, RING_CODECS, RingSchedule, chunk_elems_for
from epochmesh.ring.seal import (
    OwnerRevoked,
    Seal,
    SealError,
    SegmentSigner,
    SegmentVerifier,
    seal_message,
)
from epochmesh.v1 import agent_pb2, common_pb2, peer_pb2
from epochmesh.wire import compression
from node_agent.ring import bulk
from node_agent.ring import service as peer
from node_agent.ring.bulk import BulkError
from node_agent.ring.service import (
    ABORT_PHASE,
    ChunkRejected,
    PeerServer,
    RingChunkView,
    RingKey,
    RingMailbox,
    abort_chunk,
    failed_node_from_metadata,
    frame_ring_chunk,
    ring_chunk_header,
    ring_chunk_seal,
)

log = logging.getLogger(__name__)


class RingPeerFailed(Exception):
    """A ring member failed or stalled; `node_id` names it.

    `reported_by` is None when this node saw the failure itself, else the member whose report
    it got. `key` is (job_id, round, attempt). `fault` (agent_pb2.RingFault): what this node
    found wrong in the data `node_id`, its left neighbour, sent (UNSPECIFIED otherwise).
    """

    def __init__(
        self,
        node_id: str,
        reason: str,
        *,
        reported_by: str | None = None,
        key: RingKey | None = None,
        fault: agent_pb2.RingFault = agent_pb2.RING_FAULT_UNSPECIFIED,
    ) -> None:
        self.node_id = node_id
        self.reason = reason
        self.reported_by = reported_by
        self.key = key
        self.fault = fault
        by = f" (reported by {reported_by})" if reported_by else ""
        super().__init__(f"ring peer {node_id!r} failed: {reason}{by}")

    @property
    def detected_here(self) -> bool:
        return self.reported_by is None


class RingLike(Protocol):
    """What `ring_allreduce` needs of a ring (common_pb2.RingAssignment has it)."""

    node_ids: Sequence[str]
    peer_addresses: Sequence[str]
    rank: int
    attempt: int


@dataclass(frozen=True)
class Ring:
    """A plain RingLike (tests, scripts); the coordinator sends common_pb2.RingAssignment."""

    node_ids: Sequence[str]
    peer_addresses: Sequence[str]
    rank: int
    attempt: int = 0


# ---------------------------------------------------------------------------------------------
# Transport: this node's mailbox plus channels to its peers


NO_BULK_RETRY_S = 600.0  # after UNIMPLEMENTED: ask again (the peer may have been upgraded)
BULK_FAILED_RETRY_S = 60.0  # after a bulk socket could not be set up


class RingOutput(Protocol):
    """This node's stream to its right neighbour for one attempt: the bulk socket
    (`node_agent.ring.bulk.BulkOutput`) or a PushChunks call (`_GrpcOutput`)."""

    async def write_chunk(self, header: bytes, offset: int, payload: bytes | memoryview) -> None:
        """Send one chunk; one of `_OUTPUT_ERRORS` when the stream is broken or refused."""

    async def finish(self) -> int:
        """End the stream; the payload bytes the receiver confirms (or `_OUTPUT_ERRORS`)."""

    async def failure(self, exc: BaseException, timeout: float) -> BulkError:
        """What the receiver said when the stream failed: status, details, failed node."""

    def on_broken(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` if the stream breaks before `finish` while nothing is written."""

    def done(self) -> bool: ...

    def close(self) -> None: ...


_OUTPUT_ERRORS = (grpc.aio.AioRpcError, asyncio.InvalidStateError, BulkError)


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
        return self.call.done()

    def close(self) -> None:
        self.call.cancel()


class RingTransport:
    """This node's side of the ring: its id, its mailbox, and cached channels to peers.

    `bulk` (default True): send ring chunks over the right neighbour's bulk socket
    (`node_agent.ring.bulk`) when it has one, else (and whenever setting it up fails) over PushChunks.
    With an `identity`, all-gather segments are sealed by their owner and checked on arrival
    (`signer`, `verifier`: against the identity's CA and `revoked()`, the node ids whose
    certificates the coordinator revoked).
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
        self.bulk_streams = 0  # attempts sent over the bulk socket / over PushChunks
        self.grpc_streams = 0
        self.signer: SegmentSigner | None = None
        self.verifier: SegmentVerifier | None = None
        if identity is not None:
            self.signer = SegmentSigner(self._current_identity)
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
        method = self.channel(address, node_id).unary_unary(
            peer.OPEN_BULK,
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
        identity = self._current_identity()
        ctx = bulk.client_ssl_context(identity) if identity is not None else None
        return await bulk.connect(host, reply.port, reply.token, node_id=node_id, ssl_context=ctx)

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

    def channel(self, address: str, node_id: str) -> grpc.aio.Channel:
        """The (cached) channel to node `node_id`'s PeerService at `address`."""
        identity = self._current_identity()
        key = (address, node_id if identity is not None else "")
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = peer.peer_channel(address, node_id, identity)
        return ch

    def push_call(self, address: str, node_id: str) -> grpc.aio.StreamUnaryCall:
        method = self.channel(address, node_id).stream_unary(
            peer.PUSH_CHUNKS,
            request_serializer=None,  # frames are serialized RingChunks already
            response_deserializer=peer_pb2.RingAck.FromString,
        )
        return method()

    async def ping(self, address: str, node_id: str, timeout: float) -> float:
        return await peer.ping(self.channel(address, node_id), timeout=timeout)

    async def ring_status(
        self, address: str, node_id: str, key: RingKey, timeout: float
    ) -> peer.RingStatus:
        """A member's state in attempt `key` (starved? failed, naming whom?), by Ping."""
        return await peer.ring_status(self.channel(address, node_id), key, timeout=timeout)

    async def probe(self, address: str, node_id: str) -> tuple[float, float]:
        """(rtt_s, bandwidth_bytes_per_s) to a peer, for the coordinator's ring order."""
        return await peer.probe_link(self.channel(address, node_id))

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
        ch = self._channels.pop((address, node_id if self._identity is not None else ""), None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        channels, self._channels = [*self._retired, *self._channels.values()], {}
        self._retired = []
        for ch in channels:
            await ch.close()


# ---------------------------------------------------------------------------------------------
# Receive side: one slot per attempt, fed by the PeerService handler


@dataclass(frozen=True)
class _Expect:
    phase: str
    step: int
    segment: int
    lo: int
    hi: int
    offset: int  # byte offset within the segment's encoded stream
    nbytes: int
    reduce: bool
    forward: bool  # a lossy all-gather chunk this node passes on as received
    last: bool  # the segment's last chunk (an all-gather one carries the owner's seal)


def _chunk_offsets(codec: str, chunks: Sequence[tuple[int, int]]) -> list[int]:
    """Byte offset of every chunk within its segment's encoded stream."""
    out: list[int] = []
    offset = 0
    for lo, hi in chunks:
        out.append(offset)
        offset += compression.encoded_size(codec, hi - lo)
    return out


class _Fault(ChunkRejected):
    """A chunk refused for what it holds: the sender (or `failed_node`) sent bad data; `fault`
    is what this node reports to the coordinator about it."""

    fault: agent_pb2.RingFault = agent_pb2.RING_FAULT_UNSPECIFIED

    def __init__(self, message: str, failed_node: str | None = None) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.failed_node = failed_node


class _NonFinite(_Fault):
    """A chunk held NaN or Inf values (RING_FAULT_NON_FINITE)."""

    fault = agent_pb2.RING_FAULT_NON_FINITE


class _Tampered(_Fault):
    """An all-gather segment that does not match its owner's seal (RING_FAULT_TAMPERED)."""

    fault = agent_pb2.RING_FAULT_TAMPERED


def _require_finite(values: np.ndarray, e: _Expect) -> None:
    """As the parameter server refuses NaN/Inf in updates: a chunk that carries any is refused
    (INVALID_ARGUMENT), which fails the attempt naming the neighbour that sent it (its own
    addend entered the partial sum there: every hop checks what it receives)."""
    if not np.isfinite(values).all():
        raise _NonFinite(
            f"{e.phase} step {e.step} segment {e.segment} at offset {e.offset} holds NaN or "
            "Inf values"
        )


class _ReceiveSlot:
    """Applies the left neighbour's chunks, in schedule order, to the buffer."""

    def __init__(
        self,
        key: RingKey,
        expect: Sequence[_Expect],
        rank: int,
        codec: str,
        buf: np.ndarray,
        node_ids: Sequence[str],
        verifier: SegmentVerifier | None = None,
        received: torch.Tensor | None = None,
    ) -> None:
        n = len(node_ids)
        self.key = key
        # Verification: where the reduce-scatter's received values are kept (decoded, before
        # they are added; epochmesh.ring.evidence), or None.
        self._received = received
        self.codec = codec
        self.left_node_id = node_ids[(rank - 1) % n]
        self.members = frozenset(node_ids)
        self._node_ids = tuple(node_ids)
        # With a verifier every all-gather segment must match its owner's seal: hashed as
        # its chunks arrive, checked at its last one (which is kept to be forwarded).
        self._verifier = verifier
        self._hasher: hashlib._Hash | None = None
        self._sealed_chunk: RingChunkView | None = None  # the bulk chunk being received
        self._seals: dict[int, bytes] = {}  # segment -> its seal's RingChunk fields
        self.attached = False
        self._buf = buf
        self._tbuf = torch.from_numpy(buf)
        self._expect = expect
        self.total = len(expect)
        self.pos = 0
        self.received_bytes = 0
        self._forward: dict[int, memoryview] = {}
        self._waiter: tuple[int, asyncio.Future[None]] | None = None
        self._waiting_since: float | None = None  # time.monotonic() the run began to wait
        self._failure: RingPeerFailed | None = None
        self.closed = asyncio.Event()  # the left neighbour's stream ended after every chunk
        self.failed_future: asyncio.Future[RingPeerFailed] = (
            asyncio.get_running_loop().create_future()
        )

    # -- RingReceiver protocol (called by the PeerService) --------------------------------------

    @property
    def complete(self) -> bool:
        return self.pos >= self.total

    def failed_node(self) -> str | None:
        return self._failure.node_id if self._failure is not None else None

    def starved_s(self) -> float:
        since = self._waiting_since
        if since is None or self._failure is not None:
            return 0.0
        return max(time.monotonic() - since, 1e-6)

    def on_chunk(self, chunk: RingChunkView) -> None:
        payload = chunk.payload
        e = self._check(chunk, len(payload))
        with self._faults():
            self._apply(e, payload)
            self._check_seal(e, payload, chunk)
        self._advance(len(payload))

    @contextlib.contextmanager
    def _faults(self) -> Iterator[None]:
        """A chunk refused for what it holds fails the attempt naming the left neighbour with
        the fault (the sender of the stream is the left neighbour: its certificate says so
        under mutual TLS), which this node reports to the coordinator."""
        try:
            yield
        except _Fault as exc:
            if exc.failed_node is None:
                err = RingPeerFailed(
                    self.left_node_id, f"sent a bad chunk: {exc}", key=self.key, fault=exc.fault
                )
            else:
                err = RingPeerFailed(exc.failed_node, str(exc), key=self.key, fault=exc.fault)
            self.fail(err)
            raise

    def _check_seal(self, e: _Expect, data: memoryview, chunk: RingChunkView | None) -> None:
        """Hash an all-gather chunk's bytes (`data`: as received); at the segment's last one
        (`chunk`: its header) check the owner's seal: the digest, then the owner's signature
        and certificate. Every hop checks before it takes the last chunk (and so before it can
        forward it): a seal that fails here was altered or made up by the left neighbour."""
        if self._verifier is None or e.phase != ALL_GATHER:
            return
        if e.offset == 0:
            self._hasher = hashlib.sha256()
        assert self._hasher is not None
        self._hasher.update(data)
        if not e.last:
            return
        digest = self._hasher.digest()
        self._hasher = None
        owner = self._node_ids[(e.segment - 1) % len(self._node_ids)]
        where = f"all_gather step {e.step} segment {e.segment} (owner {owner!r})"
        if chunk is None or not chunk.segment_digest:
            raise _Tampered(f"{where} arrived without its owner's seal")
        if chunk.segment_digest != digest:
            raise _Tampered(f"{where} does not match its owner's digest")
        seal = Seal(digest, chunk.owner_signature, chunk.owner_certificate)
        job_id, round_, attempt = self.key
        try:
            self._verifier.check(
                owner, seal_message(job_id, round_, attempt, e.segment, owner, digest), seal
            )
        except OwnerRevoked as exc:
            raise _Fault(f"{where}: {exc}", failed_node=owner) from None
        except SealError as exc:
            raise _Tampered(f"{where}: {exc}") from None
        self._seals[e.segment] = ring_chunk_seal(seal.digest, seal.signature, seal.certificate)

    def seal_of(self, segment: int) -> bytes:
        """The checked seal of all-gather `segment` as RingChunk fields, to forward unchanged
        (b"" without a verifier)."""
        return self._seals.get(segment, b"")

    def bulk_target(self, chunk: RingChunkView, nbytes: int, scratch: memoryview) -> memoryview:
        e = self._check(chunk, nbytes)
        self._sealed_chunk = chunk if e.last else None
        if self.codec == "none" and not e.reduce:
            return memoryview(self._buf[e.lo : e.hi]).cast("B")  # a copy: land it in place
        if e.forward:
            return memoryview(bytearray(nbytes))  # kept until this node forwards it
        return scratch[:nbytes]

    def bulk_received(self, payload: memoryview) -> None:
        e = self._expect[self.pos]
        with self._faults():
            if self.codec != "none" or e.reduce:
                self._apply(e, payload)
            else:  # landed in place: check what arrived
                _require_finite(self._buf[e.lo : e.hi], e)
            self._check_seal(e, payload, self._sealed_chunk)
        self._advance(len(payload))

    def _check(self, chunk: RingChunkView, nbytes: int) -> _Expect:
        """The expected chunk `chunk` is (ChunkRejected if it is not), payload `nbytes` long."""
        if self.pos >= self.total:
            raise ChunkRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk beyond the {self.total} chunks of attempt {self.key}",
            )
        e = self._expect[self.pos]
        if (
            chunk.phase != e.phase
            or chunk.step != e.step
            or chunk.segment != e.segment
            or chunk.offset != e.offset
        ):
            raise ChunkRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"expected {e.phase} step {e.step} segment {e.segment} at offset {e.offset}, got "
                f"{chunk.phase} step {chunk.step} segment {chunk.segment} at offset "
                f"{chunk.offset}",
            )
        if chunk.from_node_id != self.left_node_id:
            raise ChunkRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk from {chunk.from_node_id!r} on the stream of {self.left_node_id!r}",
            )
        if nbytes != e.nbytes or (chunk.spec.codec or "none") != self.codec:
            raise ChunkRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"expected {e.nbytes} bytes of codec {self.codec!r}, got {nbytes} bytes "
                f"of codec {chunk.spec.codec!r}",
            )
        return e

    def _apply(self, e: _Expect, payload: memoryview) -> None:
        dst = self._buf[e.lo : e.hi]
        if self.codec == "none":
            src = np.frombuffer(payload, dtype=np.float32)
            _require_finite(src, e)
            if e.reduce:
                if self._received is not None:
                    self._received[e.lo : e.hi].copy_(torch.from_numpy(src))
                np.add(dst, src, out=dst)
            else:
                np.copyto(dst, src)
        else:
            try:
                decoded = compression.decode(payload, self.codec, (e.hi - e.lo,))
            except CodecError as exc:
                raise ChunkRejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            _require_finite(decoded.numpy(), e)
            if e.reduce:
                if self._received is not None:
                    self._received[e.lo : e.hi].copy_(decoded)
                self._tbuf[e.lo : e.hi].add_(decoded)
            else:
                self._tbuf[e.lo : e.hi].copy_(decoded)
                if e.forward:
                    self._forward[self.pos] = payload

    def _advance(self, nbytes: int) -> None:
        self.pos += 1
        self.received_bytes += nbytes
        waiter = self._waiter
        if waiter is not None and self.pos > waiter[0]:
            self._waiter = None
            if not waiter[1].done():
                waiter[1].set_result(None)

    def on_abort(self, failed_node_id: str, reporter: str) -> None:
        self.fail(
            RingPeerFailed(
                failed_node_id, "reported failed", reported_by=reporter or "?", key=self.key
            )
        )

    def on_stream_end(self, reason: str) -> None:
        if self.complete:
            self.closed.set()
        else:
            self.fail(
                RingPeerFailed(
                    self.left_node_id,
                    f"{reason} after {self.pos} of {self.total} chunks",
                    key=self.key,
                )
            )

    # -- used by the run -------------------------------------------------------------------------

    @property
    def failure(self) -> RingPeerFailed | None:
        return self._failure

    def fail(self, err: RingPeerFailed) -> RingPeerFailed:
        """Record a failure (the first one wins) and wake the waiting sender; returns the winner."""
        if self._failure is not None:
            return self._failure
        self._failure = err
        if not self.failed_future.done():
            self.failed_future.set_result(err)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter[1].done():
                waiter[1].set_exception(err)
        return err

    async def wait(self, index: int, timeout: float) -> None:
        """Until chunk `index` of the receive order has arrived; TimeoutError after `timeout`.
        While it waits, this node counts as starved (`starved_s`), also across the retries of
        one wait: that ends only once the chunk waited for has arrived."""
        if self._failure is not None:
            raise self._failure
        if self.pos > index:
            self._waiting_since = None
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = (index, fut)
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                await fut
            self._waiting_since = None
        finally:
            if self._waiter is not None and self._waiter[1] is fut:
                self._waiter = None

    def take_forward(self, index: int) -> memoryview:
        return self._forward.pop(index)


# ---------------------------------------------------------------------------------------------
# Send side and failure handling of one attempt


@dataclass(frozen=True)
class _Send:
    t: int
    lo: int
    hi: int
    offset: int
    suffix: bytes  # the chunk's own RingChunk fields; the attempt's prefix goes in front
    dep: int | None  # receive-order index this chunk waits for
    kind: str  # "local" | "final" (lossy owner's first all-gather send) | "forward"
    segment: int
    seal: str  # "" | "own" (the owner's all-gather send: hashed) | "forward" (forwarded)
    last: bool  # the segment's last chunk (where a seal travels)


@dataclass(frozen=True)
class _Plan:
    """Everything of one attempt that depends only on (n, numel, codec, rank)."""

    schedule: RingSchedule
    sends: tuple[_Send, ...]
    expect: tuple[_Expect, ...]


@functools.lru_cache(maxsize=16)
def _plan(n: int, numel: int, codec: str, rank: int) -> _Plan:
    """The send and receive plan of `rank`, built once per shape and reused every round.

    A chunk's header is the attempt's prefix (job, round, attempt, sender: fields 1-4) followed
    by `suffix` (phase, step, segment, spec, last); protobuf merges the two into one RingChunk.
    """
    sch = RingSchedule.build(n, numel, chunk_elems_for(codec))
    offsets = [_chunk_offsets(codec, sch.segment_chunks(k)) for k in range(n)]
    last_step = sch.num_steps - 1
    expect: list[_Expect] = []
    for t, seg, c in sch.recv_order(rank):
        lo, hi = sch.segment_chunks(seg)[c]
        last = c == len(sch.segment_chunks(seg)) - 1
        expect.append(
            _Expect(
                phase=sch.phase(t),
                step=sch.phase_step(t),
                segment=seg,
                lo=lo,
                hi=hi,
                offset=offsets[seg][c],
                nbytes=compression.encoded_size(codec, hi - lo),
                reduce=t < n - 1,
                forward=codec != "none" and n - 1 <= t < last_step,
                last=last,
            )
        )
    # Receive-order index of the first chunk of every step.
    base = [0] * (sch.num_steps + 1)
    for t in range(sch.num_steps):
        base[t + 1] = base[t] + len(sch.segment_chunks(sch.recv_segment(rank, t)))
    sends: list[_Send] = []
    for t in range(sch.num_steps):
        seg = sch.send_segment(rank, t)
        chunks = sch.segment_chunks(seg)
        for c, (lo, hi) in enumerate(chunks):
            nbytes = compression.encoded_size(codec, hi - lo)
            suffix = peer_pb2.RingChunk(
                phase=sch.phase(t),
                step=sch.phase_step(t),
                segment=seg,
                spec=common_pb2.TensorSpec(
                    dtype="float32", shape=[hi - lo], codec=codec, nbytes=nbytes
                ),
                last=c == len(chunks) - 1,
            ).SerializeToString()
            if codec == "none" or t < n - 1:
                kind = "local"
            elif t == n - 1:
                kind = "final"
            else:
                kind = "forward"
            dep = None if t == 0 else base[t - 1] + c
            seal = "" if t < n - 1 else "own" if t == n - 1 else "forward"
            last = c == len(chunks) - 1
            sends.append(_Send(t, lo, hi, offsets[seg][c], suffix, dep, kind, seg, seal, last))
    return _Plan(schedule=sch, sends=tuple(sends), expect=tuple(expect))


class _NoAnswer(RingPeerFailed):
    """The left neighbour did not answer a ping in time."""


# While a node waits for its left neighbour (before its timeout), this many unanswered pings in
# a row mean the neighbour failed.
EARLY_PROBE_MISSES = 3


class _RingRun:
    def __init__(
        self,
        *,
        buffer: torch.Tensor,
        ring: RingLike,
        transport: RingTransport,
        deadline_s: float,
        codec: str,
        job_id: str,
        round_: int,
        join_timeout_s: float,
        received: torch.Tensor | None = None,
    ) -> None:
        n = len(ring.node_ids)
        self.n = n
        self.rank = ring.rank
        self.node_ids = list(ring.node_ids)
        self.members = frozenset(self.node_ids)
        self.addresses = list(ring.peer_addresses)
        self.me = self.node_ids[self.rank]
        self.left = self.node_ids[(self.rank - 1) % n]
        self.right = self.node_ids[(self.rank + 1) % n]
        self.right_address = self.addresses[(self.rank + 1) % n]
        self.left_address = self.addresses[(self.rank - 1) % n]
        self.key: RingKey = (job_id, round_, int(ring.attempt))
        self.transport = transport
        self.deadline_s = deadline_s
        self.join_timeout_s = join_timeout_s
        self.probe_timeout_s = min(max(deadline_s / 2, 0.2), 5.0)
        # How often a node waiting for its left neighbour checks that it is still there.
        self.probe_every_s = max(deadline_s, 0.5)
        self.codec = codec
        self.tensor = buffer
        self.buf = buffer.numpy()
        plan = _plan(n, buffer.numel(), codec, self.rank)
        self.schedule = plan.schedule
        self.slot = _ReceiveSlot(
            self.key,
            plan.expect,
            self.rank,
            codec,
            self.buf,
            self.node_ids,
            verifier=transport.verifier,
            received=received,
        )
        self.sends = plan.sends
        # Seals this node's all-gather segment (None: the ring runs without identities).
        self.signer = transport.signer
        self._hasher: hashlib._Hash | None = None
        # Fields 1-4 of every chunk this attempt sends (job, round, attempt, sender).
        self.prefix = ring_chunk_header(
            job_id=job_id, round=round_, attempt=self.key[2], from_node_id=self.me, phase=""
        )
        self.abort_header = ring_chunk_header(
            job_id=job_id,
            round=round_,
            attempt=self.key[2],
            from_node_id=self.me,
            phase=ABORT_PHASE,
        )
        self.out: RingOutput | None = None
        self._watch: asyncio.Task[None] | None = None
        self.sent_bytes = 0

    # -- the attempt -----------------------------------------------------------------------------

    async def run(self) -> None:
        sender = asyncio.create_task(self._send_all(), name=f"ring-send {self.key}")
        try:
            done, _ = await asyncio.wait(
                {sender, self.slot.failed_future}, return_when=asyncio.FIRST_COMPLETED
            )
            if sender in done:
                exc = sender.exception()
                if exc is None:
                    return
                err = self.slot.fail(self._as_failure(exc))
            else:
                err = self.slot.failed_future.result()
                # The sender wakes at its next wait; let it finish a write in progress.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(sender), min(self.deadline_s, 1.0))
            log.warning("ring attempt %s on %s failed: %s", self.key, self.me, err)
            if err.detected_here:
                await self._broadcast(err.node_id)
            await self._close_output(err.node_id)
            raise err
        finally:
            if not sender.done():
                sender.cancel()
                with contextlib.suppress(BaseException):
                    await sender
            if self.out is not None and not self.out.done():
                self.out.close()
            if self._watch is not None and not self._watch.done():
                self._watch.cancel()

    def _as_failure(self, exc: BaseException) -> RingPeerFailed:
        if isinstance(exc, RingPeerFailed):
            return exc
        log.error("ring attempt %s: internal error", self.key, exc_info=exc)
        return RingPeerFailed(self.me, f"internal error: {exc!r}", key=self.key)

    async def _send_all(self) -> None:
        out = self.out = await self.transport.open_output(
            self.right_address, self.right, self.key, min(max(self.deadline_s, 1.0), 10.0)
        )
        out.on_broken(self._output_broken)
        first = self.deadline_s + self.join_timeout_s
        for s in self.sends:
            if s.dep is not None and self.slot.pos <= s.dep:
                await self._await_input(s.dep, first if s.t == 1 else self.deadline_s)
            if self.slot.failure is not None:
                raise self.slot.failure
            payload = self._payload(s)
            header = self.prefix + s.suffix
            if s.seal and self.signer is not None:
                header += self._seal(s, payload)
            await self._write(out, header, s.offset, payload, s.t == 0)
            self.sent_bytes += memoryview(payload).nbytes
        try:
            async with asyncio.timeout(self.deadline_s):
                confirmed = await out.finish()
        except TimeoutError:
            raise RingPeerFailed(
                self.right,
                f"did not confirm the stream within {self.deadline_s:.1f}s",
                key=self.key,
            ) from None
        except _OUTPUT_ERRORS as exc:
            raise await self._right_failure(out, exc) from None
        if confirmed != self.sent_bytes:
            raise RingPeerFailed(
                self.right,
                f"confirmed {confirmed} bytes of the {self.sent_bytes} sent",
                key=self.key,
            )
        if not self.slot.complete:
            await self._await_input(self.slot.total - 1, self.deadline_s)
        # Return only once the left neighbour has closed its stream: the handler is then done
        # with the buffer, and the left neighbour's confirmation is on its way.
        if not self.slot.closed.is_set():
            try:
                async with asyncio.timeout(self.deadline_s):
                    await self.slot.closed.wait()
            except TimeoutError:
                raise RingPeerFailed(
                    self.left,
                    f"did not close its stream within {self.deadline_s:.1f}s",
                    key=self.key,
                ) from None

    def _payload(self, s: _Send) -> bytes | memoryview:
        if self.codec == "none":
            return memoryview(self.buf[s.lo : s.hi]).cast("B")
        if s.kind == "forward":
            assert s.dep is not None
            return self.slot.take_forward(s.dep)
        view = self.tensor[s.lo : s.hi]
        data = compression.encode(view, self.codec)
        if s.kind == "final":
            # The owner keeps exactly what every other rank will decode.
            view.copy_(compression.decode(data, self.codec, (s.hi - s.lo,)))
        return data

    def _seal(self, s: _Send, payload: bytes | memoryview) -> bytes:
        """The seal fields an all-gather chunk carries: at the last chunk of this node's own
        segment its digest (of the bytes sent, hashed chunk by chunk) signed by this node; at
        the last chunk of a forwarded one the seal it arrived with (checked on arrival)."""
        if s.seal == "forward":
            return self.slot.seal_of(s.segment) if s.last else b""
        assert self.signer is not None
        if s.offset == 0:
            self._hasher = hashlib.sha256()
        assert self._hasher is not None
        self._hasher.update(payload)
        if not s.last:
            return b""
        digest = self._hasher.digest()
        self._hasher = None
        job_id, round_, attempt = self.key
        seal = self.signer.seal(
            seal_message(job_id, round_, attempt, s.segment, self.me, digest), digest
        )
        return ring_chunk_seal(seal.digest, seal.signature, seal.certificate)

    async def _write(
        self,
        out: RingOutput,
        header: bytes,
        offset: int,
        payload: bytes | memoryview,
        first: bool,
    ) -> None:
        timeout = self.deadline_s + (self.join_timeout_s if first else 0.0)
        try:
            async with asyncio.timeout(timeout):
                await out.write_chunk(header, offset, payload)
        except TimeoutError:
            raise RingPeerFailed(
                self.right, f"took no data for {timeout:.1f}s", key=self.key
            ) from None
        except _OUTPUT_ERRORS as exc:
            raise await self._right_failure(out, exc) from None

    def _output_broken(self, exc: BaseException) -> None:
        """The right neighbour closed or refused our stream while we may be waiting on input
        (e.g. it died after taking our first chunks): fail the attempt on what that means."""
        if self.slot.failure is None and self._watch is None and self.out is not None:
            self._watch = asyncio.get_running_loop().create_task(self._fail_right(self.out, exc))

    async def _fail_right(self, out: RingOutput, exc: BaseException) -> None:
        self.slot.fail(await self._right_failure(out, exc))

    async def _right_failure(self, out: RingOutput, exc: BaseException) -> RingPeerFailed:
        """What the right neighbour's refusal says: a failed node it names, else itself."""
        said = await out.failure(exc, min(self.deadline_s, 2.0))
        code, details, failed = said.code, said.details, said.failed_node
        if failed and failed != self.right:
            return RingPeerFailed(
                failed, details or "reported failed", reported_by=self.right, key=self.key
            )
        name = code.name if code is not None else type(exc).__name__
        own = RingPeerFailed(
            self.right, f"refused or broke the stream: {name} {details}", key=self.key
        )
        # A right neighbour that ends our stream without naming anyone may have given up on a
        # failure further along (its abort report to us can be a moment behind). Ask it: it
        # names the node its attempt found failed; if it answers without one, wait for the
        # report before blaming it.
        if self.slot.failure is not None:
            return self.slot.failure
        try:
            st = await self.transport.ring_status(
                self.right_address, self.right, self.key, self.probe_timeout_s
            )
        except (TimeoutError, grpc.aio.AioRpcError, ValueError):
            return own
        if st.failed_node_id == self.me:  # it refused what this node sent
            return RingPeerFailed(
                self.me,
                details or "refused by the right neighbour",
                reported_by=self.right,
                key=self.key,
            )
        # Only another member can have failed (a peer's answer is not trusted beyond that).
        if st.failed_node_id in self.members and st.failed_node_id != self.right:
            return RingPeerFailed(
                st.failed_node_id, "reported failed", reported_by=self.right, key=self.key
            )
        try:
            async with asyncio.timeout(self.deadline_s):
                return await asyncio.shield(self.slot.failed_future)
        except TimeoutError:
            return own

    async def _await_input(self, index: int, timeout: float) -> None:
        """Until chunk `index` has arrived from the left neighbour, or RingPeerFailed.

        While it waits (up to `timeout`), the left neighbour is asked for its state in this
        attempt every `probe_every_s`: EARLY_PROBE_MISSES unanswered pings in a row mean it
        failed (a dead or stopped node is not given the whole join timeout), and a failed node
        it names is the failed one. After `timeout` without the chunk: if it is starved itself
        (waiting for its own left), the failure is further along and the node next to it will
        name it: keep waiting (as long as its own wait may last: the join timeout plus a
        deadline per member). If it has what it needs but sends nothing: one more deadline of
        grace, then it is blamed."""
        t0 = time.monotonic()
        end = t0 + timeout
        misses = 0
        while True:
            try:
                await self.slot.wait(index, max(min(end - time.monotonic(), self.probe_every_s), 0))
                return
            except TimeoutError:
                pass
            if time.monotonic() >= end:
                break
            try:
                await self._left_status(time.monotonic() - t0)
                misses = 0
            except _NoAnswer:
                # A neighbour busy loading or computing can miss one ping: blame it early only
                # after several in a row (after the wait, one miss is enough).
                misses += 1
                if misses >= EARLY_PROBE_MISSES:
                    raise
        give_up = time.monotonic() + self.join_timeout_s + (self.n + 1) * self.deadline_s
        idle_answers = 0
        while True:
            starved = (await self._left_status(time.monotonic() - t0)).starved_s > 0.0
            if not starved:
                idle_answers += 1
            if idle_answers > 1 or time.monotonic() >= give_up:
                break
            try:
                await self.slot.wait(index, self.deadline_s)
                return
            except TimeoutError:
                pass
        raise RingPeerFailed(
            self.left,
            f"answers pings but sent nothing for {time.monotonic() - t0:.1f}s",
            key=self.key,
        )

    async def _left_status(self, waited: float) -> peer.RingStatus:
        """The left neighbour's state in this attempt; RingPeerFailed naming it when it does
        not answer, or naming the node it reports failed."""
        try:
            st = await self.transport.ring_status(
                self.left_address, self.left, self.key, self.probe_timeout_s
            )
        except (TimeoutError, grpc.aio.AioRpcError, ValueError) as exc:
            raise _NoAnswer(
                self.left,
                f"sent nothing for {waited:.1f}s and does not answer pings ({type(exc).__name__})",
                key=self.key,
            ) from None
        if st.failed_node_id in self.members and st.failed_node_id != self.me:
            raise RingPeerFailed(
                st.failed_node_id, "reported failed", reported_by=self.left, key=self.key
            )
        return st

    # -- after a failure -------------------------------------------------------------------------

    async def _broadcast(self, failed: str) -> None:
        timeout = min(self.deadline_s, 2.0)
        targets = [
            (addr, nid)
            for nid, addr in zip(self.node_ids, self.addresses, strict=True)
            if nid not in (self.me, failed)
        ]
        await asyncio.gather(
            *(self.transport.send_abort(a, nid, self.key, failed, timeout) for a, nid in targets),
            return_exceptions=True,
        )

    async def _close_output(self, failed: str) -> None:
        out = self.out
        if out is None or out.done():
            return
        if failed == self.right:
            out.close()
            return
        try:
            async with asyncio.timeout(min(self.deadline_s, 1.0)):
                await out.write_chunk(self.abort_header, 0, failed.encode())
                await out.finish()
        except (TimeoutError, *_OUTPUT_ERRORS):
            pass
        finally:
            out.close()


# ---------------------------------------------------------------------------------------------
# Entry point


async def ring_allreduce(
    buffer: torch.Tensor,
    ring: RingLike,
    transport: RingTransport,
    deadline_s: float,
    codec: str = "none",
    *,
    job_id: str,
    round: int,
    join_timeout_s: float | None = None,
    received: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum `buffer` (flat, contiguous float32 on the CPU) over the ring, in place; returns it.

    `ring`: node ids and PeerService addresses in ring order, this node's rank, the attempt
    (bumped whenever the ring is re-formed). `deadline_s`: per-step deadline from measured
    bandwidth (`epochmesh.ring.schedule.step_deadline_s`): a neighbour that makes no progress for that
    long has failed. `join_timeout_s` (default `deadline_s`) is added to the first step, for
    neighbours still computing. `codec`: "none" | "fp16" | "bf16" | "int8" on the wire.
    `received` (float32, as `buffer`; verification): gets every value received in the
    reduce-scatter, decoded, before it is added (untouched elsewhere).

    Every rank gets bit-identical sums. Raises RingPeerFailed(node_id) when a member dies,
    stalls or refuses (the buffer then holds partial sums), ValueError for bad arguments.
    """
    _check_args(buffer, ring, transport, deadline_s, codec, job_id, round)
    if received is not None and (
        received.shape != buffer.shape or received.dtype != torch.float32 or received.is_cuda
    ):
        raise ValueError("received must be a flat float32 CPU tensor of the buffer's size")
    n = len(ring.node_ids)
    if n == 1 or buffer.numel() == 0:
        return buffer
    run = _RingRun(
        buffer=buffer,
        ring=ring,
        transport=transport,
        deadline_s=deadline_s,
        codec=codec,
        job_id=job_id,
        round_=round,
        join_timeout_s=deadline_s if join_timeout_s is None else join_timeout_s,
        received=received,
    )
    transport.mailbox.register(run.slot)
    try:
        await run.run()
    finally:
        transport.mailbox.unregister(run.slot)
    return buffer


def _check_args(
    buffer: torch.Tensor,
    ring: RingLike,
    transport: RingTransport,
    deadline_s: float,
    codec: str,
    job_id: str,
    round_: int,
) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, not {type(buffer).__name__}")
    if buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.device.type != "cpu":
        raise ValueError(
            f"buffer must be a flat float32 CPU tensor (got {buffer.dtype}, "
            f"{buffer.dim()} dims, on {buffer.device})"
        )
    if not buffer.is_contiguous() or buffer.requires_grad:
        raise ValueError("buffer must be contiguous and must not require grad")
    n = len(ring.node_ids)
    if n < 1 or len(ring.peer_addresses) != n:
        raise ValueError(
            f"ring has {n} node ids and {len(ring.peer_addresses)} addresses; "
            "need the same number, at least one"
        )
    if len(set(ring.node_ids)) != n:
        raise ValueError("ring node ids must be unique")
    if not 0 <= ring.rank < n:
        raise ValueError(f"rank {ring.rank} is outside 0..{n - 1}")
    if ring.node_ids[ring.rank] != transport.node_id:
        raise ValueError(
            f"rank {ring.rank} of the ring is {ring.node_ids[ring.rank]!r}, but this node is "
            f"{transport.node_id!r}"
        )
    if not (deadline_s > 0 and math.isfinite(deadline_s)):
        raise ValueError(f"deadline_s must be a positive number (got {deadline_s})")
    if codec not in RING_CODECS:
        raise ValueError(f"codec {codec!r} is not supported in a ring; use one of {RING_CODECS}")
    if not job_id:
        raise ValueError("job_id is required")
    if round_ < 0 or ring.attempt < 0:
        raise ValueError("round and attempt must be >= 0")


__all__ = ["Ring", "RingLike", "RingPeerFailed", "RingTransport", "ring_allreduce"]
