"""The control plane against a real in-process coordinator on a loopback port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.app import Coordinator
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.procs import aio_channel_for, async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(60)

NS = common_pb2.NodeState
# Leases long enough that no node lapses during a test, however loaded the machine is; the
# tests about lapsing leases use short ones (SHORT_*).
HB_S = 0.5
TTL_S = 30.0
SHORT_HB_S = 0.2
SHORT_TTL_S = 0.6


@pytest.fixture
def lease_times() -> tuple[float, float]:
    return HB_S, TTL_S


@pytest.fixture
async def coord(tmp_path: Path, lease_times: tuple[float, float]) -> AsyncIterator[Coordinator]:
    hb, ttl = lease_times
    async with in_process_coordinator(
        tmp_path / "data", heartbeat_interval_s=hb, lease_ttl_s=ttl
    ) as c:
        yield c


async def register(
    agent: agent_pb2_grpc.AgentServiceStub, name: str, node_id: str = ""
) -> agent_pb2.RegisterResponse:
    req = agent_pb2.RegisterRequest(
        name=name, agent_version="test", peer_address="127.0.0.1:1", node_id=node_id
    )
    req.devices.add(kind="cpu", index=0, name="test cpu", cores=2)
    req.labels["zone"] = "z1"
    resp: agent_pb2.RegisterResponse = await agent.Register(req)
    return resp


async def expect_status(call: object, code: grpc.StatusCode, match: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    assert match in details, details
    return details


async def node_state(sched: scheduler_pb2_grpc.SchedulerServiceStub, node_id: str) -> int:
    info = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=node_id))
    return int(info.state)


# -- register, heartbeat, leases --------------------------------------------------------------


async def test_register_and_heartbeat(
    agent: agent_pb2_grpc.AgentServiceStub, sched: scheduler_pb2_grpc.SchedulerServiceStub
) -> None:
    reg = await register(agent, "alpha")
    assert reg.node_id.startswith("n-") and len(reg.node_id) == 12
    assert reg.lease_id
    assert reg.lease_ttl_ms == int(TTL_S * 1000)
    assert reg.heartbeat_interval_ms == int(HB_S * 1000)

    hb = await agent.Heartbeat(
        agent_pb2.HeartbeatRequest(node_id=reg.node_id, lease_id=reg.lease_id)
    )
    assert hb.state == NS.NODE_STATE_ONLINE
    assert hb.lease_ttl_ms == reg.lease_ttl_ms and not hb.cancel_task

    info = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=reg.node_id))
    assert info.name == "alpha" and info.state == NS.NODE_STATE_ONLINE
    assert info.devices[0].cores == 2 and info.labels["zone"] == "z1"
    assert info.peer_address == "127.0.0.1:1" and info.agent_version == "test"
    assert info.last_heartbeat_ms > 0 and info.lease_expires_ms > info.last_heartbeat_ms
    by_name = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id="alpha"))
    assert by_name.node_id == reg.node_id


@pytest.mark.parametrize("lease_times", [(0.2, 1.0)])
async def test_heartbeats_keep_the_lease_past_its_ttl(
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
    lease_times: tuple[float, float],
) -> None:
    hb_s, ttl_s = lease_times
    reg = await register(agent, "steady")
    loop = asyncio.get_running_loop()
    end = loop.time() + 2 * ttl_s
    while loop.time() < end:
        hb = await agent.Heartbeat(
            agent_pb2.HeartbeatRequest(node_id=reg.node_id, lease_id=reg.lease_id)
        )
        assert hb.state == NS.NODE_STATE_ONLINE
        await asyncio.sleep(hb_s)  # an agent's heartbeat period, not a wait for a condition
    assert await node_state(sched, reg.node_id) == NS.NODE_STATE_ONLINE


@pytest.mark.parametrize("lease_times", [(SHORT_HB_S, SHORT_TTL_S)])
async def test_lease_expiry_makes_node_offline_with_event(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    offline: list[str] = []

    async def on_offline(node_id: str) -> None:
        offline.append(node_id)

    coord.registry.add_offline_listener(on_offline)
    reg = await register(agent, "lapsing")
    assert coord.registry.is_alive(reg.node_id)
    assert [n.node_id for n in coord.registry.eligible_nodes()] == [reg.node_id]

    async def is_offline() -> bool:
        return await node_state(sched, reg.node_id) == NS.NODE_STATE_OFFLINE

    await async_wait_until(is_offline, timeout=10, message="node never went OFFLINE")

    # The registry marks the node OFFLINE in memory before it stores the event and then calls
    # the listeners; the listener's call is the sign that both are done.
    await async_wait_until(lambda: offline, timeout=10, message="offline listener not called")
    assert offline == [reg.node_id]
    assert not coord.registry.is_alive(reg.node_id)
    assert coord.registry.eligible_nodes() == []
    events = [
        e
        async for e in sched.WatchEvents(
            scheduler_pb2.WatchEventsRequest(node_id=reg.node_id, kinds=["node.offline"])
        )
    ]
    assert len(events) == 1 and events[0].attrs["reason"] == "lease expired"

    await expect_status(
        agent.Heartbeat(agent_pb2.HeartbeatRequest(node_id=reg.node_id, lease_id=reg.lease_id)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "lease expired: register again",
    )
    # Registering again with the known id re-joins the same node with a new lease.
    again = await register(agent, "lapsing-2", node_id=reg.node_id)
    assert again.node_id == reg.node_id and again.lease_id != reg.lease_id
    info = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=reg.node_id))
    assert info.state == NS.NODE_STATE_ONLINE and info.name == "lapsing-2"
    assert info.registered_at_ms > 0


async def test_heartbeat_with_an_old_lease_after_rejoin_is_refused(
    agent: agent_pb2_grpc.AgentServiceStub,
) -> None:
    first = await register(agent, "twice")
    second = await register(agent, "twice", node_id=first.node_id)
    await expect_status(
        agent.Heartbeat(agent_pb2.HeartbeatRequest(node_id=first.node_id, lease_id=first.lease_id)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "register again",
    )
    hb = await agent.Heartbeat(
        agent_pb2.HeartbeatRequest(node_id=second.node_id, lease_id=second.lease_id)
    )
    assert hb.state == NS.NODE_STATE_ONLINE


async def test_leave_goes_offline_at_once(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    reg = await register(agent, "leaver")
    await agent.Leave(
        agent_pb2.LeaveRequest(node_id=reg.node_id, lease_id=reg.lease_id, reason="sigterm")
    )
    assert await node_state(sched, reg.node_id) == NS.NODE_STATE_OFFLINE
    events = await coord.store.list_events(node_id=reg.node_id, kinds=["node.left"])
    assert len(events) == 1 and events[0].attrs["reason"] == "sigterm"
    await expect_status(
        agent.Leave(agent_pb2.LeaveRequest(node_id=reg.node_id, lease_id=reg.lease_id)),
        grpc.StatusCode.FAILED_PRECONDITION,
    )


# -- operator actions -------------------------------------------------------------------------


async def test_cordon_uncordon_drain(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    a = await register(agent, "a")
    b = await register(agent, "b")

    async def beat(reg: agent_pb2.RegisterResponse, draining: bool = False) -> int:
        hb = await agent.Heartbeat(
            agent_pb2.HeartbeatRequest(
                node_id=reg.node_id, lease_id=reg.lease_id, draining=draining
            )
        )
        return int(hb.state)

    info = await sched.Cordon(scheduler_pb2.NodeRequest(node_id=a.node_id))
    assert info.state == NS.NODE_STATE_CORDONED
    assert await beat(a) == NS.NODE_STATE_CORDONED
    assert [n.node_id for n in coord.registry.eligible_nodes()] == [b.node_id]
    cordoned = await sched.ListNodes(
        scheduler_pb2.ListNodesRequest(states=[NS.NODE_STATE_CORDONED])
    )
    assert [n.node_id for n in cordoned.nodes] == [a.node_id]
    # Idempotent, and by name.
    info = await sched.Cordon(scheduler_pb2.NodeRequest(node_id="a"))
    assert info.state == NS.NODE_STATE_CORDONED
    info = await sched.Uncordon(scheduler_pb2.NodeRequest(node_id=a.node_id))
    assert info.state == NS.NODE_STATE_ONLINE

    # Drain a busy node: it keeps its job id, gets DRAINING on its next heartbeat.
    await coord.registry.set_busy(b.node_id, "j-0123456789")
    assert await node_state(sched, b.node_id) == NS.NODE_STATE_BUSY
    info = await sched.Drain(scheduler_pb2.NodeRequest(node_id=b.node_id))
    assert info.state == NS.NODE_STATE_DRAINING and info.current_job_id == "j-0123456789"
    assert await beat(b) == NS.NODE_STATE_DRAINING
    assert [n.node_id for n in coord.registry.eligible_nodes()] == [a.node_id]
    await coord.registry.set_busy(b.node_id, None)
    assert await node_state(sched, b.node_id) == NS.NODE_STATE_DRAINING

    # An agent that drains by itself says so in its heartbeat.
    assert await beat(a, draining=True) == NS.NODE_STATE_DRAINING

    kinds = [e.kind for e in await coord.store.list_events(kinds=["node.*"])]
    assert kinds.count("node.cordoned") == 1 and kinds.count("node.uncordoned") == 1
    assert kinds.count("node.draining") == 2 and "node.busy" in kinds

    # Offline nodes cannot be cordoned or drained.
    await agent.Leave(agent_pb2.LeaveRequest(node_id=b.node_id, lease_id=b.lease_id))
    await expect_status(
        sched.Cordon(scheduler_pb2.NodeRequest(node_id=b.node_id)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "OFFLINE",
    )


async def test_list_nodes_filters_and_cluster_stats(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    regs = [await register(agent, f"node-{i}") for i in range(3)]
    await sched.Cordon(scheduler_pb2.NodeRequest(node_id=regs[0].node_id))
    await agent.Leave(agent_pb2.LeaveRequest(node_id=regs[1].node_id, lease_id=regs[1].lease_id))
    result = await agent.ReportBenchmark(
        agent_pb2.ReportBenchmarkRequest(
            node_id=regs[2].node_id,
            lease_id=regs[2].lease_id,
            result=common_pb2.BenchmarkResult(samples_per_second=123.5, max_batch_size=64),
        )
    )
    assert result == agent_pb2.ReportBenchmarkResponse()
    everything = await sched.ListNodes(scheduler_pb2.ListNodesRequest())
    assert len(everything.nodes) == 3
    some = await sched.ListNodes(
        scheduler_pb2.ListNodesRequest(states=[NS.NODE_STATE_ONLINE, NS.NODE_STATE_OFFLINE])
    )
    assert {n.node_id for n in some.nodes} == {regs[1].node_id, regs[2].node_id}
    bench = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=regs[2].node_id))
    assert bench.benchmark.samples_per_second == 123.5

    j = await coord.store.create_job(
        common_pb2.Job(name="x", state=common_pb2.JOB_STATE_RUNNING), owner="alice"
    )
    stats = await sched.ClusterStats(scheduler_pb2.ClusterStatsRequest())
    assert stats.nodes_by_state["ONLINE"] == 1
    assert stats.nodes_by_state["CORDONED"] == 1
    assert stats.nodes_by_state["OFFLINE"] == 1
    assert stats.nodes_by_state["BUSY"] == 0
    assert stats.jobs_by_state["RUNNING"] == 1 and stats.jobs_by_state["QUEUED"] == 0
    assert stats.total_samples_per_second == 123.5
    assert stats.events >= 5 and stats.uptime_ms >= 0

    listed = await sched.ListJobs(scheduler_pb2.ListAllJobsRequest())
    assert [x.job_id for x in listed.jobs] == [j.job_id]
    got = await sched.GetJob(scheduler_pb2.GetAnyJobRequest(job_id=j.job_id))
    assert got == j


async def test_job_queries_and_job_events(
    coord: Coordinator, jobs: job_pb2_grpc.JobServiceStub
) -> None:
    j1 = await coord.store.create_job(common_pb2.Job(name="one"), owner="alice")
    j2 = await coord.store.create_job(
        common_pb2.Job(name="two", state=common_pb2.JOB_STATE_RUNNING), owner="bob"
    )
    await coord.events.append("job.queued", job_id=j1.job_id)
    e2 = await coord.events.append("job.running", job_id=j1.job_id)
    await coord.events.append("job.queued", job_id=j2.job_id)
    got = await jobs.GetJob(job_pb2.GetJobRequest(job_id=j2.job_id))
    assert got.name == "two"
    running = await jobs.ListJobs(job_pb2.ListJobsRequest(states=[common_pb2.JOB_STATE_RUNNING]))
    assert [j.job_id for j in running.jobs] == [j2.job_id]
    assert len((await jobs.ListJobs(job_pb2.ListJobsRequest(limit=1))).jobs) == 1
    ev = await jobs.GetJobEvents(job_pb2.GetJobEventsRequest(job_id=j1.job_id))
    assert [e.kind for e in ev.events] == ["job.queued", "job.running"]
    later = await jobs.GetJobEvents(job_pb2.GetJobEventsRequest(job_id=j1.job_id, since_id=e2.id))
    assert list(later.events) == []


# -- events -------------------------------------------------------------------------------------


async def test_watch_events_resume_and_follow(
    coord: Coordinator,
    agent: agent_pb2_grpc.AgentServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    regs = [await register(agent, f"w{i}") for i in range(3)]
    past = [e async for e in sched.WatchEvents(scheduler_pb2.WatchEventsRequest())]
    kinds = [e.kind for e in past]
    assert kinds[0] == "coordinator.started" and kinds.count("node.registered") == 3
    ids = [e.id for e in past]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)

    # A late client resumes after the last id it saw, then follows new events.
    since = past[1].id
    call = sched.WatchEvents(scheduler_pb2.WatchEventsRequest(since_id=since, follow=True))
    got: list[common_pb2.Event] = []

    async def collect(n: int) -> None:
        async for event in call:
            got.append(event)
            if len(got) == n:
                return

    collector = asyncio.create_task(collect(len(past) - 2 + 2))
    await async_wait_until(lambda: len(got) >= len(past) - 2, timeout=10)
    assert [e.id for e in got] == ids[2:]
    await sched.Cordon(scheduler_pb2.NodeRequest(node_id=regs[0].node_id))
    await agent.Leave(agent_pb2.LeaveRequest(node_id=regs[1].node_id, lease_id=regs[1].lease_id))
    await asyncio.wait_for(collector, timeout=10)
    assert [e.kind for e in got[-2:]] == ["node.cordoned", "node.left"]
    call.cancel()

    # Filters: one node's events; kinds with a prefix pattern.
    mine = [
        e
        async for e in sched.WatchEvents(scheduler_pb2.WatchEventsRequest(node_id=regs[0].node_id))
    ]
    assert [e.kind for e in mine] == ["node.registered", "node.cordoned"]
    named = [e async for e in sched.WatchEvents(scheduler_pb2.WatchEventsRequest(node_id="w0"))]
    assert named == mine
    node_events = [
        e async for e in sched.WatchEvents(scheduler_pb2.WatchEventsRequest(kinds=["node.*"]))
    ]
    assert all(e.kind.startswith("node.") for e in node_events) and len(node_events) == 5


async def test_follow_stream_ends_when_the_coordinator_stops(tmp_path: Path) -> None:
    async with in_process_coordinator(tmp_path / "d", shutdown_grace_s=5.0) as coord:
        async with aio_channel_for(coord.address) as ch:
            sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            call = sched.WatchEvents(scheduler_pb2.WatchEventsRequest(follow=True))
            first = await call.read()
            assert first.kind == "coordinator.started"
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            stopper = asyncio.create_task(coord.stop())
            rest = []
            while (event := await call.read()) is not grpc.aio.EOF:
                rest.append(event)
            await stopper
            assert loop.time() - t0 < 4.0  # ended by the shutdown, not by the grace period
            assert await call.code() == grpc.StatusCode.OK
            assert [e.kind for e in rest] == ["coordinator.stopping"]


# -- health and reflection ----------------------------------------------------------------------


async def test_health_and_reflection(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in (
        "",
        "epochmesh.v1.AgentService",
        "epochmesh.v1.JobService",
        "epochmesh.v1.SchedulerService",
        "epochmesh.v1.MarketService",
    ):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
    await expect_status(
        health.Check(health_pb2.HealthCheckRequest(service="nope.Service")),
        grpc.StatusCode.NOT_FOUND,
    )

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = refl.ServerReflectionInfo(
        iter(
            [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="epochmesh.v1.AgentService"
                ),
            ]
        )
    )
    responses = [r async for r in call]
    names = {s.name for s in responses[0].list_services_response.service}
    assert names == {
        "epochmesh.v1.AgentService",
        "epochmesh.v1.JobService",
        "epochmesh.v1.SchedulerService",
        "epochmesh.v1.MarketService",
        "epochmesh.v1.IdentityService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert responses[1].file_descriptor_response.file_descriptor_proto


# -- probe and the training seam -----------------------------------------------------------------


async def test_probe_and_null_engine(
    agent: agent_pb2_grpc.AgentServiceStub,
    jobs: job_pb2_grpc.JobServiceStub,
    sched: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    echo = await agent.Probe(agent_pb2.ProbeRequest(payload=b"ping"))
    assert echo.payload == b"ping"
    filler = await agent.Probe(agent_pb2.ProbeRequest(payload=b"x" * 1000, response_bytes=1 << 20))
    assert len(filler.payload) == 1 << 20

    reg = await register(agent, "poller")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = await agent.NextTask(
        agent_pb2.NextTaskRequest(node_id=reg.node_id, lease_id=reg.lease_id, wait_ms=200)
    )
    assert task.kind == agent_pb2.TASK_KIND_NONE
    assert loop.time() - t0 >= 0.15

    unimplemented = grpc.StatusCode.UNIMPLEMENTED
    msg = "training engine not available"
    await expect_status(jobs.SubmitJob(job_pb2.SubmitJobRequest()), unimplemented, msg)
    await expect_status(
        jobs.CancelJob(job_pb2.CancelJobRequest(job_id="j-0123456789")), unimplemented, msg
    )
    await expect_status(jobs.GetRounds(job_pb2.GetRoundsRequest()), unimplemented, msg)
    await expect_status(
        sched.GetAllocation(scheduler_pb2.GetAllocationRequest()), unimplemented, msg
    )
    await expect_status(
        sched.PreviewAllocation(scheduler_pb2.PreviewAllocationRequest()), unimplemented, msg
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in jobs.WatchJob(job_pb2.WatchJobRequest(job_id="j-0123456789")):
            pass
    assert info.value.code() == unimplemented
    await expect_status(
        agent.ReportProgress(
            agent_pb2.ReportProgressRequest(node_id=reg.node_id, lease_id=reg.lease_id)
        ),
        unimplemented,
        msg,
    )


class _BrokenEngine:
    """An engine whose allocation call has a bug, to check the server survives it."""

    def __init__(self, context: object) -> None:
        from coordinator.engine.api import CoordinatorContext, NullEngine

        assert isinstance(context, CoordinatorContext)
        self._null = NullEngine(context)

    def __getattr__(self, name: str) -> object:
        return getattr(self._null, name)

    async def get_allocation(self, req: object, ctx: object) -> common_pb2.Allocation:
        raise ZeroDivisionError("bug in the engine")


async def test_unexpected_engine_error_is_internal_and_server_survives(tmp_path: Path) -> None:
    async with in_process_coordinator(tmp_path / "d", engine_factory=_BrokenEngine) as coord:
        async with aio_channel_for(coord.address) as ch:
            sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            details = await expect_status(
                sched.GetAllocation(scheduler_pb2.GetAllocationRequest(job_id="j-0123456789")),
                grpc.StatusCode.INTERNAL,
                "bug in the engine",
            )
            assert "ZeroDivisionError" in details
            stats = await sched.ClusterStats(scheduler_pb2.ClusterStatsRequest())
            assert stats.events >= 1


class _RecordingEngine:
    """A NullEngine that records the hooks the control plane calls."""

    instances: list[_RecordingEngine] = []

    def __init__(self, context: object) -> None:
        from coordinator.engine.api import NullEngine

        self._null = NullEngine(context)  # type: ignore[arg-type]
        self.calls: list[tuple[str, object]] = []
        _RecordingEngine.instances.append(self)

    def __getattr__(self, name: str) -> object:
        return getattr(self._null, name)

    async def start(self) -> None:
        self.calls.append(("start", None))

    async def stop(self) -> None:
        self.calls.append(("stop", None))

    def check_benchmark(
        self, node_id: str, task_id: str, result: common_pb2.BenchmarkResult
    ) -> None:
        if result.job_id:
            self.calls.append(("check", (node_id, task_id, result.job_id)))

    async def on_benchmark(self, node_id: str, result: common_pb2.BenchmarkResult) -> None:
        self.calls.append(("benchmark", (node_id, result.job_id, result.samples_per_second)))

    async def on_node_offline(self, node_id: str) -> None:
        self.calls.append(("offline", node_id))

    def cancel_task(self, node_id: str, task_id: str) -> bool:
        self.calls.append(("cancel?", task_id))
        return task_id == "t-cancelled"


async def test_engine_hooks(tmp_path: Path) -> None:
    async with in_process_coordinator(tmp_path / "d", engine_factory=_RecordingEngine) as coord:
        engine = _RecordingEngine.instances[-1]
        assert engine.calls == [("start", None)]
        async with aio_channel_for(coord.address) as ch:
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            reg = await register(agent, "hooked")
            for job_id, sps in (("", 50.0), ("j-0123456789", 9.0)):
                await agent.ReportBenchmark(
                    agent_pb2.ReportBenchmarkRequest(
                        node_id=reg.node_id,
                        lease_id=reg.lease_id,
                        result=common_pb2.BenchmarkResult(job_id=job_id, samples_per_second=sps),
                    )
                )
            info = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=reg.node_id))
            # The reference benchmark stays on the node; a job's benchmark goes to the engine.
            assert info.benchmark.samples_per_second == 50.0
            assert info.benchmark.measured_at_ms > 0
            for task_id, cancel in (("t-running", False), ("t-cancelled", True)):
                hb = await agent.Heartbeat(
                    agent_pb2.HeartbeatRequest(
                        node_id=reg.node_id, lease_id=reg.lease_id, task_id=task_id
                    )
                )
                assert hb.cancel_task is cancel
            await agent.Leave(agent_pb2.LeaveRequest(node_id=reg.node_id, lease_id=reg.lease_id))
    assert engine.calls == [
        ("start", None),
        ("benchmark", (reg.node_id, "", 50.0)),
        ("check", (reg.node_id, "", "j-0123456789")),
        ("benchmark", (reg.node_id, "j-0123456789", 9.0)),
        ("cancel?", "t-running"),
        ("cancel?", "t-cancelled"),
        ("offline", reg.node_id),
        ("stop", None),
    ]


async def test_agents_are_told_to_heartbeat_less_often_past_the_heartbeat_rate(
    tmp_path: Path,
) -> None:
    """At most 8 heartbeats a second at a 0.5 s interval: two agents (4 a second) hear 0.5 s
    and a 30 s lease; six would send 12 a second, so the sweep stretches both by 1.5 and
    Register and Heartbeat say so."""
    async with in_process_coordinator(
        tmp_path / "data", heartbeat_interval_s=HB_S, lease_ttl_s=TTL_S, max_heartbeats_per_s=8.0
    ) as coord:
        async with aio_channel_for(coord.address) as ch:
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            first = [await register(agent, f"n{i}") for i in range(2)]
            assert (first[0].heartbeat_interval_ms, first[0].lease_ttl_ms) == (500, 30_000)
            more = [await register(agent, f"n{i}") for i in range(2, 6)]
            hb = agent_pb2.HeartbeatRequest(node_id=more[0].node_id, lease_id=more[0].lease_id)

            async def stretched() -> bool:
                answer = await agent.Heartbeat(hb)
                return bool(answer.heartbeat_interval_ms == 750)

            await async_wait_until(stretched, timeout=30, message="a stretched interval")
            answer = await agent.Heartbeat(hb)
            assert answer.lease_ttl_ms == 45_000
            later = await register(agent, "n6")
            assert later.heartbeat_interval_ms > 500
