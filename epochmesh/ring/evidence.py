"""What a ring member saw and sent in a ring all-reduce, as sketches (verification, issue 20;
pure). The coordinator never sees a member's contribution to the all-reduce; these sketches let
it check that the contribution is the update the member sketched, and name a member that lies.

In the reduce-scatter (`epochmesh.ring.schedule`) rank i sends segment i at step 0 (its own contribution
x_i there, through the wire codec), and at step t >= 1 segment (i - t) mod n: the partial sum R_i
it received for that segment at step t-1 plus its own part, fl(R_i + x_i), through the codec. It
finally receives its owned segment (i + 1) mod n, whose result is fl(R_i + x_i) (through the codec
for a lossy one). A member keeps what it received in the reduce-scatter (`ring_allreduce`'s
``received`` buffer) and reports, per segment k and under a seed drawn after the all-reduce:

- ``sent[k]``: the sketch of what it sent of segment k (recomputed from x_i and R_i exactly as the
  ring did; zero for the segment it owns);
- ``received[k]``: of what it received of segment k (zero for the segment it originates);
- ``own[k]``: of its contribution x_i there (b_i / B times its update; the gateway's also holds
  the external nodes' sum);
- ``result[k]``: of the all-reduced sum there (the same on every member: the ring agreed on it).

Sketches are `epochmesh.sketch`'s CountSketch over the flat buffer, with the same bucket and
sign of every coordinate as `sketch()` of the parameters by name (`FlatSketch`): the own
sketches of all segments add up to the sketch of the member's update (times b_i / B).

`judge` (the coordinator's) checks every member against itself (what it sent is what it
received plus its own, within the wire codec's rounding; its result is the ring's) and every
hop against the two ends (what a member says it sent is what its right neighbour says it
received, exactly: the same float32 values sketched the same way). A member that sends a
contribution other than the one it reports must either contradict itself, or make one of its
two hops disagree: its neighbour saw the real bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from epochmesh.ring.schedule import RingSchedule
from epochmesh.sketch import coordinate_draws, relative_distance
from epochmesh.wire import compression

# Relative distance allowed between what a member sent and what it received plus its own, by
# wire codec: float32 rounding of one addition, or the codec's rounding of the sum (worst seen
# over rings of 2-8 Gaussian contributions, tests/unit/test_ring_evidence.py's simulation:
# none 3.6e-8, fp16 2.5e-4, bf16 2.0e-3, int8 9.8e-3), with a margin of 10x or more (int8's
# blocks round to their largest value: heavier tails round worse). A cheat's contribution is
# O(1) away (x100: 99; flipped: 2).
SELF_TOLERANCE = {"none": 1e-5, "fp16": 3e-3, "bf16": 3e-2, "int8": 1e-1}
# Between the two ends of a hop (the same float32 values, sketched the same way: equal bits on
# any honest pair; a margin for float64 summation order only).
HOP_TOLERANCE = 1e-9


@dataclass(frozen=True)
class FlatSketch:
    """CountSketch of a flat float32 buffer in the program's parameter order, with the buckets
    and signs `epochmesh.sketch.sketch` gives each parameter's coordinates (drawn by sorted
    name)."""

    where: torch.Tensor  # int64, one bucket per coordinate
    sign: torch.Tensor  # float64, +1 / -1 per coordinate
    buckets: int

    @classmethod
    def build(cls, shapes: Mapping[str, Sequence[int]], seed: int, buckets: int) -> FlatSketch:
        """``shapes``: the parameters in program (flat buffer) order."""
        sizes = {name: math.prod(int(d) for d in shape) for name, shape in shapes.items()}
        offsets: dict[str, int] = {}
        start = 0
        for name, n in sizes.items():
            offsets[name] = start
            start += n
        where = torch.zeros(start, dtype=torch.int64)
        sign = torch.zeros(start, dtype=torch.float64)
        for name, w, s in coordinate_draws(sizes, seed, buckets):
            lo = offsets[name]
            where[lo : lo + w.numel()] = w
            sign[lo : lo + w.numel()] = s
        return cls(where=where, sign=sign, buckets=buckets)

    @property
    def numel(self) -> int:
        return int(self.where.numel())

    def of(self, values: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """The float64 sketch of ``values``, the coordinates lo .. lo + len(values) - 1."""
        out = torch.zeros(self.buckets, dtype=torch.float64)
        hi = lo + values.numel()
        if hi > lo:
            flat = values.detach().reshape(-1).to(torch.float64)
            out.index_add_(0, self.where[lo:hi], flat * self.sign[lo:hi])
        return out


@dataclass
class RingEvidence:
    """One member's sketches, n segments x buckets each (see the module docstring)."""

    sent: torch.Tensor
    received: torch.Tensor
    own: torch.Tensor
    result: torch.Tensor

    def flat(self) -> list[list[float]]:
        return [t.reshape(-1).tolist() for t in (self.sent, self.received, self.own, self.result)]

    @classmethod
    def from_flat(cls, parts: Sequence[Sequence[float]], n: int, buckets: int) -> RingEvidence:
        """From four lists of n x buckets values (ValueError for other lengths or non-finite
        values)."""
        if len(parts) != 4:
            raise ValueError("ring evidence has four parts (sent, received, own, result)")
        tensors = []
        for name, values in zip(("sent", "received", "own", "result"), parts, strict=True):
            if len(values) != n * buckets:
                raise ValueError(
                    f"{name}: {len(values)} values; {n} segments x {buckets} buckets expected"
                )
            t = torch.tensor(list(values), dtype=torch.float64).reshape(n, buckets)
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} holds NaN or Inf")
            tensors.append(t)
        return cls(*tensors)


