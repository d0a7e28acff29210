"""How a job's rounds aggregate: the strategy a `JobRunner` holds.

The runner owns what every job has (its node set, the epoch ledger, the planner, the writer,
the parameter server that holds its state between rounds); the strategy runs the rounds
themselves: on the parameter server (coordinator/engine/strategies/parameter_server.py) or in a ring of agents
(coordinator/engine/strategies/ring.py). The runner calls the strategy at these points only.
"""

from __future__ import annotations

from typing import Protocol

import torch

from coordinator.rounds.round_state import RoundState
from epochmesh.v1 import agent_pb2, common_pb2


class Aggregation(Protocol):
    # Round records and checkpoints are written while the next round runs (else in line).
    writes_in_background: bool
    # Local SGD rounds may be time-boxed (see RoundPlanner.time_boxed).
    time_boxing: bool

    @property
    def version(self) -> int:
        """The parameter version the job's rounds start from."""
        ...

    async def restored(self, resumed: bool) -> None:
        """The runner restored the job (from its last checkpoint when ``resumed``)."""
        ...

    async def hold_over(self) -> list[str]:
        """Nodes the next round must run on before the runner gathers its nodes anew ([]:
        none; the ring keeps its state before the scheduler takes its members away)."""
        ...

    def cannot_run(self, nodes: list[str]) -> str:
        """Why a round cannot run on ``nodes`` ("" if it can)."""
        ...

    async def run_round(self, nodes: list[str]) -> None:
        """Plan, hand out, wait for, aggregate and close one round on ``nodes``."""
        ...

    def want_checkpoint(self, rs: RoundState) -> bool:
        """Whether the round just applied ends with a checkpoint."""
        ...

    def may_checkpoint(self, last_round: int) -> bool:
        """Whether the runner's parameter server holds the state to checkpoint now."""
        ...

    async def may_finish(self) -> bool:
        """Whether the job may end now (its final state is the runner's); False after a
        roll-back to the last checkpoint."""
        ...

    def on_report(self, req: agent_pb2.ReportProgressRequest) -> None: ...

    def expected_samples(self, node_id: str, task_id: str) -> int | None:
        """The samples an update of the task must carry (None: no update is expected)."""
        ...

    def wants_checkpoint(self, node_id: str, task_id: str) -> bool:
        """Whether a pushed state (UpdateHeader.kind "checkpoint") of this task is expected."""
        ...

    async def submit_checkpoint(
        self, header: agent_pb2.UpdateHeader, tensors: dict[str, torch.Tensor]
    ) -> str:
        """Take a pushed state; returns "" or why it was not taken."""
        ...

    async def parameters_payload(
        self, req: agent_pb2.PullParametersRequest
    ) -> tuple[int, common_pb2.TensorBundle, bytes]:
        """(version, header, payload) for PullParameters."""
        ...

    def authorize_state_transfer(self, source: str, requester: str) -> str | None:
        """Why ``requester`` may not fetch the job's state from ``source`` (None: it may)."""
        ...
