"""A job's pay as its runner moves it: held pay released, forfeited and settled, the escrow topped up and refunded.

`JobPay` wraps the job's `JobBilling` (coordinator/market/job_billing.py) for the runner
(coordinator/engine/job_runner.py): each move waits for the round entries that hold the pay
where it must, records the job and its event, and logs a failure instead of failing the job
(a move that fails leaves the pay where it was). Every member is called on the runner's task.
"""

from __future__ import annotations

import logging
from collections.abc import Set

from coordinator.engine.api import CoordinatorContext
from coordinator.engine.round_writer import RoundWriter
from coordinator.market.job_billing import JobBilling
from epochmesh.money import format_credits
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)


class JobPay:
    """The job's pay moves, on its `JobBilling`, with their records and events."""

    def __init__(
        self,
        ctx: CoordinatorContext,
        job: common_pb2.Job,
        billing: JobBilling,
        writer: RoundWriter,
    ) -> None:
        self.ctx = ctx
        self.job = job
        self.job_id = job.job_id
        self.billing = billing
        self.writer = writer

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
