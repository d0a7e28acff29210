"""The agent's CoordinatorConnection against a real gRPC server on loopback: once the
coordinator is reachable again, the lease is renewed at once, not at the next heartbeat."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from epochmesh.v1 import agent_pb2, agent_pb2_grpc
from node_agent.link.connection import CoordinatorConnection, HeartbeatHooks
from tests.procs import async_wait_until, free_port

pytestmark = pytest.mark.timeout(60)

# Long enough that a heartbeat inside the test can only come from the wake-up.
INTERVAL_S = 120.0


class Coordinator(agent_pb2_grpc.AgentServiceServicer):
    """Answers heartbeats (recording the lease each renews) and progress reports."""

    def __init__(self) -> None:
        self.heartbeats: list[str] = []
        self.changed = asyncio.Event()

    async def Heartbeat(  # noqa: N802 (gRPC method name)
        self, request: agent_pb2.HeartbeatRequest, context: object
    ) -> agent_pb2.HeartbeatResponse:
        self.heartbeats.append(request.lease_id)
        self.changed.set()
        return agent_pb2.HeartbeatResponse(heartbeat_interval_ms=int(INTERVAL_S * 1000))

    async def ReportProgress(  # noqa: N802
        self, request: agent_pb2.ReportProgressRequest, context: object
    ) -> agent_pb2.ReportProgressResponse:
        return agent_pb2.ReportProgressResponse()


async def serve(address: str, servicer: Coordinator) -> grpc.aio.Server:
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


async def wait_heartbeats(servicer: Coordinator, n: int, timeout: float) -> None:
    async def reached() -> None:
        while len(servicer.heartbeats) < n:
            servicer.changed.clear()
            await servicer.changed.wait()

    await asyncio.wait_for(reached(), timeout)


def beating(
    address: str, data_dir: Path, stop: asyncio.Event | None = None
) -> tuple[CoordinatorConnection, asyncio.Task[None]]:
    """A connection with a lease, and its heartbeat loop started."""
    conn = CoordinatorConnection(
        address, data_dir, agent_pb2.RegisterRequest, stop=stop, insecure=True
    )
    conn.node_id, conn.lease_id = "n-0123456789", "lease"
    hooks = HeartbeatHooks(
        current_task_id=lambda: "",
        draining=lambda: False,
        on_state=lambda state: None,
        on_cancel_task=lambda task_id: None,
    )
    return conn, asyncio.create_task(conn.heartbeat_loop(hooks, asyncio.Event()))


async def test_a_call_that_gets_through_again_renews_the_lease_at_once(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    servicer = Coordinator()
    server = await serve(address, servicer)
    conn, beats = beating(address, tmp_path / "agent")
    try:
        await wait_heartbeats(servicer, 1, timeout=10)  # the first one goes at once
        # The coordinator restarts: a call fails, then gets through to the new process.
        await server.stop(None)

        async def report() -> None:
            await conn.call(
                "ReportProgress",
                lambda: agent_pb2.ReportProgressRequest(node_id=conn.node_id),
                timeout=0.5,
            )

        reporting = asyncio.create_task(report())
        await async_wait_until(lambda: not conn.reachable, timeout=20)
        assert not reporting.done()  # still retrying: the coordinator is down
        servicer = Coordinator()
        server = await serve(address, servicer)
        await asyncio.wait_for(reporting, 20)
        assert conn.reachable
        # The heartbeat loop sleeps INTERVAL_S: a heartbeat now comes only from the wake-up.
        await wait_heartbeats(servicer, 1, timeout=10)
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        await conn.close()
        await server.stop(None)


async def test_the_heartbeat_loop_ends_when_the_agent_stops_without_a_cancellation(
    tmp_path: Path,
) -> None:
    """The agent's stop ends the loop by itself: a cancellation can be lost (Python 3.11's
    `asyncio.wait_for` returns when its event is already set; gRPC's unary call turns a
    cancellation into an RpcError when the call finishes meanwhile), and an agent that
    waited for a loop only a cancellation ends never left."""
    address = f"127.0.0.1:{free_port()}"
    servicer = Coordinator()
    server = await serve(address, servicer)
    stop = asyncio.Event()
    conn, beats = beating(address, tmp_path / "agent", stop)
    try:
        await wait_heartbeats(servicer, 1, timeout=10)  # then it sleeps INTERVAL_S
        stop.set()
        done, _ = await asyncio.wait({beats}, timeout=10)
        assert done, "the heartbeat loop went on after the agent stopped"
        assert not beats.cancelled() and beats.exception() is None
        assert len(servicer.heartbeats) == 1
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        await conn.close()
        await server.stop(None)
