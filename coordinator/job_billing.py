"""One job's side of the market: what its rounds cost and where the credits go.

At hand-out every part gets its node's price and the node's measured samples/s for the job
(kept in the round record, so that a statement can be recomputed from the rounds); a round is
handed out only if the job's escrow covers what it could cost (every part applied, no re-run);
when the round closes its applied parts are charged by the billing rule (coordinator/billing.py)
and the entries are written in the round record's own transaction (coordinator/round_writer.py).
The submitter pays each sample of an epoch once: a sample it paid for in a round that a
coordinator restart rolled back is re-run at the platform's expense.

The price cap: a job with `[market] max_price` uses no node asking more; a job without it uses
any node if it has a budget, else only donated ones (no budget: it pays nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from coordinator.billing import BilledSamples, PartCharge, charge_part, earned_micro
from coordinator.credit_book import (
    Entry,
    escrow_account,
    fund_escrow,
    round_entries,
    tenant_account,
)
from coordinator.credit_ledger import CreditLedger
from coordinator.rounds import Part
from coordinator.store import Store
from epochmesh.money import format_credits
from epochmesh.quote import max_price_of
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

RATE_QUANTUM = 1_000_000  # billed rates are kept to micro-samples per second


class BudgetExhausted(Exception):
    """The job's escrow does not cover its next round."""


class AboveMaxPrice(Exception):
    """Nodes of the round ask more than the job's max_price now (a donor raised its price)."""

    def __init__(self, nodes: list[str]) -> None:
        super().__init__(f"nodes above the job's max_price: {', '.join(nodes)}")
        self.nodes = nodes


def per_credit(spec: common_pb2.JobSpec) -> bool:
    """Whether the job prefers samples/s per credit (a budget, no deadline) to speed."""
    return spec.budget_micro > 0 and not spec.HasField("deadline_seconds")


def quantized_rate(rate: float) -> float:
    return round(rate * RATE_QUANTUM) / RATE_QUANTUM if rate > 0 else 0.0


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
        back too: a round record and its charges are written together); what it spent."""
        entries = await store.list_ledger_entries(job_id=self.job_id)
        self.job.spent_micro = sum(
            e.amount for _, e in entries if e.from_account == self.escrow and e.reason != "refund"
        )
        self.job.escrow_micro = self.available()
        for r in rounds:
            for p in r.parts:
                if p.status == "applied":
                    runs = np.array([(x.start, x.stop) for x in p.ranges], dtype=np.int64)
                    self.billed.mark(r.epoch, runs.reshape(-1, 2))

    # -- hand-out -------------------------------------------------------------------------------

    def price_parts(
        self, parts: Mapping[str, Part], prices: Mapping[str, int], rates: Mapping[str, float]
    ) -> None:
        """Fix each part's price and billed rate at hand-out; AboveMaxPrice when a node asks
        more than the job's max_price; BudgetExhausted when the escrow does not cover the round
        should every part be applied."""
        cap = max_price_of(self.job.spec)
        dear = sorted(n for n in parts if cap is not None and prices.get(n, 0) > cap)
        if dear:
            raise AboveMaxPrice(dear)
        for node_id, part in parts.items():
            part.price = int(prices.get(node_id, 0))
            part.rate = quantized_rate(float(rates.get(node_id, 0.0)))
        bound = 0
        for part in parts.values():
            earned = earned_micro(part.price, part.assigned or part.samples, part.rate)
            bound += earned + earned * self.fee_ppm // 1_000_000
        available = self.available()
        if bound > available:
            raise BudgetExhausted(
                f"budget: the next round could cost {format_credits(bound)} credits and the "
                f"job's escrow holds {format_credits(max(0, available))}; add to it with "
                f"`epochmesh budget {self.job_id} --add CREDITS`"
            )

    # -- round close ----------------------------------------------------------------------------

    def charge_round(self, epoch: int, round_id: int, parts: Iterable[Part]) -> list[Entry]:
        """The entries that bill a closed round's applied parts (marks their samples paid);
        counted as pending until :meth:`written`."""
        charges: list[PartCharge] = []
        for p in parts:
            if p.status != "applied" or p.samples <= 0:
                continue
            new, repeat = self.billed.split(epoch, p.ranges)
            charges.append(
                charge_part(
                    p.node_id,
                    self.donor_of(p.node_id),
                    p.price,
                    p.rate,
                    new + repeat,
                    repeat,
                    self.fee_ppm,
                )
            )
            self.billed.mark(epoch, p.ranges)
        entries = round_entries(self.job_id, round_id, charges, now_ms())
        taken = sum(e.amount for e in entries if e.from_account == self.escrow)
        self._pending += taken
        self.job.spent_micro += taken
        self.job.escrow_micro = self.available()
        return entries

    def written(self, entries: Iterable[Entry]) -> None:
        self._pending -= sum(e.amount for e in entries if e.from_account == self.escrow)

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
