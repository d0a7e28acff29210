"""The PeerService an agent runs for its ring neighbours (grpc.aio), and the server hosting it.

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

Data path. ``PushChunks`` handles its requests as raw bytes, not protobuf objects
(`node_agent.ring.wire`). The receive slots are in `node_agent.ring.mailbox`, the callers' side
(`ping`, `ring_status`, `probe_link`, `fetch_state`, `peer_channel`) in `node_agent.ring.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from epochmesh import identity as idm
from epochmesh.grpc_util import SERVER_OPTIONS
from epochmesh.v1 import peer_pb2
from epochmesh.wire.tensors import (
    encode_bundle,
    iter_chunks,
)
from node_agent.ring.bulk import BulkListener, TooManyTokens, listen_host
from node_agent.ring.mailbox import (
    Announcement,
    AttemptExpired,
    ChunkRejected,
    RingMailbox,
    StateAuthorizer,
    StateProvider,
)
from node_agent.ring.wire import (
    ABORT_PHASE,
    FAILED_NODE_KEY,
    MAX_ID_CHARS,
    SERVICE_NAME,
    RingChunkView,
    RingKey,
    WireError,
    failed_id_of,
    parse_checked_ring_chunk,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The service


class BulkIssuer(Protocol):
    """The bulk socket behind OpenBulk (node_agent.ring.bulk.BulkListener)."""

    port: int
    keep_alive: bool  # connections kept after a stream for the caller's next one

    def issue(self, key: RingKey, from_node_id: str) -> tuple[bytes, float]:
        """A one-time token for `from_node_id`'s stream of attempt `key`, and its lifetime;
        TooManyTokens past the per-peer cap."""


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
                        raise AssertionError("unreachable: abort raises") from None
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
        return peer_pb2.OpenBulkResponse(
            port=self.bulk.port, token=token, expires_in_s=ttl, keep_alive=self.bulk.keep_alive
        )

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
