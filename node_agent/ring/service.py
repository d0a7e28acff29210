"""The PeerService an agent runs for its ring neighbours (grpc.aio), and its client helpers.

Server side (`PeerServer` wraps a grpc.aio server with this service, health and reflection):

- ``PushChunks`` (client stream from the left neighbour): the chunks of one ring all-reduce
  attempt. The first chunk names (job, round, attempt); the stream is routed to the receive slot
  that `ring_allreduce` registered for that key in the `RingMailbox`. A stream may arrive before
  its slot (the neighbour finished its gradient first): it then waits, bounded by `join_timeout_s`,
  without reading on (gRPC flow control holds the sender back). Chunks are applied as they
  arrive, straight into the caller's buffer: nothing is queued. Only attempts this node was
  given a task of (`RingMailbox.announce`, by the ring trainer when the task arrives) are taken:
  a stream for another one waits `announce_wait_s` for the task at most. Refusals: an attempt
  older than the newest one seen for the job, or one whose slot closed, or one not announced
  or registered in time, or a sender that is not its left neighbour: FAILED_PRECONDITION; a
  second stream for the same slot: ALREADY_EXISTS; malformed chunks (NaN/Inf included, and
  an all-gather segment that does not match its owner's seal): INVALID_ARGUMENT; too many
  streams, in all or of one peer: RESOURCE_EXHAUSTED. When the slot fails, the next
  chunk is answered with FAILED_PRECONDITION and trailing metadata ``epochmesh-failed-node``
  naming the failed node, so the sender learns who failed instead of blaming this node.
  A chunk with phase ``"abort"`` (its ``chunk.data`` is the failed node's id, UTF-8) reports a
  failure of that attempt, in-band on a data stream or as a stream of its own: taken only for
  an open attempt (announced here and not over: FAILED_PRECONDITION otherwise), from one of its
  members (PERMISSION_DENIED) and naming one (INVALID_ARGUMENT); nothing is stored for later.
  Callers whose certificate is on the coordinator's revocation list (it comes with ring tasks,
  `PeerService.add_revoked`) are refused with UNAUTHENTICATED on every method.
- ``TransferState``: parameters and optimizer state from a provider callback, as a header
  (`TensorBundle`) and 1 MiB chunks; `fetch_state` is the joiner's side.
- ``Ping``: echoes the payload; `ping` and `probe_link` measure round trip and bandwidth. A
  ping that names a ring attempt is also answered with this node's state in it
  (`ring_status`): whether it is starved (waiting for its own left neighbour's data, so it will
  report a failure further along itself) and the failed node once the attempt has failed (kept
  a while after the slot closed), so a neighbour blames the right node without waiting.
- ``OpenBulk``: a one-time token for this peer's bulk socket (`node_agent.ring.bulk`, started by
  `PeerServer` next to the gRPC port), which carries a ring attempt's chunks like PushChunks but
  off grpcio. Checked like PushChunks: under mutual TLS the caller's certificate must name
  ``from_node_id`` (PERMISSION_DENIED), a known attempt must have it as left neighbour and an
  attempt that is over here is refused (FAILED_PRECONDITION); UNIMPLEMENTED when this peer has
  no bulk socket (``PeerServer(bulk=False)``, or it could not listen), and senders then use
  PushChunks.

Trust. With an `Identity` the server speaks mutual TLS (`epochmesh.identity`): every caller
presents a node certificate of the coordinator's CA, and a ring stream is accepted only from
the node its chunks name (the left neighbour; any member for an abort): PERMISSION_DENIED
otherwise. Requests that do not parse are INVALID_ARGUMENT, never UNKNOWN.

Data path. ``PushChunks`` does not go through protobuf objects: requests are handled as raw
bytes (`frame_ring_chunk` writes a RingChunk around a payload with one copy, `parse_ring_chunk`
reads one and returns the payload as a memoryview of the received bytes, no copy). The bytes on
the wire are ordinary RingChunk messages, so generated stubs interoperate both ways. This
roughly halves the CPU the data path needs, which decides the throughput when several agents
share a machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from epochmesh import identity as idm
from epochmesh.errors import CodecError
from epochmesh.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import common_pb2, peer_pb2
from epochmesh.wire.tensors import (
    BundleAssembler,
    BundleLimits,
    Expected,
    encode_bundle,
    iter_chunks,
)

if TYPE_CHECKING:
    from node_agent.ring.bulk import BulkListener

log = logging.getLogger(__name__)

SERVICE_NAME = "epochmesh.v1.PeerService"
PUSH_CHUNKS = f"/{SERVICE_NAME}/PushChunks"
TRANSFER_STATE = f"/{SERVICE_NAME}/TransferState"
PING = f"/{SERVICE_NAME}/Ping"
OPEN_BULK = f"/{SERVICE_NAME}/OpenBulk"
ABORT_PHASE = "abort"
FAILED_NODE_KEY = "epochmesh-failed-node"
MAX_ID_CHARS = 256

RingKey = tuple[str, int, int]  # (job_id, round, attempt)


class WireError(ValueError):
    """Bytes that are not a well-formed RingChunk (answered with INVALID_ARGUMENT)."""


# ---------------------------------------------------------------------------------------------
# Wire framing of RingChunk without protobuf objects for the payload


@dataclass(frozen=True)
class RingChunkView:
    """A parsed RingChunk whose payload is a view of the received bytes."""

    job_id: str
    round: int
    attempt: int
    from_node_id: str
    phase: str
    step: int
    segment: int
    spec: common_pb2.TensorSpec
    offset: int
    payload: memoryview
    last: bool
    # The owner's seal of an all-gather segment (on its last chunk; empty otherwise).
    segment_digest: bytes = b""
    owner_signature: bytes = b""
    owner_certificate: bytes = b""

    @property
    def key(self) -> RingKey:
        return (self.job_id, self.round, self.attempt)


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _skip_field(buf: bytes, pos: int, end: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = _read_varint(buf, pos, end)
        pos += length
    elif wire_type == 5:
        pos += 4
    else:
        raise WireError(f"unsupported wire type {wire_type}")
    if pos > end:
        raise WireError("field runs past the end of the message")
    return pos


def ring_chunk_header(
    *,
    job_id: str,
    round: int,
    attempt: int,
    from_node_id: str,
    phase: str,
    step: int = 0,
    segment: int = 0,
    spec: common_pb2.TensorSpec | None = None,
    last: bool = False,
) -> bytes:
    """Serialized RingChunk fields other than `chunk` (prefix of `frame_ring_chunk`)."""
    msg = peer_pb2.RingChunk(
        job_id=job_id,
        round=round,
        attempt=attempt,
        from_node_id=from_node_id,
        phase=phase,
        step=step,
        segment=segment,
        last=last,
    )
    if spec is not None:
        msg.spec.CopyFrom(spec)
    return msg.SerializeToString()


def ring_chunk_seal(digest: bytes, signature: bytes, certificate: bytes) -> bytes:
    """Serialized RingChunk seal fields (11-13), appended to a chunk's header."""
    return peer_pb2.RingChunk(
        segment_digest=digest, owner_signature=signature, owner_certificate=certificate
    ).SerializeToString()


