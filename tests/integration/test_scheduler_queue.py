"""The cluster scheduler's operator and submitter APIs, against an in-process coordinator with
the real engine over real gRPC + TLS (agents played by tests/integration/fake_agent.py):

- GetQueue shows two tenants' jobs with their fair shares, nodes and reasons; a submitter sees
  its own jobs only (and how many others there are);
- SetTenantWeight changes the split between tenants once the holds pass, and persists across a
  coordinator restart;
- who may set what: an owner lowers its own job's priority but does not raise it, nobody but
  an operator touches another tenant's job or a weight; bad input is INVALID_ARGUMENT and the
  server keeps serving after every refusal.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
import torch

from coordinator.engine.engine import Engine
from epochmesh import identity as idm
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import (
    agent_pb2,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.fixtures import write_mlp_job
from tests.integration.fake_agent import FakeAgent, task_indices
from tests.procs import async_wait_until, in_process_coordinator

if TYPE_CHECKING:
    from coordinator.app import Coordinator

pytestmark = pytest.mark.timeout(120)

S = grpc.StatusCode
GLOBAL_BATCH = 16


async def zero_gradient(agent: FakeAgent, task: agent_pb2.Task) -> None:
    _, params = await agent.pull(task.job_id, task.params_version)
    await asyncio.sleep(0.02)  # the "compute" of the round, not a wait for a condition
    zeros = {n: torch.zeros_like(t) for n, t in params.items()}
    await agent.push(task, zeros, kind="gradient", num_samples=len(task_indices(task)))


def packed_job(tmp_path: Path, name: str, samples: int, epochs: int) -> PackedJob:
    job_toml = write_mlp_job(
        tmp_path / name,
        samples,
        overrides={
            "name": name,
            "train": {"epochs": epochs, "global_batch": GLOBAL_BATCH},
            "cluster": {"min_nodes": 1, "max_nodes": 4},
        },
    )
    return build_job(load_spec(job_toml), cache=ExportCache.default())


class Caller:
    """One identity's stubs on its own channel."""

    def __init__(self, coord: Coordinator, identity: idm.Identity) -> None:
        self.coord = coord
        self.identity = identity
        self.id = identity.principal.id
        self.channel = idm.secure_aio_channel(coord.address, identity)
        self.jobs = job_pb2_grpc.JobServiceStub(self.channel)
        self.sched = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)

    async def submit(self, packed: PackedJob) -> common_pb2.Job:
        blobs = self.coord.blobs
        program = await blobs.put_bytes(packed.program, owner=self.id)
        state = await blobs.put_bytes(packed.initial_state, owner=self.id)
        shards = [
            common_pb2.Shard(
                blob=await blobs.put_bytes(data, owner=self.id), start=start, count=count
            )
            for start, count, data in packed.shards
        ]
        return await self.jobs.SubmitJob(
            job_pb2.SubmitJobRequest(
                spec=packed.spec, program=program, initial_state=state, shards=shards
            ),
            timeout=60,
        )

    async def priority(self, job_id: str, priority: str) -> common_pb2.Job:
        req = job_pb2.SetJobPriorityRequest(job_id=job_id, priority=priority)
        return await self.jobs.SetJobPriority(req, timeout=10)

    async def queue(self) -> scheduler_pb2.GetQueueResponse:
        return await self.jobs.GetQueue(scheduler_pb2.GetQueueRequest(), timeout=10)

    async def weight(
        self, tenant: str, weight: float, create: bool = False
    ) -> scheduler_pb2.SetTenantWeightResponse:
        req = scheduler_pb2.SetTenantWeightRequest(tenant=tenant, weight=weight, create=create)
        return await self.sched.SetTenantWeight(req, timeout=10)


@pytest.fixture
async def callers(tmp_path: Path) -> AsyncIterator[tuple[Caller, Caller, Caller]]:
    """An operator and two submitters (two tenants) of a coordinator with the engine."""
    async with in_process_coordinator(tmp_path / "coord", engine_factory=Engine) as coord:
        who = [
            Caller(coord, coord.issue_identity(r)) for r in ("operator", "submitter", "submitter")
        ]
        try:
            yield who[0], who[1], who[2]
        finally:
            for c in who:
                await c.channel.close()


async def refused(call: Awaitable[object], code: S, words: tuple[str, ...] = ()) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    for word in words:
        assert word in details, details


def held(reply: scheduler_pb2.GetQueueResponse) -> dict[str, int]:
    return {e.job_id: e.nodes_held for e in reply.jobs}


