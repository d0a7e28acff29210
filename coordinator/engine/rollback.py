"""A job's verification rollbacks: the pending rollback point, the states kept for it, the floor.

A failed check asks the job's runner (coordinator/engine/job_runner.py) to go back to the state
before a round; the runner does it at its next safe point. `Rollbacks` holds what that needs
between the ask and the safe point: the pending point and its reason, and the state at the
start of recent rounds (snapshots; older states come from checkpoints). The runner applies the
state it finds here; every member is called on the runner's task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch

from coordinator.aggregation.param_server import ParameterServer
from coordinator.engine.api import CoordinatorContext
from coordinator.engine.job_state import checkpoint_state
from coordinator.rounds.ledger import EpochLedger
from coordinator.store.checkpoint import CheckpointManifest, tensors_from_bytes
from coordinator.store.retention import FLOOR_UNKNOWN
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

# States kept in memory for a verification rollback (older ones: from checkpoints).
MAX_SNAPSHOTS = 16

# A state to go back to: the parameters and optimizer state, and its checkpoint manifest.
State = tuple[dict[str, torch.Tensor], CheckpointManifest]


class VerifiedRounds(Protocol):
    """What `Rollbacks` reads of the job's verifier (coordinator/engine/verifier.py)."""

    # A ring job's: the coordinator holds the state only at checkpoints.
    ring: bool

    def first_unverified_round(self) -> int | None:
        """The oldest round with an update that awaits its check (None: none)."""
        ...


class Rollbacks:
    """The job's pending verification rollback and the states kept for it."""

    def __init__(self, verifier: VerifiedRounds) -> None:
        self.verifier = verifier
        self.before: int | None = None  # roll back to before this round at the next safe point
        self.reason = ""
        self._snapshots: dict[int, State] = {}
        self.restored = False  # the runner's restore() done: the rollback floor is known

    def undo_from(self, round_id: int, reason: str) -> None:
        """Roll the job back to before round ``round_id`` at the next safe point (verification
        found it wrong; an earlier pending rollback point is kept)."""
        if self.before is None or round_id < self.before:
            self.before = round_id
            self.reason = reason

    def take(self) -> int:
        """The pending rollback point, no longer pending (its reason stays readable)."""
        before = self.before
        assert before is not None
        self.before = None
        return before

    def floor(self) -> int | None:
        """The oldest round a verification rollback may still undo (read-only; the garbage
        collector keeps the newest checkpoint from before it): None when none may be."""
        if not self.restored:  # what its checks need is not known yet: keep every checkpoint
            return FLOOR_UNKNOWN
        rounds = [self.before, self.verifier.first_unverified_round()]
        return min((r for r in rounds if r is not None), default=None)

    def keep_snapshot(
        self,
        round_id: int,
        ps: ParameterServer,
        ledger: EpochLedger,
        job: common_pb2.Job,
        rounds_applied: int,
    ) -> None:
        """Keep the state at the start of round ``round_id`` while a rollback may need it (a
        copy of the parameters and optimizer state; older ones go once no update after them
        awaits its check; at most MAX_SNAPSHOTS, then checkpoints serve)."""
        if self.verifier.ring:
            return  # ring rounds: the coordinator holds the state only at checkpoints
        self._snapshots[round_id] = checkpoint_state(
            ps, ledger, job, rounds_applied, last_round=round_id - 1
        )
        oldest = self.verifier.first_unverified_round()
        for r in sorted(self._snapshots)[:-1]:
            if (oldest is None or r < oldest) or len(self._snapshots) > MAX_SNAPSHOTS:
                del self._snapshots[r]

    async def state_before(self, ctx: CoordinatorContext, job_id: str, before: int) -> State | None:
        """The newest kept state from before round ``before``: a snapshot, else the stored
        checkpoint (None: there is none)."""
        kept = [r for r in self._snapshots if r <= before]
        if kept:
            return self._snapshots[max(kept)]
        stored = await ctx.store.checkpoint_before(job_id, before)
        if stored is None:
            return None
        manifest = CheckpointManifest.from_bytes(stored[1])
        tensors = tensors_from_bytes(await ctx.blobs.read_bytes(manifest.tensors_sha256))
        return tensors, manifest

    def rolled_back(self, after_round: int) -> None:
        """The job went back to the state after round ``after_round``: the snapshots of later
        states are forgotten."""
        for r in [r for r in self._snapshots if r > after_round + 1]:
            del self._snapshots[r]

    async def announce(
        self, ctx: CoordinatorContext, job_id: str, after_round: int, rolled: int, version: int
    ) -> None:
        """The job went back to the state after round ``after_round`` (``rolled`` rounds undone,
        its parameters now at ``version``): the event and the log line, with the reason."""
        reason = self.reason
        await ctx.events.append(
            "job.rolled_back",
            job_id=job_id,
            message=(
                f"rolled back to the state after round {after_round}: {rolled} round(s) "
                f"undone, their samples are pending again ({reason})"
            )[:1024],
            attrs={
                "after_round": str(after_round),
                "rolled_back": str(rolled),
                "params_version": str(version),
                "reason": reason[:512],
            },
        )
        log.warning(
            "job %s rolled back to after round %d (%d rounds undone): %s",
            job_id,
            after_round,
            rolled,
            reason,
        )


def seat_nodes(ledger: EpochLedger, nodes: list[str], rates: Mapping[str, float]) -> None:
    """Make a ledger restored from an older state know the job's nodes now: the segments of
    nodes gone are given to the others, a node that joined since gets one (at its rate in
    ``rates``, 1.0 when it has none)."""
    for n in [n for n in ledger.nodes if n not in nodes]:
        ledger.fail_node(n)
    for n in [n for n in nodes if n not in ledger.nodes]:
        if ledger.nodes:
            ledger.add_node(n, rates.get(n, 1.0))
        else:
            ledger.assign_segments({n: rates.get(n, 1.0)})
