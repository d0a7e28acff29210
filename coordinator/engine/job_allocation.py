"""The job's allocation as the API shows it: its nodes, their shares, rates and segments.

Read from the job's runner (coordinator/engine/job_runner.py) on its event loop, for
GetAllocation and the job's watch stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator.rounds.ledger import EpochLedger
from coordinator.rounds.node_set import JobNodeSet
from coordinator.rounds.planner import RoundPlanner
from coordinator.rounds.round_state import NodeStats, RoundState
from epochmesh.v1 import common_pb2

if TYPE_CHECKING:
    from coordinator.nodes.registry import NodeRegistry


def allocation(
    job: common_pb2.Job,
    rs: RoundState | None,
    planner: RoundPlanner,
    node_set: JobNodeSet,
    ledger: EpochLedger | None,
    registry: NodeRegistry,
) -> common_pb2.Allocation:
    """The job's allocation: each node's share of the planned batch, its measured rates and
    its segment of the epoch (``rs``: the open round, for its deadline; ``ledger``: None until
    the runner has restored the job's state, when it has no nodes yet either)."""
    out = common_pb2.Allocation(job_id=job.job_id, epoch=job.epoch, round=job.round)
    if rs is not None:
        out.round_deadline_seconds = rs.deadline_s
    total = sum(planner.batches.values()) or 1
    for n in node_set.members:
        info = registry.get(n)
        bench = planner.bench.get(n)
        st = node_set.stats.get(n, NodeStats())
        seg = ledger.segment_of(n) if ledger is not None else None
        na = common_pb2.NodeAllocation(
            node_id=n,
            name=info.name if info is not None else "",
            samples_per_second=planner.estimator.estimate(n) if n in planner.estimator else 0.0,
            share=planner.batches.get(n, 0) / total,
            local_batch=planner.batches.get(n, 0),
            max_batch=planner.max_batch(n),
            remaining=ledger.remaining(n) if ledger is not None else 0,
            compute_seconds=st.compute_s,
            communicate_seconds=st.communicate_s,
            inner_steps=planner.inner_steps,
        )
        if seg is not None:
            na.segment.start, na.segment.stop = seg
        if bench is not None:
            na.rtt_ms = bench.rtt_ms
            na.bandwidth_bytes_per_second = bench.bandwidth_bytes_per_second
        out.nodes.append(na)
    return out