def codec_roundtrip(
    values: torch.Tensor, codec: str, chunks: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """What the wire makes of a segment's float32 ``values`` (decoded), chunk by chunk as the
    ring sends it; ``chunks``: the segment's [start, stop) chunk ranges, relative to it."""
    if codec == "none":
        return values
    out = torch.empty_like(values)
    for lo, hi in chunks:
        data = compression.encode(values[lo:hi], codec)
        out[lo:hi] = compression.decode(data, codec, (hi - lo,))
    return out


def member_evidence(
    schedule: RingSchedule,
    rank: int,
    codec: str,
    contribution: torch.Tensor,
    received: torch.Tensor,
    result: torch.Tensor,
    fs: FlatSketch,
) -> RingEvidence:
    """Rank ``rank``'s evidence of one all-reduce: ``contribution`` is the buffer it put in
    (scaled), ``received`` what it received in the reduce-scatter (zeros elsewhere), ``result``
    the all-reduced buffer (all flat float32 of the schedule's numel)."""
    n, b = schedule.n, fs.buckets
    if fs.numel != schedule.numel:
        raise ValueError(f"a sketch of {fs.numel} coordinates for a buffer of {schedule.numel}")
    sent = torch.zeros(n, b, dtype=torch.float64)
    recv = torch.zeros(n, b, dtype=torch.float64)
    own = torch.zeros(n, b, dtype=torch.float64)
    res = torch.zeros(n, b, dtype=torch.float64)
    for k, (lo, hi) in enumerate(schedule.segments):
        own[k] = fs.of(contribution[lo:hi], lo)
        res[k] = fs.of(result[lo:hi], lo)
    for t in range(n - 1):
        k = schedule.send_segment(rank, t)
        lo, hi = schedule.segments[k]
        mine = contribution[lo:hi] if t == 0 else contribution[lo:hi] + received[lo:hi]
        chunks = [(a - lo, z - lo) for a, z in schedule.segment_chunks(k)]
        sent[k] = fs.of(codec_roundtrip(mine, codec, chunks), lo)
        k = schedule.recv_segment(rank, t)
        lo, hi = schedule.segments[k]
        recv[k] = fs.of(received[lo:hi], lo)
    return RingEvidence(sent=sent, received=recv, own=own, result=res)


@dataclass
class Verdict:
    """`judge`'s findings: members that contradict themselves (node -> why) and hops whose
    ends disagree (sender, receiver, why)."""

    liars: dict[str, str]
    hops: list[tuple[str, str, str]]

    @property
    def clean(self) -> bool:
        return not self.liars and not self.hops


def judge(
    order: Sequence[str],
    codec: str,
    evidence: Mapping[str, RingEvidence],
    expected_own: Mapping[str, torch.Tensor] | None = None,
    own_offsets: Mapping[str, torch.Tensor] | None = None,
) -> Verdict:
    """Check the evidence of every member of a ring (``order``: ranks) of one all-reduce.
    ``expected_own``: for members whose update sketch is known (checked ones), the sketch their
    contribution must have (b_i / B times it, plus the externals' sum at the gateway).
    ``own_offsets``: what such a contribution holds besides (a weighted round's tail, w times its
    sketch: epochmesh.ring.weights), taken off before the comparison, so that the tail's size
    does not loosen the tolerance on the update."""
    n = len(order)
    if set(evidence) != set(order):
        raise ValueError("evidence of every member is needed")
    tol = SELF_TOLERANCE[codec]
    liars: dict[str, str] = {}
    # The ring agreed on its result: the majority's sketch of it (ties: the first rank's).
    results = [evidence[m].result for m in order]
    agreed = max(
        results, key=lambda r: sum(relative_distance(r, o) <= HOP_TOLERANCE for o in results)
    )
    for i, m in enumerate(order):
        ev = evidence[m]
        if relative_distance(agreed, ev.result) > HOP_TOLERANCE:
            liars[m] = "its sketch of the all-reduced sum is not the ring's"
            continue
        if expected_own is not None and m in expected_own:
            own = ev.own.sum(dim=0)
            if own_offsets is not None and m in own_offsets:
                own = own - own_offsets[m]
            d = relative_distance(expected_own[m], own)
            if d > SELF_TOLERANCE["none"]:
                liars[m] = (
                    f"its contribution's sketch is not b_i/B times its update's (relative "
                    f"distance {d:.3g})"
                )
                continue
        for t in range(n - 1):
            k = (i - t) % n
            want = ev.own[k] if t == 0 else ev.received[k] + ev.own[k]
            d = relative_distance(ev.sent[k], want)
            if d > tol:
                liars[m] = (
                    f"what it says it sent of segment {k} is not what it says it received plus "
                    f"its own (relative distance {d:.3g} > {tol:g})"
                )
                break
        if m in liars:
            continue
        k = (i + 1) % n  # the segment it owns
        d = relative_distance(ev.result[k], ev.received[k] + ev.own[k])
        if d > tol:
            liars[m] = (
                f"the ring's sum of segment {k}, which it owns, is not what it says it received "
                f"plus its own (relative distance {d:.3g} > {tol:g})"
            )
    hops: list[tuple[str, str, str]] = []
    for i, m in enumerate(order):
        right = order[(i + 1) % n]
        if m in liars or right in liars:
            continue  # explained
        for t in range(n - 1):
            k = (i - t) % n
            d = relative_distance(evidence[m].sent[k], evidence[right].received[k])
            if d > HOP_TOLERANCE:
                hops.append(
                    (
                        m,
                        right,
                        f"segment {k}: {m} says it sent what {right} says it did not receive "
                        f"(relative distance {d:.3g})",
                    )
                )
                break
    return Verdict(liars=liars, hops=hops)
