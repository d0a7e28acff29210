"""A member that feeds NaN into the ring, against the real engine over real gRPC + TLS and a
real ring all-reduce between the members' PeerServers (mutual TLS with their node
certificates): the right neighbour that refuses its data reports the fault; a second witness
(the next ring puts another member to its right) gets it struck; honest members are not, and
the job succeeds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from coordinator.engine import Engine
from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.peer import PeerServer
from node_agent.ring_allreduce import RingPeerFailed, RingTransport, ring_allreduce
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_ring_coordinator import check_exactly_once, new_world, ring_job, run_job
from tests.integration.test_ring_divergence import Member
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(90)

NUMEL = 20_000


class RingMember(Member):
    """A member whose all-reduce is real: a zero gradient (NaN at one place when `poison`)
    summed over the ring by `ring_allreduce` through its own PeerServer; a RingPeerFailed is
    reported as the ring trainer reports it."""

    def __init__(self, world: dict, server: PeerServer, *, poison: bool = False) -> None:
        super().__init__(world)
        self.server = server
        self.poison = poison
        self.transport: RingTransport | None = None
        self.failures: list[RingPeerFailed] = []

    async def __call__(self, agent: FakeAgent, task: agent_pb2.Task) -> None:
        ring = task.ring
        if ring.node_ids:
            if self.transport is None:
                self.transport = RingTransport.for_server(
                    agent.node_id, self.server, identity=agent._identity
                )
            key = (task.job_id, task.round, ring.attempt)
            self.server.mailbox.announce(key, list(ring.node_ids), ring.rank, 60.0)
            self.server.service.add_revoked(task.revoked_node_ids)
            buf = torch.zeros(NUMEL)
            if self.poison:
                buf[NUMEL // 3] = float("nan")
            try:
                await ring_allreduce(
                    buf,
                    ring,
                    self.transport,
                    ring.deadline_seconds,
                    job_id=task.job_id,
                    round=task.round,
                    join_timeout_s=10.0,
                )
            except RingPeerFailed as exc:
                self.failures.append(exc)
                await agent.report(
                    task,
                    failed=True,
                    error=str(exc)[:2000],
                    failed_peer_node_id=exc.node_id,
                    ring_fault=exc.fault,
                    ring_attempt=ring.attempt,
                )
                return
            assert float(buf.abs().max()) == 0.0
        await super().__call__(agent, task)


@contextlib.asynccontextmanager
async def ring_agents(
    coord, world: dict, names: list[str], poisoned: str
) -> AsyncIterator[list[FakeAgent]]:
    agents: list[FakeAgent] = []
    servers: list[PeerServer] = []
    try:
        for name in names:
            agent = FakeAgent(coord, name, 200.0, None)  # type: ignore[arg-type]
            server = PeerServer("127.0.0.1:0", identity=agent._identity, tune_malloc=False)
            await server.start()
            servers.append(server)
            agent.on_train = RingMember(world, server, poison=name == poisoned)
            agent.peer_address = server.address
            agents.append(await agent.start())
        yield agents
    finally:
        for a in agents:
            await a.stop()
            member = a.on_train
            if isinstance(member, RingMember) and member.transport is not None:
                await member.transport.close()
        for s in servers:
            await s.stop(None)


async def test_a_member_feeding_nan_is_struck_on_two_witnesses(tmp_path: Path) -> None:
    packed = ring_job(tmp_path, min_nodes=3, max_nodes=4)
    world = new_world(packed)
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as coord:
        async with ring_agents(coord, world, ["m1", "m2", "m3", "m4"], poisoned="m3") as agents:
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
