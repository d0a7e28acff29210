"""The pure ring all-reduce schedule (epochmesh.ring.schedule): coverage, exactly-once reduction,
all-gather distribution, bit-identical sums, deadlines and the ring order."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.ring.schedule import (
    ALL_GATHER,
    REDUCE_SCATTER,
    RING_CODECS,
    RingSchedule,
    chunk_elems_for,
    link_cost_s,
    ring_order,
    segment_bounds,
    simulate_allreduce,
    step_deadline_s,
)
from epochmesh.wire.compression import encoded_size

pytestmark = pytest.mark.timeout(60)

SIZES = [0, 1, 2, 5, 7, 8, 64, 1000, 1031]


def _traced_allreduce(sch: RingSchedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the schedule on contributor bitmasks, counting every add and copy per element.

    Returns (masks[rank, elem], adds[rank, elem], copies[rank, elem]).
    """
    n, numel = sch.n, sch.numel
    masks = np.array([[1 << r] * numel for r in range(n)], dtype=np.int64).reshape(n, numel)
    adds = np.zeros((n, numel), dtype=np.int64)
    copies = np.zeros((n, numel), dtype=np.int64)
    for t in range(sch.num_steps):
        sent = [
            [masks[r, lo:hi].copy() for lo, hi in sch.segment_chunks(sch.send_segment(r, t))]
            for r in range(n)
        ]
        for r in range(n):
            left = (r - 1) % n
            seg = sch.recv_segment(r, t)
            for (lo, hi), data in zip(sch.segment_chunks(seg), sent[left], strict=True):
                if sch.phase(t) == REDUCE_SCATTER:
                    assert not np.any(masks[r, lo:hi] & data), "an addend arrived twice"
                    masks[r, lo:hi] |= data
                    adds[r, lo:hi] += 1
                else:
                    masks[r, lo:hi] = data
                    copies[r, lo:hi] += 1
    return masks, adds, copies


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("chunk_elems", [1, 3, 64])
def test_every_element_reduced_once_and_gathered_everywhere(
    n: int, numel: int, chunk_elems: int
) -> None:
    sch = RingSchedule.build(n, numel, chunk_elems)
    masks, adds, copies = _traced_allreduce(sch)
    full = (1 << n) - 1
    assert np.all(masks == full), "some rank misses an addend of some element"
    # Reduce-scatter: n-1 additions per element over the whole ring, at most one per rank,
    # none on the rank where the segment starts; the owner's is the last one.
    for k, (start, stop) in enumerate(sch.segments):
        if start == stop:
            continue
        order = sch.reduction_order(k)
        assert order[0] == k and order[-1] == sch.owner(k)
        assert np.all(adds[:, start:stop].sum(axis=0) == n - 1)
        assert np.all(adds[k, start:stop] == 0)
        for r in order[1:]:
            assert np.all(adds[r, start:stop] == 1)
        # All-gather: every rank but the owner gets the final value exactly once.
        owner = sch.owner(k)
        assert sch.owned_segment(owner) == k
        assert np.all(copies[owner, start:stop] == 0)
        for r in range(n):
            if r != owner:
                assert np.all(copies[r, start:stop] == 1)


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("numel", [0, 3, 1000, 1031])
def test_segments_and_chunks_partition_the_buffer(n: int, numel: int) -> None:
    sch = RingSchedule.build(n, numel, chunk_elems=16)
    assert len(sch.segments) == n
    sizes = [b - a for a, b in sch.segments]
    assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    pos = 0
    for k, (a, b) in enumerate(sch.segments):
        assert a == pos
        pos = b
        chunks = sch.segment_chunks(k)
        assert [lo for lo, _ in chunks] == list(range(a, b, 16))
        assert all(0 < hi - lo <= 16 for lo, hi in chunks)
        assert (chunks[-1][1] if chunks else a) == b
    assert pos == numel
    assert sch.num_steps == 2 * (n - 1)