def frame_ring_chunk(header: bytes, offset: int, payload: bytes | memoryview) -> bytes:
    """A serialized RingChunk: `header` (from `ring_chunk_header`) plus field 9, the DataChunk
    {offset, data=payload}. One copy of the payload; equal to what protobuf would produce."""
    n = memoryview(payload).nbytes
    inner = (b"\x08" + _varint(offset) if offset else b"") + b"\x12" + _varint(n)
    return b"".join((header, b"\x4a", _varint(len(inner) + n), inner, payload))


def parse_ring_chunk(data: bytes) -> RingChunkView:
    """Parse a serialized RingChunk; the payload is a zero-copy view of `data`.

    Accepts any valid encoding (fields in any order, unknown fields skipped); the DataChunk
    (field 9) must appear at most once. One-byte tags and lengths (every field our senders
    write except the chunk itself) take a fast path.
    """
    end = len(data)
    pos = 0
    spans: list[tuple[int, int]] = []  # header fields, adjacent ones merged
    chunk_span: tuple[int, int] | None = None
    while pos < end:
        start = pos
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_varint(data, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if number == 9:
            if wire_type != 2:
                raise WireError("RingChunk.chunk must be length-delimited")
            if chunk_span is not None:
                raise WireError("RingChunk.chunk appears twice")
            length, pos = _read_varint(data, pos, end)
            if pos + length > end:
                raise WireError("RingChunk.chunk runs past the end of the message")
            chunk_span = (pos, pos + length)
            pos += length
            continue
        if wire_type == 2 and pos < end and data[pos] < 0x80:
            pos += 1 + data[pos]
            if pos > end:
                raise WireError("field runs past the end of the message")
        elif wire_type == 0 and pos < end and data[pos] < 0x80:
            pos += 1
        else:
            pos = _skip_field(data, pos, end, wire_type)
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], pos)
        else:
            spans.append((start, pos))
    mv = memoryview(data)
    if len(spans) == 1:
        header_bytes = data[spans[0][0] : spans[0][1]]
    else:
        header_bytes = b"".join([mv[a:b] for a, b in spans])
    try:
        head = peer_pb2.RingChunk.FromString(header_bytes)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"malformed RingChunk: {exc}") from None
    offset = 0
    payload = mv[0:0]
    if chunk_span is not None:
        pos, cend = chunk_span
        while pos < cend:
            tag, pos = _read_varint(data, pos, cend)
            number, wire_type = tag >> 3, tag & 7
            if number == 1 and wire_type == 0:
                offset, pos = _read_varint(data, pos, cend)
                if offset >= 1 << 63:
                    offset -= 1 << 64
            elif number == 2 and wire_type == 2:
                length, pos = _read_varint(data, pos, cend)
                if pos + length > cend:
                    raise WireError("DataChunk.data runs past the end of the chunk")
                payload = mv[pos : pos + length]
                pos += length
            else:
                pos = _skip_field(data, pos, cend, wire_type)
    return RingChunkView(
        job_id=head.job_id,
        round=head.round,
        attempt=head.attempt,
        from_node_id=head.from_node_id,
        phase=head.phase,
        step=head.step,
        segment=head.segment,
        spec=head.spec,
        offset=offset,
        payload=payload,
        last=head.last,
        segment_digest=head.segment_digest,
        owner_signature=head.owner_signature,
        owner_certificate=head.owner_certificate,
    )


def abort_chunk(key: RingKey, from_node_id: str, failed_node_id: str) -> bytes:
    """The RingChunk reporting that `failed_node_id` failed in attempt `key`."""
    job_id, round_, attempt = key
    header = ring_chunk_header(
        job_id=job_id, round=round_, attempt=attempt, from_node_id=from_node_id, phase=ABORT_PHASE
    )
    return frame_ring_chunk(header, 0, failed_node_id.encode())


def failed_node_from_metadata(metadata: object) -> str | None:
    """The failed node a PeerService named in its trailing metadata, if any."""
    try:
        for k, v in metadata or ():  # type: ignore[attr-defined]
            if k == FAILED_NODE_KEY:
                return v.decode() if isinstance(v, bytes) else str(v)
    except (TypeError, ValueError):
        return None
    return None


