"""`RingPeerFailed`: how a ring all-reduce attempt fails, naming the node to blame.

Raised by `ring_allreduce` (`node_agent.ring.allreduce`) and recorded by the attempt's receive
slot (`node_agent.ring.receive`), where the first failure wins; the ring round reports its
`node_id` and `fault` to the coordinator.
"""

from __future__ import annotations

from epochmesh.v1 import agent_pb2
from node_agent.ring.wire import (
    RingKey,
)


class RingPeerFailed(Exception):
    """A ring member failed or stalled; `node_id` names it.

    `reported_by` is None when this node saw the failure itself, else the member whose report
    it got. `key` is (job_id, round, attempt). `fault` (agent_pb2.RingFault): what this node
    found wrong in the data `node_id`, its left neighbour, sent (UNSPECIFIED otherwise).
    """

    def __init__(
        self,
        node_id: str,
        reason: str,
        *,
        reported_by: str | None = None,
        key: RingKey | None = None,
        fault: agent_pb2.RingFault = agent_pb2.RING_FAULT_UNSPECIFIED,
    ) -> None:
        self.node_id = node_id
        self.reason = reason
        self.reported_by = reported_by
        self.key = key
        self.fault = fault
        by = f" (reported by {reported_by})" if reported_by else ""
        super().__init__(f"ring peer {node_id!r} failed: {reason}{by}")

    @property
    def detected_here(self) -> bool:
        return self.reported_by is None
