"""The device model's reference floor under an unobserved node's claims (pure): planning
(coordinator/rounds/claims.py) and the rate a hand-out reserves (coordinator/accounting/billing.py)
never believe a claim below it; observed nodes are believed, the floor notwithstanding."""

from __future__ import annotations

import math

import pytest

from coordinator.accounting.billing import handout_rate, settled_rate, standing_rate
from coordinator.rounds.claims import BENCHMARK_CAP, capped_benchmarks, reference_floor

pytestmark = pytest.mark.timeout(10)

LIE = 1e-5


def test_the_floor_is_the_models_median_reference_over_the_cap() -> None:
    assert reference_floor([]) == 0.0
    assert reference_floor([0.0, math.nan, -3.0, math.inf]) == 0.0
    assert reference_floor([800.0]) == 800.0 / BENCHMARK_CAP
    # A liar's own reference is one vote among its model's.
    assert reference_floor([1.0, 800.0, 820.0]) == 800.0 / BENCHMARK_CAP


def test_a_lone_liar_is_planned_and_reserved_at_the_floor() -> None:
    floor = reference_floor([800.0])
    planned = capped_benchmarks({"liar": LIE}, {}, {"liar": floor})
    assert planned == {"liar": floor}
    standing = standing_rate([], [], floor)  # nothing observed, no other claim
    assert standing == floor
    assert handout_rate(LIE, False, standing) == floor
    # At close the part is billed at no less than what its round observed.
    assert settled_rate(floor, 900.0) == 900.0
    assert settled_rate(floor, 50.0) == floor


def test_the_floor_does_not_lower_what_is_known() -> None:
    floor = 10.0
    assert capped_benchmarks({"a": 500.0}, {}, {"a": floor}) == {"a": 500.0}
    assert capped_benchmarks({"a": 5000.0}, {"b": 100.0}, {"a": floor}) == {"a": 400.0}
    assert standing_rate([3.0], [LIE], floor) == 3.0  # observed nodes are believed
    assert standing_rate([], [LIE, LIE], floor) == floor  # colluding claims are not
    assert standing_rate([], [200.0], floor) == 200.0
    assert standing_rate([], [], math.nan) == 0.0
