"""Ring members whose all-reduce is real, for tests that play a hostile member against the real
engine (test_ring_nonfinite.py, test_ring_tampering.py): FakeAgents with a PeerServer each
(mutual TLS with their node certificates) that sum a zero gradient over the ring with
`ring_allreduce`, and report a RingPeerFailed as the ring trainer reports it."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from coordinator.app import Coordinator
from epochmesh.v1 import agent_pb2
from node_agent.ring.allreduce import ring_allreduce
from node_agent.ring.failure import RingPeerFailed
from node_agent.ring.service import PeerServer
from node_agent.ring.transport import RingTransport
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_ring_divergence import Member

NUMEL = 20_000


class RingMember(Member):
    """A zero gradient summed over the ring through its own PeerServer: NaN at one place when
    `poison`; a `transport_cls` of the test's may alter what it sends. Its checksum is that of
    what it holds after the all-reduce, as a real member's parameters after the step would be
    (a member that took altered data reports another one than the rest)."""

    def __init__(
        self,
        world: dict,
        server: PeerServer,
        *,
        poison: bool = False,
        transport_cls: type[RingTransport] = RingTransport,
    ) -> None:
        super().__init__(world)
        self.barrier = False  # the all-reduce below is the barrier; it may end early for some
        self.server = server
        self.poison = poison
        self.transport_cls = transport_cls
        self.transport: RingTransport | None = None
        self.failures: list[RingPeerFailed] = []

    async def __call__(self, agent: FakeAgent, task: agent_pb2.Task) -> None:
        ring = task.ring
        self.checksum_salt = ""
        if ring.node_ids:
            if self.transport is None:
                self.transport = self.transport_cls.for_server(
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
            if float(buf.abs().max()) != 0.0:
                self.checksum_salt = hashlib.sha256(buf.numpy().tobytes()).hexdigest()
        await super().__call__(agent, task)


@contextlib.asynccontextmanager
async def ring_agents(
    coord: Coordinator,
    world: dict,
    names: list[str],
    member: Callable[[str, PeerServer], RingMember],
    seal_digests: Callable[[str], Sequence[str]] = lambda name: (),
) -> AsyncIterator[list[FakeAgent]]:
    """Started FakeAgents named `names`, each a `member(name, its PeerServer)` declaring
    `seal_digests(name)` at registration; all stopped (agents, transports, servers) at the
    end."""
    agents: list[FakeAgent] = []
    servers: list[PeerServer] = []
    try:
        for name in names:
            agent = FakeAgent(
                coord,
                name,
                200.0,
                None,  # type: ignore[arg-type]
                seal_digests=seal_digests(name),
            )
            server = PeerServer("127.0.0.1:0", identity=agent._identity, tune_malloc=False)
            await server.start()
            servers.append(server)
            agent.on_train = member(name, server)
            agent.peer_address = server.address
            agents.append(await agent.start())
        yield agents
    finally:
        for a in agents:
            await a.stop()
            m = a.on_train
            if isinstance(m, RingMember) and m.transport is not None:
                await m.transport.close()
        for s in servers:
            await s.stop(None)
