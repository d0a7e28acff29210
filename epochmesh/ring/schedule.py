"""Pure schedule of a ring all-reduce, the deadline of one ring step, and the ring order.

No networking here: `node_agent.ring.allreduce` moves the bytes, this module says which bytes.

Layout. A flat buffer of `numel` float32 elements is cut into `n` contiguous *segments* of
near-equal size (the first `numel % n` segments hold one element more), and every segment into
*chunks* of at most `chunk_elems` elements (`chunk_elems_for(codec)` keeps an encoded chunk
within `MAX_CHUNK_BYTES`). Segments may be empty when `numel < n`.

Steps. A ring all-reduce of n ranks runs 2(n-1) global steps t = 0 .. 2n-3: steps 0 .. n-2 are
the reduce-scatter (phase step t), steps n-1 .. 2n-3 the all-gather (phase step t-(n-1)). At
every step rank r sends segment (r - t) mod n to its right neighbour r+1 and receives segment
(r - t - 1) mod n from its left neighbour r-1:

- reduce-scatter: the receiver adds what it got to its own copy of that segment;
- all-gather: the receiver overwrites its copy with what it got.

The segment a rank sends at step t > 0 is the one it received at step t-1, chunk for chunk, so
chunk c of step t may leave as soon as chunk c of step t-1 has arrived: the exchange pipelines at
chunk granularity (a rank's receive order is `recv_order(rank)`, and the chunk a send waits for
is `dependency(rank, t, c)`).

Bit-identical results. Float addition is not associative, so every element must be summed once,
in one fixed order, and then only copied. Segment k starts at rank k (its step-0 send) and gains
one addend per hop: after the reduce-scatter its owner, rank (k - 1) mod n, holds
((x_k + x_{k+1}) + x_{k+2}) + ... + x_{k+n-1} (indices mod n; `reduction_order(k)`), computed
once, on that rank alone. The all-gather then only copies the owner's bytes around the ring, so
every rank ends with the same bits. (The two operands of each single addition commute exactly in
IEEE arithmetic, so it does not matter which side the receiver puts its own addend.) With a lossy
wire codec the owner replaces its value by decode(encode(value)) before the all-gather and the
encoded bytes are forwarded untouched, which keeps the result bit-identical too.

`simulate_allreduce` runs this schedule on numpy arrays; it is the reference the networked
implementation is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.wire.compression import INT8_BLOCK, encoded_size

REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
# Wire codecs a ring can carry: chunks are encoded per piece and accumulated in float32. topk is
# left out on purpose: every hop would re-sparsify a growing partial sum.
RING_CODECS = ("none", "fp16", "bf16", "int8")


def chunk_elems_for(codec: str = "none", max_chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Most float32 elements whose encoding with `codec` fits in `max_chunk_bytes`.

    A multiple of INT8_BLOCK (256), so int8 blocks never straddle two chunks.
    """
    if codec not in RING_CODECS:
        raise ValueError(f"codec {codec!r} is not supported in a ring; use one of {RING_CODECS}")
    if max_chunk_bytes < encoded_size(codec, INT8_BLOCK):
        raise ValueError(f"max_chunk_bytes {max_chunk_bytes} is too small for one chunk")
    per = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / INT8_BLOCK}[codec]
    elems = int(max_chunk_bytes / per) // INT8_BLOCK * INT8_BLOCK
    while encoded_size(codec, elems) > max_chunk_bytes:  # guards float rounding above
        elems -= INT8_BLOCK
    return elems