# ---------------------------------------------------------------------------------------------
# Receive routing


class ChunkRejected(Exception):
    """A data chunk that does not fit the receive slot; `code` is the gRPC status to answer,
    `failed_node` the node the refusal names as failed (None: the chunk's sender)."""

    failed_node: str | None = None

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RingReceiver(Protocol):
    """What the mailbox routes a PushChunks stream to (see node_agent.ring.allreduce)."""

    key: RingKey
    left_node_id: str
    members: frozenset[str]
    attached: bool

    def on_chunk(self, chunk: RingChunkView) -> None:
        """Apply one data chunk; ChunkRejected if it is not the expected one."""

    def on_abort(self, failed_node_id: str, reporter: str) -> None:
        """A member reports that `failed_node_id` failed in this attempt."""

    def on_stream_end(self, reason: str) -> None:
        """The left neighbour's stream ended: done if every chunk arrived, else a failure of the
        left neighbour for `reason` (ignored once the attempt has failed)."""

    def failed_node(self) -> str | None:
        """The failed node once this attempt has failed, else None."""

    def starved_s(self) -> float:
        """Seconds this node has been waiting for the left neighbour's data (0 if it is not)."""

    def bulk_target(self, chunk: RingChunkView, nbytes: int, scratch: memoryview) -> memoryview:
        """Check the header of the next chunk (`chunk`, payload not read yet, `nbytes` long;
        ChunkRejected as `on_chunk`) and say where to receive its payload: straight into the
        destination where it is only copied, else `scratch` (or a buffer of its own when the
        receiver keeps it). Then `bulk_received` with that view."""

    def bulk_received(self, payload: memoryview) -> None:
        """The payload of the chunk `bulk_target` was asked about arrived in its target."""

    @property
    def complete(self) -> bool:
        """Every expected chunk has arrived."""


@dataclass(frozen=True)
class RingStatus:
    """A node's state in one ring attempt, as its Ping answers it (`ring_status`)."""

    known: bool  # the attempt is running here, or failed here recently
    starved_s: float  # waiting that long for its own left neighbour's data (0: not waiting)
    failed_node_id: str  # the node the attempt found failed ("" while it has not failed)


@dataclass(frozen=True)
class Announcement:
    """An attempt this node takes part in: its members and this node's left neighbour."""

    members: frozenset[str]
    left_node_id: str
    expires: float  # time.monotonic()


class AttemptExpired(Exception):
    """The (job, round, attempt) is over on this node (finished, failed or superseded)."""


class RingMailbox:
    """Receive slots of this node by (job, round, attempt), and what arrives before them.

    One slot per job at a time: registering one replaces the job's previous slot, and its
    (round, attempt) becomes the job's current one (also when it is lower, e.g. after the
    coordinator rolled the job back to a checkpoint). A stream for a (round, attempt) at or
    below the current one without a slot is over (`AttemptExpired`); a higher one may wait
    for its slot. Aborts for attempts without a slot yet are remembered (a bounded number)
    and fail the slot as soon as it registers.
    """

    def __init__(
        self, *, max_pending_aborts: int = 256, max_jobs: int = 1024, max_announced: int = 256
    ) -> None:
        self._slots: dict[RingKey, RingReceiver] = {}
        self._current: OrderedDict[str, tuple[int, int]] = OrderedDict()  # job -> (round, att.)
        self._aborts: OrderedDict[RingKey, tuple[str, str]] = OrderedDict()
        # Attempts the coordinator announced to this node (ring tasks it received), by key.
        self._announced: OrderedDict[RingKey, Announcement] = OrderedDict()
        self._max_announced = max_announced
        # Failed node of attempts whose slot closed after a failure, for neighbours that ask.
        self._failed: OrderedDict[RingKey, str] = OrderedDict()
        self._changed = asyncio.Event()
        self._max_pending_aborts = max_pending_aborts
        self._max_jobs = max_jobs

    def is_expired(self, key: RingKey) -> bool:
        job_id, round_, attempt = key
        current = self._current.get(job_id)
        return current is not None and key not in self._slots and (round_, attempt) <= current

    def announce(self, key: RingKey, node_ids: Sequence[str], rank: int, ttl_s: float) -> None:
        """The coordinator gave this node a task of attempt `key` (ring `node_ids`, this node
        at `rank`): its left neighbour may connect, and its members may report failures, from
        now until the slot closes (or `ttl_s` passes without one)."""
        n = len(node_ids)
        if n < 1 or not 0 <= rank < n or self.is_expired(key):
            return
        now = time.monotonic()
        for k in [k for k, a in self._announced.items() if a.expires <= now]:
            del self._announced[k]
        self._announced[key] = Announcement(
            frozenset(node_ids), node_ids[(rank - 1) % n], now + max(ttl_s, 1.0)
        )
        self._announced.move_to_end(key)
        while len(self._announced) > self._max_announced:
            self._announced.popitem(last=False)
        self._notify()

    def attempt(self, key: RingKey) -> Announcement | None:
        """Members and left neighbour of an open attempt (its slot is registered, or it was
        announced and is not over); None otherwise."""
        receiver = self._slots.get(key)
        if receiver is not None:
            return Announcement(receiver.members, receiver.left_node_id, math.inf)
        if self.is_expired(key):
            return None
        ann = self._announced.get(key)
        if ann is None or ann.expires <= time.monotonic():
            return None
        return ann

    async def wait_open(self, key: RingKey, timeout: float) -> Announcement | None:
        """`attempt(key)` once it is open (None after `timeout` s); AttemptExpired if over."""
        deadline = time.monotonic() + timeout
        while True:
            ann = self.attempt(key)
            if ann is not None:
                return ann
            if self.is_expired(key):
                raise AttemptExpired(f"ring attempt {key} is over on this node")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return None

    def register(self, receiver: RingReceiver) -> None:
        """Open the slot (replacing the job's previous one) and apply a pending abort."""
        job_id, round_, attempt = receiver.key
        for key in [k for k in self._slots if k[0] == job_id]:
            self.unregister(self._slots[key])
        self._current[job_id] = (round_, attempt)
        self._current.move_to_end(job_id)
        while len(self._current) > self._max_jobs:
            self._current.popitem(last=False)
        self._slots[receiver.key] = receiver
        pending = self._aborts.pop(receiver.key, None)
        if pending is not None:
            receiver.on_abort(*pending)
        self._notify()

    def unregister(self, receiver: RingReceiver) -> None:
        if self._slots.get(receiver.key) is receiver:
            del self._slots[receiver.key]
            self._announced.pop(receiver.key, None)
            failed = receiver.failed_node()
            if failed is not None:
                self._failed[receiver.key] = failed
                while len(self._failed) > self._max_pending_aborts:
                    self._failed.popitem(last=False)
            self._notify()

    def status(self, key: RingKey) -> RingStatus:
        """What this node knows of attempt `key`: for a neighbour deciding whom to blame."""
        receiver = self._slots.get(key)
        if receiver is not None:
            return RingStatus(True, receiver.starved_s(), receiver.failed_node() or "")
        failed = self._failed.get(key)
        if failed is not None:
            return RingStatus(True, 0.0, failed)
        return RingStatus(False, 0.0, "")

    def get(self, key: RingKey) -> RingReceiver | None:
        return self._slots.get(key)

    def abort(self, key: RingKey, failed_node_id: str, reporter: str) -> None:
        """Route an abort report to its slot, or remember it until the slot registers. Only
        for an open attempt (`attempt`; the caller checked that the reporter and the failed
        node are members): a report for any other attempt is dropped."""
        receiver = self._slots.get(key)
        if receiver is not None:
            receiver.on_abort(failed_node_id, reporter)
            return
        if self.attempt(key) is None:
            return
        self._aborts[key] = (failed_node_id, reporter)
        while len(self._aborts) > self._max_pending_aborts:
            self._aborts.popitem(last=False)

    async def wait_for(self, key: RingKey, timeout: float) -> RingReceiver | None:
        """The slot for `key` once registered (None after `timeout` s); AttemptExpired."""
        deadline = time.monotonic() + timeout
        while True:
            receiver = self._slots.get(key)
            if receiver is not None:
                return receiver
            if self.is_expired(key):
                raise AttemptExpired(f"ring attempt {key} is over on this node")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                return None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


