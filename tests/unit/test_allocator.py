"""Unit tests of coordinator.allocator: local batches and epoch segments."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.allocator import apportion, equal_split, segments, split_batch

pytestmark = pytest.mark.timeout(60)


def test_split_batch_4_2_1_is_largest_remainder() -> None:
    assert split_batch(128, {"a": 4.0, "b": 2.0, "c": 1.0}) == {"a": 73, "b": 37, "c": 18}


def test_split_batch_sums_exactly_and_keeps_order() -> None:
    rates = {"x": 3.3, "y": 1.7, "z": 0.9, "w": 12.0}
    out = split_batch(1000, rates)
    assert list(out) == list(rates)
    assert sum(out.values()) == 1000
    for n, r in rates.items():
        quota = 1000 * r / sum(rates.values())
        assert math.floor(quota) <= out[n] <= math.ceil(quota)


def test_split_batch_caps_redistribute_proportionally() -> None:
    # a would get 90 of 100 but holds 20; b and c share the remaining 80 as 2:1.
    out = split_batch(100, {"a": 9.0, "b": 0.6666, "c": 0.3333}, {"a": 20, "b": 500, "c": 500})
    assert out["a"] == 20
    assert out == {"a": 20, "b": 53, "c": 27}
    assert sum(out.values()) == 100


def test_split_batch_cap_cascade() -> None:
    out = split_batch(30, {"a": 10.0, "b": 5.0, "c": 1.0}, {"a": 5, "b": 5, "c": 100})
    assert out == {"a": 5, "b": 5, "c": 20}


def test_split_batch_raises_when_caps_too_small() -> None:
    with pytest.raises(ValueError, match="at most 15"):
        split_batch(16, {"a": 1.0, "b": 1.0}, {"a": 10, "b": 5})


def test_split_batch_exactly_fills_caps() -> None:
    assert split_batch(15, {"a": 1.0, "b": 100.0}, {"a": 10, "b": 5}) == {"a": 10, "b": 5}


def test_split_batch_min_one_per_node() -> None:
    rates = {"fast": 1000.0, "slow1": 1.0, "slow2": 0.5}
    out = split_batch(8, rates)
    assert out == {"fast": 6, "slow1": 1, "slow2": 1}
    assert split_batch(3, rates) == {"fast": 1, "slow1": 1, "slow2": 1}


def test_split_batch_fewer_samples_than_nodes_goes_to_fastest() -> None:
    out = split_batch(2, {"a": 1.0, "b": 3.0, "c": 2.0})
    assert out == {"a": 0, "b": 1, "c": 1}
    assert split_batch(0, {"a": 1.0}) == {"a": 0}


def test_split_batch_zero_rate_and_zero_cap_get_nothing() -> None:
    out = split_batch(10, {"a": 0.0, "b": 1.0, "c": 1.0}, {"a": 10, "b": 10, "c": 0})
    assert out == {"a": 0, "b": 10, "c": 0}


@pytest.mark.parametrize(
    ("rates", "caps", "match"),
    [
        ({"a": -1.0}, None, "finite number >= 0"),
        ({"a": float("nan")}, None, "finite number >= 0"),
        ({"a": float("inf")}, None, "finite number >= 0"),
        ({"a": 0.0, "b": 0.0}, None, "no node has a positive rate"),
        ({"a": 1.0, "b": 1.0}, {"a": 10}, "no cap"),
        ({"a": 1.0}, {"a": -1}, ">= 0"),
    ],
)
def test_split_batch_rejects_bad_input(
    rates: dict[str, float], caps: dict[str, int] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        split_batch(4, rates, caps)


def test_equal_split() -> None:
    assert equal_split(10, ["a", "b", "c"]) == {"a": 4, "b": 3, "c": 3}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 5000),
    st.lists(
        st.tuples(st.floats(0.0, 1e4, allow_nan=False), st.integers(0, 3000)),
        min_size=1,
        max_size=30,
    ),
)
def test_split_batch_properties(total: int, nodes: list[tuple[float, int]]) -> None:
    rates = {f"n{i}": r for i, (r, _) in enumerate(nodes)}
    caps = {f"n{i}": c for i, (_, c) in enumerate(nodes)}
    eligible = [n for n in rates if rates[n] > 0 and caps[n] >= 1]
    room = sum(caps[n] for n in eligible)
    if total > 0 and (not eligible or room < total):
        with pytest.raises(ValueError):
            split_batch(total, rates, caps)
        return
    out = split_batch(total, rates, caps)
    assert sum(out.values()) == total
    for n in rates:
        assert 0 <= out[n] <= caps[n]
        if n not in eligible:
            assert out[n] == 0
    if total >= len(eligible):
        assert all(out[n] >= 1 for n in eligible)
    # Proportionality among uncapped nodes above the minimum: b_i/r_i equal within rounding.
    free = [n for n in eligible if 1 < out[n] < caps[n]]
    if len(free) >= 2:
        lo = max((out[n] - 1) / rates[n] for n in free)
        hi = min((out[n] + 1) / rates[n] for n in free)
        assert lo <= hi * (1 + 1e-9)


def test_apportion_bounds() -> None:
    assert apportion(10, {"a": 1.0, "b": 1.0}, lo={"a": 7}) == {"a": 7, "b": 3}
    with pytest.raises(ValueError, match="lower bounds"):
        apportion(3, {"a": 1.0, "b": 1.0}, lo={"a": 2, "b": 2})
    with pytest.raises(ValueError, match="integer"):
        apportion(-1, {"a": 1.0})


def test_segments_cover_exactly() -> None:
    segs = segments(1000, {"a": 4.0, "b": 2.0, "c": 1.0})
    assert segs == {"a": (0, 571), "b": (571, 857), "c": (857, 1000)}
    assert segments(10, {"a": 1.0, "b": 0.0, "c": 1.0}, start=5) == {
        "a": (5, 10),
        "b": (10, 10),
        "c": (10, 15),
    }
    assert segments(0, {"a": 1.0}) == {"a": (0, 0)}
    with pytest.raises(ValueError):
        segments(5, {"a": 0.0})


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 100_000),
    st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=1, max_size=50),
)
def test_segments_tile(order_len: int, rate_list: list[float]) -> None:
    rates = {f"n{i}": r for i, r in enumerate(rate_list)}
    if order_len > 0 and not any(r > 0 for r in rate_list):
        return
    segs = segments(order_len, rates)
    pos = 0
    for n in rates:
        a, b = segs[n]
        assert a == pos and b >= a
        pos = b
        quota = order_len * rates[n] / sum(rate_list) if sum(rate_list) else 0
        assert math.floor(quota) <= b - a <= math.ceil(quota)
    assert pos == order_len


def test_split_batch_extreme_rates() -> None:
    assert split_batch(10, {"a": 1e308, "b": 1e308, "c": 1e-308}) == {"a": 5, "b": 4, "c": 1}
    assert split_batch(10, {"a": 5e-324, "b": 1.0}) == {"a": 1, "b": 9}
    assert split_batch(10, {"a": 5e-324, "b": 1e300}, {"a": 5, "b": 5}) == {"a": 5, "b": 5}


def test_min_time_rounding_shortens_lockstep_rounds() -> None:
    rates = {"a": 4.0, "b": 2.0, "c": 1.0}
    out = split_batch(128, rates, rounding="min_time")
    assert sum(out.values()) == 128
    assert max(out[n] / rates[n] for n in rates) == pytest.approx(18.5)
    # Many slow nodes with small quotas: largest remainder rounds some of them up by a large
    # fraction, min_time keeps the round within one sample of the fastest node's time.
    many = {f"n{i}": 1.0 + (i % 7) / 10 for i in range(50)}
    lr = split_batch(700, many)
    mt = split_batch(700, many, rounding="min_time")
    ideal = 700 / sum(many.values())

    def round_time(b: dict[str, int]) -> float:
        return max(b[n] / many[n] for n in many)

    assert round_time(mt) <= round_time(lr)
    assert round_time(mt) <= ideal + 1 / min(many.values())
    with pytest.raises(ValueError, match="unknown rounding"):
        split_batch(10, rates, rounding="nearest")  # type: ignore[arg-type]


def _brute_min_time(total: int, rates: list[float], lo: list[int], hi: list[int]) -> float:
    best = float("inf")

    def rec(i: int, left: int, worst: float) -> None:
        nonlocal best
        if worst >= best:
            return
        if i == len(rates):
            if left == 0:
                best = worst
            return
        for b in range(lo[i], min(hi[i], left) + 1):
            rec(i + 1, left - b, max(worst, b / rates[i]))

    rec(0, total, 0.0)
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 14),
    st.lists(
        st.tuples(st.floats(0.1, 10.0, allow_nan=False), st.integers(1, 9)),
        min_size=1,
        max_size=4,
    ),
)
def test_min_time_rounding_is_optimal(total: int, nodes: list[tuple[float, int]]) -> None:
    rates = {f"n{i}": r for i, (r, _) in enumerate(nodes)}
    caps = {f"n{i}": c for i, (_, c) in enumerate(nodes)}
    if sum(caps.values()) < total:
        return
    out = split_batch(total, rates, caps, rounding="min_time")
    assert sum(out.values()) == total
    assert all(0 <= out[n] <= caps[n] for n in rates)
    lo = [1 if total >= len(rates) else 0] * len(rates)
    best = _brute_min_time(total, list(rates.values()), lo, list(caps.values()))
    got = max(out[n] / rates[n] for n in rates)
    assert got <= best * (1 + 1e-9)
