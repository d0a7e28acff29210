"""Chunked, pipelined ring all-reduce between agents over their PeerServices.

    transport = RingTransport.for_server(node_id, peer_server)     # once per agent
    summed = await ring_allreduce(flat_grads, ring, transport, deadline_s,
                                  job_id=job_id, round=round_)     # every round

`ring_allreduce` sums a flat float32 CPU buffer over the ring in place (the schedule, and why
every rank ends with bit-identical sums, is in `epochmesh.ring`). It sends to its right
neighbour on ONE PushChunks stream per attempt (over a channel kept open across rounds) and the
left neighbour's stream lands in this node's `RingMailbox`, where every chunk is added (reduce-
scatter) or copied (all-gather) into the buffer the moment it arrives. Chunk c of step t leaves
as soon as chunk c of step t-1 has arrived, so both phases pipeline at 1 MiB granularity. The
caller pre-scales its gradient (e.g. by b_i / B) so that the sum is the weighted mean.

Failures never hang. Every wait is bounded by `deadline_s` (the first step also by
`join_timeout_s`, for neighbours still computing their gradient):

- the right neighbour does not take a chunk in time, or refuses or breaks the stream and does
  not answer a ping: it failed (if it answers, wait up to `deadline_s` for a report naming
  the node that failed further along, as below, then blame it);
- the left neighbour's stream breaks or ends early, or sends a malformed chunk: it failed;
- nothing arrives from the left in time: it is pinged; no answer: it failed; an answer (it is
  alive, so probably waiting on its own left): wait another `deadline_s` for a report from the
  node that saw the real failure, then blame the left neighbour;
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
What is left per chunk is one copy into the frame, the reduction, and grpcio itself, which
dominates: its Python data path copies every message twice on the way out and three times or
more on the way in, with a thread hand-off per message each side. `scripts/bench_allreduce.py
--floor` times that transport alone (our frames streamed around the ring, no ring logic);
this ring runs at roughly 0.7-1.0 of it, and the floor itself at roughly 0.5-0.7 of gloo on
loopback with 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np
import torch

from epochmesh import compression
from epochmesh.errors import CodecError
from epochmesh.identity import Identity
from epochmesh.ring import RING_CODECS, RingSchedule, chunk_elems_for
from epochmesh.v1 import common_pb2, peer_pb2
from node_agent import peer
from node_agent.peer import (
    ChunkRejected,
    PeerServer,
    RingChunkView,
    RingKey,
    RingMailbox,
    abort_chunk,
    failed_node_from_metadata,
    frame_ring_chunk,
    ring_chunk_header,
)

log = logging.getLogger(__name__)


class RingPeerFailed(Exception):
    """A ring member failed or stalled; `node_id` names it.

    `reported_by` is None when this node saw the failure itself, else the member whose report
    it got. `key` is (job_id, round, attempt).
    """

    def __init__(
        self,
        node_id: str,
        reason: str,
        *,
        reported_by: str | None = None,
        key: RingKey | None = None,
    ) -> None:
        self.node_id = node_id
        self.reason = reason
        self.reported_by = reported_by
        self.key = key
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


class RingTransport:
    """This node's side of the ring: its id, its mailbox, and cached channels to peers."""

    def __init__(
        self,
        node_id: str,
        mailbox: RingMailbox,
        *,
        identity: Identity | None = None,
    ) -> None:
        if not node_id:
            raise ValueError("node_id is required")
        self.node_id = node_id
        self.mailbox = mailbox
        self._identity = identity
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    @classmethod
    def for_server(
        cls, node_id: str, server: PeerServer, *, identity: Identity | None = None
    ) -> RingTransport:
        return cls(node_id, server.mailbox, identity=identity)

    def channel(self, address: str, node_id: str) -> grpc.aio.Channel:
        """The (cached) channel to node `node_id`'s PeerService at `address`."""
        key = (address, node_id if self._identity is not None else "")
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = peer.peer_channel(address, node_id, self._identity)
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
        ch = self._channels.pop((address, node_id if self._identity is not None else ""), None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
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


def _chunk_offsets(codec: str, chunks: Sequence[tuple[int, int]]) -> list[int]:
    """Byte offset of every chunk within its segment's encoded stream."""
    out: list[int] = []
    offset = 0
    for lo, hi in chunks:
        out.append(offset)
        offset += compression.encoded_size(codec, hi - lo)
    return out


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
    ) -> None:
        n = len(node_ids)
        self.key = key
        self.codec = codec
        self.left_node_id = node_ids[(rank - 1) % n]
        self.members = frozenset(node_ids)
        self.attached = False
        self._buf = buf
        self._tbuf = torch.from_numpy(buf)
        self._expect = expect
        self.total = len(expect)
        self.pos = 0
        self.received_bytes = 0
        self._forward: dict[int, memoryview] = {}
        self._waiter: tuple[int, asyncio.Future[None]] | None = None
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

    def on_chunk(self, chunk: RingChunkView) -> None:
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
        payload = chunk.payload
        if len(payload) != e.nbytes or (chunk.spec.codec or "none") != self.codec:
            raise ChunkRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"expected {e.nbytes} bytes of codec {self.codec!r}, got {len(payload)} bytes "
                f"of codec {chunk.spec.codec!r}",
            )
        dst = self._buf[e.lo : e.hi]
        if self.codec == "none":
            src = np.frombuffer(payload, dtype=np.float32)
            if e.reduce:
                np.add(dst, src, out=dst)
            else:
                np.copyto(dst, src)
        else:
            try:
                decoded = compression.decode(payload, self.codec, (e.hi - e.lo,))
            except CodecError as exc:
                raise ChunkRejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if e.reduce:
                self._tbuf[e.lo : e.hi].add_(decoded)
            else:
                self._tbuf[e.lo : e.hi].copy_(decoded)
                if e.forward:
                    self._forward[self.pos] = payload
        self.pos += 1
        self.received_bytes += len(payload)
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
        """Until chunk `index` of the receive order has arrived; TimeoutError after `timeout`."""
        if self._failure is not None:
            raise self._failure
        if self.pos > index:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = (index, fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
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
            sends.append(_Send(t, lo, hi, offsets[seg][c], suffix, dep, kind))
    return _Plan(schedule=sch, sends=tuple(sends), expect=tuple(expect))


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
    ) -> None:
        n = len(ring.node_ids)
        self.n = n
        self.rank = ring.rank
        self.node_ids = list(ring.node_ids)
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
        self.codec = codec
        self.tensor = buffer
        self.buf = buffer.numpy()
        plan = _plan(n, buffer.numel(), codec, self.rank)
        self.schedule = plan.schedule
        self.slot = _ReceiveSlot(self.key, plan.expect, self.rank, codec, self.buf, self.node_ids)
        self.sends = plan.sends
        # Fields 1-4 of every chunk this attempt sends (job, round, attempt, sender).
        self.prefix = ring_chunk_header(
            job_id=job_id, round=round_, attempt=self.key[2], from_node_id=self.me, phase=""
        )
        self.call: grpc.aio.StreamUnaryCall | None = None
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
            if self.call is not None and not self.call.done():
                self.call.cancel()

    def _as_failure(self, exc: BaseException) -> RingPeerFailed:
        if isinstance(exc, RingPeerFailed):
            return exc
        log.error("ring attempt %s: internal error", self.key, exc_info=exc)
        return RingPeerFailed(self.me, f"internal error: {exc!r}", key=self.key)

    async def _send_all(self) -> None:
        call = self.call = self.transport.push_call(self.right_address, self.right)
        first = self.deadline_s + self.join_timeout_s
        for s in self.sends:
            if s.dep is not None and self.slot.pos <= s.dep:
                await self._await_input(s.dep, first if s.t == 1 else self.deadline_s)
            if self.slot.failure is not None:
                raise self.slot.failure
            payload = self._payload(s)
            frame = frame_ring_chunk(self.prefix + s.suffix, s.offset, payload)
            await self._write(call, frame, s.t == 0)
            self.sent_bytes += memoryview(payload).nbytes
        try:
            async with asyncio.timeout(self.deadline_s):
                await call.done_writing()
                ack = await call
        except TimeoutError:
            raise RingPeerFailed(
                self.right,
                f"did not confirm the stream within {self.deadline_s:.1f}s",
                key=self.key,
            ) from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise await self._right_failure(call, exc) from None
        if ack.received_bytes != self.sent_bytes:
            raise RingPeerFailed(
                self.right,
                f"confirmed {ack.received_bytes} bytes of the {self.sent_bytes} sent",
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

    async def _write(self, call: grpc.aio.StreamUnaryCall, frame: bytes, first: bool) -> None:
        timeout = self.deadline_s + (self.join_timeout_s if first else 0.0)
        try:
            async with asyncio.timeout(timeout):
                await call.write(frame)
        except TimeoutError:
            raise RingPeerFailed(
                self.right, f"took no data for {timeout:.1f}s", key=self.key
            ) from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise await self._right_failure(call, exc) from None

    async def _right_failure(
        self, call: grpc.aio.StreamUnaryCall, exc: BaseException
    ) -> RingPeerFailed:
        """What the right neighbour's refusal says: a failed node it names, else itself."""
        code: grpc.StatusCode | None = None
        details = ""
        failed: str | None = None
        try:
            async with asyncio.timeout(min(self.deadline_s, 2.0)):
                code = await call.code()
                details = await call.details()
                failed = failed_node_from_metadata(await call.trailing_metadata())
        except (TimeoutError, grpc.aio.AioRpcError):
            details = str(exc)
        if failed and failed != self.right:
            return RingPeerFailed(
                failed, details or "reported failed", reported_by=self.right, key=self.key
            )
        name = code.name if code is not None else type(exc).__name__
        own = RingPeerFailed(
            self.right, f"refused or broke the stream: {name} {details}", key=self.key
        )
        # A right neighbour that ends our stream without naming anyone may have given up on a
        # failure further along (its abort report to us can be a moment behind). If it still
        # answers pings, wait for that report before blaming it.
        if self.slot.failure is not None:
            return self.slot.failure
        try:
            await self.transport.ping(self.right_address, self.right, self.probe_timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, ValueError):
            return own
        try:
            async with asyncio.timeout(self.deadline_s):
                return await asyncio.shield(self.slot.failed_future)
        except TimeoutError:
            return own

    async def _await_input(self, index: int, timeout: float) -> None:
        try:
            await self.slot.wait(index, timeout)
            return
        except TimeoutError:
            pass
        try:
            await self.transport.ping(self.left_address, self.left, self.probe_timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, ValueError) as exc:
            raise RingPeerFailed(
                self.left,
                f"sent nothing for {timeout:.1f}s and does not answer pings ({type(exc).__name__})",
                key=self.key,
            ) from None
        # Alive: most likely waiting on its own left neighbour. Give the node that saw the
        # failure time to report it before blaming this one.
        try:
            await self.slot.wait(index, self.deadline_s)
        except TimeoutError:
            raise RingPeerFailed(
                self.left,
                f"answers pings but sent nothing for {timeout + self.deadline_s:.1f}s",
                key=self.key,
            ) from None

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
        call = self.call
        if call is None or call.done():
            return
        if failed == self.right:
            call.cancel()
            return
        try:
            async with asyncio.timeout(min(self.deadline_s, 1.0)):
                await call.write(abort_chunk(self.key, self.me, failed))
                await call.done_writing()
                await call
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        finally:
            call.cancel()


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
) -> torch.Tensor:
    """Sum `buffer` (flat, contiguous float32 on the CPU) over the ring, in place; returns it.

    `ring`: node ids and PeerService addresses in ring order, this node's rank, the attempt
    (bumped whenever the ring is re-formed). `deadline_s`: per-step deadline from measured
    bandwidth (`epochmesh.ring.step_deadline_s`): a neighbour that makes no progress for that
    long has failed. `join_timeout_s` (default `deadline_s`) is added to the first step, for
    neighbours still computing. `codec`: "none" | "fp16" | "bf16" | "int8" on the wire.

    Every rank gets bit-identical sums. Raises RingPeerFailed(node_id) when a member dies,
    stalls or refuses (the buffer then holds partial sums), ValueError for bad arguments.
    """
    _check_args(buffer, ring, transport, deadline_s, codec, job_id, round)
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