# ---------------------------------------------------------------------------------------------
# State transfer


@dataclass(frozen=True)
class StateSnapshot:
    """Parameters and optimizer state of a job at `version`, in a fixed name order."""

    version: int
    tensors: Mapping[str, torch.Tensor]


# (job_id, min_version) -> the newest snapshot, or None when this node has no state of the job.
StateProvider = Callable[[str, int], Awaitable[StateSnapshot | None]]
# (job id, requesting node id) -> None when that node may have the job's state, else why not.
StateAuthorizer = Callable[[str, str], Awaitable[str | None]]


# ---------------------------------------------------------------------------------------------
# The service


class BulkIssuer(Protocol):
    """The bulk socket behind OpenBulk (node_agent.ring.bulk.BulkListener)."""

    port: int

    def issue(self, key: RingKey, from_node_id: str) -> tuple[bytes, float]:
        """A one-time token for `from_node_id`'s stream of attempt `key`, and its lifetime;
        TooManyTokens past the per-peer cap."""


class TooManyTokens(Exception):
    """A peer holds as many unused bulk tokens as it may (RESOURCE_EXHAUSTED)."""


# How long a ring stream for an attempt this node was not (yet) given a task of waits for the
# coordinator's task to arrive here; OpenBulk waits less (the sender falls back to PushChunks).
ANNOUNCE_WAIT_S = 10.0
OPEN_BULK_WAIT_S = 2.0
# Ring streams (PushChunks, OpenBulk calls) one peer may have open here at once: a left
# neighbour needs one per job, plus an abort report now and then.
MAX_STREAMS_PER_PEER = 4


