"""epochmesh.sketch: linear, norm-preserving within its bounds, seed-dependent; honest
cross-device differences stay small in sketch space while cheats are far."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epochmesh.sketch import combine, relative_distance, sketch

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
