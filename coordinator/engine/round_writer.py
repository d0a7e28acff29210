"""One job's round records and checkpoints, written to the store in order.

In the background (parameter-server jobs) a closed round's record is written while the next
round runs, each record after the one before, and a checkpoint only after every record it
covers; in line (ring jobs) each is written before the runner goes on. Either way a reader
sees only stored records, so a round it saw survives a crash.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import torch

from coordinator.accounting.credit_book import Entry
from coordinator.engine.api import CoordinatorContext
from coordinator.rounds.round_state import Part, RoundState
from coordinator.store.checkpoint import CheckpointManifest, tensors_to_bytes
from epochmesh.v1 import common_pb2


class RoundWriter:
    def __init__(
        self,
        ctx: CoordinatorContext,
        job: common_pb2.Job,
        *,
        background: bool,
        on_stored: Callable[[], Awaitable[None]],
        on_charged: Callable[[Sequence[Entry]], None] = lambda entries: None,
    ) -> None:
        """``job`` is the runner's job message, stored with every record and checkpoint as it
        is then; ``on_stored`` is awaited after a background record write (watchers hear of
        it); ``on_charged`` is called with a round's ledger entries once they are written
        with its record."""
        self.ctx = ctx
        self.job = job
        self.background = background
        self._on_stored = on_stored
        self._on_charged = on_charged
        # The newest round whose record is in the store (None: not known, e.g. after a restart).
        self.stored_round: int | None = None
        self._pending: tuple[common_pb2.RoundRecord, RoundState, list[Part], list[Entry]] | None = (
            None
        )
        self._record_task: asyncio.Task[None] | None = None
        self._checkpoint_task: asyncio.Task[None] | None = None

    # -- round records ----------------------------------------------------------------------------

    async def add(
        self,
        record: common_pb2.RoundRecord,
        rs: RoundState,
        dropped: list[Part],
        charges: list[Entry] | None = None,
    ) -> None:
        """A closed round's record (and the event for the parts it did without, ``dropped``,
        and the ledger entries that bill it, ``charges``, in the same transaction): in line,
        written now; in the background, written once the next round is out (:meth:`start`),
        after the record before it is stored (waited for here, so that at most one record is
        unwritten when a round is handed out)."""
        if not self.background:
            await self._write(None, record, rs, dropped, charges or [])
            return
        await self.written()
        self._pending = (record, rs, dropped, charges or [])

    def start(self) -> None:
        """Start writing the record :meth:`add` keeps, if any (the round loop calls it right
        after handing out the next round, so that the write does not delay the hand-out)."""
        if self._pending is None:
            return
        record, rs, dropped, charges = self._pending
        self._pending = None
        self._record_task = asyncio.create_task(
            self._write(self._record_task, record, rs, dropped, charges),
            name=f"record-{record.job_id}-{rs.round}",
        )

    async def written(self) -> None:
        """Wait until every closed round's record is in the store (each background write
        waits for the one before, so the latest one done means all are done)."""
        self.start()
        task = self._record_task
        if task is not None:
            await task

    async def _write(
        self,
        previous: asyncio.Task[None] | None,
        record: common_pb2.RoundRecord,
        rs: RoundState,
        dropped: list[Part],
        charges: list[Entry],
    ) -> None:
        if previous is not None:
            await previous
        # No charge without its committed round, no committed round without its charges.
        try:
            async with self.ctx.store.transaction():
                await self.ctx.store.add_round(record)
                await self.ctx.store.update_job(self.job)
                if dropped:
                    await self._record_dropped(rs, dropped)
                if charges:
                    await self.ctx.credits.post(charges)
        except BaseException:
            if charges:
                await self.ctx.credits.reload()
            raise
        self._on_charged(charges)
        self.stored_round = record.round
        if self.background:
            await self._on_stored()

    async def _record_dropped(self, rs: RoundState, dropped: list[Part]) -> None:
        """One event per round that closed without some of its parts (their samples are
        pending again): who, why, the deadline and how long the round waited."""
        samples = sum(p.samples for p in dropped)
        what = "; ".join(f"{p.node_id} {p.status} ({p.error})" for p in dropped)
        await self.ctx.events.append(
            "round.incomplete",
            job_id=self.job.job_id,
            message=(
                f"round {rs.round} closed after {rs.waited_s:.2f}s without {what}; "
                f"their {samples} samples are pending again in epoch {rs.epoch + 1}"
            ),
            attrs={
                "round": str(rs.round),
                "epoch": str(rs.epoch),
                "deadline_s": f"{rs.deadline_s:.3f}",
                "waited_s": f"{rs.waited_s:.3f}",
                "late": ",".join(p.node_id for p in dropped if p.status == "late"),
                "failed": ",".join(p.node_id for p in dropped if p.status != "late"),
                "samples": str(samples),
            },
        )

    # -- checkpoints ----------------------------------------------------------------------------

    async def checkpoint(
        self, tensors: dict[str, torch.Tensor], manifest: CheckpointManifest
    ) -> None:
        """Write a checkpoint of ``tensors`` (a copy nobody changes) now, after any still
        being written, and wait for it."""
        await self.checkpoint_written()
        await self._write_checkpoint(tensors, manifest)

    async def checkpoint_soon(
        self, tensors: dict[str, torch.Tensor], manifest: CheckpointManifest
    ) -> None:
        """In the background: written while the next round runs, after the checkpoint before
        it (a crash before it lands loses the rounds since the previous one, as between any
        two checkpoints). In line: as :meth:`checkpoint`."""
        if not self.background:
            await self.checkpoint(tensors, manifest)
            return
        await self.checkpoint_written()
        self._checkpoint_task = asyncio.create_task(
            self._write_checkpoint(tensors, manifest),
            name=f"checkpoint-{self.job.job_id}-{manifest.round}",
        )

    async def checkpoint_written(self) -> None:
        """Wait for the checkpoint being written in the background, if any (its error, e.g. a
        full disk, is raised here)."""
        task, self._checkpoint_task = self._checkpoint_task, None
        if task is not None:
            await task

    async def _write_checkpoint(
        self, tensors: dict[str, torch.Tensor], manifest: CheckpointManifest
    ) -> None:
        # A checkpoint never lands before the records of the rounds it covers (after a restart
        # from it, every round it holds has its record).
        await self.written()
        data = await asyncio.to_thread(tensors_to_bytes, tensors)
        async with self.ctx.blobs.stored(data) as ref:
            manifest.tensors_sha256 = ref.sha256
            async with self.ctx.store.transaction():
                await self.ctx.store.save_checkpoint(
                    self.job.job_id, manifest.round, manifest.to_bytes()
                )
                await self.ctx.store.update_job(self.job)
