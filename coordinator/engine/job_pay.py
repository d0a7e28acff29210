"""A job's pay as its runner moves it: held pay released, forfeited and settled, the escrow topped up and refunded.

`JobPay` wraps the job's `JobBilling` (coordinator/market/job_billing.py) for the runner
(coordinator/engine/job_runner.py): each move waits for the round entries that hold the pay
where it must, records the job and its event, and logs a failure instead of failing the job
(a move that fails leaves the pay where it was). Every member is called on the runner's task,
but `record_end`, which a cancel calls on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence, Set

from coordinator.accounting.billing import standing_rate
from coordinator.accounting.credit_book import REFUND, RELEASED, Entry, held_account
from coordinator.engine.api import CoordinatorContext
from coordinator.engine.round_writer import RoundWriter
from coordinator.market.job_billing import JobBilling, settle_ended_job
from coordinator.nodes.kinds import node_kind
from coordinator.rounds.claims import reference_floor
from coordinator.rounds.planner import RoundPlanner
from epochmesh.money import format_credits
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

JS = common_pb2.JobState
TERMINAL = (JS.JOB_STATE_SUCCEEDED, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED)


class JobPay:
    """The job's pay moves, on its `JobBilling`, with their records and events."""

    def __init__(
        self,
        ctx: CoordinatorContext,
        job: common_pb2.Job,
        billing: JobBilling,
        writer: RoundWriter,
        planner: RoundPlanner | None = None,
    ) -> None:
        """``planner``: the job's, whose claims get their device model's reference floor from
        here (`reference_floor`)."""
        self.ctx = ctx
        self.job = job
        self.job_id = job.job_id
        self.billing = billing
        self.writer = writer
        # Held while the job's end is recorded and settled (`record_end`), and by the runner's
        # last settlement (`settle_at_exit`), which then finds the end's money moved.
        self._ending = asyncio.Lock()
        if planner is not None:
            planner.reference_of = self.reference_floor

    def reference_floor(self, node_id: str) -> float:
        """The samples/s below which ``node_id``'s claims are not believed: the reference floor
        of its device model over the registered nodes (coordinator/rounds/claims.py)."""
        info = self.ctx.registry.get(node_id)
        if info is None:
            return 0.0
        kind = node_kind(info)
        refs = [
            n.benchmark.samples_per_second
            for n in self.ctx.registry.list()
            if node_kind(n) == kind or n.node_id == node_id
        ]
        return reference_floor(refs)

    async def release(self, node_id: str, up_to_round: int) -> None:
        """A check vouched for ``node_id``'s parts up to ``up_to_round``: the pay held for
        them goes to its donor (coordinator/market/job_billing.py)."""
        try:
            await self.writer.written()  # the entries that hold it first
            await self.billing.release(node_id, up_to_round)
        except Exception:
            log.exception("job %s: %s's held pay could not be released", self.job_id, node_id)

    async def settle(self, accused: Set[str]) -> None:
        """The job ended: pay held for nodes no check found wrong goes to their donors; what
        is still held for a node a check found wrong (``accused``: a part of it applied after
        its check failed, then undone) is forfeited."""
        try:
            for node_id in accused:
                await self.billing.forfeit(node_id)
            await self.billing.release_all(except_nodes=accused)
        except Exception:
            log.exception("job %s: held pay could not be settled", self.job_id)

    async def forfeit(self, node_id: str, reason: str) -> None:
        """A check of ``node_id`` failed (``reason``): the pay held for its unverified parts is
        forfeited, once the entries that hold it are stored."""
        try:
            await self.writer.written()
            forfeited = await self.billing.forfeit(node_id)
        except Exception:
            log.exception("job %s: %s's held pay could not be forfeited", self.job_id, node_id)
            forfeited = 0
        if forfeited:
            await self.ctx.events.append(
                "node.pay_forfeited",
                node_id=node_id,
                job_id=self.job_id,
                message=f"{format_credits(forfeited)} credits held for its unverified parts "
                f"forfeited: {reason}"[:1024],
                attrs={"amount_micro": str(forfeited)},
            )

    async def settle_ended(self, accused: Set[str]) -> None:
        """The job reaches its terminal state: called inside ``billing.settling()`` and the
        store transaction that records it (`record_end`), so that the state and the money
        move together (a crash leaves both or neither): held pay to the donors (an
        ``accused`` node's forfeited), the escrow back to the tenant but what a round in
        flight could still cost, each with its event. Raises (the caller's transaction fails
        and the ledger is read back)."""
        posted = await self.billing.settle_ended(self.ctx.store, accused)
        await settlement_events(self.ctx, self.job, posted)

    async def record_end(self, previous: int, accused: Set[str]) -> None:
        """Store the job's terminal state (set on ``job``, from ``previous``), its event and
        its settlement (`settle_ended`) in one store transaction: a crash leaves the job live
        with its escrow, or ended and settled (what a round in flight kept back is settled by
        the runner's end or the start-up sweep). On failure the state goes back to
        ``previous``, the ledger is read back, and the error is raised."""
        store = self.ctx.store
        try:
            # The billing's lock before the store's (as a release or a forfeit takes them).
            async with self._ending, self.billing.settling(), store.transaction():
                await self.settle_ended(accused)
                await store.update_job(self.job)
                name = JS.Name(self.job.state).removeprefix("JOB_STATE_").lower()
                await self.ctx.events.append(
                    f"job.{name}", job_id=self.job_id, message=self.job.message or f"job is {name}"
                )
        except BaseException:
            self.job.state = previous  # type: ignore[assignment]
            await self.ctx.credits.reload()
            raise

    async def settle_at_exit(self, accused: Set[str]) -> None:
        """The runner's last step: once a recording of the job's end in progress is done
        (`record_end`: a cancel's, on another task), an ended job's held pay is settled and
        its escrow refunded (`settle`, `refund`). Without the wait the two computed the same
        refund, one from the store as it was and one from the ledger as it had become, and
        the cancel failed."""
        async with self._ending:
            if self.job.state in TERMINAL:
                await self.settle(accused)
                await self.refund()

    async def top_up(self, amount: int) -> None:
        """Top the escrow up by ``amount`` from the tenant (InsufficientCredits when short)."""
        await self.billing.top_up(amount)
        await self.ctx.store.update_job(self.job)
        await self.ctx.events.append(
            "job.budget",
            job_id=self.job_id,
            message=f"budget topped up by {format_credits(amount)} credits",
            attrs={"amount_micro": str(amount)},
        )

    async def refund(self) -> None:
        """The job ended: what is left in its escrow returns to its tenant."""
        try:
            left = await self.billing.refund()
        except Exception:
            log.exception("job %s: its escrow could not be refunded", self.job_id)
            return
        if left:
            await self.ctx.store.update_job(self.job)
            await self.ctx.events.append(
                "job.refund",
                job_id=self.job_id,
                message=f"{format_credits(left)} credits left in the escrow returned to "
                f"{self.job.owner or 'its tenant'}",
                attrs={"amount_micro": str(left)},
            )


