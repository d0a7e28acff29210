"""The credit ledger's rules, double-entry and pure: accounts, entries, and the entries each
market event makes (a grant, a job's escrow, a billed round, a refund). Nothing here touches the
store; the engine posts what these functions return in the same transaction as the round
record it bills, and a `CreditBook` replays stored entries to check every posting.

Accounts: ``mint`` (where granted credits come from: the only account that goes negative, so
that all balances always sum to zero), ``platform`` (fees in, re-runs out: it may go negative
too, the operator's loss), ``tenant:<principal>``, ``donor:<principal>`` (one per donor, however
many nodes it enrolled), ``escrow:<job>`` and ``held:<job>`` (a verified job's pay for updates no
check has vouched for yet: released to the donor when a check passes, forfeited when one fails).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.accounting.billing import PartCharge

MINT = "mint"
PLATFORM = "platform"
# Accounts whose balance may go below zero.
MAY_GO_NEGATIVE = frozenset({MINT, PLATFORM})


def tenant_account(principal: str) -> str:
    return f"tenant:{principal}"


def donor_account(principal: str) -> str:
    return f"donor:{principal}"


def escrow_account(job_id: str) -> str:
    return f"escrow:{job_id}"


def held_account(job_id: str) -> str:
    return f"held:{job_id}"


# Reasons of the entries that hold, release and forfeit a verified job's pay.
PLATFORM_FEE = "platform fee"
HELD = "held until verified"
HELD_RERUN = "re-run held until verified"
RELEASED = "verified: applied samples"
FORFEITED = "forfeited: failed verification"
FORFEITED_RERUN = "forfeited re-run: failed verification"
FEE_RETURNED = "fee returned: failed verification"


@dataclass(frozen=True)
class Entry:
    """``amount`` micro-credits from one account to another, and why."""

    at_ms: int
    from_account: str
    to_account: str
    amount: int
    reason: str
    job_id: str = ""
    round: int = 0
    node_id: str = ""
    samples: int = 0


class InsufficientCredits(ValueError):
    """A posting would take an account below zero."""

    def __init__(self, account: str, balance: int, needed: int) -> None:
        super().__init__(f"{account} holds {balance} micro-credits, {needed} are needed")
        self.account = account
        self.balance = balance
        self.needed = needed


class CreditBook:
    """Balances, changed only by whole postings that keep every account that may not go
    negative at or above zero (all or nothing)."""

    def __init__(self, balances: Mapping[str, int] | None = None) -> None:
        self._balances: dict[str, int] = dict(balances or {})

    def balance(self, account: str) -> int:
        return self._balances.get(account, 0)

    def balances(self) -> dict[str, int]:
        return {a: b for a, b in self._balances.items() if b}

    def total(self) -> int:
        """Always 0: every entry takes from one account what it gives another."""
        return sum(self._balances.values())

    def check(self, entries: Iterable[Entry]) -> dict[str, int]:
        """The balances after ``entries``, or ValueError / InsufficientCredits (nothing is
        changed either way)."""
        after = dict(self._balances)
        for e in entries:
            if not isinstance(e.amount, int) or isinstance(e.amount, bool) or e.amount <= 0:
                raise ValueError(f"an entry moves a positive whole amount, not {e.amount!r}")
            if not e.from_account or not e.to_account or e.from_account == e.to_account:
                raise ValueError(f"an entry moves between two accounts: {e}")
            after[e.from_account] = after.get(e.from_account, 0) - e.amount
            after[e.to_account] = after.get(e.to_account, 0) + e.amount
        for account, balance in after.items():
            if balance < 0 and account not in MAY_GO_NEGATIVE:
                before = self._balances.get(account, 0)
                raise InsufficientCredits(account, before, before - balance)
        return after

    def post(self, entries: Sequence[Entry]) -> None:
        self._balances = self.check(entries)


# -- the entries of market events ---------------------------------------------------------------


def grant(account: str, amount: int, at_ms: int, reason: str = "granted") -> Entry:
    """Credits an operator grants: from the mint."""
    return Entry(at_ms, MINT, account, amount, reason)


def fund_escrow(job_id: str, tenant: str, amount: int, at_ms: int, reason: str) -> Entry:
    """A job's budget (at submit) or a top-up moves from its tenant into its escrow."""
    return Entry(at_ms, tenant_account(tenant), escrow_account(job_id), amount, reason, job_id)


def round_entries(
    job_id: str, round_id: int, charges: Sequence[PartCharge], at_ms: int, hold: bool = False
) -> list[Entry]:
    """A round's applied parts billed: each donor's earnings from the job's escrow (samples
    the submitter had not paid for) and from the platform (re-runs), the fee from the escrow
    to the platform. ``hold``: the earnings go to the job's held account instead, until a check
    vouches for them (:func:`release_entries`) or finds them bad (:func:`forfeit_entries`).
    Zero amounts make no entry."""
    escrow = escrow_account(job_id)
    out: list[Entry] = []
    for c in charges:
        donor = held_account(job_id) if hold else donor_account(c.donor)
        moves = (
            (escrow, donor, c.submitter_pays, HELD if hold else "applied samples"),
            (
                PLATFORM,
                donor,
                c.platform_pays,
                HELD_RERUN if hold else "re-run of rolled-back samples",
            ),
            (escrow, PLATFORM, c.fee, PLATFORM_FEE),
        )
        for src, dst, amount, reason in moves:
            if amount > 0:
                samples = c.repeat_samples if src == PLATFORM else c.samples - c.repeat_samples
                out.append(
                    Entry(at_ms, src, dst, amount, reason, job_id, round_id, c.node_id, samples)
                )
    return out


def release_entries(
    job_id: str, round_id: int, node_id: str, donor: str, amount: int, samples: int, at_ms: int
) -> list[Entry]:
    """A node's held pay for its part of ``round_id`` goes to its donor: a check vouched for it
    (or the job ended without finding it bad)."""
    if amount <= 0:
        return []
    return [
        Entry(
            at_ms,
            held_account(job_id),
            donor_account(donor),
            amount,
            RELEASED,
            job_id,
            round_id,
            node_id,
            samples,
        )
    ]


def forfeit_entries(
    job_id: str, round_id: int, node_id: str, charge: PartCharge, at_ms: int
) -> list[Entry]:
    """A node's held pay for its part of ``round_id`` is forfeited (a check found its work
    bad, and the part was undone): the submitter's share and the fee back to the escrow, a
    re-run's share back to the platform."""
    held, escrow = held_account(job_id), escrow_account(job_id)
    moves = (
        (held, escrow, charge.submitter_pays, FORFEITED),
        (held, PLATFORM, charge.platform_pays, FORFEITED_RERUN),
        (PLATFORM, escrow, charge.fee, FEE_RETURNED),
    )
    return [
        Entry(at_ms, src, dst, amount, reason, job_id, round_id, node_id, charge.samples)
        for src, dst, amount, reason in moves
        if amount > 0
    ]


def escrow_needed(charges: Sequence[PartCharge]) -> int:
    """What a round's charges take from the job's escrow."""
    return sum(c.submitter_total for c in charges)


def refund(book: CreditBook, job_id: str, tenant: str, at_ms: int) -> list[Entry]:
    """What is left in the job's escrow back to its tenant (the job ended or was cancelled)."""
    left = book.balance(escrow_account(job_id))
    if left <= 0:
        return []
    return [Entry(at_ms, escrow_account(job_id), tenant_account(tenant), left, "refund", job_id)]