@pytest.mark.parametrize("n", range(2, 9))
def test_sends_match_receives_and_dependencies(n: int) -> None:
    sch = RingSchedule.build(n, 997, chunk_elems=10)
    for r in range(n):
        right = (r + 1) % n
        assert sch.send_order(r) == sch.recv_order(right)
        recv = sch.recv_order(r)
        assert len(recv) == sch.recv_count(r)
        for t in range(sch.num_steps):
            seg = sch.send_segment(r, t)
            if t > 0:
                assert seg == sch.recv_segment(r, t - 1)
            for c in range(len(sch.segment_chunks(seg))):
                dep = sch.dependency(r, t, c)
                if t == 0:
                    assert dep is None
                else:
                    assert dep is not None and recv[dep] == (t - 1, seg, c)
        assert sch.recv_segment(r, n - 2) == sch.owned_segment(r)
    for t in range(sch.num_steps):
        phase = sch.phase(t)
        assert phase == (REDUCE_SCATTER if t < n - 1 else ALL_GATHER)
        assert sch.global_step(phase, sch.phase_step(t)) == t


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("numel", [1, 7, 1031, 5000])
def test_bit_identical_sums_with_random_floats(n: int, numel: int) -> None:
    rng = np.random.default_rng(n * 100_003 + numel)
    # Wildly different magnitudes make the order of additions visible in the low bits.
    bufs = [
        (rng.standard_normal(numel) * 10.0 ** rng.integers(-8, 8, numel)).astype(np.float32)
        for _ in range(n)
    ]
    sch = RingSchedule.build(n, numel, chunk_elems=128)
    out = simulate_allreduce(sch, bufs)
    for r in range(1, n):
        assert out[r].tobytes() == out[0].tobytes()
    # The value is the left-to-right sum in reduction_order, computed once.
    expected = np.empty(numel, dtype=np.float32)
    for k, (a, b) in enumerate(sch.segments):
        order = sch.reduction_order(k)
        acc = bufs[order[0]][a:b].copy()
        for r in order[1:]:
            acc = acc + bufs[r][a:b]
        expected[a:b] = acc
    assert out[0].tobytes() == expected.tobytes()
    # Within float32 rounding of a sum of n addends (relative to the addends' magnitudes).
    stacked = np.stack(bufs).astype(np.float64)
    bound = n * np.finfo(np.float32).eps * np.abs(stacked).sum(axis=0)
    assert np.all(np.abs(out[0] - stacked.sum(axis=0)) <= bound)
    # Inputs untouched.
    assert all(b.dtype == np.float32 for b in bufs)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=8),
    numel=st.integers(min_value=0, max_value=300),
    chunk_elems=st.integers(min_value=1, max_value=50),
)
def test_property_exactly_once_for_any_shape(n: int, numel: int, chunk_elems: int) -> None:
    sch = RingSchedule.build(n, numel, chunk_elems)
    masks, adds, _ = _traced_allreduce(sch)
    assert np.all(masks == (1 << n) - 1)
    if numel:
        assert np.all(adds.sum(axis=0) == n - 1)


def test_segment_bounds_and_bad_arguments() -> None:
    assert segment_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert segment_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError):
        RingSchedule.build(0, 10)
    with pytest.raises(ValueError):
        RingSchedule.build(2, -1)
    with pytest.raises(ValueError):
        RingSchedule.build(2, 10, chunk_elems=0)
    sch = RingSchedule.build(3, 10)
    with pytest.raises(ValueError):
        sch.send_segment(3, 0)
    with pytest.raises(ValueError):
        sch.recv_segment(0, 4)
    with pytest.raises(ValueError):
        sch.global_step("sideways", 0)
    with pytest.raises(ValueError):
        simulate_allreduce(sch, [np.zeros(10, np.float32)] * 2)


def test_chunk_elems_fit_the_wire_limit() -> None:
    assert chunk_elems_for("none") == MAX_CHUNK_BYTES // 4
    for codec in RING_CODECS:
        elems = chunk_elems_for(codec)
        assert elems % 256 == 0
        assert encoded_size(codec, elems) <= MAX_CHUNK_BYTES
        assert encoded_size(codec, elems + 256) > MAX_CHUNK_BYTES
    with pytest.raises(ValueError):
        chunk_elems_for("topk")


