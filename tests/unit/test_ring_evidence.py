"""epochmesh.ring.evidence: ring members' sketches of their reduce-scatter, and the judge that
checks every member against itself and every hop against its two ends (pure; the ring is
simulated here with the real schedule and wire codecs)."""

from __future__ import annotations

import math

import pytest
import torch

from epochmesh.ring.evidence import (
    HOP_TOLERANCE,
    SELF_TOLERANCE,
    FlatSketch,
    RingEvidence,
    codec_roundtrip,
    judge,
    member_evidence,
)
from epochmesh.ring.schedule import RingSchedule, chunk_elems_for
from epochmesh.sketch import relative_distance, sketch

pytestmark = pytest.mark.timeout(60)

SHAPES = {"w1": (40, 30), "b1": (40,), "w2": (7, 40), "b2": (7,)}
NUMEL = sum(math.prod(s) for s in SHAPES.values())


def simulate(
    contributions: list[torch.Tensor], codec: str, chunk_elems: int = 256
) -> tuple[RingSchedule, list[torch.Tensor], list[torch.Tensor]]:
    """A ring all-reduce as node_agent.ring.allreduce runs it (reduce-scatter adding decoded
    chunks, the owner's sum through the codec, all-gather copying): the schedule, every rank's
    received reduce-scatter values and its final buffer."""
    n = len(contributions)
    sch = RingSchedule.build(n, contributions[0].numel(), chunk_elems)
    bufs = [c.clone() for c in contributions]
    received = [torch.zeros_like(c) for c in contributions]

    def wire(r: int, k: int) -> torch.Tensor:
        lo, hi = sch.segments[k]
        chunks = [(a - lo, z - lo) for a, z in sch.segment_chunks(k)]
        return codec_roundtrip(bufs[r][lo:hi].clone(), codec, chunks)

    for t in range(n - 1):
        sent = [(sch.send_segment(r, t), wire(r, sch.send_segment(r, t))) for r in range(n)]
        for r in range(n):
            k, data = sent[(r - 1) % n]
            lo, hi = sch.segments[k]
            received[r][lo:hi] = data
            bufs[r][lo:hi] += data
    for r in range(n):
        k = (r + 1) % n
        lo, hi = sch.segments[k]
        bufs[r][lo:hi] = wire(r, k)
    for t in range(n - 1, 2 * (n - 1)):
        sent = [
            (sch.send_segment(r, t), bufs[r][slice(*sch.segments[sch.send_segment(r, t)])].clone())
            for r in range(n)
        ]
        for r in range(n):
            k, data = sent[(r - 1) % n]
            lo, hi = sch.segments[k]
            bufs[r][lo:hi] = data
    return sch, received, bufs


def contributions(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) * 0.01 for _ in range(n)]


def evidence_of(sch, received, bufs, contribs, codec, fs) -> dict[str, RingEvidence]:
    return {
        f"m{r}": member_evidence(sch, r, codec, contribs[r], received[r], bufs[r], fs)
        for r in range(sch.n)
    }


def test_the_flat_sketch_is_the_sketch_of_the_parameters_by_name() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    fs = FlatSketch.build(SHAPES, seed=99, buckets=64)
    assert relative_distance(sketch(tensors, 99, 64), fs.of(flat)) < 1e-12
    # And segment by segment: the parts add up.
    parts = fs.of(flat[:100]) + fs.of(flat[100:777], 100) + fs.of(flat[777:], 777)
    assert relative_distance(fs.of(flat), parts) < 1e-12


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_an_honest_ring_is_clean_and_well_inside_the_tolerances(codec: str, n: int) -> None:
    contribs = contributions(n)
    sch, received, bufs = simulate(contribs, codec)
    assert all(torch.equal(bufs[0], b) for b in bufs)  # the ring's bit-identical result
    fs = FlatSketch.build(SHAPES, seed=5, buckets=128)
    ev = evidence_of(sch, received, bufs, contribs, codec, fs)
    verdict = judge([f"m{r}" for r in range(n)], codec, ev)
    assert verdict.clean, verdict
    worst = 0.0
    for r in range(n):
        e = ev[f"m{r}"]
        for t in range(n - 1):
            k = (r - t) % n
            want = e.own[k] if t == 0 else e.received[k] + e.own[k]
            worst = max(worst, relative_distance(e.sent[k], want))
    # The tolerance leaves a margin of several times what the codec's rounding gives.
    assert worst < SELF_TOLERANCE[codec] / 4, (codec, worst)
    # Own sketches add up to the sketch of the contribution.
    for r in range(n):
        assert relative_distance(fs.of(contribs[r]), ev[f"m{r}"].own.sum(dim=0)) < 1e-12


