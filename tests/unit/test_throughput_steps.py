"""Unit tests of the per-step time model of coordinator.rounds.throughput (local SGD planning).

An inner step of b samples costs ``a + b * c`` seconds. Planning local SGD by samples/s
(proportional split) hands a node measured at a larger batch even more; planning by the
per-step model (``split_batch(fixed_s=a_i, rates=1/c_i)``) gives every node's H steps the same
time.
"""

from __future__ import annotations

import json
import math

import pytest

from coordinator.rounds.allocator import split_batch
from coordinator.rounds.throughput import (
    MAX_FIXED_FRACTION,
    StepModel,
    ThroughputEstimator,
    fit_line,
)

pytestmark = pytest.mark.timeout(30)

H = 700
B = 96


def step_s(a: float, c: float, b: float) -> float:
    return a + c * b


def bench_points(a: float, c: float, sizes: tuple[int, ...] = (12, 24, 48, 96)) -> list:
    """A job benchmark's (batch size, samples/s) points of a device with step time a + c b."""
    return [(b, b / step_s(a, c, b)) for b in sizes]


def test_fit_line_recovers_an_exact_line_and_refuses_a_flat_spread() -> None:
    pts = [(b, 0.0015 + 0.0001 * b, 1.0) for b in (20, 30, 40)]
    a, c = fit_line(pts)  # type: ignore[misc]
    assert a == pytest.approx(0.0015)
    assert c == pytest.approx(0.0001)
    # All at (nearly) the same batch: the slope is not determined.
    assert fit_line([(32, 0.005, 1.0), (32, 0.0052, 1.0), (33, 0.0051, 1.0)]) is None
    # A falling line is no step time.
    assert fit_line([(10, 0.01, 1.0), (40, 0.005, 1.0)]) is None
    assert fit_line([(10, 0.01, 1.0)]) is None


def test_benchmark_points_give_the_shape_once_a_round_gives_the_level() -> None:
    est = ThroughputEstimator()
    a, c = 0.0015, 0.0002
    est.add_node("n", 32 / step_s(a, c, 32), step_points=bench_points(a, c), rated_batch=32)
    assert est.fixed_fraction("n", 32) == pytest.approx(a / step_s(a, c, 32))
    # Before any round: samples/s alone (a benchmark's level is too noisy to amplify).
    m = est.step_model("n")
    assert m.fixed_s == 0.0
    assert m.rate == pytest.approx(est.planning_rate("n"))
    # One round at b = 30 (no spread yet: the benchmark's shape, the round's level).
    est.observe("n", H * 30, H * step_s(a, c, 30))
    est.observe_steps("n", H * 30, H, H * step_s(a, c, 30))
    m = est.step_model("n")
    assert m.step_seconds(30) == pytest.approx(step_s(a, c, 30))
    assert m.fixed_s == pytest.approx(a)
    assert m.per_sample_s == pytest.approx(c)


def test_no_shape_information_means_the_proportional_model() -> None:
    est = ThroughputEstimator()
    est.add_node("n", 1000.0)
    m = est.step_model("n", batch=50)
    assert m.fixed_s == 0.0
    assert m.rate == pytest.approx(est.planning_rate("n"))


def test_rounds_with_different_batches_give_the_shape() -> None:
    est = ThroughputEstimator()
    a, c = 0.002, 0.0001
    # The benchmark says "no fixed cost" (a wrong prior): the rounds overrule it.
    est.add_node("n", 1e4, step_points=[(12, 1e4), (96, 1e4)])
    for b in (25, 32, 39, 30):
        est.observe("n", H * b, H * step_s(a, c, b))
        est.observe_steps("n", H * b, H, H * step_s(a, c, b))
    x = est.reference_batch("n")
    assert 29 < x < 33
    assert est.fixed_fraction("n", x) == pytest.approx(a / step_s(a, c, x), rel=1e-6)
    m = est.step_model("n")
    assert m.fixed_s == pytest.approx(a, rel=0.05)
    assert m.per_sample_s == pytest.approx(c, rel=0.05)


def test_fixed_fraction_is_capped() -> None:
    est = ThroughputEstimator()
    est.add_node("n", 100.0, step_points=[(1, 100.0), (100, 9999.0)])
    assert est.fixed_fraction("n", 1) == MAX_FIXED_FRACTION == 0.5


def test_level_noise_moves_the_split_at_most_twice_as_much_as_by_samples_per_s() -> None:
    # Two identical devices with a large fixed part (phi = 0.8 at b = 48); in one round node
    # "b" measured 10% slow (contention). By samples/s its share drops ~5%; by per-step time
    # with phi capped at 0.5, ~10% (uncapped it would be 50%).
    a, c = 0.004, 0.00002

    def split(slow: float, by_steps: bool) -> dict[str, int]:
        est = ThroughputEstimator()
        for n, f in (("a", 1.0), ("b", slow)):
            est.add_node(n, 1000.0, step_points=bench_points(a, c), rated_batch=48)
            est.observe(n, H * 48, f * H * step_s(a, c, 48))
            est.observe_steps(n, H * 48, H, f * H * step_s(a, c, 48))
        if not by_steps:
            return split_batch(B, est.planning_rates())
        models = est.step_models()
        return split_batch(
            B,
            {n: m.rate for n, m in models.items()},
            rounding="min_time",
            fixed_s={n: m.fixed_s for n, m in models.items()},
        )

    assert split(1.0, True) == {"a": 48, "b": 48}
    assert 45 <= split(1.1, False)["b"] <= 46
    assert 42 <= split(1.1, True)["b"] <= 44