async def test_queue_shows_tenants_and_a_weight_changes_the_split_and_persists(
    tmp_path: Path,
) -> None:
    # Long jobs: they run through the whole test.
    job_a = packed_job(tmp_path, "tenant-a", 1600, 50)
    job_b = packed_job(tmp_path, "tenant-b", 1600, 50)
    data_dir = tmp_path / "coord"
    async with in_process_coordinator(
        data_dir, engine_factory=Engine, heartbeat_interval_s=1.0, scheduler_hold_s=0.5
    ) as coord:
        op = Caller(coord, coord.issue_identity("operator"))
        alice = Caller(coord, coord.issue_identity("submitter"))
        bob = Caller(coord, coord.issue_identity("submitter"))
        agents = [await FakeAgent(coord, f"n{i}", 100.0, zero_gradient).start() for i in range(4)]
        try:
            a = await alice.submit(job_a)
            b = await bob.submit(job_b)

            async def split(want_a: int, want_b: int) -> scheduler_pb2.GetQueueResponse | None:
                reply = await op.sched.GetQueue(scheduler_pb2.GetQueueRequest(), timeout=10)
                return reply if held(reply) == {a.job_id: want_a, b.job_id: want_b} else None

            even = await async_wait_until(
                lambda: split(2, 2), timeout=40, interval=0.2, message="A and B on 2 nodes each"
            )
            assert isinstance(even, scheduler_pb2.GetQueueResponse)
            assert [e.job_id for e in even.jobs] == [a.job_id, b.job_id]  # submission order
            ea, eb = even.jobs
            assert (ea.tenant, eb.tenant) == (alice.id, bob.id)
            assert (ea.name, ea.priority, ea.nodes_wanted, ea.min_nodes) == (
                "tenant-a",
                "normal",
                4,
                1,
            )
            assert ea.state in (common_pb2.JOB_STATE_QUEUED, common_pb2.JOB_STATE_RUNNING)
            assert ea.fair_share == pytest.approx(2.0) and eb.fair_share == pytest.approx(2.0)
            assert len(ea.node_ids) == 2 and not set(ea.node_ids) & set(eb.node_ids)
            assert not ea.waiting and ea.reason and ea.value > 0
            assert ea.submitted_ms == a.created_ms
            assert dict(even.tenant_weights) == {} and even.other_jobs == 0

            # A submitter sees its own job only, and the count of the others.
            mine = await alice.queue()
            assert [e.job_id for e in mine.jobs] == [a.job_id] and mine.other_jobs == 1

            done = await op.weight(alice.id, 3.0)
            assert (done.tenant, done.weight) == (alice.id, 3.0)
            three_one = await async_wait_until(
                lambda: split(3, 1), timeout=40, interval=0.2, message="A on 3 nodes, B on 1"
            )
            assert isinstance(three_one, scheduler_pb2.GetQueueResponse)
            assert dict(three_one.tenant_weights) == {alice.id: 3.0}
            assert three_one.jobs[0].fair_share == pytest.approx(3.0)
            assert three_one.jobs[1].fair_share == pytest.approx(1.0)
            # Each submitter sees its own weight only.
            assert dict((await alice.queue()).tenant_weights) == {alice.id: 3.0}
            assert dict((await bob.queue()).tenant_weights) == {}
        finally:
            for x in agents:
                await x.stop()
            for c in (op, alice, bob):
                await c.channel.close()

    async with in_process_coordinator(data_dir, engine_factory=Engine) as coord:
        op = Caller(coord, coord.issue_identity("operator"))
        try:
            reply = await op.sched.GetQueue(scheduler_pb2.GetQueueRequest(), timeout=10)
            assert dict(reply.tenant_weights) == {alice.id: 3.0}
            # The jobs are back in the queue, each with the scheduler's reason.
            assert [e.job_id for e in reply.jobs] == [a.job_id, b.job_id]
            assert all(e.reason and e.tenant for e in reply.jobs), reply
        finally:
            await op.channel.close()


