"""An operator's drain keeps a node's agent; only Drain with stop asks it to leave: the
request reaches the agent in its heartbeat answers until it leaves, its lease ends or an
operator uncordons the node. Real in-process coordinator on a loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(60)

NS = common_pb2.NodeState


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    # Leases long enough that none lapses during a test, however loaded the machine is.
    async with in_process_coordinator(
        tmp_path / "data", heartbeat_interval_s=0.5, lease_ttl_s=30.0
    ) as c:
        yield c


async def register(
    agent: agent_pb2_grpc.AgentServiceStub, name: str, node_id: str = ""
) -> agent_pb2.RegisterResponse:
    req = agent_pb2.RegisterRequest(name=name, agent_version="test", node_id=node_id)
    req.devices.add(kind="cpu", index=0, name="test cpu", cores=2)
    resp: agent_pb2.RegisterResponse = await agent.Register(req)
    return resp


async def beat(
    agent: agent_pb2_grpc.AgentServiceStub, reg: agent_pb2.RegisterResponse
) -> agent_pb2.HeartbeatResponse:
    resp: agent_pb2.HeartbeatResponse = await agent.Heartbeat(
        agent_pb2.HeartbeatRequest(node_id=reg.node_id, lease_id=reg.lease_id)
    )
    return resp


def node(node_id: str, stop: bool = False) -> scheduler_pb2.NodeRequest:
    return scheduler_pb2.NodeRequest(node_id=node_id, stop=stop)


async def test_drain_keeps_the_agent_and_drain_stop_asks_it_to_leave(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    reg = await register(agent, "a")
    assert not (await beat(agent, reg)).leave

    # A plain drain: no new work, no leave request.
    info = await sched.Drain(node(reg.node_id))
    assert info.state == NS.NODE_STATE_DRAINING
    hb = await beat(agent, reg)
    assert hb.state == NS.NODE_STATE_DRAINING and not hb.leave
    assert not coord.registry.leave_requested(reg.node_id)

    # --stop on the drained node (by name): every heartbeat answer says leave.
    info = await sched.Drain(node("a", stop=True))
    assert info.state == NS.NODE_STATE_DRAINING
    for _ in range(2):
        hb = await beat(agent, reg)
        assert hb.state == NS.NODE_STATE_DRAINING and hb.leave
    # Idempotent: a second drain --stop records nothing new.
    await sched.Drain(node(reg.node_id, stop=True))
    events = await coord.store.list_events(node_id=reg.node_id, kinds=["node.draining"])
    assert [(e.attrs["by"], e.attrs["stop"]) for e in events] == [
        ("operator", "false"),
        ("operator", "true"),
    ]

    # The agent leaves: OFFLINE at once, with its reason; the request went with the lease.
    await agent.Leave(
        agent_pb2.LeaveRequest(node_id=reg.node_id, lease_id=reg.lease_id, reason="drain --stop")
    )
    info = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=reg.node_id))
    assert info.state == NS.NODE_STATE_OFFLINE
    assert not coord.registry.leave_requested(reg.node_id)
    left = await coord.store.list_events(node_id=reg.node_id, kinds=["node.left"])
    assert [e.attrs["reason"] for e in left] == ["drain --stop"]

    # Started again, it comes back cordoned (drained by an operator) and is not asked to leave.
    again = await register(agent, "a", node_id=reg.node_id)
    hb = await beat(agent, again)
    assert hb.state == NS.NODE_STATE_CORDONED and not hb.leave


async def test_drain_stop_of_an_online_node_and_uncordon_withdraws_it(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    reg = await register(agent, "b")
    await coord.registry.set_busy(reg.node_id, "j-0123456789")
    info = await sched.Drain(node(reg.node_id, stop=True))
    assert info.state == NS.NODE_STATE_DRAINING and info.current_job_id == "j-0123456789"
    assert reg.node_id not in {n.node_id for n in coord.registry.eligible_nodes()}
    assert (await beat(agent, reg)).leave
    events = await coord.store.list_events(node_id=reg.node_id, kinds=["node.draining"])
    assert [e.attrs["stop"] for e in events] == ["true"]
    assert "asked to leave" in events[0].message

    # The operator changes their mind before the agent acted: it stays, and works again.
    info = await sched.Uncordon(node(reg.node_id))
    assert info.state == NS.NODE_STATE_BUSY
    hb = await beat(agent, reg)
    assert hb.state == NS.NODE_STATE_BUSY and not hb.leave
    uncordoned = await coord.store.list_events(node_id=reg.node_id, kinds=["node.uncordoned"])
    assert "withdrawn" in uncordoned[0].message


async def test_a_new_lease_ends_a_leave_request(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    """A leave request is the incarnation's: an agent that registers again (restarted, or its
    lease replaced) is drained, not asked to leave."""
    reg = await register(agent, "c")
    await sched.Drain(node(reg.node_id, stop=True))
    again = await register(agent, "c", node_id=reg.node_id)
    hb = await beat(agent, again)
    assert hb.state == NS.NODE_STATE_CORDONED and not hb.leave


async def test_stop_is_for_drain_only(
    agent: agent_pb2_grpc.AgentServiceStub, sched: scheduler_pb2_grpc.SchedulerServiceStub
) -> None:
    reg = await register(agent, "d")
    for method in (sched.Cordon, sched.Uncordon):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await method(node(reg.node_id, stop=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop is for Drain only" in (err.value.details() or "")
    info = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=reg.node_id))
    assert info.state == NS.NODE_STATE_ONLINE  # and the server goes on serving