def test_observe_steps_ignores_figures_that_say_nothing_and_keeps_a_window() -> None:
    est = ThroughputEstimator()
    est.add_node("n", 100.0)
    est.observe_steps("n", 0, 4, 1.0)
    est.observe_steps("n", 10, 0, 1.0)
    est.observe_steps("n", 10, 4, float("nan"))
    est.observe_steps("n", 10, 4, 0.0)
    assert est.reference_batch("n") == 0.0
    for b in range(1, 30):
        est.observe_steps("n", 4 * b, 4, 0.1)
    assert est.reference_batch("n") > 20  # only recent rounds count


def simulate(plan_by_steps: bool, rounds: int = 8) -> list[dict[str, int]]:
    """Three identical devices (step 1.5 ms + 0.15 ms/sample), joined one by one and rated at
    different batches (B, B/2, B/3): the coordinator's planning, round after round."""
    a, c = 0.0015, 0.00015
    est = ThroughputEstimator()
    for n, rated in (("x", B), ("y", B // 2), ("z", B // 3)):
        est.add_node(
            n, rated / step_s(a, c, rated), step_points=bench_points(a, c), rated_batch=rated
        )
    history = []
    for _ in range(rounds):
        if plan_by_steps:
            models = est.step_models(batch=B / 3)
            b = split_batch(
                B,
                {n: m.rate for n, m in models.items()},
                rounding="min_time",
                fixed_s={n: m.fixed_s for n, m in models.items()},
            )
        else:
            b = split_batch(B, est.planning_rates())
        history.append(b)
        for n, bi in b.items():
            est.observe(n, H * bi, H * step_s(a, c, bi))
            est.observe_steps(n, H * bi, H, H * step_s(a, c, bi))
    return history


def test_identical_nodes_rated_at_different_batches_converge_to_equal_batches() -> None:
    # Round one is planned by samples/s either way (35/32/29: the node rated at the biggest
    # batch looks fastest). Round two by per-step time: equal at once; by samples/s the gap
    # closes by the fixed fraction per round only.
    by_steps = simulate(plan_by_steps=True)
    proportional = simulate(plan_by_steps=False)
    assert by_steps[0] == proportional[0]
    assert max(by_steps[0].values()) - min(by_steps[0].values()) >= 5
    assert by_steps[1] == {"x": 32, "y": 32, "z": 32}
    assert by_steps[-1] == {"x": 32, "y": 32, "z": 32}
    assert max(proportional[1].values()) - min(proportional[1].values()) >= 2


def test_heterogeneous_nodes_finish_their_steps_together() -> None:
    # A fast device with a large fixed cost per step (a GPU: launches) and a slow one without.
    dev = {"gpu": (0.004, 0.00002), "cpu": (0.0002, 0.0002)}
    est = ThroughputEstimator()
    for n, (a, c) in dev.items():
        est.add_node(n, 48 / step_s(a, c, 48), step_points=bench_points(a, c), rated_batch=48)
    # The GPU's phi (0.8) is capped at 0.5: convergence takes a few rounds more.
    for _ in range(10):
        models = est.step_models()
        b = split_batch(
            B,
            {n: m.rate for n, m in models.items()},
            rounding="min_time",
            fixed_s={n: m.fixed_s for n, m in models.items()},
        )
        for n, bi in b.items():
            a, c = dev[n]
            est.observe(n, H * bi, H * step_s(a, c, bi))
            est.observe_steps(n, H * bi, H, H * step_s(a, c, bi))
    times = {n: step_s(*dev[n], b[n]) for n in dev}
    # Equal step times within one sample of the slow device: (4 + 0.02 b) ms = (0.2 + 0.2 b) ms
    # at b_gpu + b_cpu = 96 -> b_cpu = 5.72 / 0.22 = 26 (by samples/s at b = 48 it would be
    # 96 x 4.2 / (4.2 + 9.8) ~ 29: the CPU's steps would take 6 ms, the GPU's 5.3 ms).
    assert abs(times["gpu"] - times["cpu"]) <= dev["cpu"][1] + 1e-9
    assert b["cpu"] == 26


def test_step_state_survives_persistence() -> None:
    est = ThroughputEstimator()
    est.add_node("n", 1000.0, step_points=bench_points(0.001, 0.0001), rated_batch=32)
    est.observe_steps("n", 320, 10, 0.05)
    again = ThroughputEstimator.from_state(json.loads(json.dumps(est.to_state())))
    assert again.step_model("n") == est.step_model("n")
    # A state written before the per-step model existed still loads.
    old = est.to_state()
    for d in old["nodes"].values():
        for key in ("steps", "prior_fixed_s", "prior_per_sample_s", "rated_batch"):
            d.pop(key)
    legacy = ThroughputEstimator.from_state(old)
    assert legacy.step_model("n", batch=32).fixed_s == 0.0


def test_step_model_arithmetic() -> None:
    m = StepModel(0.002, 0.0001)
    assert m.step_seconds(30) == pytest.approx(0.005)
    assert m.rate == pytest.approx(1e4)
    assert math.isfinite(m.rate)
