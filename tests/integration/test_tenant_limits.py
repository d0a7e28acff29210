"""What one tenant may see of and do to the others, against a real in-process coordinator
(TLS, real SQLite, raw gRPC calls): the node list without donors' peer addresses, other
tenants' job ids or check evidence for a submitter (operators see all), and a cap on live jobs
per tenant (RESOURCE_EXHAUSTED naming it, other tenants unaffected, room again once a job
ends)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from epochmesh import identity as idm
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(60)

S = grpc.StatusCode


async def list_nodes(address: str, ident: idm.Identity) -> dict[str, common_pb2.NodeInfo]:
    async with idm.secure_aio_channel(address, ident) as ch:
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        nodes = (await sched.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=10)).nodes
        one = await sched.GetNode(scheduler_pb2.GetNodeRequest(node_id=nodes[0].node_id))
    out = {n.node_id: n for n in nodes}
    assert out[one.node_id] == one  # GetNode shows what ListNodes shows
    return out


async def test_submitters_see_no_peer_addresses_nor_others_jobs(tmp_path: Path) -> None:
    async with in_process_coordinator(tmp_path / "c", lease_ttl_s=60.0) as coord:
        alice = coord.issue_identity("submitter")
        operator = coord.issue_identity("operator")
        mine = await coord.store.create_job(
            common_pb2.Job(name="mine", state=common_pb2.JOB_STATE_RUNNING),
            owner=alice.principal.id,
        )
        theirs = await coord.store.create_job(
            common_pb2.Job(name="theirs", state=common_pb2.JOB_STATE_RUNNING), owner="u-other"
        )
        node_ids = []
        for i, job in enumerate((theirs, mine)):
            node = coord.issue_identity("node")
            async with idm.secure_aio_channel(coord.address, node) as ch:
                reply = await agent_pb2_grpc.AgentServiceStub(ch).Register(
                    agent_pb2.RegisterRequest(name=f"n{i}", peer_address=f"10.9.8.{i}:7100"),
                    timeout=10,
                )
            node_ids.append(reply.node_id)
            await coord.registry.set_busy(reply.node_id, job.job_id)
        busy_theirs, busy_mine = node_ids

        seen = await list_nodes(coord.address, alice)
        assert {n.peer_address for n in seen.values()} == {""}
        assert seen[busy_theirs].current_job_id == ""
        assert seen[busy_mine].current_job_id == mine.job_id  # its own job stays
        # Operators see everything.
        full = await list_nodes(coord.address, operator)
        assert full[busy_theirs].peer_address == "10.9.8.0:7100"
        assert full[busy_theirs].current_job_id == theirs.job_id
        assert full[busy_mine].current_job_id == mine.job_id


async def submit(address: str, ident: idm.Identity) -> S:
    async with idm.secure_aio_channel(address, ident) as ch:
        try:
            await job_pb2_grpc.JobServiceStub(ch).SubmitJob(job_pb2.SubmitJobRequest(), timeout=10)
        except grpc.aio.AioRpcError as err:
            if err.code() == S.RESOURCE_EXHAUSTED:
                details = err.details() or ""
                assert "3 live jobs" in details and "--max-live-jobs 3" in details, details
            return err.code()
    return S.OK


async def test_live_jobs_per_tenant_are_capped(tmp_path: Path) -> None:
    async with in_process_coordinator(tmp_path / "c", max_live_jobs=3) as coord:
        alice = coord.issue_identity("submitter")
        bob = coord.issue_identity("submitter")
        states = (
            common_pb2.JOB_STATE_QUEUED,
            common_pb2.JOB_STATE_RUNNING,
            common_pb2.JOB_STATE_PAUSED,
            common_pb2.JOB_STATE_SUCCEEDED,  # ended: does not count
        )
        jobs = [
            await coord.store.create_job(
                common_pb2.Job(name=f"j{i}", state=state), owner=alice.principal.id
            )
            for i, state in enumerate(states)
        ]
        # Alice is at the cap: refused before anything else is looked at.
        assert await submit(coord.address, alice) == S.RESOURCE_EXHAUSTED
        # Bob is not (this control plane has no training engine: the submission goes on to
        # the engine, which says so).
        assert await submit(coord.address, bob) == S.UNIMPLEMENTED
        # One of Alice's jobs ends: she may submit again.
        jobs[0].state = common_pb2.JOB_STATE_CANCELLED
        await coord.store.update_job(jobs[0])
        assert await submit(coord.address, alice) == S.UNIMPLEMENTED
