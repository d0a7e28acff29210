"""Shared verification rules (epochmesh/verification.py): chunks, commitments, tolerances."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epochmesh.sketch import combine, relative_distance, sketch
from epochmesh.verification import (
    CONSISTENCY_TOLERANCE,
    chunk_bounds,
    commitment_problem,
    consistency_tolerance,
    loss_matches,
    recompute_tolerance,
)
from epochmesh.wire.compression import ErrorFeedback
from epochmesh.wire.tensors import decode_bundle, encode_bundle

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("samples", "k"), [(1, 12), (5, 12), (12, 12), (13, 12), (100, 12), (7, 3)]
)
def test_chunks_cover_the_part_in_order(samples: int, k: int) -> None:
    bounds = chunk_bounds(samples, k)
    assert len(bounds) == max(1, min(samples // 2, k))
    assert bounds[0][0] == 0 and bounds[-1][1] == samples
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)


def test_no_chunks_for_nothing() -> None:
    assert chunk_bounds(0, 12) == [] and chunk_bounds(10, 0) == []


def commitments(samples: int, k: int, losses: list[float]) -> list[tuple[int, float]]:
    return [(e - s, loss) for (s, e), loss in zip(chunk_bounds(samples, k), losses, strict=True)]


def test_a_fitting_commitment_passes() -> None:
    chunks = commitments(25, 12, [float(i) for i in range(12)])
    mean = sum(n * loss for n, loss in chunks) / 25
    assert commitment_problem(chunks, 25, mean, 12) == ""


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda c: [], "carries no chunk commitments"),
        (lambda c: c[:-1], "11 chunk commitments for 25 samples; expected 12"),
        (lambda c: [(c[0][0] + 1, c[0][1]), *c[1:]], "chunk 0 commits 4 samples; it has 3"),
        (lambda c: [*c[:-1], (c[-1][0], float("nan"))], "chunk 11 commits a loss of nan"),
        (lambda c: [*c[:-1], (c[-1][0], c[-1][1] + 1.0)], "is not the update's mean_loss"),
    ],
)
def test_commitments_that_do_not_fit_are_named(mutate, expected: str) -> None:  # type: ignore[no-untyped-def]
    chunks = commitments(25, 12, [1.0 + i / 10 for i in range(12)])
    mean = sum(n * loss for n, loss in chunks) / 25
    assert expected in commitment_problem(mutate(chunks), 25, mean, 12)


def test_no_commitments_when_none_were_asked() -> None:
    assert commitment_problem([], 10, 1.0, 0) == ""
    assert "asked for no chunk" in commitment_problem([(10, 1.0)], 10, 1.0, 0)


def test_tolerances_follow_the_measured_device_pairs() -> None:
    cpu_cpu = recompute_tolerance("cpu", "cpu")
    cpu_gpu = recompute_tolerance("cpu", "cuda")
    assert recompute_tolerance("cuda", "cpu") == cpu_gpu
    assert recompute_tolerance("cuda", "cuda") < cpu_cpu < cpu_gpu
    assert recompute_tolerance("cuda", "cuda", same_model=False) == cpu_gpu
    assert cpu_gpu <= 1e-2  # far below a cheat's O(0.1..1)
    # Local SGD chunks: their own measured table, the same rules.
    local = {
        pair: recompute_tolerance(*pair, local_sgd=True)
        for pair in [("cpu", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")]
    }
    assert local[("cpu", "cpu")] >= cpu_cpu and local[("cpu", "cpu")] <= local[("cpu", "cuda")]
    assert (
        recompute_tolerance("cuda", "cuda", same_model=False, local_sgd=True)
        == local[("cpu", "cuda")]
    )
    assert max(local.values()) <= 1e-2
    assert consistency_tolerance("topk") is None
    assert consistency_tolerance("") == CONSISTENCY_TOLERANCE["none"]
    assert loss_matches(2.0, 2.0 + 1e-7, 1e-5) and not loss_matches(2.0, 2.1, 1e-3)


def mlp_gradients(rounds: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for _ in range(rounds):
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
    return out


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
def test_a_compressed_update_stays_within_its_consistency_tolerance(codec: str) -> None:
    """What the codec (and int8's error feedback, carried between rounds) does to the sum
    check: the sent update's sketch vs the sketch of the gradient computed, over 30 rounds;
    the tolerance keeps at least a factor 2 of margin over the worst round."""
    ef = ErrorFeedback(codec) if codec == "int8" else None
    worst = 0.0
    for grads in mlp_gradients(30):
        header, payload = encode_bundle(grads, codec, error_feedback=ef)
        sent = decode_bundle(header, payload)
        seed = 1234
        d = relative_distance(sketch(grads, seed), sketch(sent, seed))
        worst = max(worst, d)
    tolerance = consistency_tolerance(codec)
    assert tolerance is not None
    assert worst * 2 <= tolerance, f"{codec}: worst {worst:.3g} vs tolerance {tolerance}"


def test_cheats_are_far_outside_every_tolerance() -> None:
    """The update a cheat sends against the sketch sum of honest chunks."""
    grads = mlp_gradients(2)
    g, previous = grads[1], grads[0]
    seed = 99
    honest = sketch(g, seed)
    cheats = {
        "scaled": {k: 100 * v for k, v in g.items()},
        "flipped": {k: -v for k, v in g.items()},
        "stale": previous,
    }
    for name, update in cheats.items():
        d = relative_distance(honest, sketch(update, seed))
        assert d > CONSISTENCY_TOLERANCE["int8"], (name, d)
        assert d > 100 * recompute_tolerance("cpu", "cuda"), (name, d)
    # The weighted sum of chunk sketches is the sketch of the weighted sum (linearity).
    parts = [(0.25, sketch(previous, seed)), (0.75, honest)]
    mixed = {k: 0.25 * previous[k] + 0.75 * g[k] for k in g}
    assert relative_distance(combine(parts), sketch(mixed, seed)) < 1e-6  # float32 sums
