"""The plan of one ring all-reduce attempt: what this rank sends, and what it receives in order.

Everything in it depends only on (ring size, buffer size, codec, rank): `attempt_plan` builds it
once per shape and caches it, so a round only prefixes the chunk headers with (job, round,
attempt, sender). The schedule itself is `epochmesh.ring.schedule`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from epochmesh.ring.schedule import RingSchedule, chunk_elems_for
from epochmesh.v1 import common_pb2, peer_pb2
from epochmesh.wire import compression


@dataclass(frozen=True)
class Expect:
    """One chunk this rank receives, in receive order: where it lands and what is done with it."""

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


@dataclass(frozen=True)
class Send:
    """One chunk this rank sends: its slice of the buffer, what it waits for, how it is made."""

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
class Plan:
    """Everything of one attempt that depends only on (n, numel, codec, rank)."""

    schedule: RingSchedule
    sends: tuple[Send, ...]
    expect: tuple[Expect, ...]


@functools.lru_cache(maxsize=16)
def attempt_plan(n: int, numel: int, codec: str, rank: int) -> Plan:
    """The send and receive plan of `rank`, built once per shape and reused every round.

    A chunk's header is the attempt's prefix (job, round, attempt, sender: fields 1-4) followed
    by `suffix` (phase, step, segment, spec, last); protobuf merges the two into one RingChunk.
    """
    sch = RingSchedule.build(n, numel, chunk_elems_for(codec))
    offsets = [_chunk_offsets(codec, sch.segment_chunks(k)) for k in range(n)]
    last_step = sch.num_steps - 1
    expect: list[Expect] = []
    for t, seg, c in sch.recv_order(rank):
        lo, hi = sch.segment_chunks(seg)[c]
        last = c == len(sch.segment_chunks(seg)) - 1
        expect.append(
            Expect(
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
    sends: list[Send] = []
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
            sends.append(Send(t, lo, hi, offsets[seg][c], suffix, dep, kind, seg, seal, last))
    return Plan(schedule=sch, sends=tuple(sends), expect=tuple(expect))