def cheat_ring(codec: str, n: int = 4, liar: int = 2):
    """The liar puts 100 x its contribution into the ring but claims its honest one."""
    claimed = contributions(n, seed=3)
    actual = [c.clone() for c in claimed]
    actual[liar] = claimed[liar] * 100
    sch, received, bufs = simulate(actual, codec)
    fs = FlatSketch.build(SHAPES, seed=7, buckets=128)
    return sch, received, bufs, claimed, actual, fs


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_liar_reporting_what_really_happened_contradicts_itself(codec: str) -> None:
    sch, received, bufs, claimed, actual, fs = cheat_ring(codec)
    ev = evidence_of(sch, received, bufs, actual, codec, fs)
    # Its true sends and receipts, but its honest contribution's sketches:
    true = member_evidence(sch, 2, codec, actual[2], received[2], bufs[2], fs)
    honest = member_evidence(sch, 2, codec, claimed[2], received[2], bufs[2], fs)
    ev["m2"] = RingEvidence(true.sent, true.received, honest.own, true.result)
    verdict = judge(["m0", "m1", "m2", "m3"], codec, ev)
    assert set(verdict.liars) == {"m2"} and not verdict.hops, verdict


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_liar_consistent_with_its_claim_breaks_a_hop_next_to_it(codec: str) -> None:
    sch, received, bufs, claimed, actual, fs = cheat_ring(codec)
    ev = evidence_of(sch, received, bufs, actual, codec, fs)
    # What it would have sent with its claimed contribution: the ring's (public) sum of the
    # segment it owns holds its real contribution, so it contradicts itself there.
    ev["m2"] = member_evidence(sch, 2, codec, claimed[2], received[2], bufs[2], fs)
    verdict = judge(["m0", "m1", "m2", "m3"], codec, ev)
    assert set(verdict.liars) == {"m2"} and not verdict.hops, verdict
    assert "which it owns" in verdict.liars["m2"]
    # With the sum of its own segment left out of it (as if the ring had no such check), its
    # right neighbour's word is what shows it.
    hidden = ev["m2"]
    owned = (2 + 1) % 4
    result = hidden.result.clone()
    result[owned] = hidden.received[owned] + hidden.own[owned]
    for m in ev:  # every member "agrees" on that result
        e = ev[m]
        ev[m] = RingEvidence(e.sent, e.received, e.own, result)
    verdict = judge(["m0", "m1", "m2", "m3"], codec, ev)
    assert [(a, b) for a, b, _ in verdict.hops] == [("m2", "m3")] or "m2" in verdict.liars, verdict
    assert set(verdict.liars) <= {"m2"}
    # Or it claims to have received what fits: then its left neighbour disagrees.
    lo_hi = sch.segments
    fake_received = received[2].clone()
    for t in range(3):
        k = sch.recv_segment(2, t)
        lo, hi = lo_hi[k]
        fake_received[lo:hi] = received[2][lo:hi] + actual[2][lo:hi] - claimed[2][lo:hi]
    sent_true = member_evidence(sch, 2, codec, actual[2], received[2], bufs[2], fs).sent
    own = member_evidence(sch, 2, codec, claimed[2], fake_received, bufs[2], fs)
    ev = evidence_of(sch, received, bufs, actual, codec, fs)
    ev["m2"] = RingEvidence(sent_true, own.received, own.own, own.result)
    verdict = judge(["m0", "m1", "m2", "m3"], codec, ev)
    assert ("m1", "m2") in [(a, b) for a, b, _ in verdict.hops] or "m2" in verdict.liars, verdict
    assert set(verdict.liars) <= {"m2"}
    assert all("m2" in (a, b) for a, b, _ in verdict.hops)


def test_a_neighbour_that_frames_a_member_breaks_only_its_own_hop() -> None:
    contribs = contributions(4, seed=4)
    sch, received, bufs = simulate(contribs, "none")
    fs = FlatSketch.build(SHAPES, seed=8, buckets=128)
    ev = evidence_of(sch, received, bufs, contribs, "none", fs)
    framed = ev["m3"].received.clone()
    framed[sch.recv_segment(3, 0)] *= 5.0  # m3 says m2 sent it something else
    ev["m3"] = RingEvidence(ev["m3"].sent, framed, ev["m3"].own, ev["m3"].result)
    verdict = judge(["m0", "m1", "m2", "m3"], "none", ev)
    # Its own books no longer balance: it names itself, not m2.
    assert set(verdict.liars) == {"m3"}, verdict


def test_the_contribution_must_be_the_sketched_update_scaled() -> None:
    contribs = contributions(3, seed=6)
    sch, received, bufs = simulate(contribs, "none")
    fs = FlatSketch.build(SHAPES, seed=9, buckets=64)
    ev = evidence_of(sch, received, bufs, contribs, "none", fs)
    order = ["m0", "m1", "m2"]
    good = {"m1": fs.of(contribs[1])}
    assert judge(order, "none", ev, good).clean
    bad = {"m1": fs.of(contribs[1] * 0.5)}
    assert set(judge(order, "none", ev, bad).liars) == {"m1"}


def test_a_member_lying_about_the_result_is_named() -> None:
    contribs = contributions(3, seed=2)
    sch, received, bufs = simulate(contribs, "none")
    fs = FlatSketch.build(SHAPES, seed=1, buckets=64)
    ev = evidence_of(sch, received, bufs, contribs, "none", fs)
    e = ev["m0"]
    ev["m0"] = RingEvidence(e.sent, e.received, e.own, e.result * 1.01)
    assert set(judge(["m0", "m1", "m2"], "none", ev).liars) == {"m0"}


def test_evidence_from_flat_values_is_checked() -> None:
    e = RingEvidence(*(torch.zeros(3, 4, dtype=torch.float64) for _ in range(4)))
    back = RingEvidence.from_flat(e.flat(), 3, 4)
    assert e.flat() == back.flat()
    with pytest.raises(ValueError, match="sent: 11 values"):
        RingEvidence.from_flat([[0.0] * 11, *e.flat()[1:]], 3, 4)
    with pytest.raises(ValueError, match="NaN"):
        RingEvidence.from_flat([e.flat()[0], [float("nan")] * 12, *e.flat()[2:]], 3, 4)
    assert HOP_TOLERANCE < SELF_TOLERANCE["none"]
    assert chunk_elems_for("int8") % 256 == 0