class PeerService:
    """Handlers of epochmesh.v1.PeerService (register with `generic_handler()`)."""

    def __init__(
        self,
        mailbox: RingMailbox | None = None,
        *,
        state_provider: StateProvider | None = None,
        state_authorizer: StateAuthorizer | None = None,
        join_timeout_s: float = 60.0,
        max_streams: int = 64,
        max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
        announce_wait_s: float = ANNOUNCE_WAIT_S,
        verify_callers: bool = False,
    ) -> None:
        """`verify_callers`: the server runs mutual TLS, so check that the certificate of a
        PushChunks caller names the node its chunks claim to come from. `state_authorizer`
        (with `verify_callers`): asked before serving a TransferState to the node named by the
        caller's certificate (the agent asks the coordinator whether it sent that node here)."""
        self.mailbox = mailbox or RingMailbox()
        self.verify_callers = verify_callers
        self.state_provider = state_provider
        self.state_authorizer = state_authorizer
        self.join_timeout_s = join_timeout_s
        self.max_streams = max_streams
        self.max_streams_per_peer = max_streams_per_peer
        self.announce_wait_s = announce_wait_s
        self._streams = 0
        self._peer_streams: dict[str, int] = {}
        # Node ids whose certificates the coordinator revoked (its list, from heartbeats).
        self.revoked: frozenset[str] = frozenset()
        self.bulk: BulkIssuer | None = None  # set by PeerServer when its bulk socket listens
        self.received_bytes = 0  # payload bytes of data chunks applied, all time
        self.received_chunks = 0

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "PushChunks": grpc.stream_unary_rpc_method_handler(
                    self.push_chunks,
                    request_deserializer=None,  # raw bytes: parse_ring_chunk
                    response_serializer=peer_pb2.RingAck.SerializeToString,
                ),
                # Parsed in the handlers, so that bad bytes are INVALID_ARGUMENT.
                "TransferState": grpc.unary_stream_rpc_method_handler(
                    self._transfer_state_raw,
                    request_deserializer=None,
                    response_serializer=peer_pb2.TransferStateResponse.SerializeToString,
                ),
                "Ping": grpc.unary_unary_rpc_method_handler(
                    self._ping_raw,
                    request_deserializer=None,
                    response_serializer=peer_pb2.PingResponse.SerializeToString,
                ),
                "OpenBulk": grpc.unary_unary_rpc_method_handler(
                    self._open_bulk_raw,
                    request_deserializer=None,
                    response_serializer=peer_pb2.OpenBulkResponse.SerializeToString,
                ),
            },
        )

    # -- PushChunks ----------------------------------------------------------------------------

    def add_revoked(self, node_ids: Iterable[str]) -> None:
        """Node ids from the coordinator's revocation list (it comes with every ring task;
        revocations are never lifted): callers with these ids are refused from now on."""
        new = frozenset(node_ids) - self.revoked
        if new:
            log.info("refusing revoked node certificate(s): %s", ", ".join(sorted(new)))
            self.revoked |= new

    async def push_chunks(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> peer_pb2.RingAck:
        if self._streams >= self.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this peer already handles {self._streams} ring streams (at most "
                f"{self.max_streams})",
            )
        self._streams += 1
        try:
            return await self._push_chunks(request_iterator, context)
        except WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises
        finally:
            self._streams -= 1

    @contextlib.asynccontextmanager
    async def _peer_stream(
        self, peer: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        """Count one open stream or call of `peer`; RESOURCE_EXHAUSTED past the per-peer cap."""
        held = self._peer_streams.get(peer, 0)
        if held >= self.max_streams_per_peer:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"node {peer!r} already has {held} ring streams open on this peer (at most "
                f"{self.max_streams_per_peer} per peer)",
            )
        self._peer_streams[peer] = held + 1
        try:
            yield
        finally:
            left = self._peer_streams.get(peer, 1) - 1
            if left > 0:
                self._peer_streams[peer] = left
            else:
                self._peer_streams.pop(peer, None)

    async def _push_chunks(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> peer_pb2.RingAck:
        iterator = aiter(request_iterator)
        try:
            first = parse_checked_ring_chunk(await anext(iterator))  # WireError: INVALID_ARGUMENT
        except StopAsyncIteration:
            return peer_pb2.RingAck(received_bytes=0)
        await self._check_caller(first, context)
        async with self._peer_stream(first.from_node_id, context):
            if first.phase == ABORT_PHASE:
                return await self._abort_stream(first, iterator, context)
            return await self._data_stream(first, iterator, context)

    async def _announced_from_left(
        self,
        key: RingKey,
        from_node_id: str,
        wait_s: float,
        what: str,
        context: grpc.aio.ServicerContext,
    ) -> Announcement:
        """The attempt ``key`` once the coordinator announced it to this node (within
        ``wait_s``), with ``from_node_id`` its left neighbour there; else the call is aborted
        (FAILED_PRECONDITION naming the rule). AttemptExpired if the attempt is over."""
        ann = await self.mailbox.wait_open(key, wait_s)
        if ann is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ring attempt {key} was not announced to this node by the coordinator "
                f"within {wait_s:.1f}s ({what} are taken only for attempts of this node's ring "
                "tasks)",
            )
        assert ann is not None
        if from_node_id != ann.left_node_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {from_node_id!r} is not this node's left neighbour "
                f"({ann.left_node_id!r}) in attempt {key}",
            )
        return ann

    async def _data_stream(
        self,
        first: RingChunkView,
        iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> peer_pb2.RingAck:
        key = first.key
        try:
            remaining = context.time_remaining()
            wait = self.join_timeout_s if remaining is None else min(self.join_timeout_s, remaining)
            wait = max(0.0, wait)
            # Only an attempt the coordinator gave this node a task of, from its left neighbour.
            await self._announced_from_left(
                key, first.from_node_id, min(self.announce_wait_s, wait), "streams", context
            )
            receiver = await self.mailbox.wait_for(key, wait)
        except AttemptExpired as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise
        if receiver is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no ring all-reduce for job {first.job_id!r} round {first.round} attempt "
                f"{first.attempt} started here within {self.join_timeout_s:.1f}s",
            )
            raise AssertionError("unreachable")
        if first.from_node_id != receiver.left_node_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {first.from_node_id!r} is not this node's left neighbour "
                f"({receiver.left_node_id!r}) in attempt {key}",
            )
        if receiver.attached:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"attempt {key} already has an incoming stream"
            )
        receiver.attached = True
        received = 0
        chunk: RingChunkView | None = first
        try:
            while True:
                if chunk is None:
                    try:
                        raw = await anext(iterator)
                    except StopAsyncIteration:
                        break
                    try:
                        chunk = parse_checked_ring_chunk(raw)
                    except WireError as exc:
                        receiver.on_stream_end(f"sent a malformed chunk: {exc}")
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                failed = receiver.failed_node()
                if failed is not None:
                    await _abort_failed(context, key, failed)
                if chunk.phase == ABORT_PHASE:
                    failed_id = failed_id_of(chunk)
                    if failed_id not in receiver.members:
                        raise WireError(
                            f"the abort names {failed_id!r}, not a member of attempt {key}"
                        )
                    receiver.on_abort(failed_id, chunk.from_node_id)
                    break
                if chunk.key != key:
                    receiver.on_stream_end(f"switched to attempt {chunk.key} mid-stream")
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"chunk for {chunk.key} on the stream of {key}",
                    )
                if chunk.from_node_id != first.from_node_id:
                    receiver.on_stream_end("changed its from_node_id mid-stream")
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "from_node_id changed mid-stream"
                    )
                try:
                    receiver.on_chunk(chunk)
                except ChunkRejected as exc:
                    receiver.on_stream_end(f"sent a bad chunk: {exc}")
                    # Naming the sender as the failed node: it does not blame this node then.
                    await context.abort(
                        exc.code,
                        str(exc),
                        trailing_metadata=(
                            (FAILED_NODE_KEY, exc.failed_node or first.from_node_id),
                        ),
                    )
                received += len(chunk.payload)
                self.received_bytes += len(chunk.payload)
                self.received_chunks += 1
                chunk = None
        finally:
            receiver.on_stream_end(
                "its stream ended early" + (" (cancelled)" if context.cancelled() else "")
            )
        failed = receiver.failed_node()
        if failed is not None and not receiver.complete:
            await _abort_failed(context, key, failed)
        return peer_pb2.RingAck(received_bytes=received)

    async def _check_caller(self, chunk: RingChunkView, context: grpc.aio.ServicerContext) -> None:
        await self._check_sender(chunk.from_node_id, context)

    async def _caller(self, context: grpc.aio.ServicerContext, what: str) -> idm.Principal:
        """The calling node (mutual TLS): PERMISSION_DENIED for another role, UNAUTHENTICATED
        for a certificate on the coordinator's revocation list."""
        principal = idm.peer_principal(context)
        if principal is None or principal.role != idm.ROLE_NODE:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{what} take a node certificate"
            )
        assert principal is not None
        if principal.id in self.revoked:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the certificate of node {principal.id!r} has been revoked (the coordinator's "
                "revocation list)",
            )
        return principal

    async def _check_sender(self, from_node_id: str, context: grpc.aio.ServicerContext) -> None:
        if not self.verify_callers:
            return
        principal = await self._caller(context, "ring streams")
        if principal.id != from_node_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {principal.id!r} may not send chunks as {from_node_id!r}",
            )

    # -- OpenBulk ------------------------------------------------------------------------------

    async def _open_bulk_raw(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> peer_pb2.OpenBulkResponse:
        request = await _parse_request(peer_pb2.OpenBulkRequest, raw, context)
        return await self.open_bulk(request, context)

    async def open_bulk(
        self, request: peer_pb2.OpenBulkRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.OpenBulkResponse:
        """A one-time token for the bulk socket (node_agent.ring.bulk), checked like PushChunks."""
        if self.bulk is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer has no bulk socket")
        assert self.bulk is not None
        for name, value in (("job_id", request.job_id), ("from_node_id", request.from_node_id)):
            if not value or len(value) > MAX_ID_CHARS:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name} must have 1..{MAX_ID_CHARS} chars"
                )
        if request.round < 0 or request.attempt < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "round and attempt are >= 0")
        await self._check_sender(request.from_node_id, context)
        key: RingKey = (request.job_id, request.round, request.attempt)
        async with self._peer_stream(request.from_node_id, context):
            remaining = context.time_remaining()
            wait = OPEN_BULK_WAIT_S if remaining is None else min(OPEN_BULK_WAIT_S, remaining)
            try:
                await self._announced_from_left(
                    key, request.from_node_id, max(0.0, wait), "bulk tokens", context
                )
            except AttemptExpired as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                raise
            try:
                token, ttl = self.bulk.issue(key, request.from_node_id)
            except TooManyTokens as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                raise
        return peer_pb2.OpenBulkResponse(port=self.bulk.port, token=token, expires_in_s=ttl)

    async def _abort_stream(
        self,
        first: RingChunkView,
        iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> peer_pb2.RingAck:
        chunk: RingChunkView | None = first
        n = 0
        while chunk is not None and n < 16:
            if chunk.phase != ABORT_PHASE:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "an abort stream carries only abort chunks"
                )
            ann = self.mailbox.attempt(chunk.key)
            if ann is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"ring attempt {chunk.key} is not open on this node: aborts are taken only "
                    "for attempts of this node's ring tasks that are not over",
                )
            assert ann is not None
            if chunk.from_node_id not in ann.members:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"node {chunk.from_node_id!r} is not a member of ring attempt {chunk.key}",
                )
            failed = failed_id_of(chunk)
            if failed not in ann.members:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the abort names {failed!r}, not a member of ring attempt {chunk.key}",
                )
            self.mailbox.abort(chunk.key, failed, chunk.from_node_id)
            n += 1
            try:
                chunk = parse_checked_ring_chunk(await anext(iterator))
            except StopAsyncIteration:
                chunk = None
            if chunk is not None and chunk.from_node_id != first.from_node_id:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "from_node_id changed mid-stream"
                )
        return peer_pb2.RingAck(received_bytes=0)

    # -- TransferState -------------------------------------------------------------------------

    async def _transfer_state_raw(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[peer_pb2.TransferStateResponse]:
        request = await _parse_request(peer_pb2.TransferStateRequest, raw, context)
        async for part in self.transfer_state(request, context):
            yield part

    async def transfer_state(
        self, request: peer_pb2.TransferStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[peer_pb2.TransferStateResponse]:
        if not request.job_id or len(request.job_id) > MAX_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        if self.verify_callers:
            principal = await self._caller(context, "state transfers")
            if request.node_id and request.node_id != principal.id:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"node {principal.id!r} may not ask for state as {request.node_id!r}",
                )
            if self.state_authorizer is not None:
                refused = await self.state_authorizer(request.job_id, principal.id)
                if refused is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        if self.state_provider is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "this peer does not serve state transfers"
            )
        assert self.state_provider is not None
        snapshot = await self.state_provider(request.job_id, request.version)
        if snapshot is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"this peer holds no state of job {request.job_id!r}"
            )
        assert snapshot is not None
        if snapshot.version < request.version:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer has version {snapshot.version} of job {request.job_id!r}, "
                f"older than the requested {request.version}",
            )
        tensors = {k: v.detach().cpu() for k, v in snapshot.tensors.items()}
        header, payload = await asyncio.to_thread(encode_bundle, tensors)
        log.info(
            "state transfer of job %s version %d (%d bytes) to node %s",
            request.job_id,
            snapshot.version,
            len(payload),
            request.node_id or "?",
        )
        yield peer_pb2.TransferStateResponse(
            header=peer_pb2.TransferStateHeader(
                job_id=request.job_id, version=snapshot.version, bundle=header
            )
        )
        for chunk in iter_chunks(payload):
            yield peer_pb2.TransferStateResponse(chunk=chunk)

    # -- Ping ----------------------------------------------------------------------------------

    async def _ping_raw(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PingResponse:
        return await self.ping(await _parse_request(peer_pb2.PingRequest, raw, context), context)

    async def ping(
        self, request: peer_pb2.PingRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PingResponse:
        if self.verify_callers:
            await self._caller(context, "pings")
        if not request.job_id:
            return peer_pb2.PingResponse(payload=request.payload)
        st = self.mailbox.status((request.job_id, request.round, request.attempt))
        return peer_pb2.PingResponse(
            payload=request.payload,
            attempt_known=st.known,
            starved_s=st.starved_s,
            failed_node_id=st.failed_node_id,
        )


async def _parse_request(cls: Any, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return cls.FromString(raw)
    except (DecodeError, RuntimeWarning, ValueError, TypeError) as exc:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"malformed {cls.DESCRIPTOR.full_name} message: {exc or type(exc).__name__}",
        )
        raise AssertionError("unreachable: abort raises") from None


def parse_checked_ring_chunk(raw: bytes) -> RingChunkView:
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise WireError("expected a serialized RingChunk")
    chunk = parse_ring_chunk(bytes(raw) if not isinstance(raw, bytes) else raw)
    if not chunk.job_id or len(chunk.job_id) > MAX_ID_CHARS:
        raise WireError(f"job_id must have 1..{MAX_ID_CHARS} characters")
    if not chunk.from_node_id or len(chunk.from_node_id) > MAX_ID_CHARS:
        raise WireError(f"from_node_id must have 1..{MAX_ID_CHARS} characters")
    return chunk


def failed_id_of(chunk: RingChunkView) -> str:
    try:
        text = bytes(chunk.payload[:MAX_ID_CHARS]).decode()
    except UnicodeDecodeError:
        raise WireError("an abort chunk's data must be the failed node id in UTF-8") from None
    return text or chunk.from_node_id


async def _abort_failed(context: grpc.aio.ServicerContext, key: RingKey, failed: str) -> None:
    await context.abort(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"ring attempt {key} was aborted: node {failed!r} failed",
        trailing_metadata=((FAILED_NODE_KEY, failed),),
    )


# ---------------------------------------------------------------------------------------------
# The server an agent runs (--peer-listen)


_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def tune_malloc_for_streaming() -> bool:
    """Keep glibc from returning 1 MiB message buffers to the kernel after every message.

    By default each freed message buffer shrinks the heap and the next one page-faults its
    memory back in (zeroed): a large share of the data path's CPU. Raises the mmap and trim
    thresholds (process-wide, harmless for the agent). Returns False where it does not apply.
    """
    path = ctypes.util.find_library("c")
    if not path:
        return False
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    ok &= mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    ok &= mallopt(_M_TOP_PAD, 16 << 20)
    return bool(ok)


class PeerServer:
    """A grpc.aio server with the PeerService (plus health and reflection) on `listen`.

    `await start()`, then advertise `address`; `await stop()` when the agent exits. With an
    `identity` (the node's certificate) it runs mutual TLS and checks who sends ring chunks.
    `bulk` (default True): also listen on a bulk socket for ring chunks (`node_agent.ring.bulk`;
    same host as `listen`, an ephemeral port handed out by OpenBulk, TLS with `identity`); if
    that fails the server runs without one and senders use PushChunks.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        state_provider: StateProvider | None = None,
        state_authorizer: StateAuthorizer | None = None,
        join_timeout_s: float = 60.0,
        identity: idm.Identity | None = None,
        advertise: str | None = None,
        tune_malloc: bool = True,
        bulk: bool = True,
    ) -> None:
        self.listen = listen
        self.service = PeerService(
            state_provider=state_provider,
            state_authorizer=state_authorizer,
            join_timeout_s=join_timeout_s,
            verify_callers=identity is not None,
        )
        self._identity = identity
        self._advertise = advertise
        self._tune_malloc = tune_malloc
        self._bulk_enabled = bulk
        self._server: grpc.aio.Server | None = None
        self.bulk: BulkListener | None = None
        self.port = 0

    @property
    def mailbox(self) -> RingMailbox:
        return self.service.mailbox

    @property
    def address(self) -> str:
        """host:port for other peers: `advertise` if given, else the listen host (a wildcard
        host is replaced by 127.0.0.1: pass `advertise` for a multi-machine cluster)."""
        if self._advertise:
            return self._advertise
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        if self._tune_malloc:
            tune_malloc_for_streaming()
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers([self.service.generic_handler()])
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        if self._identity is None:
            port = server.add_insecure_port(self.listen)
        else:
            port = server.add_secure_port(self.listen, idm.peer_server_credentials(self._identity))
        if port == 0:
            raise OSError(f"cannot listen on {self.listen} for the PeerService")
        await server.start()
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.port = port
        if self._bulk_enabled:
            await self._start_bulk()
        log.info(
            "PeerService listening on %s (advertised as %s; bulk socket %s)",
            self.listen,
            self.address,
            f"on port {self.bulk.port}" if self.bulk is not None else "off",
        )

    async def _start_bulk(self) -> None:
        from node_agent.ring.bulk import BulkListener, listen_host

        listener = BulkListener(self.service, listen_host(self.listen), identity=self._identity)
        try:
            await listener.start()
        except OSError as exc:
            log.warning("no bulk socket (ring chunks go over PushChunks): %s", exc)
            return
        self.bulk = listener
        self.service.bulk = listener

    async def stop(self, grace: float | None = None) -> None:
        if self.bulk is not None:
            self.service.bulk = None
            await self.bulk.stop()
            self.bulk = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None


# ---------------------------------------------------------------------------------------------
# Client helpers


async def ping(channel: grpc.aio.Channel, *, timeout: float, payload: bytes = b"") -> float:
    """Round-trip seconds of one Ping (raises grpc.aio.AioRpcError / TimeoutError)."""
    call = channel.unary_unary(
        PING,
        request_serializer=peer_pb2.PingRequest.SerializeToString,
        response_deserializer=peer_pb2.PingResponse.FromString,
    )
    t0 = time.perf_counter()
    reply = await call(peer_pb2.PingRequest(payload=payload), timeout=timeout)
    if reply.payload != payload:
        raise ValueError("peer echoed a different payload")
    return time.perf_counter() - t0


async def ring_status(channel: grpc.aio.Channel, key: RingKey, *, timeout: float) -> RingStatus:
    """Ping a ring member and return its state in attempt `key` (a peer from before this field
    answers "unknown"). Raises grpc.aio.AioRpcError / TimeoutError when it does not answer."""
    call = channel.unary_unary(
        PING,
        request_serializer=peer_pb2.PingRequest.SerializeToString,
        response_deserializer=peer_pb2.PingResponse.FromString,
    )
    job_id, round_, attempt = key
    reply = await call(
        peer_pb2.PingRequest(job_id=job_id, round=round_, attempt=attempt), timeout=timeout
    )
    starved = reply.starved_s if math.isfinite(reply.starved_s) else 0.0
    return RingStatus(reply.attempt_known, max(starved, 0.0), reply.failed_node_id)


async def probe_link(
    channel: grpc.aio.Channel, *, payload_bytes: int = MAX_CHUNK_BYTES, timeout: float = 10.0
) -> tuple[float, float]:
    """(rtt_s, bandwidth_bytes_per_s) to a peer: best of three empty pings, then a payload
    round trip (it travels both ways: 2 * payload_bytes over the time beyond the rtt)."""
    rtt = min([await ping(channel, timeout=timeout) for _ in range(3)])
    payload = bytes(min(payload_bytes, MAX_CHUNK_BYTES))
    t = min([await ping(channel, timeout=timeout, payload=payload) for _ in range(2)])
    bandwidth = 2 * len(payload) / max(t - rtt, 1e-6)
    return rtt, bandwidth


async def fetch_state(
    channel: grpc.aio.Channel,
    job_id: str,
    *,
    node_id: str = "",
    min_version: int = 0,
    expected: Expected | None = None,
    timeout: float | None = None,
    limits: BundleLimits | None = None,
) -> StateSnapshot:
    """Pull a job's parameters and optimizer state from a live peer (TransferState).

    Validates everything (`BundleAssembler`: header, chunk order and sizes, sha256, names,
    dtypes, shapes with `expected`, NaN/Inf). Raises grpc.aio.AioRpcError from the peer and
    CodecError for a bad stream.
    """
    call = channel.unary_stream(
        TRANSFER_STATE,
        request_serializer=peer_pb2.TransferStateRequest.SerializeToString,
        response_deserializer=peer_pb2.TransferStateResponse.FromString,
    )
    stream = call(
        peer_pb2.TransferStateRequest(job_id=job_id, node_id=node_id, version=min_version),
        timeout=timeout,
    )
    assembler: BundleAssembler | None = None
    version = -1
    async for part in stream:
        which = part.WhichOneof("part")
        if which == "header":
            if assembler is not None:
                raise CodecError("state transfer sent two headers")
            if part.header.job_id != job_id:
                raise CodecError(f"state transfer is for job {part.header.job_id!r}")
            version = part.header.version
            assembler = BundleAssembler(part.header.bundle, limits, expected=expected)
        elif which == "chunk":
            if assembler is None:
                raise CodecError("state transfer sent data before its header")
            assembler.add(part.chunk)
        else:
            raise CodecError("state transfer sent an empty message")
    if assembler is None:
        raise CodecError("state transfer ended without a header")
    if version < min_version:
        raise CodecError(f"peer sent version {version}, older than {min_version}")
    tensors = assembler.finish()
    return StateSnapshot(version=version, tensors=tensors)


def peer_channel(
    address: str, node_id: str = "", identity: idm.Identity | None = None
) -> grpc.aio.Channel:
    """A channel to the PeerService of node `node_id` at `address`: mutual TLS that checks the
    peer's certificate names `node_id` when an `identity` is given, else plaintext."""
    if identity is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    if not node_id:
        raise ValueError("a TLS channel to a peer needs the peer's node id")
    return idm.peer_aio_channel(address, node_id, identity)
