"""Ports: what the round strategies and the verifier see of the job runner.

The runner (coordinator/engine/job_runner.py) holds a round strategy
(coordinator/engine/strategies/) and a `Verifier` (coordinator/engine/verifier.py); they call
back into it for the job's state and for what only the runner does (planning, task building,
closing a round, rollbacks). They see it through these protocols, never through the concrete
`JobRunner`, so that imports run one way: job_runner -> strategies, verifier -> ports. The
ring-only calls the verifier makes on the ring strategy go through `RingStatePort`, which the
runner hands it for a ring job (there is no such state in a parameter-server job).

Everything here is called on the job's runner task (or an RPC handler on the same event loop):
no member needs a lock.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from coordinator.aggregation.param_server import ParameterServer
from coordinator.engine.api import CoordinatorContext
from coordinator.engine.host import RunnerHost
from coordinator.engine.round_writer import RoundWriter
from coordinator.rounds.ledger import EpochLedger
from coordinator.rounds.node_set import JobNodeSet
from coordinator.rounds.planner import RoundPlanner
from coordinator.rounds.round_state import Part, RoundState
from epochmesh.v1 import agent_pb2, common_pb2

# An encoded parameter state: (bundle header, payload), as `encode_bundle` returns it.
Payload = tuple[common_pb2.TensorBundle, bytes]


class VerifierPort(Protocol):
    """What the round strategies call on the job's verifier (coordinator/engine/verifier.py),
    reached as `JobPort.verifier`: the verifier depends on neither."""

    def round_started(self, version: int, payload: Payload | None) -> None:
        """A parameter-server round starts from parameters ``version`` (encoded: ``payload``),
        called once its parts are planned, before they are handed out."""
        ...

    def screen(self, received: list[Part]) -> list[tuple[Part, str]]:
        """Screen a round's received updates before they are applied (called once per
        parameter-server round); returns the flagged ones with the reason."""
        ...

    @property
    def ring_disputes(self) -> dict[str, set[str]]:
        """Ring members -> the right neighbours they must not get (disputed hops), read when
        an attempt's ring is formed."""
        ...

    def ring_attempt_applied(self, round_id: int, attempt: int) -> None:
        """Ring round ``round_id`` was applied as its attempt ``attempt`` computed it (called
        once the round's members agreed, before it closes)."""
        ...


@runtime_checkable
class RingStatePort(Protocol):
    """The ring strategy's state the verifier reads (coordinator/engine/strategies/ring.py
    implements it; the runner hands its strategy to the verifier when the strategy is one):
    the verifier never imports the strategy."""

    def ring_codec(self) -> str:
        """The codec of the ring's all-reduce (what the members' evidence of a hop is judged
        under), read when an attempt's audit is drawn."""
        ...

    async def agreed_params_checksum(self, version: int) -> str | None:
        """The checksum of the parameters of ``version`` (its ring's agreed one, else the
        coordinator's own when it holds that version; None when neither is known), read when a
        checked member uploads the parameters its part started from."""
        ...


