"""The market's money rules (epochmesh/money.py, coordinator/accounting/billing.py,
coordinator/accounting/credit_book.py), pure: parsing credits, the billing rule, and a hypothesis model of
a job's life (grants, escrow at submit, rounds with failed and late parts, coordinator
roll-backs, a budget that runs out, top-ups, cancel) against the ledger's invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.accounting.billing import BilledSamples, PartCharge, charge_part, earned_micro
from coordinator.accounting.credit_book import (
    MINT,
    PLATFORM,
    CreditBook,
    Entry,
    InsufficientCredits,
    donor_account,
    escrow_account,
    escrow_needed,
    fund_escrow,
    grant,
    refund,
    round_entries,
    tenant_account,
)
from epochmesh.money import MICRO, format_credits, parse_credits

pytestmark = pytest.mark.timeout(120)


# -- credits as text ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "micro"),
    [("0", 0), ("12", 12 * MICRO), ("0.25", 250_000), (" 1.000001 ", 1_000_001), ("1e3", 10**9)],
)
def test_credits_parse_exactly(text: str, micro: int) -> None:
    assert parse_credits(text) == micro
    assert parse_credits(format_credits(micro)) == micro


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-1", "must not be negative"),
        ("nan", "finite"),
        ("inf", "finite"),
        ("ten", "must be a number"),
        ("", "must be a number"),
        ("0.0000001", "more than 6 decimals"),
        ("1e10", "at most"),
    ],
)
def test_bad_amounts_are_refused_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_credits(text, "price")


def test_zero_can_be_refused() -> None:
    with pytest.raises(ValueError, match="more than 0"):
        parse_credits("0", "budget", allow_zero=False)
    assert format_credits(-1_500_000) == "-1.5"


# -- the billing rule -----------------------------------------------------------------------------


def test_a_node_earns_its_price_for_the_time_its_applied_samples_take() -> None:
    # 3.6 credits/h at 10 samples/s: 36000 samples are one hour, 3.6 credits.
    assert earned_micro(3_600_000, 36_000, 10.0) == 3_600_000
    assert earned_micro(3_600_000, 1, 10.0) == 100  # a tenth of a second: 100 micro-credits
    assert earned_micro(0, 1000, 10.0) == 0  # a donation
    assert earned_micro(3_600_000, 1000, 0.0) == 0  # no measured speed: nothing billed
    c = charge_part("n1", "d1", 3_600_000, 10.0, samples=10, repeat_samples=4, fee_ppm=100_000)
    assert (c.earned, c.submitter_pays, c.platform_pays, c.fee) == (1000, 600, 400, 60)
    with pytest.raises(ValueError):
        charge_part("n1", "d1", 1, 1.0, samples=3, repeat_samples=4)


def test_billed_samples_split_new_from_repeats() -> None:
    paid = BilledSamples(10)
    runs = np.array([[0, 4], [6, 8]])
    assert paid.split(0, runs) == (6, 0)
    paid.mark(0, runs)
    assert paid.split(0, np.array([[2, 7]])) == (2, 3)  # 4 and 5 are new; 2, 3, 6 paid
    assert paid.split(1, runs) == (6, 0)  # another epoch
    with pytest.raises(ValueError):
        paid.split(0, np.array([[8, 11]]))


def _mask_of(runs: list[tuple[int, int]], n: int) -> np.ndarray:
    """Which of n samples the runs cover, sample by sample (the rule, written plainly)."""
    mask = np.zeros(n, dtype=bool)
    for start, stop in runs:
        mask[start:stop] = True
    return mask


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 8)), max_size=10),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 8)), max_size=10),
)
def test_billed_samples_count_each_covered_sample_once_in_any_order_or_overlap(
    paid_runs: list[tuple[int, int]], part_runs: list[tuple[int, int]]
) -> None:
    n = 48
    first = [(a, min(n, a + k)) for a, k in paid_runs]
    part = [(a, min(n, a + k)) for a, k in part_runs]
    billed = BilledSamples(n)
    billed.mark(0, np.array(first, dtype=np.int64).reshape(-1, 2))
    arr = np.array(part, dtype=np.int64).reshape(-1, 2)
    covered, paid = _mask_of(part, n), _mask_of(first, n)
    repeat = int((covered & paid).sum())
    assert billed.split(0, arr) == (int(covered.sum()) - repeat, repeat)
    assert billed.unpaid(0, arr).tolist() == np.flatnonzero(covered & ~paid).tolist()
    assert billed.unpaid(1, arr).tolist() == np.flatnonzero(covered).tolist()


def test_a_posting_is_all_or_nothing() -> None:
    book = CreditBook()
    book.post([grant(tenant_account("t"), 100, 0)])
    with pytest.raises(InsufficientCredits) as err:
        book.post([fund_escrow("j", "t", 60, 1, "budget"), fund_escrow("j", "t", 60, 1, "top-up")])
    assert err.value.account == tenant_account("t") and err.value.needed == 120
    assert book.balance(tenant_account("t")) == 100 and book.balance(escrow_account("j")) == 0
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError):
            book.post([Entry(0, MINT, "tenant:t", bad, "x")])  # type: ignore[arg-type]
    assert book.total() == 0


# -- a job's life, modelled ----------------------------------------------------------------------

N = 24  # samples per epoch
NODES = {"n1": ("alice", 3_600_000, 10.0), "n2": ("alice", 7_200_000, 25.0), "n3": ("bob", 0, 5.0)}


@dataclass
class Model:
    """A job of 2 epochs and its tenant, driven by hypothesis steps."""

    book: CreditBook = field(default_factory=CreditBook)
    paid: BilledSamples = field(default_factory=lambda: BilledSamples(N))
    epoch: int = 0
    pending: list[int] = field(default_factory=lambda: list(range(N)))
    done: set[int] = field(default_factory=set)  # applied in this epoch (since the checkpoint)
    history: list[tuple[int, list[int]]] = field(default_factory=list)  # applied, by round
    earned: dict[str, int] = field(default_factory=dict)  # donor -> the billing rule's total
    submitter_samples: dict[int, int] = field(default_factory=dict)  # epoch -> samples paid
    applied: dict[int, set[int]] = field(default_factory=dict)  # epoch -> samples applied
    cancelled: bool = False
    paused: int = 0
    spent: int = 0  # by the submitter (donors' pay for new samples, and fees)
    fees: int = 0
    reruns: int = 0  # paid by the platform
    round: int = 0

    def post(self, entries: list[Entry]) -> None:
        self.book.post(entries)
        assert self.book.total() == 0
        for account, balance in self.book.balances().items():
            assert balance >= 0 or account in (MINT, PLATFORM), (account, balance)


def run_round(m: Model, take: int, outcomes: list[str]) -> None:
    """A round hands ``take`` pending samples to the nodes; each part is applied, failed or
    late. Before billing, a round that would overdraw the escrow pauses the job instead."""
    if m.cancelled or not m.pending:
        return
    m.round += 1
    batch, m.pending = m.pending[:take], m.pending[take:]
    parts = [batch[i :: len(NODES)] for i in range(len(NODES))]
    charges: list[PartCharge] = []
    applied_samples: list[int] = []
    for (node, (donor, price, rate)), samples, outcome in zip(
        NODES.items(), parts, outcomes, strict=False
    ):
        if not samples or outcome != "applied":
            m.pending.extend(samples)  # failed or late: back to pending, nobody paid
            continue
        runs = np.array([[s, s + 1] for s in samples])
        new, repeat = m.paid.split(m.epoch, runs)
        charges.append(charge_part(node, donor, price, rate, len(samples), repeat, 50_000))
        applied_samples.extend(samples)
    if escrow_needed(charges) > m.book.balance(escrow_account("j")):
        m.pending.extend(applied_samples)  # paused: "budget"; the round is not applied
        m.paused += 1
        return
    m.post(round_entries("j", m.round, charges, m.round))
    m.paid.mark(m.epoch, np.array([[s, s + 1] for s in applied_samples]).reshape(-1, 2))
    for c in charges:
        m.earned[c.donor] = m.earned.get(c.donor, 0) + c.earned
        m.spent += c.submitter_total
        m.fees += c.fee
        m.reruns += c.platform_pays
        m.submitter_samples[m.epoch] = (
            m.submitter_samples.get(m.epoch, 0) + c.samples - c.repeat_samples
        )
    m.applied.setdefault(m.epoch, set()).update(applied_samples)
    m.done.update(applied_samples)
    m.history.append((m.epoch, applied_samples))
    if not m.pending and len(m.done) == N and m.epoch == 0:
        m.epoch, m.pending, m.done, m.history = 1, list(range(N)), set(), []


def roll_back(m: Model, rounds: int) -> None:
    """A coordinator restart: the last ``rounds`` rounds of this epoch are rolled back (their
    samples pending again); their entries stay (the donors keep their pay)."""
    for _ in range(min(rounds, len(m.history))):
        epoch, samples = m.history.pop()
        assert epoch == m.epoch
        m.done.difference_update(samples)
        m.pending.extend(samples)


a_round = st.tuples(
    st.just("round"),
    st.integers(1, 12),
    st.lists(st.sampled_from(["applied", "applied", "failed", "late"]), min_size=3, max_size=3),
)
steps = st.lists(
    st.one_of(
        a_round,
        a_round,
        a_round,
        st.tuples(st.just("rollback"), st.integers(1, 3)),
        st.tuples(st.just("topup"), st.integers(1, 5_000)),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    budget=st.integers(1, 20_000),
    extra=st.integers(-2_000, 30_000),
    steps=steps,
    cancel_after=st.integers(0, 80),
)
def test_every_applied_sample_is_billed_once_and_the_books_balance(
    budget: int, extra: int, steps: list[tuple], cancel_after: int
) -> None:
    granted = max(0, budget + extra)
    m = Model()
    m.post([grant(tenant_account("t"), granted, 0)] if granted else [])
    try:
        m.post([fund_escrow("j", "t", budget, 0, "budget at submit")])
    except InsufficientCredits:
        assert budget > granted  # refused: nothing stored, the job never starts
        assert m.book.balance(tenant_account("t")) == granted
        return
    for i, step in enumerate(steps):
        if i == cancel_after:  # the submitter cancels: the rest of the escrow comes back
            m.post(refund(m.book, "j", "t", 0))
            m.cancelled = True
        if step[0] == "round":
            run_round(m, step[1], step[2])
        elif step[0] == "rollback":
            roll_back(m, step[1])
        elif step[0] == "topup" and not m.cancelled:
            try:
                m.post([fund_escrow("j", "t", step[1], 0, "top-up")])
            except InsufficientCredits:
                pass  # refused with its reason; nothing moved
    # Donors got exactly the billing rule's earnings for the parts applied (re-runs included).
    for donor in {d for d, _, _ in NODES.values()}:
        assert m.book.balance(donor_account(donor)) == m.earned.get(donor, 0)
    # The submitter paid for each applied sample of each epoch once.
    for epoch, samples in m.applied.items():
        assert m.submitter_samples.get(epoch, 0) == len(samples)
    # What the submitter spent went to the donors and the platform's fee; the rest is its own
    # or still in escrow (none once cancelled); the platform's balance is fees less re-runs.
    tenant, escrow = m.book.balance(tenant_account("t")), m.book.balance(escrow_account("j"))
    assert tenant + escrow == granted - m.spent
    assert m.book.balance(PLATFORM) == m.fees - m.reruns
    if m.cancelled:
        assert escrow == 0
