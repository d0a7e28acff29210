"""Unit tests of coordinator.rounds.allocator: local batches and epoch segments."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.rounds.allocator import apportion, equal_split, quotas, segments, split_batch

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


# -- affine round times: a_i + b_i / r_i ---------------------------------------------------------


def test_equal_fixed_costs_keep_the_proportional_split() -> None:
    rates = {"a": 800.0, "b": 400.0, "c": 200.0}
    fixed = dict.fromkeys(rates, 0.03)
    assert split_batch(192, rates, fixed_s=fixed) == split_batch(192, rates)
    assert split_batch(192, rates, fixed_s=fixed, rounding="min_time") == split_batch(
        192, rates, rounding="min_time"
    )
    assert quotas(192, rates, fixed_s=fixed) == pytest.approx(quotas(192, rates))
    assert split_batch(192, rates, fixed_s={}) == split_batch(192, rates)


def test_fixed_costs_equalize_finishing_times() -> None:
    # The fast node spends 0.15 s per round outside compute, the others 0.06 and 0.03 s.
    rates = {"a": 800.0, "b": 400.0, "c": 200.0}
    fixed = {"a": 0.15, "b": 0.06, "c": 0.03}
    q = quotas(192, rates, fixed_s=fixed)
    assert sum(q.values()) == pytest.approx(192)
    times = [fixed[n] + q[n] / rates[n] for n in rates]
    assert max(times) - min(times) == pytest.approx(0.0, abs=1e-9)
    out = split_batch(192, rates, fixed_s=fixed, rounding="min_time")
    assert out == {"a": 76, "b": 74, "c": 42}
    # The proportional split (110/55/27) keeps the fast node busy 0.2875 s: 0.245 s instead.
    prop = split_batch(192, rates)

    def round_time(b: dict[str, int]) -> float:
        return max(fixed[n] + b[n] / rates[n] for n in rates)

    assert round_time(out) == pytest.approx(0.245)
    assert round_time(prop) == pytest.approx(0.2875)


def test_fixed_costs_with_caps_and_hopeless_nodes() -> None:
    rates = {"a": 800.0, "b": 400.0, "c": 200.0}
    # a holds 50 at most: b and c share the rest so that they finish together.
    out = quotas(192, rates, {"a": 50, "b": 500, "c": 500}, fixed_s={"b": 0.1})
    assert out["a"] == 50 and out["b"] == pytest.approx(81.33, abs=0.01)
    assert 0.1 + out["b"] / 400 == pytest.approx(out["c"] / 200)
    # c's link costs more than the others take for the whole round: no fluid share (a
    # best-effort node), but split_batch still gives it its minimum of one sample.
    q = quotas(192, rates, fixed_s={"c": 0.5})
    assert q["c"] == 0.0 and q["a"] == pytest.approx(128) and q["b"] == pytest.approx(64)
    assert split_batch(192, rates, fixed_s={"c": 0.5}) == {"a": 127, "b": 64, "c": 1}
    assert quotas(0, rates) == dict.fromkeys(rates, 0.0)


def test_fixed_costs_with_extreme_rates_fall_back_to_rates() -> None:
    assert split_batch(1, {"a": 5e-324}, {"a": 2}, fixed_s={"a": 1.0}) == {"a": 1}
    out = split_batch(10, {"a": 1e300, "b": 1e-300}, fixed_s={"a": 1.0, "b": 0.0})
    assert sum(out.values()) == 10 and out["b"] >= 1


@pytest.mark.parametrize(
    ("fixed", "match"),
    [({"a": -0.1}, "fixed seconds"), ({"a": float("nan")}, "fixed seconds")],
)
def test_fixed_costs_are_validated(fixed: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_batch(10, {"a": 1.0, "b": 1.0}, fixed_s=fixed)
    with pytest.raises(ValueError, match=match):
        quotas(10, {"a": 1.0, "b": 1.0}, fixed_s=fixed)


def _brute_min_time_affine(
    total: int, rates: list[float], fixed: list[float], lo: list[int], hi: list[int]
) -> float:
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
            t = fixed[i] + b / rates[i] if b > 0 else 0.0
            rec(i + 1, left - b, max(worst, t))

    rec(0, total, 0.0)
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 14),
    st.lists(
        st.tuples(
            st.floats(0.1, 10.0, allow_nan=False),
            st.integers(1, 9),
            st.floats(0.0, 2.0, allow_nan=False),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_min_time_rounding_with_fixed_costs_is_optimal(
    total: int, nodes: list[tuple[float, int, float]]
) -> None:
    rates = {f"n{i}": r for i, (r, _, _) in enumerate(nodes)}
    caps = {f"n{i}": c for i, (_, c, _) in enumerate(nodes)}
    fixed = {f"n{i}": a for i, (_, _, a) in enumerate(nodes)}
    if sum(caps.values()) < total:
        return
    out = split_batch(total, rates, caps, rounding="min_time", fixed_s=fixed)
    assert sum(out.values()) == total
    assert all(0 <= out[n] <= caps[n] for n in rates)
    lo = [1 if total >= len(rates) else 0] * len(rates)
    best = _brute_min_time_affine(
        total, list(rates.values()), list(fixed.values()), lo, list(caps.values())
    )
    got = max((fixed[n] + out[n] / rates[n] if out[n] > 0 else 0.0) for n in rates)
    assert got <= best * (1 + 1e-9) + 1e-12


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 3000),
    st.lists(
        st.tuples(
            st.one_of(st.just(0.0), st.floats(1e-3, 1e4)),
            st.integers(0, 2000),
            st.floats(0.0, 5.0, allow_nan=False),
        ),
        min_size=1,
        max_size=20,
    ),
)
def test_affine_quotas_properties(total: int, nodes: list[tuple[float, int, float]]) -> None:
    rates = {f"n{i}": r for i, (r, _, _) in enumerate(nodes)}
    caps = {f"n{i}": c for i, (_, c, _) in enumerate(nodes)}
    fixed = {f"n{i}": a for i, (_, _, a) in enumerate(nodes)}
    eligible = [n for n in rates if rates[n] > 0 and caps[n] >= 1]
    if total > 0 and (not eligible or sum(caps[n] for n in eligible) < total):
        with pytest.raises(ValueError):
            quotas(total, rates, caps, fixed_s=fixed)
        return
    q = quotas(total, rates, caps, fixed_s=fixed)
    assert sum(q.values()) == pytest.approx(total, abs=1e-6 * max(1, total))
    for n in rates:
        assert -1e-9 <= q[n] <= caps[n] + 1e-9
    # Every node strictly inside its bounds finishes at the same time T; nodes at 0 could
    # not finish even a sliver by T, nodes at their cap finish by T.
    inside = [n for n in eligible if 1e-6 < q[n] < caps[n] - 1e-6]
    if inside:
        t = [fixed[n] + q[n] / rates[n] for n in inside]
        assert max(t) - min(t) <= 1e-6 * max(1.0, max(t))
        for n in eligible:
            if q[n] == 0.0:
                assert fixed[n] >= min(t) - 1e-6 * max(1.0, min(t))
            elif q[n] >= caps[n] - 1e-9:
                assert fixed[n] + q[n] / rates[n] <= max(t) * (1 + 1e-6) + 1e-9
    out = split_batch(total, rates, caps, fixed_s=fixed)
    assert sum(out.values()) == total
    assert all(0 <= out[n] <= caps[n] for n in rates)
