"""A ring job's state between its members and the coordinator: transfers and pushed checkpoints.

The ring's state lives on its members; the coordinator holds a copy only when a member pushes it
(UpdateHeader.kind "checkpoint", after a round that asked for it: `StatePush`). A node that
lacks the round's version fetches it from a member that holds it, and only from one it was sent
to (`StateTransfers`), and only the state that member's ring agreed on (docs/ring-rounds.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from coordinator.aggregation.param_server import ParameterServer
from coordinator.engine.ports import JobPort
from coordinator.engine.strategies.ring_links import slowest_bandwidth
from coordinator.rounds.round_state import RoundState
from epochmesh.errors import CodecError
from epochmesh.optim import (
    OPTIM_PREFIX,
    PARAM_PREFIX,
    build_round_optimizer,
    load_optimizer_state_tensors,
)
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import params_checksum

log = logging.getLogger(__name__)

# The rank-0 member's pushed state is awaited at least this long after the round succeeded.
CHECKPOINT_WAIT_MIN_S = 5.0
# Versions whose agreed state checksums are kept (a joiner fetches a recent one).
AGREED_VERSIONS_KEPT = 8
# How long past its task's deadline a node sent to a peer for state may still fetch it.
STATE_GRANT_GRACE_S = 60.0


class StateTransfers:
    """Which state a member may serve to a node that lacks the round's version, and to whom."""

    def __init__(self) -> None:
        # version -> the checksums (parameters, optimizer state) its ring agreed on: a member
        # serving that version to a joiner must serve exactly that state.
        self.agreed: dict[int, tuple[str, str]] = {}
        # (state holder, node sent there for the state) -> until when the holder may serve it.
        self._grants: dict[tuple[str, str], float] = {}

    def agree(self, version: int, params: str, optim: str) -> None:
        """The ring agreed on ``version`` with these checksums (only recent versions kept)."""
        self.agreed[version] = (params, optim)
        for old in [x for x in self.agreed if x < version - AGREED_VERSIONS_KEPT]:
            del self.agreed[old]

    def send(
        self, task: agent_pb2.Task, node: str, holder: str, address: str, valid_s: float
    ) -> None:
        """Send ``node`` (its ``task``) to ``holder`` (at ``address``) for the task's version."""
        task.state_source_node_id = holder
        task.state_source_address = address
        # What the state must hash to: a holder cannot hand a joiner another state (which
        # would put the joiner, not itself, in the next round's checksum minority).
        agreed = self.agreed.get(int(task.params_version))
        if agreed is not None:
            task.state_params_checksum, task.state_optim_checksum = agreed
        # The holder serves the state only to nodes sent there (AuthorizeStateTransfer),
        # while their task may run.
        now = time.monotonic()
        self._grants = {k: t for k, t in self._grants.items() if t > now}
        self._grants[(holder, node)] = now + valid_s + STATE_GRANT_GRACE_S

    def refusal(self, source: str, requester: str, job_id: str) -> str | None:
        """None when `requester` was told to fetch job ``job_id``'s state from `source` (and
        its task may still run), else why not."""
        expires = self._grants.get((source, requester))
        if expires is None or expires <= time.monotonic():
            return f"node {requester} was not sent to {source} for the state of job {job_id}"
        return None


@dataclass
class PushedState:
    node_id: str
    task_id: str
    version: int
    checksum: str  # of the pushed parameters, computed here
    tensors: dict[str, torch.Tensor]


class StatePush:
    """The state the attempt's push_state member pushes after a round: taken by the RPC side
    (`RingRounds.submit_checkpoint` sets `pushed`), awaited and loaded by the round."""

    def __init__(self) -> None:
        self.pushed: PushedState | None = None

    async def load(
        self, runner: JobPort, rs: RoundState, node: str, agreed: str, version: int
    ) -> bool:
        """Wait for the rank-0 member's pushed state and load it into the ParameterServer."""
        bandwidth = slowest_bandwidth(runner.bench, [node])
        timeout = max(CHECKPOINT_WAIT_MIN_S, 4.0 * 2 * runner.ps.num_bytes() / bandwidth)
        end = time.monotonic() + timeout
        while self.pushed is None and not runner.stopping:
            left = end - time.monotonic()
            if left <= 0 or runner.host.is_silent(node):
                break
            rs.changed.clear()
            try:
                await asyncio.wait_for(rs.changed.wait(), timeout=min(left, 0.25))
            except TimeoutError:
                pass
        pushed, self.pushed = self.pushed, None
        if pushed is None:
            log.warning(
                "job %s round %d: %s did not push its state; asking again next round",
                runner.job_id,
                rs.round,
                node,
            )
            return False
        if pushed.version != version or pushed.checksum != agreed:
            await runner.ctx.events.append(
                "round.checkpoint_refused",
                node_id=node,
                job_id=runner.job_id,
                message=(
                    f"the state {node} pushed after round {rs.round} (version {pushed.version}, "
                    f"checksum {pushed.checksum[:16]}) is not the agreed one (version {version}, "
                    f"checksum {agreed[:16]}); asking again next round"
                ),
            )
            return False
        await asyncio.to_thread(runner.ps.load_state_tensors, pushed.tensors, version)
        return True


def check_pushed_state(
    tensors: dict[str, torch.Tensor], ps: ParameterServer, spec: common_pb2.JobSpec
) -> tuple[dict[str, torch.Tensor], str]:
    """Validate a pushed state against the job's parameters (``ps``) and round optimizer
    (names, dtypes, shapes; the optimizer state must load); returns the parameters and their
    checksum. CodecError otherwise."""
    expected = ps.expected()
    params: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in expected.items():
        t = tensors.get(PARAM_PREFIX + name)
        if t is None:
            raise CodecError(f"the state lacks parameter {name!r}")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise CodecError(
                f"parameter {name!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}"
            )
        params[name] = t
    optim: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.startswith(PARAM_PREFIX):
            if key[len(PARAM_PREFIX) :] not in expected:
                raise CodecError(f"the state holds an unknown parameter {key!r}")
        elif key.startswith(OPTIM_PREFIX):
            optim[key[len(OPTIM_PREFIX) :]] = t
        else:
            raise CodecError(f"state tensor {key!r} is neither param/<name> nor optim/<key>")
    scratch = [torch.nn.Parameter(p.detach().clone()) for p in params.values()]
    try:
        load_optimizer_state_tensors(build_round_optimizer(spec, scratch), list(params), optim)
    except ValueError as exc:
        raise CodecError(f"optimizer state refused: {exc}") from None
    return params, params_checksum(params)
