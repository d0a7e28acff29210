"""coordinator.rounds.claims: reported compute seconds and benchmarks are believed only as far as the
coordinator's own observations go."""

from __future__ import annotations

import pytest

from coordinator.rounds.claims import (
    BENCHMARK_CAP,
    CLAIM_TOLERANCE,
    capped_benchmarks,
    confirmed_compute,
)

pytestmark = pytest.mark.timeout(10)


def test_honest_figures_stand() -> None:
    # Three nodes with 0.1 s of decoding/encoding each around their compute.
    parts = [(1.0, 1.1), (2.0, 2.1), (0.5, 0.6)]
    assert confirmed_compute(parts) == pytest.approx([1.0, 2.0, 0.5])


def test_a_node_that_says_it_computed_in_no_time_is_credited_its_window() -> None:
    # The liar took as long as the slowest honest node but claims a microsecond.
    parts = [(1.0, 1.1), (2.0, 2.1), (1e-6, 2.1)]
    believed = confirmed_compute(parts)
    assert believed[:2] == pytest.approx([1.0, 2.0])
    # Its window less the typical overhead, less the tolerance for timing noise.
    assert believed[2] == pytest.approx(2.0 * (1 - CLAIM_TOLERANCE))
    # With one honest peer (two parts) the smaller overhead is the reference.
    pair = confirmed_compute([(1.0, 1.1), (1e-6, 1.1)])
    assert pair == pytest.approx([1.0, 1.0 * (1 - CLAIM_TOLERANCE)])


def test_an_honest_node_with_a_little_more_overhead_keeps_its_figure() -> None:
    assert confirmed_compute([(1.0, 1.1), (1.0, 1.3), (1.0, 1.1)]) == [1.0, 1.0, 1.0]


def test_a_node_cannot_claim_more_compute_than_its_window() -> None:
    # Saying it is slower would make every sample dearer: cut to what it had.
    assert confirmed_compute([(1.0, 1.1), (5.0, 1.1), (1.0, 1.05)])[1] == pytest.approx(1.1)


def test_unobserved_windows_and_invalid_figures_pass_through() -> None:
    assert confirmed_compute([(1.0, 0.0), (0.3, 0.0)]) == [1.0, 0.3]
    out = confirmed_compute([(float("nan"), 1.0), (1.0, 1.1), (1.0, 1.2)])
    assert out[0] != out[0] and out[1:] == [1.0, 1.0]  # nan kept for refusal
    assert confirmed_compute([]) == []


def test_benchmarks_are_capped_by_observed_nodes_or_the_median_claim() -> None:
    assert capped_benchmarks({"liar": 1e12}, {"a": 100.0, "b": 300.0}) == {
        "liar": BENCHMARK_CAP * 300.0
    }
    assert capped_benchmarks({"slow": 10.0}, {"a": 100.0}) == {"slow": 10.0}
    # Nobody observed yet: the claims' median bounds them (a real 4x faster device keeps it).
    claims = {"a": 100.0, "b": 110.0, "c": 400.0, "liar": 1e12, "e": 90.0}
    capped = capped_benchmarks(claims, {})
    assert capped["liar"] == BENCHMARK_CAP * 110.0 and capped["c"] == 400.0
    assert capped_benchmarks({}, {}) == {}
