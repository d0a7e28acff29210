"""What every end-to-end verification test checks once its job with a cheater has succeeded
(tests/system/test_local_sgd_verification.py, test_ring_verification.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from epochmesh.v1 import common_pb2
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_fault_tolerance import applied, check_exactly_once, events_of

NS = common_pb2.NodeState


def check_cheater_undone(
    jobs: Jobs,
    job_id: str,
    events: list[common_pb2.Event],
    nodes: Mapping[str, common_pb2.NodeInfo],
    cheater: common_pb2.NodeInfo,
    honest: Iterable[str],
    first_cheated: int,
    samples: int,
    epochs: int,
) -> None:
    """Every sample of every epoch trained once in the live rounds, none of the cheater's parts
    from round ``first_cheated`` on still applied, no honest node struck, quarantined or failed
    a check (those that worked have verified rounds), and the job's figures: one failed check,
    some passed."""
    live = jobs.rounds(job_id)
    check_exactly_once(live, samples, epochs)
    kept = [
        r.round
        for r in live
        for p in applied(r)
        if p.node_id == cheater.node_id and r.round >= first_cheated
    ]
    assert not kept, f"the cheater's updates of rounds {kept} are still applied"
    worked = {p.node_id for r in live for p in applied(r)}
    for name in honest:
        node = nodes[name]
        assert node.state != NS.NODE_STATE_QUARANTINED and node.strikes == 0, node
        assert node.reputation.failed_total == 0, node
        assert node.reputation.verified_total > 0 or node.node_id not in worked, node
    assert not [e for e in events_of(events, "node.quarantined") if e.node_id != cheater.node_id]
    summary = dict(events_of(events, "job.verification")[-1].attrs)
    assert int(summary["failed"]) == 1 and int(summary["passed"]) > 0, summary
