"""Weighted ring contributions (epochmesh/ring/weights.py): the tail's layout keeps the weight
alone in its int8 block, the all-reduce's result is the sample-weighted mean, and the sketches
the coordinator expects of a contribution are the ones a member's evidence holds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from epochmesh.ring.evidence import FlatSketch
from epochmesh.ring.schedule import RingSchedule, chunk_elems_for, simulate_allreduce
from epochmesh.ring.weights import (
    WEIGHT_NAME,
    tail_length,
    tail_sketch,
    weight_of,
    weighted_contribution,
    weighted_mean,
    weighted_shapes,
)
from epochmesh.sketch import sketch
from epochmesh.wire import compression
from epochmesh.wire.compression import INT8_BLOCK

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 1000, 65_537, 300_001])
def test_the_weight_starts_an_int8_block_of_the_last_segment(numel: int, n: int) -> None:
    total = numel + tail_length(numel, n)
    assert tail_length(numel, n) <= n * INT8_BLOCK + n
    schedule = RingSchedule.build(n, total, chunk_elems_for("int8"))
    lo, hi = next(c for c in schedule.segment_chunks(n - 1) if c[0] <= total - 1 < c[1])
    assert hi == total
    assert (total - 1 - lo) % INT8_BLOCK == 0


def _int8_ring(buffers: list[torch.Tensor], n: int) -> torch.Tensor:
    """The int8 ring's arithmetic on one machine: each segment summed in its reduction order,
    encoded and decoded at every hop, the owner's sum decoded once more (what all ranks get)."""
    numel = buffers[0].numel()
    schedule = RingSchedule.build(n, numel, chunk_elems_for("int8"))
    out = torch.zeros(numel)
    for seg in range(n):
        for lo, hi in schedule.segment_chunks(seg):
            order = schedule.reduction_order(seg)
            acc = buffers[order[0]][lo:hi].clone()
            for r in order[1:]:
                wire = compression.encode(acc, "int8")
                acc = compression.decode(wire, "int8", (hi - lo,)) + buffers[r][lo:hi]
            out[lo:hi] = compression.decode(compression.encode(acc, "int8"), "int8", (hi - lo,))
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_int8_carries_the_summed_weight_and_the_mean_is_sample_weighted(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    numel = 5_000 + n
    deltas = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(n)]
    samples = [64 * (k + 1) for k in range(n)]
    total = sum(samples) + 32  # what was handed out: more than was trained
    buffers = [
        weighted_contribution(d, weight_of(s, total), n)
        for d, s in zip(deltas, samples, strict=True)
    ]
    summed = _int8_ring(buffers, n)
    assert math.isclose(float(summed[-1]), sum(samples) / total, rel_tol=1e-6)
    result = weighted_mean(summed, numel)
    exact = sum(s * d for s, d in zip(samples, deltas, strict=True)) / sum(samples)
    # int8's own error on the parameters (the weight's block holds no parameter).
    assert float((result - exact).norm() / exact.norm()) < 0.02


def test_without_a_codec_the_result_is_the_weighted_mean() -> None:
    n, numel = 3, 777
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(numel, generator=gen) for _ in range(n)]
    samples, total = [10, 30, 20], 90
    buffers = [
        weighted_contribution(d, weight_of(s, total), n).numpy()
        for d, s in zip(deltas, samples, strict=True)
    ]
    schedule = RingSchedule.build(n, buffers[0].size)
    outs = simulate_allreduce(schedule, buffers)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    result = weighted_mean(torch.from_numpy(outs[0]), numel)
    exact = sum(s * d for s, d in zip(samples, deltas, strict=True)) / sum(samples)
    torch.testing.assert_close(result, exact, rtol=1e-5, atol=1e-6)


def test_a_summed_weight_that_is_not_positive_is_refused() -> None:
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        buf = torch.ones(10)
        buf[-1] = bad
        with pytest.raises(ValueError, match="summed weight"):
            weighted_mean(buf, 3)


def test_weights_need_samples_within_the_total() -> None:
    assert weight_of(3, 12) == 0.25
    assert weight_of(1, 3) == float(torch.tensor(1 / 3, dtype=torch.float32))
    for samples, total in ((0, 10), (11, 10), (-1, 10)):
        with pytest.raises(ValueError, match="0 < samples <= the round's total"):
            weight_of(samples, total)


def test_the_contribution_sketches_as_the_coordinator_expects() -> None:
    shapes = {"b.weight": (3, 5), "a.bias": (7,), "z": (2, 2, 2)}
    gen = torch.Generator().manual_seed(7)
    update = {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}
    flat = torch.cat([update[k].reshape(-1) for k in shapes])  # program order
    n, seed, buckets, w = 3, 1234, 16, 0.375
    contribution = weighted_contribution(flat, w, n)
    fs = FlatSketch.build(weighted_shapes(shapes, n), seed, buckets)
    assert fs.numel == contribution.numel()
    member = fs.of(contribution)
    sizes = {k: math.prod(s) for k, s in shapes.items()}
    expected = w * (sketch(update, seed, buckets) + tail_sketch(sizes, n, seed, buckets))
    # float32 rounding of flat * w apart (a wrong draw would be off by O(1)).
    torch.testing.assert_close(member, expected, rtol=1e-6, atol=1e-6)
    # The parameters' own coordinates keep the draws of a sketch of the parameters alone.
    plain = FlatSketch.build(shapes, seed, buckets)
    torch.testing.assert_close(fs.of(flat), plain.of(flat))


def test_a_zero_update_leaves_nothing_once_the_tail_is_taken_off() -> None:
    """The coordinator's offset is the tail's exact share (the weight is a float32 value on both
    sides): an honest member whose update is zero is not accused of a non-zero contribution."""
    shapes = {"w": (300,), "b": (7,)}
    n, seed, buckets = 4, 99, 32
    w = weight_of(17, 384)
    assert w == float(torch.tensor(w, dtype=torch.float32))
    contribution = weighted_contribution(torch.zeros(307), w, n)
    own = FlatSketch.build(weighted_shapes(shapes, n), seed, buckets).of(contribution)
    offset = w * tail_sketch({"w": 300, "b": 7}, n, seed, buckets)
    assert torch.equal(own - offset, torch.zeros(buckets, dtype=torch.float64))


def test_a_parameter_name_after_the_weights_is_refused() -> None:
    with pytest.raises(ValueError, match="sorts after"):
        weighted_shapes({WEIGHT_NAME + "x": (1,)}, 2)
