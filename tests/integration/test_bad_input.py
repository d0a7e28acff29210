"""Bad input gets a clear gRPC status; the server keeps serving and the store is unchanged."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from epochmesh.grpc_util import CHANNEL_OPTIONS
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.procs import aio_channel_for, in_process_coordinator

pytestmark = pytest.mark.timeout(60)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNKNOWN_NODE = "n-0123456789"
UNKNOWN_JOB = "j-0123456789"
UNKNOWN_SHA = "0" * 64


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with in_process_coordinator(tmp_path / "data", lease_ttl_s=60.0) as c:
        yield c


@pytest.fixture
async def channel(coord: Coordinator) -> AsyncIterator[grpc.aio.Channel]:
    async with aio_channel_for(coord.address) as ch:
        yield ch


async def expect(call: object, code: grpc.StatusCode, match: str = "") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, (code, info.value.code(), info.value.details())
    assert match in (info.value.details() or ""), info.value.details()
    assert info.value.details(), "every refusal says why"


async def drain_stream(call: AsyncIterator[object]) -> None:
    async for _ in call:
        pass


async def snapshot(coord: Coordinator) -> tuple[object, ...]:
    store = coord.store
    nodes = [(r.info.SerializeToString(), r.lease_id) for r in await store.list_nodes()]
    events = [e.SerializeToString() for e in await store.list_events(limit=0)]
    jobs = [j.SerializeToString() for j in await store.list_jobs()]
    return nodes, events, jobs, await store.blob_stats()


async def test_bad_requests_are_refused_and_change_nothing(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    agent = agent_pb2_grpc.AgentServiceStub(channel)
    jobs = job_pb2_grpc.JobServiceStub(channel)
    sched = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    reg = await agent.Register(agent_pb2.RegisterRequest(name="good"))
    job = await coord.store.create_job(common_pb2.Job(name="j"), owner="alice")
    await coord.registry.flush_heartbeats()
    before = await snapshot(coord)

    # Register
    await expect(agent.Register(agent_pb2.RegisterRequest()), INVALID, "name is required")
    await expect(agent.Register(agent_pb2.RegisterRequest(name="x" * 500)), INVALID, "too long")
    await expect(agent.Register(agent_pb2.RegisterRequest(name="a\x00b")), INVALID, "control")
    await expect(
        agent.Register(agent_pb2.RegisterRequest(name="a", node_id="node-1")), INVALID, "malformed"
    )
    await expect(
        agent.Register(agent_pb2.RegisterRequest(name="a", node_id=UNKNOWN_NODE)),
        NOT_FOUND,
        UNKNOWN_NODE,
    )
    too_many = agent_pb2.RegisterRequest(name="a")
    for i in range(100):
        too_many.devices.add(kind="cpu", index=i)
    await expect(agent.Register(too_many), INVALID, "too many devices")
    await expect(
        agent.Register(agent_pb2.RegisterRequest(name="a", price_micro_per_hour=-1)),
        INVALID,
        "price_micro_per_hour must be 0..",
    )
    await expect(
        agent.Register(agent_pb2.RegisterRequest(name="a", ring_seal_digests=["x"] * 17)),
        INVALID,
        "too many ring seal digests",
    )
    await expect(
        agent.Register(agent_pb2.RegisterRequest(name="a", ring_seal_digests=[""])),
        INVALID,
        "ring seal digest",
    )
    await expect(
        agent.Register(agent_pb2.RegisterRequest(name="a", ring_features=["x"] * 17)),
        INVALID,
        "too many ring features",
    )
    await expect(
        agent.Register(agent_pb2.RegisterRequest(name="a", ring_features=["x" * 33])),
        INVALID,
        "ring feature",
    )

    # Heartbeat / Leave / NextTask / ReportBenchmark
    def hb(node_id: str, lease_id: str) -> object:
        return agent.Heartbeat(agent_pb2.HeartbeatRequest(node_id=node_id, lease_id=lease_id))

    await expect(hb("", reg.lease_id), INVALID, "node_id is required")
    await expect(hb("bogus", reg.lease_id), INVALID, "malformed node_id")
    await expect(hb(UNKNOWN_NODE, reg.lease_id), NOT_FOUND, "unknown node")
    await expect(hb(reg.node_id, ""), INVALID, "lease_id is required")
    await expect(hb(reg.node_id, "stale-lease"), PRECONDITION, "lease expired: register again")
    await expect(
        agent.Heartbeat(
            agent_pb2.HeartbeatRequest(
                node_id=reg.node_id, lease_id=reg.lease_id, price_micro_per_hour=-2_500_000
            )
        ),
        INVALID,
        "price_micro_per_hour must be 0..",
    )
    await expect(
        agent.Leave(agent_pb2.LeaveRequest(node_id=reg.node_id, lease_id="stale")), PRECONDITION
    )
    await expect(
        agent.NextTask(agent_pb2.NextTaskRequest(node_id=reg.node_id, lease_id="stale")),
        PRECONDITION,
    )
    await expect(
        agent.NextTask(
            agent_pb2.NextTaskRequest(node_id=reg.node_id, lease_id=reg.lease_id, wait_ms=-1)
        ),
        INVALID,
        "wait_ms",
    )
    nan_result = common_pb2.BenchmarkResult(samples_per_second=math.nan)
    await expect(
        agent.ReportBenchmark(
            agent_pb2.ReportBenchmarkRequest(
                node_id=reg.node_id, lease_id=reg.lease_id, result=nan_result
            )
        ),
        INVALID,
        "finite",
    )
    await expect(
        agent.ReportBenchmark(
            agent_pb2.ReportBenchmarkRequest(node_id=reg.node_id, lease_id=reg.lease_id)
        ),
        INVALID,
        "result is required",
    )

    # Probe limits (under the message limit but over the 1 MiB probe cap).
    await expect(agent.Probe(agent_pb2.ProbeRequest(payload=b"x" * (2 << 20))), INVALID, "probe")
    await expect(agent.Probe(agent_pb2.ProbeRequest(response_bytes=-1)), INVALID, "response")
    await expect(agent.Probe(agent_pb2.ProbeRequest(response_bytes=2 << 20)), INVALID, "response")

    # Blobs
    await expect(
        drain_stream(agent.FetchBlob(agent_pb2.FetchBlobRequest(sha256=UNKNOWN_SHA))),
        NOT_FOUND,
        "not found",
    )
    await expect(
        drain_stream(agent.FetchBlob(agent_pb2.FetchBlobRequest(sha256="xyz"))), INVALID, "hex"
    )
    await expect(jobs.GetBlobStatus(job_pb2.GetBlobStatusRequest()), INVALID, "required")

    # Operators
    await expect(sched.GetNode(scheduler_pb2.GetNodeRequest()), INVALID, "required")
    await expect(sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=UNKNOWN_NODE)), NOT_FOUND)
    for rpc in (sched.Cordon, sched.Uncordon, sched.Drain):
        await expect(rpc(scheduler_pb2.NodeRequest(node_id=UNKNOWN_NODE)), NOT_FOUND)
        await expect(rpc(scheduler_pb2.NodeRequest()), INVALID)
    await expect(sched.ListNodes(scheduler_pb2.ListNodesRequest(states=[99])), INVALID, "state")
    await expect(sched.ListJobs(scheduler_pb2.ListAllJobsRequest(limit=-5)), INVALID, "limit")
    await expect(sched.ListJobs(scheduler_pb2.ListAllJobsRequest(states=[42])), INVALID, "state")
    await expect(sched.GetJob(scheduler_pb2.GetAnyJobRequest(job_id="job-1")), INVALID, "malformed")
    await expect(sched.GetJob(scheduler_pb2.GetAnyJobRequest(job_id=UNKNOWN_JOB)), NOT_FOUND)
    await expect(jobs.GetJob(job_pb2.GetJobRequest()), INVALID, "required")
    await expect(jobs.GetJob(job_pb2.GetJobRequest(job_id=UNKNOWN_JOB)), NOT_FOUND)
    await expect(jobs.GetJobEvents(job_pb2.GetJobEventsRequest(job_id=UNKNOWN_JOB)), NOT_FOUND)
    await expect(
        jobs.GetJobEvents(job_pb2.GetJobEventsRequest(job_id=job.job_id, since_id=-1)), INVALID
    )
    for bad_watch, code in (
        (scheduler_pb2.WatchEventsRequest(since_id=-1), INVALID),
        (scheduler_pb2.WatchEventsRequest(node_id=UNKNOWN_NODE), NOT_FOUND),
        (scheduler_pb2.WatchEventsRequest(job_id=UNKNOWN_JOB), NOT_FOUND),
        (scheduler_pb2.WatchEventsRequest(kinds=[""]), INVALID),
    ):
        await expect(drain_stream(sched.WatchEvents(bad_watch)), code)

    assert await snapshot(coord) == before
    # Still serving, and the good node is untouched.
    ok = await agent.Heartbeat(
        agent_pb2.HeartbeatRequest(node_id=reg.node_id, lease_id=reg.lease_id)
    )
    assert ok.state == common_pb2.NODE_STATE_ONLINE


async def test_malformed_and_oversized_messages(
    coord: Coordinator, channel: grpc.aio.Channel
) -> None:
    before = await snapshot(coord)
    identity = lambda b: b  # noqa: E731  (raw bytes on the wire)

    # Bytes that are not a protobuf message of the method's request type.
    register = channel.unary_unary(
        "/epochmesh.v1.AgentService/Register",
        request_serializer=identity,
        response_deserializer=identity,
    )
    await expect(register(b"\x0a\xff\x01abc"), INVALID, "malformed epochmesh.v1.RegisterRequest")

    # ... also inside a client stream.
    upload = channel.stream_unary(
        "/epochmesh.v1.JobService/UploadBlob",
        request_serializer=identity,
        response_deserializer=identity,
    )

    async def garbage() -> AsyncIterator[bytes]:
        yield b"\x12\xff\xff\xff\xff\x0f"

    await expect(upload(garbage()), INVALID, "malformed epochmesh.v1.UploadBlobRequest")

    # A message over the server's 4 MiB receive limit; the client may send it.
    big_options = [o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_send_message_length"]
    big_options.append(("grpc.max_send_message_length", 64 << 20))
    async with aio_channel_for(coord.address, options=big_options[-1:]) as big:
        agent = agent_pb2_grpc.AgentServiceStub(big)
        await expect(
            agent.Probe(agent_pb2.ProbeRequest(payload=b"x" * (5 << 20))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        # The same connection still works.
        assert (await agent.Probe(agent_pb2.ProbeRequest(payload=b"ok"))).payload == b"ok"

    # Unknown method.
    nothing = channel.unary_unary(
        "/epochmesh.v1.AgentService/NoSuchMethod",
        request_serializer=identity,
        response_deserializer=identity,
    )
    await expect(nothing(b""), grpc.StatusCode.UNIMPLEMENTED)

    assert await snapshot(coord) == before
    agent = agent_pb2_grpc.AgentServiceStub(channel)
    assert (await agent.Register(agent_pb2.RegisterRequest(name="after"))).node_id