@dataclass(frozen=True)
class RingSchedule:
    """Who sends and receives what, for `n` ranks and a flat buffer of `numel` elements."""

    n: int
    numel: int
    chunk_elems: int = MAX_CHUNK_BYTES // 4
    segments: tuple[tuple[int, int], ...] = ()
    chunks: tuple[tuple[tuple[int, int], ...], ...] = ()

    @classmethod
    def build(cls, n: int, numel: int, chunk_elems: int = MAX_CHUNK_BYTES // 4) -> RingSchedule:
        if n < 1:
            raise ValueError(f"a ring needs at least one rank (got n={n})")
        if numel < 0:
            raise ValueError(f"numel must be >= 0 (got {numel})")
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1 (got {chunk_elems})")
        segments = tuple(segment_bounds(numel, n))
        chunks = tuple(
            tuple((lo, min(lo + chunk_elems, stop)) for lo in range(start, stop, chunk_elems))
            for start, stop in segments
        )
        return cls(n=n, numel=numel, chunk_elems=chunk_elems, segments=segments, chunks=chunks)

    # -- steps ---------------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """2(n-1) global steps: n-1 of reduce-scatter, then n-1 of all-gather."""
        return 2 * (self.n - 1)

    def phase(self, t: int) -> str:
        self._check_step(t)
        return REDUCE_SCATTER if t < self.n - 1 else ALL_GATHER

    def phase_step(self, t: int) -> int:
        """Index of global step t within its phase (0 .. n-2)."""
        self._check_step(t)
        return t if t < self.n - 1 else t - (self.n - 1)

    def global_step(self, phase: str, step: int) -> int:
        """Inverse of (phase, phase_step); ValueError for anything outside the schedule."""
        if not 0 <= step < self.n - 1:
            raise ValueError(f"step {step} is outside 0..{self.n - 2}")
        if phase == REDUCE_SCATTER:
            return step
        if phase == ALL_GATHER:
            return step + self.n - 1
        raise ValueError(f"unknown phase {phase!r}; expected {REDUCE_SCATTER} or {ALL_GATHER}")

    def send_segment(self, rank: int, t: int) -> int:
        self._check(rank, t)
        return (rank - t) % self.n

    def recv_segment(self, rank: int, t: int) -> int:
        self._check(rank, t)
        return (rank - t - 1) % self.n

    def owned_segment(self, rank: int) -> int:
        """The segment whose final sum `rank` computes (at the last reduce-scatter step)."""
        self._check_rank(rank)
        return (rank + 1) % self.n

    def owner(self, segment: int) -> int:
        """The rank that computes `segment`'s final sum."""
        return (segment - 1) % self.n

    def reduction_order(self, segment: int) -> list[int]:
        """Ranks in the order their addends enter `segment`'s sum (left to right)."""
        return [(segment + i) % self.n for i in range(self.n)]

    # -- chunks --------------------------------------------------------------------------------

    def segment_chunks(self, segment: int) -> tuple[tuple[int, int], ...]:
        """[start, stop) element ranges of `segment`'s chunks, in order."""
        return self.chunks[segment]

    def recv_order(self, rank: int) -> list[tuple[int, int, int]]:
        """(global step, segment, chunk index) of every chunk `rank` receives, in arrival order.

        The left neighbour sends them in exactly this order on one stream.
        """
        out: list[tuple[int, int, int]] = []
        for t in range(self.num_steps):
            seg = self.recv_segment(rank, t)
            out.extend((t, seg, c) for c in range(len(self.chunks[seg])))
        return out

    def send_order(self, rank: int) -> list[tuple[int, int, int]]:
        """(global step, segment, chunk index) of every chunk `rank` sends, in order."""
        out: list[tuple[int, int, int]] = []
        for t in range(self.num_steps):
            seg = self.send_segment(rank, t)
            out.extend((t, seg, c) for c in range(len(self.chunks[seg])))
        return out

    def dependency(self, rank: int, t: int, c: int) -> int | None:
        """Position in `recv_order(rank)` of the chunk that must have arrived before `rank`
        sends chunk c of step t (None at step 0: a rank's own data is ready at once)."""
        self._check(rank, t)
        if t == 0:
            return None
        before = sum(len(self.chunks[self.recv_segment(rank, s)]) for s in range(t - 1))
        return before + c

    def recv_count(self, rank: int) -> int:
        return sum(len(self.chunks[self.recv_segment(rank, t)]) for t in range(self.num_steps))

    def max_segment_elems(self) -> int:
        return max((stop - start for start, stop in self.segments), default=0)

    # -- checks --------------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.n:
            raise ValueError(f"rank {rank} is outside 0..{self.n - 1}")

    def _check_step(self, t: int) -> None:
        if not 0 <= t < self.num_steps:
            raise ValueError(f"step {t} is outside 0..{self.num_steps - 1}")

    def _check(self, rank: int, t: int) -> None:
        self._check_rank(rank)
        self._check_step(t)


def segment_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous [start, stop) ranges covering [0, numel); sizes differ by at most one."""
    base, extra = divmod(numel, n)
    out: list[tuple[int, int]] = []
    start = 0
    for k in range(n):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def simulate_allreduce(schedule: RingSchedule, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run the schedule on numpy arrays (one per rank, all of `schedule.numel` elements).

    Every step delivers, chunk by chunk, what each rank sends to its right neighbour: added in
    the reduce-scatter, copied in the all-gather. Returns new arrays; the inputs are untouched.
    """
    n = schedule.n
    if len(buffers) != n:
        raise ValueError(f"expected {n} buffers, got {len(buffers)}")
    bufs = [np.array(b, copy=True) for b in buffers]
    for b in bufs:
        if b.shape != (schedule.numel,):
            raise ValueError(f"every buffer must have shape ({schedule.numel},), got {b.shape}")
    for t in range(schedule.num_steps):
        # Snapshot every send first: in a real ring all ranks send concurrently.
        sent = []
        for r in range(n):
            seg = schedule.send_segment(r, t)
            sent.append([bufs[r][lo:hi].copy() for lo, hi in schedule.segment_chunks(seg)])
        for r in range(n):
            left = (r - 1) % n
            seg = schedule.recv_segment(r, t)
            for (lo, hi), data in zip(schedule.segment_chunks(seg), sent[left], strict=True):
                if schedule.phase(t) == REDUCE_SCATTER:
                    np.add(data, bufs[r][lo:hi], out=bufs[r][lo:hi])
                else:
                    bufs[r][lo:hi] = data
    return bufs


# ---------------------------------------------------------------------------------------------
# Deadlines


def step_deadline_s(
    numel: int,
    n: int,
    bandwidth_bytes_per_s: float,
    rtt_s: float = 0.0,
    *,
    codec: str = "none",
    safety: float = 4.0,
    floor_s: float = 1.0,
) -> float:
    """Deadline of one ring step: `safety` times the time the largest segment needs on the
    slowest link (`bandwidth_bytes_per_s`, measured), plus one round trip per chunk, never less
    than `floor_s`. A neighbour that makes no progress for this long is treated as failed."""
    if n < 1 or numel < 0:
        raise ValueError(f"bad ring size n={n}, numel={numel}")
    if not bandwidth_bytes_per_s > 0 or not math.isfinite(bandwidth_bytes_per_s):
        raise ValueError(f"bandwidth must be a positive number (got {bandwidth_bytes_per_s})")
    if rtt_s < 0 or safety <= 0 or floor_s < 0:
        raise ValueError("rtt_s, safety and floor_s must be non-negative (safety positive)")
    seg = -(-numel // n)
    elems = chunk_elems_for(codec)
    chunks = max(1, -(-seg // elems))
    seconds = encoded_size(codec, seg) / bandwidth_bytes_per_s + chunks * rtt_s
    return max(floor_s, safety * seconds)


# ---------------------------------------------------------------------------------------------
# Ring order


def ring_order(
    nodes: Sequence[str],
    rtt_s: Mapping[tuple[str, str], float] | None = None,
    *,
    node_rtt_s: Mapping[str, float] | None = None,
    node_bandwidth: Mapping[str, float] | None = None,
) -> list[str]:
    """A ring order of `nodes` from measured link figures (deterministic for equal inputs).

    With a matrix `rtt_s[(a, b)]` of measured link costs between peers in seconds (round trips,
    or `link_cost_s` of round trip and bandwidth; either orientation, the worse one counts; a
    missing pair counts as unknown = slower than every measured one): greedy nearest neighbour
    tours from every start node, keeping the tour with the smallest worst hop, then the smallest
    total, then the first in node order. A ring is as fast as its slowest link, so the worst hop
    comes first; the total breaks ties towards compact tours.

    Without a matrix, per-node figures towards the coordinator (`node_rtt_s`, `node_bandwidth`)
    stand in: nodes sorted by round trip, then by bandwidth (fastest first), then by id, so
    nodes that see the coordinator alike (probably near each other) sit next to each other and
    only the wrap-around hop is long. With no figures at all the order is by node id.

    The result starts with the first node of the chosen tour rotated to the smallest id (the
    rotation of a ring does not change its links).
    """
    ids = list(dict.fromkeys(nodes))
    if len(ids) != len(nodes):
        raise ValueError("ring_order: node ids must be unique")
    if len(ids) <= 2:
        return sorted(ids)
    if rtt_s:
        tour = _best_greedy_tour(ids, rtt_s)
    else:
        rtt = node_rtt_s or {}
        bw = node_bandwidth or {}
        tour = sorted(ids, key=lambda i: (rtt.get(i, math.inf), -bw.get(i, 0.0), i))
    first = tour.index(min(tour))
    return tour[first:] + tour[:first]


def link_cost_s(
    rtt_s: float, bandwidth_bytes_per_s: float, chunk_bytes: int = MAX_CHUNK_BYTES
) -> float:
    """What one pipelined ring hop of a chunk costs on a link: its round trip plus the chunk's
    transfer time; the figure `ring_order` compares links by (inf for a useless measurement)."""
    if not (math.isfinite(rtt_s) and rtt_s >= 0):
        return math.inf
    if not (math.isfinite(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
        return math.inf
    return rtt_s + chunk_bytes / bandwidth_bytes_per_s


def _link(rtt_s: Mapping[tuple[str, str], float], a: str, b: str) -> float:
    ab = rtt_s.get((a, b))
    ba = rtt_s.get((b, a))
    known = [v for v in (ab, ba) if v is not None and math.isfinite(v) and v >= 0]
    return max(known) if known else math.inf


def _best_greedy_tour(ids: list[str], rtt_s: Mapping[tuple[str, str], float]) -> list[str]:
    order = sorted(ids)
    # Large rings: start only from a few nodes to keep this O(n^2) per start.
    starts = order if len(order) <= 64 else order[:8]
    best: tuple[float, float, list[str]] | None = None
    for start in starts:
        tour = [start]
        left = set(order) - {start}
        while left:
            here = tour[-1]
            nxt = min(left, key=lambda b: (_link(rtt_s, here, b), b))
            tour.append(nxt)
            left.remove(nxt)
        hops = [_link(rtt_s, tour[i], tour[(i + 1) % len(tour)]) for i in range(len(tour))]
        worst = max(hops)
        total = math.fsum(h for h in hops if math.isfinite(h))
        total += sum(1 for h in hops if not math.isfinite(h)) * 1e9
        if best is None or (worst, total) < (best[0], best[1]):
            best = (worst, total, tour)
    assert best is not None
    return best[2]
