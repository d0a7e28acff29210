"""DeleteBlob: a tenant gives up blobs it uploaded (issue 22: the storage quota needs a way out),
played against an in-process coordinator with the real engine, every party on its own
certificate over mutual TLS.

- Giving a blob up frees the quota at once: an upload refused at the quota goes through after.
- A blob two tenants uploaded stays for the other (stored once, deleted with its last holder,
  file and record).
- A blob one of the caller's jobs in progress uses is refused (FAILED_PRECONDITION naming the
  job); once the job ended, its bytes go.
- Another tenant's blob is NOT_FOUND (it looks like none) and stays; a partial upload is given
  up with its reservation; a malformed hash is INVALID_ARGUMENT.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.app import Coordinator
from coordinator.engine.engine import Engine
from epochmesh.v1 import job_pb2
from tests.integration.blob_calls import MIB, Party, S, header, refused, sha, tiny_job
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(120)


async def delete(party: Party, digest: str) -> job_pb2.DeleteBlobResponse:
    reply: job_pb2.DeleteBlobResponse = await party.jobs.DeleteBlob(
        job_pb2.DeleteBlobRequest(sha256=digest), timeout=10
    )
    return reply


def on_disk(coord: Coordinator, digest: str) -> bool:
    return coord.blobs.path(digest).exists()


async def test_giving_blobs_up_frees_the_quota_and_the_disk(tmp_path: Path) -> None:
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, blob_quota_bytes=3 * MIB
    ) as coord:
        alice, bob, mallory = (Party(coord, "submitter") for _ in range(3))
        try:
            first, second = os.urandom(2 * MIB), os.urandom(2 * MIB)
            await alice.put(first)
            await refused(alice.put(second), S.RESOURCE_EXHAUSTED, "storage quota")
            # Mallory cannot give up alice's blob: it looks like none, and stays.
            await refused(delete(mallory, sha(first)), S.NOT_FOUND, "of yours")
            assert on_disk(coord, sha(first))
            gone = await delete(alice, sha(first))
            assert (gone.released_bytes, gone.deleted) == (2 * MIB, True)
            assert not on_disk(coord, sha(first)) and not await coord.blobs.exists(sha(first))
            await alice.put(second)  # the quota is free again
            await refused(delete(alice, sha(first)), S.NOT_FOUND)  # given up already

            # A blob two tenants hold: given up by one, kept for the other.
            shared = os.urandom(MIB // 2)
            await alice.put(shared)
            await bob.put(shared)
            one = await delete(alice, sha(shared))
            assert (one.released_bytes, one.deleted) == (MIB // 2, False)
            assert (await bob.status(sha(shared))).complete
            await refused(alice.status(sha(shared)), S.NOT_FOUND)
            last = await delete(bob, sha(shared))
            assert (last.released_bytes, last.deleted) == (MIB // 2, True)
            assert not on_disk(coord, sha(shared))
            deleted = [
                e.attrs["sha256"] for e in await coord.store.list_events(kinds=["blob.deleted"])
            ]
            assert deleted == [sha(first), sha(shared)]

            # A partial upload is given up with its reservation.
            partial = os.urandom(MIB)
            held = await alice.upload([header(sha(partial), len(partial))])  # reserved, no bytes
            assert held.received_bytes == 0
            assert not (await alice.status(sha(partial))).complete
            assert (await delete(alice, sha(partial))).released_bytes == 0
            await refused(alice.status(sha(partial)), S.NOT_FOUND)

            await refused(delete(alice, "not-a-hash"), S.INVALID_ARGUMENT)
        finally:
            for party in (alice, bob, mallory):
                await party.close()


async def test_a_blob_of_a_job_in_progress_is_kept_until_the_job_ends(tmp_path: Path) -> None:
    packed = tiny_job(tmp_path / "job")
    async with in_process_coordinator(tmp_path / "coord", engine_factory=Engine) as coord:
        alice = Party(coord, "submitter")
        try:
            await alice.put_job(packed)
            job = await alice.submit(packed)  # queued: no node to run it
            shard = sha(packed.shards[0][2])
            message = await refused(delete(alice, shard), S.FAILED_PRECONDITION, job.job_id)
            assert "in progress" in message
            assert on_disk(coord, shard)
            await alice.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job.job_id), timeout=10)
            gone = await delete(alice, shard)
            assert gone.deleted and gone.released_bytes == len(packed.shards[0][2])
            assert not on_disk(coord, shard)
            # The ended job's record still names it; reading it is NOT_FOUND, nothing else.
            ended = await coord.store.get_job(job.job_id)
            assert ended is not None and ended.shards[0].blob.sha256 == shard
        finally:
            await alice.close()