class JobPort(Protocol):
    """What the round strategies and the verifier use of their job's runner
    (coordinator/engine/job_runner.py). The runner makes both and passes itself in; they hold
    it as this port."""

    # -- the job and what the coordinator gives it --------------------------------------------
    job_id: str
    ctx: CoordinatorContext

    @property
    def host(self) -> RunnerHost:
        """The engine's side of the runner (task queues, node ownership, silence)."""
        ...

    @property
    def job(self) -> common_pb2.Job:
        """The job's record (the strategies update its parameter version)."""
        ...

    @property
    def spec(self) -> common_pb2.JobSpec: ...

    # -- the job's state, owned by the runner --------------------------------------------------
    @property
    def ps(self) -> ParameterServer:
        """The parameter server that holds the job's state between rounds."""
        ...

    @property
    def ledger(self) -> EpochLedger:
        """The epoch ledger (replaced on restore and at an epoch's end: read it anew)."""
        ...

    @property
    def planner(self) -> RoundPlanner: ...

    @property
    def node_set(self) -> JobNodeSet: ...

    @property
    def writer(self) -> RoundWriter: ...

    @property
    def verifier(self) -> VerifierPort: ...

    @property
    def bench(self) -> dict[str, common_pb2.BenchmarkResult]:
        """The nodes' benchmarks on this job's program."""
        ...

    @property
    def nodes(self) -> list[str]:
        """The job's node set, in join order."""
        ...

    @property
    def rounds_applied(self) -> int: ...

    @property
    def stop_requested(self) -> asyncio.Event:
        """Set when the coordinator stops (waits end early on it)."""
        ...

    @property
    def stopping(self) -> bool:
        """The runner is asked to stop: end the open round."""
        ...

    # The open round (set by the strategy that opens it, None between rounds), the encoded
    # parameters of the newest version and that version (set by a round's apply), and the next
    # round number (raised past the persisted mark of a restarted ring job).
    round_state: RoundState | None
    params_payload: Payload | None
    params_payload_version: int
    next_round: int

    # -- what only the runner does, called by a strategy's round ------------------------------
    def plan_parts(self, nodes: list[str]) -> tuple[int, dict[str, Part], float]:
        """Plan the next round on ``nodes``: (round number, parts by node, deadline)."""
        ...

    def train_task(self, rs: RoundState, part: Part) -> agent_pb2.Task:
        """The TRAIN task of ``part`` of ``rs`` (the strategy adds its own fields)."""
        ...

    async def ensure_params_payload(self) -> None:
        """Encode the parameter server's current version into `params_payload` if it is not."""
        ...

    async def notify(self) -> None:
        """Wake the job's watchers (a round was handed out or ended)."""
        ...

    def fail_silent(self, rs: RoundState) -> None:
        """Fail the pending parts of nodes that stopped heartbeating (checked while a round
        waits)."""
        ...

    async def close_round(self, rs: RoundState, t0: float) -> None:
        """Commit the round's applied parts, record it, checkpoint when due (called once per
        round that applies; ``t0``: when its apply began)."""
        ...

    async def next_epoch(self) -> None:
        """The ledger's epoch is complete: start the next one (instead of a round)."""
        ...

    async def restore(self) -> None:
        """Back to the last checkpoint (a ring job's rollback)."""
        ...

    async def fail(self, message: str) -> None:
        """The job fails with ``message`` (replicas diverged beyond repair)."""
        ...

    def benchmark_task_ids(self) -> set[str]:
        """The job's open benchmark tasks (kept when a round that did not apply ends)."""
        ...

    def round_seconds(self) -> float:
        """How long the job's rounds take lately (0 before the first one closed)."""
        ...

    # -- RPC-side, called by a strategy's `on_report` / `parameters_payload` -----------------
    def on_failure_report(self, req: agent_pb2.ReportProgressRequest) -> None:
        """ReportProgress of one of the job's tasks that failed (else nothing to do)."""
        ...

    def on_job_fault(self, node_id: str, task_id: str, error: str) -> None:
        """A node says one of its tasks failed by the job's own fault."""
        ...

    def note_failure(self, node_id: str, error: str) -> None:
        """Count a failed task against the node (excluded after too many in a row)."""
        ...

    def part_samples(self, node_id: str, task_id: str) -> int | None:
        """The samples of the task's open part (None: not an open part)."""
        ...

    async def serve_parameters(
        self, req: agent_pb2.PullParametersRequest
    ) -> tuple[int, common_pb2.TensorBundle, bytes]:
        """(version, header, payload) of the parameter server's state for PullParameters."""
        ...

    # -- called by the verifier --------------------------------------------------------------
    def check_task(
        self,
        task_id: str,
        round_id: int,
        version: int,
        runs: npt.NDArray[np.int64],
        check: agent_pb2.CheckSpec,
        payload: Payload | None,
        local_batch: int = 0,
    ) -> agent_pb2.Task:
        """A CHECK task recomputing ``runs`` of a part of ``round_id`` from ``version``."""
        ...

    def undo_from(self, round_id: int, reason: str) -> None:
        """Roll the job back to before round ``round_id`` at the next safe point."""
        ...

    async def release_pay(self, node_id: str, up_to_round: int) -> None:
        """A check vouched for the node's parts up to ``up_to_round``: release their pay."""
        ...

    async def on_verification_failed(
        self, node_id: str, first_round: int | None, reason: str, *, accuse: bool
    ) -> None:
        """A check of ``node_id`` failed: discard its open part, undo its unverified rounds
        (from ``first_round``), forfeit its held pay; ``accuse``: it leaves the job."""
        ...
