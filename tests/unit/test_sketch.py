"""epochmesh.sketch: linear, norm-preserving within its bounds, seed-dependent; honest
cross-device differences stay small in sketch space while cheats are far."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epochmesh.sketch import combine, coordinate_draws, relative_distance, sketch, sketch_many

pytestmark = pytest.mark.timeout(60)


def grads(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(256, 32, generator=g) * scale,
        "b1": torch.randn(256, generator=g) * scale,
        "w2": torch.randn(10, 256, generator=g) * scale,
    }


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**63 - 1), st.floats(-3, 3), st.floats(-3, 3))
def test_a_sketch_is_linear(seed: int, wa: float, wb: float) -> None:
    a, b = grads(1), grads(2)
    mixed = {k: wa * a[k] + wb * b[k] for k in a}
    left = sketch(mixed, seed)
    right = combine([(wa, sketch(a, seed)), (wb, sketch(b, seed))])
    assert torch.allclose(left, right, rtol=1e-5, atol=1e-4)


def one_by_one(tensors: dict[str, torch.Tensor], seed: int, buckets: int) -> torch.Tensor:
    """The definition, coordinate by coordinate: sketch[h(j)] += s(j) g[j]."""
    sizes = {k: v.numel() for k, v in tensors.items()}
    out = [0.0] * buckets
    for name, where, sign in coordinate_draws(sizes, seed, buckets):
        flat = tensors[name].reshape(-1).double().tolist()
        for j, (b, sg) in enumerate(zip(where.tolist(), sign.tolist(), strict=True)):
            out[b] += sg * flat[j]
    return torch.tensor(out, dtype=torch.float64)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(1, 5), st.sampled_from([1, 7, 64]))
def test_sketch_many_is_each_part_sketched_alone(seed: int, n: int, buckets: int) -> None:
    parts = [
        {"w": torch.randn(12, 5, generator=torch.Generator().manual_seed(i)), "b": torch.ones(3)}
        for i in range(n)
    ]
    many = sketch_many(parts, seed, buckets)
    assert len(many) == n
    for part, s in zip(parts, many, strict=True):
        assert torch.equal(s, sketch(part, seed, buckets))  # bit for bit
        assert torch.allclose(s, one_by_one(part, seed, buckets), rtol=1e-12, atol=1e-12)
    assert sketch_many([], seed, buckets) == []


def test_sketch_many_refuses_parts_of_other_shapes() -> None:
    with pytest.raises(ValueError, match="part 1"):
        sketch_many([{"w": torch.zeros(4)}, {"w": torch.zeros(5)}], 1)
    with pytest.raises(ValueError, match="part 1"):
        sketch_many([{"w": torch.zeros(4)}, {"v": torch.zeros(4)}], 1)
    with pytest.raises(ValueError, match="bucket"):
        sketch_many([{"w": torch.zeros(4)}], 1, 0)


def test_norms_are_kept_within_a_few_over_sqrt_k_and_seeds_differ() -> None:
    g = grads(3)
    norm = float(torch.cat([t.reshape(-1) for t in g.values()]).norm())
    ratios = [float(sketch(g, seed).norm()) / norm for seed in range(40)]
    # 256 buckets: the squared norm has a relative spread of about sqrt(2/256) ~ 0.09
    assert all(0.7 < r < 1.3 for r in ratios), ratios
    assert not torch.equal(sketch(g, 1), sketch(g, 2))
    assert torch.equal(sketch(g, 7), sketch(g, 7))
    assert sketch(g, 7, buckets=16).shape == (16,)
    with pytest.raises(ValueError):
        sketch(g, 7, buckets=0)


def test_honest_noise_is_close_and_every_cheat_is_far() -> None:
    honest = grads(4)
    seed = 12345
    ref = sketch(honest, seed)
    # a recomputation on another device: 1e-4 relative noise (conv under TF32, measured)
    g = torch.Generator().manual_seed(5)
    other_device = {k: v + 1e-4 * v.norm() / v.numel() ** 0.5 * torch.randn(v.shape, generator=g)
                    for k, v in honest.items()}  # fmt: skip
    assert relative_distance(ref, sketch(other_device, seed)) < 1e-3
    lazy_part = grads(6)  # a gradient over other samples (e.g. a quarter of them)
    cheats = {
        "scaled": {k: 100 * v for k, v in honest.items()},
        "flipped": {k: -v for k, v in honest.items()},
        "random": {k: torch.randn(v.shape, generator=g) * v.std() for k, v in honest.items()},
        "lazy": {k: 0.25 * honest[k] + 0.75 * lazy_part[k] for k in honest},
        "stale": grads(7),
    }
    for name, cheat in cheats.items():
        assert relative_distance(ref, sketch(cheat, seed)) > 0.3, name


def test_relative_distance_edges() -> None:
    zero = torch.zeros(4, dtype=torch.float64)
    assert relative_distance(zero, zero) == 0.0
    assert relative_distance(zero, torch.ones(4)) == float("inf")
    with pytest.raises(ValueError):
        combine([])
