"""Rounds aggregated on the coordinator's parameter server (aggregation = "ps"): every node
computes its part from the same parameters and pushes its gradient (or local SGD's
pseudo-gradient); the round applies their sample-weighted mean in one optimizer step
(docs/job-rounds.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import torch

from coordinator.core.errors import FailedPreconditionError
from coordinator.engine.ports import JobPort
from coordinator.rounds.round_state import MAX_DEADLINE_EXTENSIONS, RoundState
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import encode_bundle

log = logging.getLogger(__name__)

# A round's apply (aggregation, optimizer step, encoding the new parameters) that takes less
# than this runs on the event loop: handing it to a worker thread and back costs 1-3 ms on a
# busy host (measured: most of the time between a small model's last update and the next
# round). Longer ones go to a thread, so that the event loop keeps serving. Judged by the
# last apply; the first one by the parameters' size at APPLY_SECONDS_PER_BYTE, ten times the
# ~2 ns per byte measured here for SGD with momentum plus encoding (a 77 KB model: 0.18 ms).
INLINE_APPLY_MAX_S = 0.002
APPLY_SECONDS_PER_BYTE = 20e-9


class ParameterServerRounds:
    """`coordinator.engine.strategy.Aggregation` for aggregation = "ps" (see the module)."""

    writes_in_background = True
    time_boxing = True

    def __init__(self, runner: JobPort) -> None:
        self.runner = runner
        self._apply_s: float | None = None  # the last round's apply took (see INLINE_APPLY_MAX_S)

    async def restored(self, resumed: bool) -> None:
        return None

    async def hold_over(self) -> list[str]:
        return []

    def may_checkpoint(self, last_round: int) -> bool:
        return True

    async def may_finish(self) -> bool:
        return True

    def on_report(self, req: agent_pb2.ReportProgressRequest) -> None:
        """Only failures matter here (updates come with PushUpdate)."""
        self.runner.on_failure_report(req)

    def expected_samples(self, node_id: str, task_id: str) -> int | None:
        return self.runner.part_samples(node_id, task_id)

    async def parameters_payload(
        self, req: agent_pb2.PullParametersRequest
    ) -> tuple[int, common_pb2.TensorBundle, bytes]:
        if req.external_round:
            raise FailedPreconditionError(
                "external_round is for ring jobs; this job aggregates on the parameter server"
            )
        return await self.runner.serve_parameters(req)

    def authorize_state_transfer(self, source: str, requester: str) -> str | None:
        return f"job {self.runner.job_id!r} does not transfer state between agents"

    async def run_round(self, nodes: list[str]) -> None:
        if self.runner.ledger.complete:
            await self.runner.next_epoch()
            return
        round_id, parts, deadline = self.runner.plan_parts(nodes)
        await self.runner.ensure_params_payload()
        self.runner.verifier.round_started(self.version, self.runner.params_payload)
        rs = RoundState(
            round=round_id,
            epoch=self.runner.ledger.epoch,
            version=self.version,
            deadline_s=deadline,
            parts=parts,
        )
        self.runner.round_state = rs
        for node_id, part in parts.items():
            part.handed_out = time.monotonic()
            self.runner.host.enqueue(node_id, self.runner.train_task(rs, part), self.runner.job_id)
        await self.runner.notify()
        self.runner.writer.start()  # the previous round's record, now that this one is out
        # Wait for every awaited node (a failure, silence, or the deadline ends the wait for
        # it). Silence is checked a few times per heartbeat interval (not on every wake-up:
        # O(parts) per check).
        end = rs.started + deadline
        check_every = max(0.02, self.runner.ctx.registry.heartbeat_interval_s / 4)
        next_check = rs.started + check_every
        extensions = 0
        while rs.awaited():
            now = time.monotonic()
            left = end - now
            if left <= 0 or self.runner.stopping:
                if self.runner.stopping or not self._extend_deadline(rs, extensions):
                    break
                extensions += 1
                end += deadline
                rs.deadline_s += deadline
                continue
            if now >= next_check:
                self.runner.fail_silent(rs)
                next_check = now + check_every
                if not rs.awaited():
                    break
            rs.changed.clear()
            try:
                # A timeout scope, not wait_for: no task to create and wake per update.
                async with asyncio.timeout(min(left, next_check - now)):
                    await rs.changed.wait()
            except TimeoutError:
                continue  # the deadline or a silence check is due: the loop looks again
        rs.closed = True
        waited = time.monotonic() - rs.started
        rs.waited_s = waited
        for part in rs.outstanding():
            part.status = "late"
            part.error = (
                f"missed the {rs.deadline_s:.2f}s deadline"
                if part.required
                else f"best effort (a share below one sample): not done after {waited:.2f}s"
            )
            self.runner.planner.mark_late(part, waited)
        if self.runner.stopping:
            self.runner.ledger.abort_round(round_id)
            self.runner.round_state = None
            return
        await self._apply_round(rs)

    def _extend_deadline(self, rs: RoundState, extensions: int) -> bool:
        """At the deadline: whether to wait once more as long. Only when no node of the round
        has delivered and none failed or fell silent: a deadline that every node misses says
        that the estimates were wrong (a first round loads programs and data; a benchmark
        without optimizer steps flatters local SGD's inner steps), not that someone lags, and
        closing the round would only throw all of its work away. The late figures feed the
        estimates, so the next deadlines fit."""
        if extensions >= MAX_DEADLINE_EXTENSIONS:
            return False
        parts = list(rs.parts.values())
        if any(p.status != "pending" for p in parts if p.required):
            return False
        live = [p for p in parts if p.required and not self.runner.host.is_silent(p.node_id)]
        if not live:
            return False
        log.info(
            "job %s round %d: no node delivered within the %.2fs deadline; waiting as long "
            "again (%d of %d)",
            self.runner.job_id,
            rs.round,
            rs.deadline_s,
            extensions + 1,
            MAX_DEADLINE_EXTENSIONS,
        )
        return True

    async def _apply_round(self, rs: RoundState) -> None:
        t0 = time.monotonic()
        received = sorted(
            (p for p in rs.parts.values() if p.status == "received"), key=lambda p: p.node_id
        )
        # Screening (coordinator/engine/verifier.py): a node whose update lies far from the others'
        # robust centre has its next part checked.
        for p, why in self.runner.verifier.screen(received):
            log.info(
                "job %s round %d: screening flagged %s (%s); its next part is checked",
                self.runner.job_id,
                rs.round,
                p.node_id,
                why,
            )
        if received:
            contributions: list[tuple[int, Mapping[str, torch.Tensor]]] = [
                (p.samples, p.grads or {}) for p in received
            ]

            def apply() -> tuple[int, tuple[common_pb2.TensorBundle, bytes], float]:
                # With the next round's parameter payload (every round needs it: inline in its
                # tasks, or served by PullParameters).
                began = time.perf_counter()
                self.runner.ps.apply(contributions)
                payload = encode_bundle(self.runner.ps.snapshot())
                return self.runner.ps.version, payload, time.perf_counter() - began

            if self._apply_s is None:
                self._apply_s = self.runner.ps.num_bytes() * APPLY_SECONDS_PER_BYTE
            if self._apply_s <= INLINE_APPLY_MAX_S:
                version, payload, self._apply_s = apply()
            else:
                version, payload, self._apply_s = await asyncio.to_thread(apply)
            self.runner.params_payload_version, self.runner.params_payload = version, payload
            for p in received:
                p.status = "applied"
                p.grads = None
        await self.runner.close_round(rs, t0)

    def want_checkpoint(self, rs: RoundState) -> bool:
        """Whether the round just applied ends with a checkpoint (every K applied rounds)."""
        return (
            self.runner.spec.checkpoint_every > 0
            and self.runner.rounds_applied % self.runner.spec.checkpoint_every == 0
        )

    def cannot_run(self, nodes: list[str]) -> str:
        """Why a round cannot run on ``nodes`` (enough of them, benchmarked, live): "" if it
        can. The job is PAUSED with this message meanwhile."""
        return ""

    @property
    def version(self) -> int:
        """The parameter version the job's rounds start from (the parameter server's)."""
        return self.runner.ps.version

    def wants_checkpoint(self, node_id: str, task_id: str) -> bool:
        """Whether a pushed state (UpdateHeader.kind "checkpoint") of this task is expected."""
        return False

    async def submit_checkpoint(
        self, header: agent_pb2.UpdateHeader, tensors: dict[str, torch.Tensor]
    ) -> str:
        """Take a pushed state; returns "" or why it was not taken."""
        return "this job takes no checkpoints from nodes"
