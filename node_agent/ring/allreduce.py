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
cached (`attempt_plan` in `node_agent.ring.plan`): a round only prefixes the chunk headers with
(job, round, attempt, sender).
Over the bulk socket a chunk costs no copy in Python on the way out (`sendmsg` of its header and
a view of the buffer) and none beyond the kernel's on the way in (into a preallocated buffer,
reduced from there with numpy; a chunk that is only copied lands in the buffer directly), plus
the reduction and per attempt one round trip on the connection kept from the attempt before
(the first attempt to a peer: an OpenBulk call and a connect, a TLS handshake with identities).
With 4 ranks on 2 cores, 64 MiB, plaintext, `scripts/bench_allreduce.py` measures it at roughly
0.65-0.75 of gloo's bus bandwidth on a quiet machine (0.8-1.0 in earlier runs) for about 1.5x
gloo's CPU; with TLS (AES-GCM on this process's event loop, BLAKE3 seals) about 0.35-0.42 of
gloo: the encryption and the seals' hash cost more CPU than gloo's whole all-reduce
(docs/benchmarks.md). PushChunks (the fallback, `--transport grpc`)
reaches about 0.45 of gloo plaintext: grpcio's Python data path copies every message twice on
the way out and three times or more on the way in, with a thread hand-off per message each side
(`--floor` times that transport alone). With identities the all-gather is sealed
(docs/ring-rounds.md, "Sealed all-gather"): per attempt one pass of the ring's seal digest over
the buffer (BLAKE3 about 2.7-3.7 GB/s on this machine, SHA-256 about 1 GB/s, on the event loop),
one signature and n-1 signature checks (`scripts/bench_ring_seal.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from epochmesh.ring.schedule import RING_CODECS
from epochmesh.ring.seal import BLAKE3, SegmentHasher, seal_digest, seal_message, segment_hasher
from epochmesh.wire import compression
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.mailbox import RingStatus
from node_agent.ring.plan import Send, attempt_plan
from node_agent.ring.receive import ReceiveSlot
from node_agent.ring.transport import OUTPUT_ERRORS, RingOutput, RingTransport
from node_agent.ring.wire import (
    ABORT_PHASE,
    RingKey,
    ring_chunk_header,
    ring_chunk_seal,
)

log = logging.getLogger(__name__)


class RingLike(Protocol):
    """What `ring_allreduce` needs of a ring (common_pb2.RingAssignment has it)."""

    node_ids: Sequence[str]
    peer_addresses: Sequence[str]
    rank: int
    attempt: int
    seal_digest: str  # with identities: the all-gather seals' digest ("": SHA-256)


@dataclass(frozen=True)
class Ring:
    """A plain RingLike (tests, scripts); the coordinator sends common_pb2.RingAssignment."""

    node_ids: Sequence[str]
    peer_addresses: Sequence[str]
    rank: int
    attempt: int = 0
    seal_digest: str = BLAKE3


# ---------------------------------------------------------------------------------------------
# Send side and failure handling of one attempt


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
        # The all-gather seals' digest (SealError for one this agent does not know: the
        # coordinator's mistake, raised before the attempt starts).
        self.digest = seal_digest(ring.seal_digest)
        plan = attempt_plan(n, buffer.numel(), codec, self.rank)
        self.schedule = plan.schedule
        self.slot = ReceiveSlot(
            self.key,
            plan.expect,
            self.rank,
            codec,
            self.buf,
            self.node_ids,
            verifier=transport.verifier,
            received=received,
            digest=self.digest,
        )
        self.sends = plan.sends
        # Seals this node's all-gather segment (None: the ring runs without identities).
        self.signer = transport.signer
        self._hasher: SegmentHasher | None = None
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
            either: set[asyncio.Future[None] | asyncio.Future[RingPeerFailed]] = {
                sender,
                self.slot.failed_future,
            }
            done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
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
        except OUTPUT_ERRORS as exc:
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

    def _payload(self, s: Send) -> bytes | memoryview:
        if self.codec == "none":
            return self.buf[s.lo : s.hi].data.cast("B")
        if s.kind == "forward":
            assert s.dep is not None
            return self.slot.take_forward(s.dep)
        view = self.tensor[s.lo : s.hi]
        data = compression.encode(view, self.codec)
        if s.kind == "final":
            # The owner keeps exactly what every other rank will decode.
            view.copy_(compression.decode(data, self.codec, (s.hi - s.lo,)))
        return data

    def _seal(self, s: Send, payload: bytes | memoryview) -> bytes:
        """The seal fields an all-gather chunk carries: at the last chunk of this node's own
        segment its digest (of the bytes sent, hashed chunk by chunk) signed by this node; at
        the last chunk of a forwarded one the seal it arrived with (checked on arrival)."""
        if s.seal == "forward":
            return self.slot.seal_of(s.segment) if s.last else b""
        assert self.signer is not None
        if s.offset == 0:
            self._hasher = segment_hasher(self.digest)
        assert self._hasher is not None
        self._hasher.update(payload)
        if not s.last:
            return b""
        digest = self._hasher.digest()
        self._hasher = None
        job_id, round_, attempt = self.key
        seal = self.signer.seal(
            seal_message(job_id, round_, attempt, s.segment, self.me, digest, self.digest), digest
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
        except OUTPUT_ERRORS as exc:
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

    async def _left_status(self, waited: float) -> RingStatus:
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
        except (TimeoutError, *OUTPUT_ERRORS):
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
    bandwidth (`epochmesh.ring.schedule.step_deadline_s`): a neighbour that makes no progress for
    that long has failed. `join_timeout_s` (default `deadline_s`) is added to the first step, for
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


__all__ = ["Ring", "RingLike", "ring_allreduce"]
