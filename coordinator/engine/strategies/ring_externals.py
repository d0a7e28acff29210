"""The externals' sum of a ring attempt: what its gateway member adds to the all-reduce.

External nodes (agents without a PeerService) push their updates to the coordinator; the
attempt's gateway pulls their weighted sum (PullParametersRequest.external_round) and adds it
as its own addend (docs/ring-rounds.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from coordinator.aggregation.param_server import ParameterServer
from coordinator.core.errors import AbortedError, FailedPreconditionError
from coordinator.engine.ports import JobPort
from coordinator.rounds.ring_verdicts import DEAD, RingAttempt
from coordinator.rounds.round_state import Part
from epochmesh.v1 import agent_pb2, common_pb2
from epochmesh.wire.tensors import encode_bundle


async def external_sum(
    runner: JobPort,
    current: Callable[[], RingAttempt | None],
    req: agent_pb2.PullParametersRequest,
) -> tuple[int, common_pb2.TensorBundle, bytes]:
    """The gateway's addend: sum over the attempt's externals of (b_j / B) * update_j, in
    parameter order; waits for the externals up to the attempt's deadline. ``current``: the
    ring strategy's attempt now (the wait ends when another one replaced it)."""
    rs = runner.round_state
    att = current()
    if rs is None or att is None or rs.round != req.external_round:
        raise FailedPreconditionError(f"round {req.external_round} is not open")
    if att.gateway != req.node_id:
        raise FailedPreconditionError(
            f"node {req.node_id} is not the gateway of round {rs.round} attempt {att.number}"
        )
    end = att.started + att.deadline_s
    while att.external_sum is None:
        if current() is not att or runner.round_state is not rs or rs.closed:
            raise AbortedError(f"attempt {att.number} of round {rs.round} is over")
        parts = [rs.parts[n] for n in att.externals]
        bad = [p for p in parts if p.status in DEAD]
        if bad:
            raise AbortedError(
                "external node(s) "
                + ", ".join(f"{p.node_id} ({p.status}: {p.error})" for p in bad)
                + f" failed; round {rs.round} is retried without them"
            )
        if all(p.status == "received" for p in parts):
            att.external_sum = await asyncio.to_thread(sum_externals, runner.ps, parts, att.total)
            break
        left = end - time.monotonic()
        if left <= 0:
            raise AbortedError(f"the externals of round {rs.round} missed its deadline")
        rs.touched.clear()
        try:
            await asyncio.wait_for(rs.touched.wait(), timeout=min(left, 0.5))
        except TimeoutError:
            pass
    header, data = att.external_sum
    return rs.version, header, data


def sum_externals(
    ps: ParameterServer, parts: list[Part], total: int
) -> tuple[common_pb2.TensorBundle, bytes]:
    """Sum over ``parts`` of (local_batch / ``total``) * update, in ``ps``'s parameter order
    (float32), encoded."""
    out: dict[str, torch.Tensor] = {}
    for name in ps.names:
        acc = torch.zeros_like(ps.params[name], dtype=torch.float32)
        for p in sorted(parts, key=lambda p: p.node_id):
            assert p.grads is not None
            acc.add_(p.grads[name].to(torch.float32), alpha=p.local_batch / total)
        out[name] = acc.detach()
    return encode_bundle(out)
