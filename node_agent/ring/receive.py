"""The receive side of a ring attempt: one slot per attempt, fed by the PeerService handler.

`ReceiveSlot` is the `RingReceiver` that `ring_allreduce` registers in the `RingMailbox` for its
(job, round, attempt). It checks every chunk of the left neighbour against the attempt's plan
(`node_agent.ring.plan`), refuses NaN/Inf and all-gather segments that do not match their
owner's seal, adds or copies the payload into the buffer the moment it arrives, and records the
attempt's first failure for the run to raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import torch

from epochmesh.errors import CodecError
from epochmesh.ring.schedule import ALL_GATHER
from epochmesh.ring.seal import (
    SHA256,
    OwnerRevoked,
    Seal,
    SealError,
    SegmentHasher,
    SegmentVerifier,
    seal_message,
    segment_hasher,
)
from epochmesh.v1 import agent_pb2
from epochmesh.wire import compression
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.mailbox import ChunkRejected
from node_agent.ring.plan import Expect
from node_agent.ring.wire import (
    RingChunkView,
    RingKey,
    ring_chunk_seal,
)


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


def _require_finite(values: np.ndarray, e: Expect) -> None:
    """As the parameter server refuses NaN/Inf in updates: a chunk that carries any is refused
    (INVALID_ARGUMENT), which fails the attempt naming the neighbour that sent it (its own
    addend entered the partial sum there: every hop checks what it receives)."""
    if not np.isfinite(values).all():
        raise _NonFinite(
            f"{e.phase} step {e.step} segment {e.segment} at offset {e.offset} holds NaN or "
            "Inf values"
        )


class ReceiveSlot:
    """Applies the left neighbour's chunks, in schedule order, to the buffer."""

    def __init__(
        self,
        key: RingKey,
        expect: Sequence[Expect],
        rank: int,
        codec: str,
        buf: np.ndarray,
        node_ids: Sequence[str],
        verifier: SegmentVerifier | None = None,
        received: torch.Tensor | None = None,
        digest: str = SHA256,
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
        self._digest = digest  # the seals' digest (epochmesh.ring.seal.SEAL_DIGESTS)
        self._hasher: SegmentHasher | None = None
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

    def _check_seal(self, e: Expect, data: memoryview, chunk: RingChunkView | None) -> None:
        """Hash an all-gather chunk's bytes (`data`: as received); at the segment's last one
        (`chunk`: its header) check the owner's seal: the digest, then the owner's signature
        and certificate. Every hop checks before it takes the last chunk (and so before it can
        forward it): a seal that fails here was altered or made up by the left neighbour."""
        if self._verifier is None or e.phase != ALL_GATHER:
            return
        if e.offset == 0:
            self._hasher = segment_hasher(self._digest)
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
                owner,
                seal_message(job_id, round_, attempt, e.segment, owner, digest, self._digest),
                seal,
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
            return self._buf[e.lo : e.hi].data.cast("B")  # a copy: land it in place
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

    def _check(self, chunk: RingChunkView, nbytes: int) -> Expect:
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

    def _apply(self, e: Expect, payload: memoryview) -> None:
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