def test_step_deadline_follows_measured_bandwidth() -> None:
    numel = 16 << 20  # 64 MiB of float32
    fast = step_deadline_s(numel, 4, 1e9, floor_s=0.0)
    slow = step_deadline_s(numel, 4, 1e8, floor_s=0.0)
    assert slow == pytest.approx(10 * fast)
    assert fast == pytest.approx(4.0 * (numel * 4 / 4) / 1e9)
    # fp16 halves the bytes on the wire.
    assert step_deadline_s(numel, 4, 1e9, codec="fp16", floor_s=0.0) == pytest.approx(fast / 2)
    # One rtt per chunk on top; the floor holds for tiny buffers.
    with_rtt = step_deadline_s(numel, 4, 1e9, 0.01, floor_s=0.0)
    assert with_rtt == pytest.approx(fast + 4.0 * 16 * 0.01)
    assert step_deadline_s(10, 4, 1e9) == 1.0
    with pytest.raises(ValueError):
        step_deadline_s(10, 4, 0.0)
    with pytest.raises(ValueError):
        step_deadline_s(10, 4, math.inf)


def test_ring_order_from_rtt_matrix_keeps_near_nodes_adjacent() -> None:
    # Two sites: a*, b* are 1 ms apart within a site, 50 ms across.
    nodes = ["b2", "a1", "b1", "a2", "a3"]
    rtt: dict[tuple[str, str], float] = {}
    for x in nodes:
        for y in nodes:
            if x < y:
                rtt[(x, y)] = 0.001 if x[0] == y[0] else 0.050
    order = ring_order(nodes, rtt)
    assert sorted(order) == sorted(nodes) and order[0] == "a1"
    cross = sum(1 for i in range(len(order)) if order[i][0] != order[(i + 1) % len(order)][0])
    assert cross == 2  # the minimum for a ring over two sites
    assert ring_order(list(reversed(nodes)), rtt) == order  # deterministic


def test_ring_order_avoids_a_slow_link() -> None:
    nodes = ["n1", "n2", "n3", "n4"]
    rtt = {(a, b): 0.002 for a in nodes for b in nodes if a < b}
    rtt[("n1", "n2")] = 0.5  # a bad link
    order = ring_order(nodes, rtt)
    pairs = {frozenset((order[i], order[(i + 1) % 4])) for i in range(4)}
    assert frozenset(("n1", "n2")) not in pairs


def test_ring_order_without_matrix_uses_per_node_figures() -> None:
    nodes = ["x", "y", "z", "w"]
    order = ring_order(
        nodes,
        node_rtt_s={"x": 0.050, "y": 0.001, "z": 0.049, "w": 0.002},
        node_bandwidth={"x": 1e8, "y": 1e9, "z": 1e8, "w": 1e9},
    )
    assert order == ["w", "z", "x", "y"]  # sorted by rtt: y, w, z, x, rotated to start at "w"
    assert ring_order(nodes) == ["w", "x", "y", "z"]
    assert ring_order(["b", "a"]) == ["a", "b"]
    with pytest.raises(ValueError):
        ring_order(["a", "a", "b"])


def test_link_cost_adds_the_chunk_transfer_to_the_round_trip() -> None:
    assert link_cost_s(0.010, 1e6, chunk_bytes=1_000_000) == pytest.approx(1.010)
    # A fast but distant link against a near but thin one: 1 MiB chunks decide.
    far_fat = link_cost_s(0.050, 1e9)
    near_thin = link_cost_s(0.001, 1e6)
    assert far_fat < near_thin
    for bad in ((math.nan, 1e6), (-1.0, 1e6), (0.01, 0.0), (0.01, math.inf)):
        assert link_cost_s(*bad) == math.inf
    nodes = ["n1", "n2", "n3", "n4"]
    cost = {(a, b): link_cost_s(0.001, 1e9) for a in nodes for b in nodes if a < b}
    cost[("n2", "n1")] = link_cost_s(0.001, 1e6)  # measured thin one way: the worse way counts
    order = ring_order(nodes, cost)
    pairs = {frozenset((order[i], order[(i + 1) % 4])) for i in range(4)}
    assert frozenset(("n1", "n2")) not in pairs