async def settlement_events(
    ctx: CoordinatorContext, job: common_pb2.Job, posted: Sequence[Entry]
) -> None:
    """The events of an ended job's settlement (`settle_ended_job`'s entries): the held pay
    released and forfeited, the refund."""
    held = held_account(job.job_id)
    released = sum(e.amount for e in posted if e.from_account == held and e.reason == RELEASED)
    forfeited = sum(e.amount for e in posted if e.from_account == held and e.reason != RELEASED)
    refunded = sum(e.amount for e in posted if e.reason == REFUND)
    if released or forfeited:
        await ctx.events.append(
            "job.pay_settled",
            job_id=job.job_id,
            message=f"the job ended: {format_credits(released)} credits of held pay released "
            f"to its donors, {format_credits(forfeited)} forfeited",
            attrs={"released_micro": str(released), "forfeited_micro": str(forfeited)},
        )
    if refunded:
        await ctx.events.append(
            "job.refund",
            job_id=job.job_id,
            message=f"{format_credits(refunded)} credits left in the escrow returned to "
            f"{job.owner or 'its tenant'}",
            attrs={"amount_micro": str(refunded)},
        )


def unobserved_standing(
    planner: RoundPlanner, nodes: Sequence[str], members: Collection[str]
) -> dict[str, float]:
    """The ``nodes`` no round of the job observed yet, each with the rate the coordinator can
    stand behind for it (coordinator/accounting/billing.py `standing_rate`: the job's observed
    nodes, else the other ``members``' benchmark claims, never below its device model's
    reference floor): its own claim bounds its pay only from above."""
    est = planner.estimator
    observed = {n: est.estimate(n) for n in est.nodes if est.observations(n) > 0}
    out = {}
    for n in nodes:
        if n in observed or n not in est:
            continue
        claims = [r.samples_per_second for m, r in planner.bench.items() if m != n and m in members]
        seen = [r for m, r in observed.items() if m != n]
        out[n] = standing_rate(seen, claims, planner.reference_of(n))
    return out


AccusedOf = Callable[[str], Awaitable[frozenset[str]]]


async def settle_ended_jobs(ctx: CoordinatorContext, accused_of: AccusedOf) -> None:
    """The start-up sweep: an ended job with money still in its escrow or held account (a
    crash between its end and its settlement, or a round in flight at its end) is settled now,
    as its runner would have (``accused_of``: the nodes a job's stored verification accuses);
    settled once, a second sweep finds nothing."""
    balances = await ctx.store.ledger_balances()
    job_ids = sorted(
        {
            account.split(":", 1)[1]
            for account, balance in balances.items()
            if balance > 0 and account.startswith(("escrow:", "held:"))
        }
    )
    for job_id in job_ids:
        job = await ctx.store.get_job(job_id)
        if job is not None and job.state in TERMINAL:
            await settle_ended(ctx, job, await accused_of(job_id))


async def settle_ended(
    ctx: CoordinatorContext, job: common_pb2.Job, accused: frozenset[str]
) -> None:
    """Settle an ended job that has no runner (coordinator/market/job_billing.py
    `settle_ended_job`; ``accused``, the nodes its stored verification accuses, forfeit their
    held pay) and
    store its record, in one transaction; a failure is logged (the next start-up sweep tries
    again)."""
    store = ctx.store
    try:
        async with store.transaction():
            posted = await settle_ended_job(store, ctx.credits, job, ctx.registry.donor_of, accused)
            await store.update_job(job)
            await settlement_events(ctx, job, posted)
    except Exception:
        log.exception("job %s: its escrow and held pay could not be settled", job.job_id)
        await ctx.credits.reload()
        return
    if posted:
        log.info("job %s ended: %d settlement entries posted", job.job_id, len(posted))
