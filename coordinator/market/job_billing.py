"""One job's side of the market: what its rounds cost and where the credits go.

At hand-out every part gets its node's price and the node's measured samples/s for the job
(kept in the round record, so that a statement can be recomputed from the rounds); a round is
handed out only if the job's escrow covers what it could cost (every part applied, no re-run);
when the round closes its applied parts are charged by the billing rule (coordinator/accounting/billing.py)
and the entries are written in the round record's own transaction (coordinator/engine/round_writer.py).
The submitter pays each sample of an epoch once: a sample it paid for in a round that a
coordinator restart rolled back is re-run at the platform's expense.

Verified jobs hold their donors' pay (coordinator/engine/verifier.py): a part's earnings go to the
job's held account and reach the donor when a check of the node vouches for it (a passed check
of round r vouches for the node's parts up to r: a failure would have undone all of them) or the
job ends with no check failed; a failed check forfeits the node's held pay (the submitter's share
and the fee back to the escrow, a re-run's back to the platform) and the samples it paid for are
the submitter's to pay again when they are re-run, so that it still pays each sample once.

The price cap: a job with `[market] max_price` uses no node asking more; a job without it uses
any node if it has a budget, else only donated ones (no budget: it pays nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from coordinator.accounting.billing import (
    BilledSamples,
    PartCharge,
    charge_part,
    earned_micro,
    handout_rate,
    quantized_rate,
    settled_rate,
)
from coordinator.accounting.credit_book import (
    FEE_RETURNED,
    FORFEITED,
    Entry,
    InsufficientCredits,
    escrow_account,
    forfeit_entries,
    fund_escrow,
    held_account,
    held_charges,
    release_entries,
    round_entries,
    settlement_entries,
    tenant_account,
)
from coordinator.market.credit_ledger import CreditLedger
from coordinator.rounds.round_state import Part
from coordinator.store.base import Store
from epochmesh.money import format_credits
from epochmesh.quote import max_price_of
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

# Tries at settling an ended job whose ledger changed under the settlement (see settle_ended).
SETTLE_ATTEMPTS = 3


class BudgetExhausted(Exception):
    """The job's escrow does not cover its next round."""


class AboveMaxPrice(Exception):
    """Nodes of the round ask more than the job's max_price now (a donor raised its price)."""

    def __init__(self, nodes: list[str]) -> None:
        super().__init__(f"nodes above the job's max_price: {', '.join(nodes)}")
        self.nodes = nodes


@dataclass(frozen=True, eq=False)
class Hold:
    """A node's pay for one applied part, held until a check vouches for it (compared by
    identity: one per part)."""

    round: int
    epoch: int
    charge: PartCharge
    unpaid: np.ndarray  # the sample indices the submitter paid for with this part


