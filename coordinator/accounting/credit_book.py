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

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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


# -- a job's end: what is held and left goes where it belongs ----------------------------------

REFUND = "refund"


def held_charges(
    job_id: str, entries: Iterable[Entry], donor_of: Callable[[str], str]
) -> dict[tuple[int, str], PartCharge]:
    """(round, node) -> the charge of each part whose pay is still in the job's held account
    (moved in by the round's entries, not out by a release or a forfeit: each moves a part's
    whole hold), rebuilt from the ledger."""
    held = held_account(job_id)
    parts: dict[tuple[int, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    settled: set[tuple[int, str]] = set()
    for e in entries:
        key = (e.round, e.node_id)
        if e.from_account == held:
            settled.add(key)
        elif e.to_account == held and e.reason == HELD:
            parts[key]["submitter"] += e.amount
            parts[key]["samples"] += e.samples
        elif e.to_account == held and e.reason == HELD_RERUN:
            parts[key]["platform"] += e.amount
            parts[key]["repeat"] += e.samples
        elif e.reason == PLATFORM_FEE:
            parts[key]["fee"] += e.amount
    out = {}
    for key, f in parts.items():
        earned = f["submitter"] + f["platform"]
        if key in settled or earned <= 0:
            continue
        out[key] = PartCharge(
            node_id=key[1],
            donor=donor_of(key[1]),
            samples=f["samples"] + f["repeat"],
            repeat_samples=f["repeat"],
            earned=earned,
            submitter_pays=f["submitter"],
            platform_pays=f["platform"],
            fee=f["fee"],
        )
    return out


def escrow_balance(job_id: str, entries: Iterable[Entry]) -> int:
    """What the job's escrow holds after ``entries`` (all of the job's entries)."""
    escrow = escrow_account(job_id)
    return sum(
        (e.amount if e.to_account == escrow else -e.amount)
        for e in entries
        if escrow in (e.to_account, e.from_account)
    )


def settlement_entries(
    job_id: str,
    tenant: str,
    entries: Sequence[Entry],
    donor_of: Callable[[str], str],
    accused: Collection[str],
    at_ms: int,
    keep: int = 0,
) -> list[Entry]:
    """The entries that settle an ended job from its ledger ``entries``: the pay still held for
    each part goes to its donor (:func:`release_entries`), but an ``accused`` node's (a check
    found its work bad), which is forfeited (:func:`forfeit_entries`); then what the escrow
    holds, less ``keep`` (a round in flight may still be charged), returns to the tenant. Empty
    when nothing is left: settling twice moves nothing the second time."""
    out: list[Entry] = []
    back = 0
    for (round_id, node_id), charge in sorted(held_charges(job_id, entries, donor_of).items()):
        if node_id in accused:
            moves = forfeit_entries(job_id, round_id, node_id, charge, at_ms)
            back += sum(e.amount for e in moves if e.to_account == escrow_account(job_id))
        else:
            moves = release_entries(
                job_id, round_id, node_id, charge.donor, charge.earned, charge.samples, at_ms
            )
        out += moves
    left = escrow_balance(job_id, entries) + back - max(0, keep)
    if left > 0:
        out.append(
            Entry(at_ms, escrow_account(job_id), tenant_account(tenant), left, REFUND, job_id)
        )
    return out
