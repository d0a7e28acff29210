"""Blobs belong to their uploaders and to the jobs that use them (issue 22), played against an
in-process coordinator with the real engine, every party on its own certificate over mutual
TLS: another tenant learns nothing of a blob by its hash (GetBlobStatus, UploadBlob), cannot
name it in SubmitJob, cannot disturb a partial upload of it; a node fetches only the blobs of
the job that holds it; the honest tenant's uploads, job and node are unaffected throughout."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from coordinator.engine.engine import Engine
from coordinator.store.blobs import BlobCaller
from epochmesh.packaging import PackedJob
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2, scheduler_pb2
from tests.integration.blob_calls import MIB, Party, S, chunks, header, refused, sha, tiny_job
from tests.integration.fake_agent import FakeAgent
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    return tiny_job(tmp_path_factory.mktemp("job"))


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as c:
        yield c


@pytest.fixture
async def parties(coord: Coordinator) -> AsyncIterator[dict[str, Party]]:
    who = {
        "alice": Party(coord, "submitter"),
        "mallory": Party(coord, "submitter"),
        "operator": Party(coord, "operator"),
        "rogue_node": Party(coord, "node"),
    }
    try:
        yield who
    finally:
        for party in who.values():
            await party.close()


async def idle_train(agent: FakeAgent, task: agent_pb2.Task) -> None:
    """This test trains nothing."""


async def test_another_tenant_learns_nothing_and_names_nothing(
    coord: Coordinator, parties: dict[str, Party], packed: PackedJob
) -> None:
    alice, mallory, operator = parties["alice"], parties["mallory"], parties["operator"]
    await alice.put_job(packed)
    shard = packed.shards[0][2]

    # GetBlobStatus: alice's blob and a blob nobody has look the same to mallory.
    unknown = sha(b"nobody uploaded this")
    mine = await refused(mallory.status(sha(shard)), S.NOT_FOUND, "of yours")
    nobody = await refused(mallory.status(unknown), S.NOT_FOUND, "of yours")
    assert mine.replace(sha(shard), "X") == nobody.replace(unknown, "X")
    assert (await alice.status(sha(shard))).complete
    assert (await operator.status(sha(shard))).complete  # operators see every blob

    # UploadBlob is no oracle either: mallory's header alone is not answered "stored".
    probe = await mallory.upload([header(sha(shard), len(shard))])
    assert not probe.blob.sha256 and probe.received_bytes == 0

    # SubmitJob naming alice's blobs: refused, nothing stored, the rule in the message.
    jobs_before = await coord.store.list_jobs()
    await refused(mallory.submit(packed), S.FAILED_PRECONDITION, "not uploaded", "submitter")
    assert await coord.store.list_jobs() == jobs_before

    # Alice's own submission goes through.
    job = await alice.submit(packed)
    assert job.owner == alice.id and job.state == common_pb2.JOB_STATE_QUEUED
    assert await coord.store.job_blobs(job.job_id) == {
        sha(packed.program),
        sha(packed.initial_state),
        *(sha(d) for _, _, d in packed.shards),
    }
    # A blob her job uses is hers to name again, even one she did not upload herself.
    assert await coord.blobs.visible(sha(shard), _caller(alice))

    # Mallory gets the blob only by sending all of its bytes: then it is hers too, stored once
    # (one `blob.stored` event; the store's totals are no measure here: alice's queued job may
    # write its first checkpoint meanwhile).
    ref = await mallory.put(shard)
    assert ref.size == len(shard)
    events = await coord.store.list_events(kinds=["blob.stored"])
    assert [e.attrs["sha256"] for e in events].count(sha(shard)) == 1
    assert (await mallory.status(sha(shard))).complete
    assert await operator.fetch(sha(shard)) == shard


def _caller(party: Party) -> BlobCaller:
    return BlobCaller(party.id, full_access=False)


async def test_partial_uploads_are_per_uploader(
    coord: Coordinator, parties: dict[str, Party]
) -> None:
    alice, mallory, operator = parties["alice"], parties["mallory"], parties["operator"]
    data = os.urandom(3 * MIB + 17)
    digest = sha(data)
    parts = chunks(data)
    first = await alice.upload([header(digest, len(data)), *parts[:2]])
    assert first.received_bytes == 2 * MIB

    # Mallory's "fresh start" at offset 0 of the same hash, garbage included, used to truncate
    # alice's partial upload. Now it is mallory's own partial, and fails on its own.
    garbage = os.urandom(len(data))
    await refused(
        mallory.upload([header(digest, len(data)), *chunks(garbage)]), S.DATA_LOSS, "hash to"
    )
    held = await mallory.upload([header(digest, len(data)), *chunks(garbage)[:1]])
    assert held.received_bytes == MIB
    assert (await mallory.status(digest)).received_bytes == MIB
    assert (await alice.status(digest)).received_bytes == 2 * MIB  # untouched

    # Both may upload at once (no ABORTED across identities); alice finishes hers.
    stalled = mallory.stalled_upload([header(digest, len(data), offset=MIB), *parts[1:2]])
    done = await alice.upload([header(digest, len(data), offset=2 * MIB), *parts[2:]])
    assert done.blob.sha256 == digest
    stalled.cancel()
    assert await operator.fetch(digest) == data
    # Mallory still does not see alice's blob: it is hers only once she sends every byte.
    status = await mallory.status(digest)
    assert not status.complete


async def test_a_node_fetches_only_the_blobs_of_its_job(
    coord: Coordinator, parties: dict[str, Party], packed: PackedJob
) -> None:
    alice, rogue = parties["alice"], parties["rogue_node"]
    await alice.put_job(packed)
    other = os.urandom(1000)  # a blob of alice's that no job uses
    await alice.put(other)
    reg = await rogue.agent.Register(agent_pb2.RegisterRequest(name="rogue"), timeout=10)
    assert reg.node_id == rogue.id

    async def rogue_offline() -> bool:
        info = await parties["operator"].sched.GetNode(
            scheduler_pb2.GetNodeRequest(node_id=rogue.id), timeout=10
        )
        return int(info.state) == common_pb2.NODE_STATE_OFFLINE

    # The rogue sends no heartbeat: once its lease has lapsed no job can take it (a job
    # submitted before then may, and a node its job holds may fetch the job's blobs).
    await async_wait_until(rogue_offline, timeout=30, message="the rogue node never went OFFLINE")
    job = await alice.submit(packed)
    program = sha(packed.program)

    honest = await FakeAgent(coord, "honest", 100.0, idle_train).start()
    try:
        engine = coord.engine
        assert isinstance(engine, Engine)
        await async_wait_until(lambda: engine.claims.get(honest.node_id) == job.job_id, timeout=30)
        # The node the job holds fetches its program, state and shards ...
        got = bytearray()
        async for part in honest.stub.FetchBlob(agent_pb2.FetchBlobRequest(sha256=program)):
            got += part.chunk.data
        assert bytes(got) == packed.program
        # ... but no other blob of the tenant's.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in honest.stub.FetchBlob(
                agent_pb2.FetchBlobRequest(sha256=sha(other)), timeout=10
            ):
                pass
        assert info.value.code() == S.PERMISSION_DENIED
        assert "jobs it works for" in (info.value.details() or "")
    finally:
        await honest.stop()

    # A node no job holds (a stranger's certificate knowing the hashes) fetches none, and
    # the answer does not say whether the blob exists.
    for digest in (program, sha(other), sha(b"no such blob")):
        await refused(rogue.fetch(digest), S.PERMISSION_DENIED, "jobs it works for")
    # Alice's job and blobs are intact.
    assert (await alice.status(program)).complete
    stored = await alice.jobs.GetJob(job_pb2.GetJobRequest(job_id=job.job_id), timeout=10)
    assert stored.state != common_pb2.JOB_STATE_FAILED