class JobBilling:
    def __init__(
        self,
        job: common_pb2.Job,
        credits: CreditLedger,
        fee_ppm: int = 0,
        donor_of: Callable[[str], str] = lambda node_id: node_id,
    ) -> None:
        self.job = job
        self.credits = credits
        self.fee_ppm = fee_ppm
        self.donor_of = donor_of  # node id -> the donor whose account it earns for
        self.billed = BilledSamples(job.num_samples)
        self._pending = 0  # charged at round close, not yet written (background records)
        # Whether donors' pay waits for verification (set by the runner), and what is held.
        self.hold = False
        self._holds: dict[str, list[Hold]] = defaultdict(list)
        # Task ids of open parts priced while their node was unobserved (see price_parts).
        self._provisional: set[str] = set()
        # What the round handed out last could still cost (until it is charged): kept in the
        # escrow when the job ends while it is in flight.
        self._reserved = 0
        # Releases, forfeits and the end's settlement one at a time: the settlement reads the
        # stored ledger and posts what is left, so a release posted between its read and its
        # post would be paid twice (and refused: the held account short). Always taken before
        # the store's write lock (see `settling`).
        self._settling = asyncio.Lock()
        self._settling_task: asyncio.Task[object] | None = None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def escrow(self) -> str:
        return escrow_account(self.job_id)

    def available(self) -> int:
        """Micro-credits the escrow holds beyond the charges not yet written."""
        return self.credits.balance(self.escrow) - self._pending

    # -- restore --------------------------------------------------------------------------------

    async def restore(self, store: Store, rounds: Iterable[common_pb2.RoundRecord]) -> None:
        """The samples the submitter paid for: every stored round's applied parts (rolled
        back too: a round record and its charges are written together), less those whose pay
        was forfeited; what it spent; and the pay still held, held again (rebuilt from the
        ledger: a later check of the node releases or forfeits it, as before the restart; the
        verifier keeps its unverified rounds across it). Held pay of a job that no longer holds
        (``hold`` off) is released."""
        entries = [e for _, e in await store.list_ledger_entries(job_id=self.job_id)]
        self.job.spent_micro = sum(
            e.amount for e in entries if e.from_account == self.escrow and e.reason != "refund"
        ) - sum(
            e.amount
            for e in entries
            if e.to_account == self.escrow and e.reason in (FORFEITED, FEE_RETURNED)
        )
        self.job.escrow_micro = self.available()
        forfeited = {(e.round, e.node_id) for e in entries if e.reason == FORFEITED}
        charges = held_charges(self.job_id, entries, self.donor_of)
        release: list[Entry] = []
        for r in sorted(rounds, key=lambda r: r.round):
            for p in r.parts:
                if p.status == "applied" and (r.round, p.node_id) not in forfeited:
                    runs = np.array([(x.start, x.stop) for x in p.ranges], dtype=np.int64)
                    runs = runs.reshape(-1, 2)
                    charge = charges.pop((r.round, p.node_id), None)
                    if charge is not None and self.hold:
                        unpaid = self.billed.unpaid(r.epoch, runs)
                        self._holds[p.node_id].append(Hold(r.round, r.epoch, charge, unpaid))
                    elif charge is not None:
                        release += self._release_entries(r.round, charge)
                    self.billed.mark(r.epoch, runs)
        for (round_id, _), charge in sorted(charges.items()):  # a part with no stored record
            release += self._release_entries(round_id, charge)
        if release:
            await self.credits.post(release)
            log.info("job %s: %d held part(s) released after a restart", self.job_id, len(release))
        held = sum(len(h) for h in self._holds.values())
        if held:
            log.info("job %s: %d part(s)' pay held again after a restart", self.job_id, held)

    def _release_entries(self, round_id: int, charge: PartCharge) -> list[Entry]:
        return release_entries(
            self.job_id,
            round_id,
            charge.node_id,
            charge.donor,
            charge.earned,
            charge.samples,
            now_ms(),
        )

    # -- hand-out -------------------------------------------------------------------------------

    def price_parts(
        self,
        parts: Mapping[str, Part],
        prices: Mapping[str, int],
        rates: Mapping[str, float],
        unobserved: Mapping[str, float] | None = None,
    ) -> None:
        """Fix each part's price and billed rate at hand-out; AboveMaxPrice when a node asks
        more than the job's max_price; BudgetExhausted when the escrow does not cover the round
        should every part be applied. ``unobserved``: the nodes no round observed yet, each
        with the rate the coordinator can stand behind for it (coordinator/accounting/billing.py
        `standing_rate`): their claims bound their parts' rates only from above, and their
        parts are billed at close at no less than what the round observed (`settle_rates`)."""
        cap = max_price_of(self.job.spec)
        dear = sorted(n for n in parts if cap is not None and prices.get(n, 0) > cap)
        if dear:
            raise AboveMaxPrice(dear)
        unobserved = unobserved or {}
        for node_id, part in parts.items():
            part.price = int(prices.get(node_id, 0))
            rate = float(rates.get(node_id, 0.0))
            if node_id in unobserved:
                rate = handout_rate(rate, False, unobserved[node_id])
                self._provisional.add(part.task_id)
            part.rate = quantized_rate(rate)
        bound = 0
        for part in parts.values():
            earned = earned_micro(part.price, part.assigned or part.samples, part.rate)
            bound += earned + earned * self.fee_ppm // 1_000_000
        available = self.available()
        self._reserved = 0
        if bound > available:
            raise BudgetExhausted(
                f"budget: the next round could cost {format_credits(bound)} credits and the "
                f"job's escrow holds {format_credits(max(0, available))}; add to it with "
                f"`epochmesh budget {self.job_id} --add CREDITS`"
            )
        self._reserved = bound

    # -- round close ----------------------------------------------------------------------------

    def settle_rates(self, parts: Iterable[Part], observed: Mapping[str, float]) -> None:
        """The round closed: a part handed out while its node was unobserved is billed at no
        less than the node's rate the round observed (``observed``: node -> samples/s, absent
        when not observed); called before the round's record is made, so that the record
        keeps the rate billed."""
        for p in parts:
            if p.task_id in self._provisional:
                self._provisional.discard(p.task_id)
                p.rate = quantized_rate(settled_rate(p.rate, observed.get(p.node_id, 0.0)))

    def charge_round(self, epoch: int, round_id: int, parts: Iterable[Part]) -> list[Entry]:
        """The entries that bill a closed round's applied parts (marks their samples paid);
        counted as pending until :meth:`written`."""
        charges: list[PartCharge] = []
        for p in parts:
            if p.status != "applied" or p.samples <= 0:
                continue
            new, repeat = self.billed.split(epoch, p.ranges)
            charge = charge_part(
                p.node_id,
                self.donor_of(p.node_id),
                p.price,
                p.rate,
                new + repeat,
                repeat,
                self.fee_ppm,
            )
            charges.append(charge)
            if self.hold and charge.earned > 0:
                unpaid = self.billed.unpaid(epoch, p.ranges)
                self._holds[p.node_id].append(Hold(round_id, epoch, charge, unpaid))
            self.billed.mark(epoch, p.ranges)
        self._reserved = 0
        entries = round_entries(self.job_id, round_id, charges, now_ms(), hold=self.hold)
        taken = sum(e.amount for e in entries if e.from_account == self.escrow)
        self._pending += taken
        self.job.spent_micro += taken
        self.job.escrow_micro = self.available()
        return entries

    def written(self, entries: Iterable[Entry]) -> None:
        self._pending -= sum(e.amount for e in entries if e.from_account == self.escrow)

    # -- held pay -------------------------------------------------------------------------------
    # The caller makes sure the rounds' own entries are written first (RoundWriter.written).

    def held(self, node_id: str | None = None) -> int:
        """Micro-credits held for ``node_id`` (None: every node)."""
        nodes = self._holds.values() if node_id is None else [self._holds.get(node_id, [])]
        return sum(h.charge.earned for holds in nodes for h in holds)

    async def release(self, node_id: str, up_to_round: int | None = None) -> int:
        """A check vouched for ``node_id``'s parts up to ``up_to_round`` (None: all of them):
        their held pay goes to its donor. The amount."""
        async with self._settling:
            return await self._release(node_id, up_to_round)

    async def _release(self, node_id: str, up_to_round: int | None) -> int:
        holds = self._holds.get(node_id, [])
        due = [h for h in holds if up_to_round is None or h.round <= up_to_round]
        if not due:
            return 0
        # Taken off the list before anything is awaited: a forfeit or another release that
        # runs meanwhile sees only what is still held.
        self._holds[node_id] = [h for h in holds if h not in due]
        at = now_ms()
        entries = [
            e
            for h in due
            for e in release_entries(
                self.job_id, h.round, node_id, h.charge.donor, h.charge.earned, h.charge.samples, at
            )
        ]
        try:
            await self.credits.post(entries)
        except BaseException:
            self._holds[node_id] = due + self._holds.get(node_id, [])
            raise
        return sum(e.amount for e in entries)

    async def release_all(self, except_nodes: Iterable[str] = ()) -> int:
        """The job ended: every node's held pay goes to its donor, but ``except_nodes``'."""
        skip = set(except_nodes)
        return sum([await self.release(n) for n in list(self._holds) if n not in skip])

    async def forfeit(self, node_id: str) -> int:
        """A check found ``node_id``'s work bad and its parts were undone: its held pay is
        forfeited (back to the escrow, a re-run's to the platform, the fee returned) and the
        samples the submitter paid for with it are its to pay again. The amount forfeited."""
        async with self._settling:
            return await self._forfeit(node_id)

    async def _forfeit(self, node_id: str) -> int:
        holds = self._holds.pop(node_id, [])  # before anything is awaited (see release)
        if not holds:
            return 0
        at = now_ms()
        entries = [
            e for h in holds for e in forfeit_entries(self.job_id, h.round, node_id, h.charge, at)
        ]
        try:
            await self.credits.post(entries)
        except BaseException:
            self._holds[node_id] = holds + self._holds.get(node_id, [])
            raise
        for h in holds:
            self.billed.unmark(h.epoch, h.unpaid)
        back = sum(e.amount for e in entries if e.to_account == self.escrow)
        self.job.spent_micro -= back
        self.job.escrow_micro = self.available()
        return sum(h.charge.earned for h in holds)

    # -- the job's end --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def settling(self) -> AsyncIterator[None]:
        """Hold releases and forfeits off while the job's end is settled (`settle_ended`).
        Enter it before the store transaction the settlement runs in: a release or a forfeit
        takes the same lock before its own store write, which waits for the store's write lock
        a transaction holds, so a settlement that took it inside the transaction could wait
        for a release that waits for the transaction, for ever."""
        async with self._settling:
            self._settling_task = asyncio.current_task()
            try:
                yield
            finally:
                self._settling_task = None

    async def settle_ended(self, store: Store, accused: Iterable[str]) -> list[Entry]:
        """The job ended: its held pay settled and its escrow refunded (`settle_ended_job`),
        inside `settling` and in the caller's store transaction if any (it calls
        ``credits.reload()`` should that fail). What a round in flight could still cost stays
        in the escrow (refunded when the runner ends, or by the start-up sweep). The entries
        posted. RuntimeError outside `settling`."""
        if self._settling_task is None or self._settling_task is not asyncio.current_task():
            raise RuntimeError("settle_ended runs inside JobBilling.settling()")
        return await self._settle_ended(store, frozenset(accused))

    async def _settle_ended(self, store: Store, accused: frozenset[str]) -> list[Entry]:
        for attempt in range(SETTLE_ATTEMPTS):
            try:
                posted = await settle_ended_job(
                    store,
                    self.credits,
                    self.job,
                    self.donor_of,
                    accused,
                    keep=self._pending + self._reserved,
                )
                break
            except InsufficientCredits as e:
                # A round's record written meanwhile changed the ledger the settlement was
                # computed from (nothing was posted): computed again from the ledger as it is.
                if attempt + 1 == SETTLE_ATTEMPTS:
                    raise
                log.info("job %s: settling again (%s)", self.job_id, e)
        held = held_account(self.job_id)
        settled = {(e.round, e.node_id) for e in posted if e.from_account == held}
        for node_id in list(self._holds):
            self._holds[node_id] = [
                h for h in self._holds[node_id] if (h.round, node_id) not in settled
            ]
            if not self._holds[node_id]:
                del self._holds[node_id]
        back = sum(e.amount for e in posted if e.to_account == self.escrow)
        self.job.spent_micro -= back
        self.job.escrow_micro = self.available()
        return posted

    # -- escrow ---------------------------------------------------------------------------------

    async def top_up(self, amount: int) -> None:
        """``amount`` more from the tenant's account into the escrow (InsufficientCredits when
        the account is short)."""
        entry = fund_escrow(self.job_id, self.job.owner, amount, now_ms(), "budget top-up")
        await self.credits.post([entry])
        self.job.escrow_micro = self.available()

    async def refund(self) -> int:
        """What is left in the escrow back to the tenant (the job ended); the amount."""
        left = self.credits.balance(self.escrow)
        if left <= 0:
            return 0
        entry = Entry(
            now_ms(), self.escrow, tenant_account(self.job.owner), left, "refund", self.job_id
        )
        await self.credits.post([entry])
        self.job.escrow_micro = self.available()
        return left


async def settle_ended_job(
    store: Store,
    credits: CreditLedger,
    job: common_pb2.Job,
    donor_of: Callable[[str], str],
    accused: frozenset[str] = frozenset(),
    keep: int = 0,
) -> list[Entry]:
    """Settle an ended job from its stored ledger entries (coordinator/accounting/credit_book.py
    `settlement_entries`): held pay released to its donors (forfeited for ``accused`` nodes),
    the escrow but ``keep`` back to the job's tenant. Posted in the caller's store transaction
    if any; nothing when nothing is left, so a second settlement changes nothing. The entries
    posted (``job.escrow_micro`` follows the escrow)."""
    entries = [e for _, e in await store.list_ledger_entries(job_id=job.job_id)]
    out = settlement_entries(job.job_id, job.owner, entries, donor_of, accused, now_ms(), keep)
    if out:
        await credits.post(out)
    job.escrow_micro = credits.balance(escrow_account(job.job_id))
    return out
