"""A member that feeds NaN into the ring, against the real engine over real gRPC + TLS and a
real ring all-reduce between the members' PeerServers (mutual TLS with their node
certificates): the right neighbour that refuses its data reports the fault; a second witness
(the next ring puts another member to its right) gets it struck; honest members are not, and
the job succeeds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.engine.engine import Engine
from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.ring.service import PeerServer
from tests.integration.ring_members import RingMember, ring_agents
from tests.integration.test_ring_coordinator import check_exactly_once, new_world, ring_job, run_job
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(90)


async def test_a_member_feeding_nan_is_struck_on_two_witnesses(tmp_path: Path) -> None:
    packed = ring_job(tmp_path, min_nodes=3, max_nodes=4)
    world = new_world(packed)
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as coord:

        def member(name: str, server: PeerServer) -> RingMember:
            return RingMember(world, server, poison=name == "m3")

        async with ring_agents(coord, world, ["m1", "m2", "m3", "m4"], member) as agents:
            final, rounds, events = await run_job(coord, packed)
            ids = {a.name: a.node_id for a in agents}
            strikes = {a.name: coord.registry.get(a.node_id).strikes for a in agents}
            members = {a.name: a.on_train for a in agents}
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, final.message
    check_exactly_once(rounds)
    assert strikes["m3"] >= 1, strikes
    assert all(strikes[n] == 0 for n in ("m1", "m2", "m4")), strikes
    struck = [e for e in events if e.kind == "node.strike"]
    assert struck and {e.node_id for e in struck} == {ids["m3"]}
    assert "fed NaN or Inf values into the ring" in struck[0].message
    # The honest members saw it: the right neighbours of m3 refused its data themselves.
    witnesses = {
        a
        for a, m in members.items()
        if isinstance(m, RingMember)
        for f in m.failures
        if f.fault == agent_pb2.RING_FAULT_NON_FINITE and f.node_id == ids["m3"]
    }
    assert len(witnesses) >= 2 and "m3" not in witnesses, witnesses
    retried = [e for e in events if e.kind == "round.retried"]
    assert any("alone: retried with another member to its right" in e.message for e in retried)
