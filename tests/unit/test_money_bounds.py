"""The pure rules behind the money holes closed: a claimed benchmark bounds a part's billed rate
only from above (coordinator/accounting/billing.py), an ended job's settlement from its ledger
entries moves everything once (coordinator/accounting/credit_book.py), a node's events go
through a token bucket with counted drops (coordinator/core/token_bucket.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.accounting.billing import (
    earned_micro,
    handout_rate,
    settled_rate,
    standing_rate,
)
from coordinator.accounting.credit_book import (
    HELD,
    PLATFORM_FEE,
    CreditBook,
    Entry,
    donor_account,
    escrow_account,
    fund_escrow,
    grant,
    held_account,
    settlement_entries,
    tenant_account,
)
from coordinator.core.token_bucket import BucketLimit, TokenBuckets

pytestmark = pytest.mark.timeout(60)

PRICE = 100_000_000  # 100 credits/h


def test_a_claim_of_being_slow_does_not_raise_the_pay_of_an_unobserved_part() -> None:
    honest = 131.0
    standing = standing_rate([honest], [])
    billed = handout_rate(1e-5, observed=False, standing=standing)
    assert billed == honest
    # Per sample it earns what an honest node of the same price and speed earns.
    assert earned_micro(PRICE, 1, billed) <= earned_micro(PRICE, 131, honest) / 131 + 1
    # Before anything is observed, the other nodes' claims are the reference.
    assert standing_rate([], [120.0, 140.0, 1e-5]) == 120.0
    # An observed node is billed at what was observed, whatever it claimed.
    assert handout_rate(50.0, observed=True, standing=131.0) == 50.0
    # A claim of being fast is believed (it only lowers the node's own pay).
    assert handout_rate(500.0, observed=False, standing=131.0) == 500.0


def test_once_observed_the_part_follows_the_observed_rate() -> None:
    # Nothing to stand behind (a lone node): the part's own observation decides at close.
    assert standing_rate([], []) == 0.0
    assert settled_rate(handout_rate(1e-5, False, 0.0), 120.0) == 120.0
    assert settled_rate(131.0, 0.0) == 131.0  # not observed: the hand-out rate
    assert settled_rate(131.0, math.nan) == 131.0


@given(
    claim=st.floats(1e-9, 1e9),
    standing=st.floats(0.0, 1e6),
    observed=st.floats(0.0, 1e6),
)
def test_the_billed_rate_is_never_below_the_standing_or_the_observed_rate(
    claim: float, standing: float, observed: float
) -> None:
    handed = handout_rate(claim, False, standing)
    final = settled_rate(handed, observed)
    assert handed >= standing and final >= handed and final >= observed
    # The hand-out reservation covers the charge at close (a higher rate pays less).
    assert earned_micro(PRICE, 10, final) <= earned_micro(PRICE, 10, handed)


JOB = "j-0123456789"


def _ledger(accused_node: str = "") -> list[Entry]:
    entries = [
        grant(tenant_account("u-a"), 10_000, at_ms=1),
        fund_escrow(JOB, "u-a", 5_000, at_ms=2, reason="budget"),
    ]
    for round_id, node in ((1, "n1"), (2, "n2")):
        entries += [
            Entry(3, escrow_account(JOB), held_account(JOB), 100, HELD, JOB, round_id, node, 10),
            Entry(3, escrow_account(JOB), "platform", 10, PLATFORM_FEE, JOB, round_id, node, 10),
        ]
    return entries


@pytest.mark.parametrize("accused", [frozenset(), frozenset({"n2"})])
def test_an_ended_jobs_settlement_empties_it_once(accused: frozenset[str]) -> None:
    entries = _ledger()
    book = CreditBook()
    book.post(entries)
    out = settlement_entries(JOB, "u-a", entries, lambda n: n, accused, at_ms=9)
    book.post(out)
    assert book.balance(escrow_account(JOB)) == 0 and book.balance(held_account(JOB)) == 0
    assert book.balance(donor_account("n1")) == 100
    assert book.balance(donor_account("n2")) == (0 if accused else 100)
    # The forfeited part's pay and fee are the tenant's again.
    spent = 220 if not accused else 110
    assert book.balance(tenant_account("u-a")) == 10_000 - spent
    assert book.total() == 0
    # Settling again moves nothing.
    assert settlement_entries(JOB, "u-a", [*entries, *out], lambda n: n, accused, 10) == []


def test_a_round_in_flight_keeps_its_reservation_in_the_escrow() -> None:
    entries = _ledger()
    out = settlement_entries(JOB, "u-a", entries, lambda n: n, (), at_ms=9, keep=300)
    refund = [e for e in out if e.reason == "refund"]
    assert [e.amount for e in refund] == [5_000 - 220 - 300]


def test_a_token_bucket_bounds_a_key_and_counts_its_drops() -> None:
    buckets = TokenBuckets(BucketLimit(burst=5, per_second=1.0))
    taken = [buckets.take("n1", now=0.0) for _ in range(500)]
    assert sum(taken) == 5 and buckets.dropped("n1") == 495
    assert buckets.take("n2", now=0.0)  # per key
    assert not buckets.take("n1", now=0.5)
    assert buckets.take("n1", now=1.6)  # earned back
    assert buckets.take_dropped("n1") == 496 and buckets.take_dropped("n1") == 0
    assert buckets.dropped_total == 496
    buckets.forget_idle(now=100.0)
    assert buckets.pending() == []
    with pytest.raises(ValueError):
        BucketLimit(burst=0, per_second=1.0)


def test_idle_buckets_are_forgotten_least_recently_used_first() -> None:
    buckets = TokenBuckets(BucketLimit(burst=2, per_second=1.0))  # full again after 2 s
    for i, key in enumerate(("a", "b", "c")):
        assert buckets.take(key, now=float(i))
    assert buckets.take("a", now=3.0)  # used again: now the most recent
    for _ in range(3):
        buckets.take("d", now=3.0)  # its third take is a drop, not yet reported
    buckets.forget_idle(now=4.5)  # b (1.0) and c (2.0) idle past 2 s; a and d recent
    assert sorted(buckets._tokens) == ["a", "d"]
    buckets.forget_idle(now=10.0)  # d's drop is pending: its bucket stays until reported
    assert sorted(buckets._tokens) == ["d"]
    assert buckets.take_dropped("d") == 1
    buckets.forget_idle(now=10.0)
    assert buckets._tokens == {}