async def test_who_may_change_priorities_and_weights(
    tmp_path: Path, callers: tuple[Caller, Caller, Caller]
) -> None:
    op, alice, bob = callers
    a = await alice.submit(packed_job(tmp_path, "alice-job", 64, 1))
    b = await bob.submit(packed_job(tmp_path, "bob-job", 64, 1))
    assert a.spec.priority == "normal"

    async def still_serving() -> None:
        reply = await op.sched.GetQueue(scheduler_pb2.GetQueueRequest(), timeout=10)
        assert {e.job_id for e in reply.jobs} == {a.job_id, b.job_id}

    # No agents: the jobs wait, and say why.
    q = await alice.queue()
    assert [(e.job_id, e.waiting) for e in q.jobs] == [(a.job_id, True)]
    assert q.jobs[0].reason.startswith("waits:") and q.other_jobs == 1

    denied, invalid = S.PERMISSION_DENIED, S.INVALID_ARGUMENT
    refusals: list[tuple[Callable[[], Awaitable[object]], S, tuple[str, ...]]] = [
        # An owner raises its own job: only operators raise.
        (lambda: alice.priority(a.job_id, "high"), denied, ("only an operator",)),
        # Another tenant's job, even to lower it.
        (lambda: bob.priority(a.job_id, "low"), denied, ("another submitter",)),
        (lambda: alice.priority(b.job_id, "low"), denied, ("another submitter",)),
        # Bad input.
        (lambda: alice.priority(a.job_id, "urgent"), invalid, ("unknown priority",)),
        (lambda: op.priority(a.job_id, ""), invalid, ("high, normal, low",)),
        (lambda: op.priority(a.job_id, "HIGH"), invalid, ("unknown priority",)),
        (lambda: op.priority("nonsense", "low"), invalid, ("job_id",)),
        (lambda: op.priority("j-0000000000", "low"), S.NOT_FOUND, ("not found",)),
        # Weights: operators only, positive finite numbers, a named tenant.
        (lambda: alice.weight(alice.id, 5.0), denied, ("SetTenantWeight",)),
        (lambda: alice.sched.GetQueue(scheduler_pb2.GetQueueRequest()), denied, ()),
        (lambda: op.weight(alice.id, 0.0), invalid, ("positive",)),
        (lambda: op.weight(alice.id, -2.0), invalid, ("positive",)),
        (lambda: op.weight(alice.id, math.nan), invalid, ("positive",)),
        (lambda: op.weight(alice.id, math.inf), invalid, ("positive",)),
        (lambda: op.weight("", 2.0), invalid, ("tenant",)),
        (lambda: op.weight("x" * 200, 2.0), invalid, ("tenant",)),
    ]
    for call, code, words in refusals:
        await refused(call(), code, words)
        await still_serving()
    assert (await op.jobs.GetJob(job_pb2.GetJobRequest(job_id=a.job_id))).spec.priority == "normal"
    assert dict((await op.sched.GetQueue(scheduler_pb2.GetQueueRequest())).tenant_weights) == {}

    # An owner lowers its own job, one step or two, or leaves it where it is.
    assert (await alice.priority(a.job_id, "low")).spec.priority == "low"
    assert (await alice.priority(a.job_id, "low")).spec.priority == "low"
    await refused(alice.priority(a.job_id, "normal"), S.PERMISSION_DENIED, ("low -> normal",))
    # An operator raises anyone's job; its owner may then lower it from high.
    assert (await op.priority(a.job_id, "high")).spec.priority == "high"
    assert (await alice.priority(a.job_id, "normal")).spec.priority == "normal"
    assert (await op.priority(b.job_id, "high")).spec.priority == "high"
    assert (await bob.priority(b.job_id, "low")).spec.priority == "low"
    q = await op.sched.GetQueue(scheduler_pb2.GetQueueRequest())
    assert {e.job_id: e.priority for e in q.jobs} == {a.job_id: "normal", b.job_id: "low"}
    stored = await op.jobs.GetJob(job_pb2.GetJobRequest(job_id=b.job_id))
    assert stored.spec.priority == "low"

    # An operator's weight, for a tenant with or without jobs.
    assert (await op.weight(bob.id, 0.25)).weight == 0.25
    # One the coordinator does not know yet only when asked to create it.
    await refused(op.weight("u-nobody-yet", 2), S.NOT_FOUND, ("u-nobody-yet",))
    assert (await op.weight("u-nobody-yet", 2, create=True)).weight == 2.0
    q = await op.sched.GetQueue(scheduler_pb2.GetQueueRequest())
    assert dict(q.tenant_weights) == {bob.id: 0.25, "u-nobody-yet": 2.0}

    # A job that ended keeps its priority.
    await op.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=b.job_id))
    await refused(bob.priority(b.job_id, "low"), S.FAILED_PRECONDITION, ("already ended",))
    await refused(bob.priority(b.job_id, "high"), S.PERMISSION_DENIED, ())
    await still_serving_without(op, b.job_id)


async def still_serving_without(op: Caller, job_id: str) -> None:
    reply = await op.sched.GetQueue(scheduler_pb2.GetQueueRequest(), timeout=10)
    assert job_id not in {e.job_id for e in reply.jobs}
