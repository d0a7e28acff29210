"""Unit tests of coordinator.verification.reputation: check probability, check sampling, the record."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.verification.reputation import (
    CHECK_FRACTION,
    MAX_EVIDENCE_CHARS,
    N0,
    NEW_BUDGET,
    P_FLOOR,
    RECOMPUTE_COST,
    TRUSTED_BUDGET,
    ReputationRecord,
    check_probability,
    check_reason,
    checked_count,
    checked_micro_batches,
    expected_overhead,
    record_failed,
    record_verified,
    should_check,
)

pytestmark = pytest.mark.timeout(60)


def in_a_row(v: int) -> ReputationRecord:
    return ReputationRecord(
        verified_in_a_row=v, verified_total=v, last_verified_round=None if v == 0 else 0
    )


def verified(n: int, start: ReputationRecord | None = None) -> ReputationRecord:
    r = start or ReputationRecord()
    for i in range(n):
        r = record_verified(r, i)
    return r


# --------------------------------------------------------------------------- the budgets
def test_the_constants_meet_the_issue_budgets() -> None:
    assert 1.0 * CHECK_FRACTION * RECOMPUTE_COST <= NEW_BUDGET
    assert P_FLOOR * CHECK_FRACTION * RECOMPUTE_COST <= TRUSTED_BUDGET
    assert check_probability(verified(10 * N0)) == P_FLOOR


@pytest.mark.parametrize("n", [13, 20, 50, 64, 100, 1000])
def test_expected_overhead_within_budget_once_a_part_has_enough_micro_batches(n: int) -> None:
    assert expected_overhead([1.0], n) <= NEW_BUDGET
    assert expected_overhead([P_FLOOR], n) <= TRUSTED_BUDGET
    assert expected_overhead([1.0], 64) == pytest.approx(5 / 64)


def test_expected_overhead_weights_nodes_by_their_work() -> None:
    # a new node doing 1/4 of the work and a trusted one doing 3/4
    got = expected_overhead([1.0, P_FLOOR], 100, 0.1, work=[1.0, 3.0])
    assert got == pytest.approx((0.25 * 1.0 + 0.75 * P_FLOOR) * 0.1)
    assert expected_overhead([0.5], 100, 0.1, recompute_cost=2.0) == pytest.approx(0.1)
    # fewer micro-batches than 1 / fraction: one micro-batch is more than the fraction
    assert expected_overhead([1.0], 4, 0.1) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"probabilities": []},
        {"probabilities": [1.5]},
        {"probabilities": [0.5], "work": [1.0, 2.0]},
        {"probabilities": [0.5], "work": [0.0]},
        {"probabilities": [0.5], "recompute_cost": -1.0},
    ],
)
def test_expected_overhead_refuses_bad_fleets(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        expected_overhead(n_micro_batches=10, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- probability
def test_new_nodes_are_checked_every_round() -> None:
    for n in range(N0):
        r = verified(n)
        assert check_probability(r) == 1.0
        assert should_check(r, random.Random(0))
        assert "new" in check_reason(r)


def test_probability_falls_monotonically_to_the_floor_and_never_below() -> None:
    r = ReputationRecord()
    last = check_probability(r)
    for i in range(1000):
        r = record_verified(r, i)
        p = check_probability(r)
        assert P_FLOOR <= p <= last
        last = p
    assert last == P_FLOOR
    assert "trusted" in check_reason(r)
    assert check_probability(verified(N0)) == 1.0
    assert check_probability(verified(2 * N0)) == pytest.approx(0.5)
    assert "building trust" in check_reason(verified(2 * N0))


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_probability_is_non_increasing_in_the_verified_run(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert check_probability(in_a_row(lo)) >= check_probability(in_a_row(hi)) >= P_FLOOR


def test_a_failure_resets_the_node_to_new_and_keeps_the_evidence() -> None:
    trusted = verified(200)
    assert check_probability(trusted) == P_FLOOR
    failed = record_failed(trusted, 201, "micro-batch 3: rel_l2 0.9 > 1e-4", time_ms=1234)
    assert check_probability(failed) == 1.0
    assert failed.verified_in_a_row == 0
    assert failed.verified_total == 200 and failed.failed_total == 1
    assert failed.last_failure_round == 201 and failed.last_failure_ms == 1234
    assert failed.last_failure_evidence.startswith("micro-batch 3")
    assert "reset by a failed check" in check_reason(failed)
    assert trusted.verified_in_a_row == 200  # the old record is unchanged
    # it has to earn its trust again from scratch
    again = verified(N0 - 1, failed)
    assert check_probability(again) == 1.0
    assert check_probability(record_verified(again, 500)) == 1.0  # N0 in a row: 10 / 10


def test_record_failed_refuses_empty_evidence_and_cuts_long_evidence() -> None:
    with pytest.raises(ValueError, match="evidence"):
        record_failed(ReputationRecord(), 1, "  ")
    long = record_failed(ReputationRecord(), 1, "x" * 10_000)
    assert len(long.last_failure_evidence) == MAX_EVIDENCE_CHARS
    with pytest.raises(ValueError, match="round"):
        record_verified(ReputationRecord(), -1)
    with pytest.raises(ValueError, match="time_ms"):
        record_failed(ReputationRecord(), 1, "bad", time_ms=-5)


def test_last_verified_round_is_the_latest_whatever_the_order_checks_finish_in() -> None:
    r = record_verified(record_verified(ReputationRecord(), 7), 5)
    assert r.last_verified_round == 7 and r.verified_total == 2


@pytest.mark.parametrize("p_target", [1.0, 0.5, P_FLOOR])
def test_should_check_draws_with_the_probability(p_target: float) -> None:
    v = N0 if p_target == 1.0 else round(N0 / p_target)
    r = in_a_row(v)
    assert check_probability(r) == pytest.approx(p_target)
    rng = random.Random(12345)
    trials = 20_000
    hits = sum(should_check(r, rng) for _ in range(trials))
    sigma = math.sqrt(trials * p_target * (1 - p_target))
    assert abs(hits - trials * p_target) <= 5 * sigma + 1e-9


def test_should_check_takes_a_numpy_generator_too() -> None:
    r = verified(N0 * 10)
    rng = np.random.default_rng(7)
    hits = sum(should_check(r, rng) for _ in range(10_000))
    assert 1800 <= hits <= 2200


# --------------------------------------------------------------------------- micro-batches
@given(
    n=st.integers(1, 500),
    fraction=st.floats(0.001, 1.0, allow_nan=False),
    seed=st.integers(0, 2**32 - 1),
)
def test_checked_micro_batches_are_distinct_in_range_and_at_least_one(
    n: int, fraction: float, seed: int
) -> None:
    got = checked_micro_batches(n, fraction, random.Random(seed))
    assert 1 <= len(got) <= n
    assert len(set(got)) == len(got) and got == sorted(got)
    assert all(0 <= i < n for i in got)
    assert len(got) == checked_count(n, fraction)
    assert len(got) <= max(1, fraction * n + 1e-6)
    # only the generator decides: the same state gives the same choice
    assert got == checked_micro_batches(n, fraction, random.Random(seed))


def test_checked_count_rounds_down_but_not_below_one() -> None:
    assert checked_count(64) == 5
    assert checked_count(100, 0.29) == 29  # 0.29 * 100 is 28.999999999999996 in floats
    assert checked_count(3, 0.1) == 1
    assert checked_count(7, 1.0) == 7
    for bad in [(0, 0.1), (5, 0.0), (5, 1.5)]:
        with pytest.raises(ValueError):
            checked_count(*bad)


def test_checked_micro_batches_are_uniform() -> None:
    rng = random.Random(3)
    counts = [0] * 10
    for _ in range(20_000):
        for i in checked_micro_batches(10, 0.3, rng):
            counts[i] += 1
    # each index is picked with probability 3/10: 6000 expected, sd ~ 65
    assert all(abs(c - 6000) < 400 for c in counts)


# --------------------------------------------------------------------------- storage
@given(
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.one_of(st.none(), st.integers(0, 10**12)),
    st.text(min_size=1, max_size=50).filter(str.strip),
)
def test_to_dict_from_dict_round_trip(
    verified_extra: int, in_a_row: int, failures: int, time_ms: int | None, evidence: str
) -> None:
    r = ReputationRecord()
    if failures:
        r = record_failed(r, 3, evidence, time_ms=time_ms)
    r = ReputationRecord(
        verified_in_a_row=in_a_row,
        verified_total=in_a_row + verified_extra,
        failed_total=failures,
        last_verified_round=None if in_a_row + verified_extra == 0 else 9,
        last_failure_round=r.last_failure_round,
        last_failure_ms=r.last_failure_ms,
        last_failure_evidence=r.last_failure_evidence,
    )
    again = ReputationRecord.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again == r


@pytest.mark.parametrize(
    "d",
    [
        {"verified_in_a_row": 3, "verified_total": 2, "last_verified_round": 1},
        {"verified_in_a_row": -1},
        {"verified_total": 1.5, "last_verified_round": 1},
        {"failed_total": True},
        {"failed_total": 1},  # without its round
        {"last_failure_evidence": "a failure that never happened"},
        {"verified_total": 1},  # without last_verified_round
        {"surprise": 1},
    ],
)
def test_from_dict_refuses_inconsistent_records(d: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ReputationRecord.from_dict(d)


def test_from_dict_of_an_empty_mapping_is_a_new_node() -> None:
    assert ReputationRecord.from_dict({}) == ReputationRecord()
