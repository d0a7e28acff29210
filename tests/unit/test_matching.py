"""Price-performance matching (epochmesh/matching.py): the chosen node set is the cheapest
per epoch of all allowed sets (checked against brute force), respects max_price and the node
counts, and says when too few nodes qualify; `fastest_nodes` takes the fastest allowed."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochmesh.matching import Offer, cheapest_nodes, epoch_cost, fastest_nodes

pytestmark = pytest.mark.timeout(60)


def ratio(offers: list[Offer]) -> Fraction:
    return Fraction(sum(o.price_per_hour for o in offers)) / sum(Fraction(o.rate) for o in offers)


offers_st = st.lists(
    st.builds(
        Offer,
        node_id=st.sampled_from([f"n{i:02d}" for i in range(40)]),
        price_per_hour=st.integers(0, 5_000_000),
        rate=st.floats(0.5, 500.0, allow_nan=False),
    ),
    min_size=1,
    max_size=9,
    unique_by=lambda o: o.node_id,
)


@settings(max_examples=200, deadline=None)
@given(
    offers=offers_st, lo=st.integers(1, 4), extra=st.integers(0, 5), cap=st.integers(0, 5_000_000)
)
def test_the_chosen_set_is_the_cheapest_per_epoch(
    offers: list[Offer], lo: int, extra: int, cap: int
) -> None:
    hi = lo + extra
    chosen = cheapest_nodes(offers, lo, hi, max_price=cap)
    allowed = [o for o in offers if o.price_per_hour <= cap]
    sets = [
        list(c)
        for k in range(lo, min(hi, len(allowed)) + 1)
        for c in itertools.combinations(allowed, k)
    ]
    if not sets:
        assert chosen == []
        return
    assert lo <= len(chosen) <= hi and all(o.price_per_hour <= cap for o in chosen)
    assert ratio(chosen) == min(ratio(s) for s in sets)


def test_free_nodes_first_and_a_price_cap_is_hard() -> None:
    offers = [
        Offer("fast", 4_000_000, 400.0),  # 10 000 per sample/s
        Offer("mid", 1_000_000, 200.0),  # 5 000
        Offer("slow", 300_000, 30.0),  # 10 000
        Offer("free", 0, 10.0),
    ]
    assert [o.node_id for o in cheapest_nodes(offers, 1, 4)] == ["free"]
    assert [o.node_id for o in cheapest_nodes(offers, 2, 2)] == ["free", "mid"]
    assert cheapest_nodes(offers, 1, 4, max_price=-1) == []
    assert [o.node_id for o in cheapest_nodes(offers, 3, 3, max_price=1_000_000)] == [
        "free",
        "mid",
        "slow",
    ]
    assert cheapest_nodes(offers, 4, 4, max_price=1_000_000) == []  # only three qualify
    cost, seconds = epoch_cost([offers[1]], 720_000)  # an hour at 200 samples/s
    assert (cost, seconds) == (pytest.approx(1_000_000), pytest.approx(3600))


@settings(max_examples=200, deadline=None)
@given(
    offers=offers_st, lo=st.integers(1, 4), extra=st.integers(0, 5), cap=st.integers(0, 5_000_000)
)
def test_fastest_nodes_are_the_fastest_allowed(
    offers: list[Offer], lo: int, extra: int, cap: int
) -> None:
    hi = lo + extra
    chosen = fastest_nodes(offers, lo, hi, max_price=cap)
    allowed = [o for o in offers if o.price_per_hour <= cap]
    if len(allowed) < lo:
        assert chosen == []
        return
    assert len(chosen) == min(hi, len(allowed))
    assert all(o.price_per_hour <= cap for o in chosen)
    assert [o.node_id for o in chosen] == sorted(o.node_id for o in chosen)
    slowest_chosen = min(o.rate for o in chosen)
    assert all(o.rate <= slowest_chosen for o in allowed if o not in chosen)


def test_fastest_nodes_break_ties_by_price_then_id() -> None:
    offers = [
        Offer("b", 2_000_000, 100.0),
        Offer("a", 3_000_000, 100.0),
        Offer("c", 1_000_000, 100.0),
        Offer("slow", 0, 10.0),
        Offer("dear", 9_000_000, 500.0),
        Offer("idle", 0, 0.0),  # no rate: never chosen
    ]
    assert [o.node_id for o in fastest_nodes(offers, 1, 2, max_price=3_000_000)] == ["b", "c"]
    assert [o.node_id for o in fastest_nodes(offers, 1, 9)] == ["a", "b", "c", "dear", "slow"]
    assert [o.node_id for o in fastest_nodes(offers, 1, 4, max_price=0)] == ["slow"]
    assert fastest_nodes(offers, 2, 4, max_price=0) == []
    assert fastest_nodes(offers, 3, 2) == []  # min_nodes above max_nodes
