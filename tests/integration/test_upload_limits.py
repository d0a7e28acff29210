"""Quotas and timeouts of uploads and streams (issue 22), played by a hostile tenant against an
in-process coordinator over mutual TLS while an honest tenant works beside it: the storage
quota, the caps on concurrent upload and watch streams (RESOURCE_EXHAUSTED naming the limit,
nobody else affected), idle upload streams closed with their bytes kept, partial uploads
expiring after their TTL (periodically and at start), and SubmitJob reading only the headers
of shards."""

from __future__ import annotations

import json
import os
import resource
import struct
import time
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from coordinator.engine.engine import Engine
from epochmesh.packaging import PackedJob
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2, scheduler_pb2
from tests.integration.blob_calls import MIB, Party, S, chunks, header, refused, sha, tiny_job
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    return tiny_job(tmp_path_factory.mktemp("job"))


async def parties(coord: Coordinator, *roles: str) -> list[Party]:
    return [Party(coord, role) for role in roles]


async def test_quota_and_upload_stream_caps(tmp_path: Path) -> None:
    async with in_process_coordinator(
        tmp_path / "coord",
        blob_quota_bytes=3 * MIB,
        max_upload_streams=2,
        max_upload_streams_total=4,
    ) as coord:
        alice, mallory, bob = await parties(coord, "submitter", "submitter", "submitter")
        try:
            # The quota: blobs uploaded plus partial uploads' announced sizes.
            await mallory.put(os.urandom(2 * MIB))
            big = os.urandom(2 * MIB)
            await refused(
                mallory.upload([header(sha(big), len(big)), *chunks(big)]),
                S.RESOURCE_EXHAUSTED,
                "storage quota",
                "--blob-quota-bytes",
            )
            assert (await coord.blobs.stats()).count == 1  # nothing of it stored
            half = os.urandom(MIB)
            reserved = await mallory.upload([header(sha(half), len(half))])  # started, no bytes
            assert reserved.received_bytes == 0
            more = os.urandom(MIB)
            await refused(
                mallory.upload([header(sha(more), len(more)), *chunks(more)]),
                S.RESOURCE_EXHAUSTED,
                "--blob-quota-bytes",
            )
            # Alice has a quota of her own.
            kept = [os.urandom(2 * MIB), os.urandom(MIB // 2)]
            for data in kept:
                await alice.put(data)

            # Concurrent upload streams: mallory holds two open, the third is refused ...
            stalled = [mallory.stalled_upload([]) for _ in range(2)]
            await async_wait_until(
                lambda: coord.blobs.streams.open_streams(mallory.id) == 2, timeout=10
            )
            await refused(
                mallory.upload([header(sha(b"x"), 1), *chunks(b"x")]),
                S.RESOURCE_EXHAUSTED,
                "at most 2 per identity",
                "--max-upload-streams",
            )
            # ... while alice uploads as before.
            small = os.urandom(1000)
            await alice.put(small)
            # The cap in all: bob fills it up; then a stream of anyone's waits for a free one.
            stalled += [bob.stalled_upload([]) for _ in range(2)]
            await async_wait_until(lambda: coord.blobs.streams.open_streams() == 4, timeout=10)
            await refused(alice.put(small), S.RESOURCE_EXHAUSTED, "in all")
            for call in stalled:
                call.cancel()
            await async_wait_until(lambda: coord.blobs.streams.open_streams() == 0, timeout=10)
            await bob.put(b"x")  # the slots are free again
            # Nothing alice had stored is lost.
            for data in [*kept, small]:
                assert await coord.blobs.read_bytes(sha(data)) == data
        finally:
            for party in (alice, mallory, bob):
                await party.close()


async def test_idle_upload_streams_close_and_partial_uploads_expire(tmp_path: Path) -> None:
    data_dir = tmp_path / "coord"
    limits = {"upload_idle_timeout_s": 0.5, "partial_upload_ttl_s": 1.5}
    data = os.urandom(2 * MIB + 5)
    digest = sha(data)
    async with in_process_coordinator(data_dir, **limits) as coord:  # type: ignore[arg-type]
        alice, mallory = await parties(coord, "submitter", "submitter")
        try:
            # A stream that sends a chunk and then nothing is closed; its bytes are kept.
            details = await refused(
                mallory.stalled_upload([header(digest, len(data)), *chunks(data)[:1]]),
                S.DEADLINE_EXCEEDED,
                "--upload-idle-timeout",
                "resume at that offset",
            )
            assert str(MIB) in details
            assert coord.blobs.streams.open_streams(mallory.id) == 0
            await refused(mallory.stalled_upload([]), S.DEADLINE_EXCEEDED, "no header")
            assert (await mallory.status(digest)).received_bytes == MIB
            # Alice completes an upload meanwhile; later sweeps never touch a stored blob.
            kept = os.urandom(MIB)
            await alice.put(kept)

            # Mallory's abandoned partial upload expires after its TTL.
            async def expired() -> bool:
                try:
                    await mallory.status(digest)
                except grpc.aio.AioRpcError as err:
                    return err.code() == S.NOT_FOUND
                return False

            await async_wait_until(expired, timeout=15)
            partials = coord.config.blob_dir / "partial"
            assert not [p for p in partials.rglob("*") if p.is_file()]
            assert await coord.blobs.read_bytes(sha(kept)) == kept

            # A partial upload left behind when the coordinator stops ...
            held = await alice.upload([header(digest, len(data)), *chunks(data)[:1]])
            assert held.received_bytes == MIB
        finally:
            await alice.close()
            await mallory.close()
    # ... that outlived its TTL while it was down is deleted at start.
    for path in (data_dir / "blobs" / "partial").rglob("*"):
        if path.is_file():
            old = time.time() - 3600
            os.utime(path, (old, old))
    async with in_process_coordinator(data_dir, **limits) as coord:  # type: ignore[arg-type]
        partials = coord.config.blob_dir / "partial"
        assert not [p for p in partials.rglob("*") if p.is_file()]
        assert (await coord.blobs.stats()).count == 1  # alice's blob stays


async def test_watch_streams_are_capped_per_identity(tmp_path: Path, packed: PackedJob) -> None:
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, max_watch_streams=2, max_watch_streams_total=8
    ) as coord:
        alice, mallory, op1, op2 = await parties(
            coord, "submitter", "submitter", "operator", "operator"
        )
        try:
            jobs = {}
            for party in (alice, mallory):
                await party.put_job(packed)
                jobs[party.id] = (await party.submit(packed)).job_id

            def watch(party: Party) -> grpc.aio.UnaryStreamCall[object, object]:
                req = job_pb2.WatchJobRequest(job_id=jobs[party.id])
                return party.jobs.WatchJob(req, timeout=60)

            held = [watch(mallory) for _ in range(2)]
            for call in held:
                first = await call.read()
                assert first.job.job_id == jobs[mallory.id]
            third = watch(mallory)
            await refused(third.read(), S.RESOURCE_EXHAUSTED, "--max-watch-streams")
            # Alice watches her job as before.
            mine = watch(alice)
            assert (await mine.read()).job.job_id == jobs[alice.id]
            mine.cancel()
            # A watch mallory closes frees its slot.
            held[0].cancel()
            await async_wait_until(lambda: _watching(coord, mallory) == 1, timeout=10)
            again = watch(mallory)
            assert (await again.read()).job.job_id == jobs[mallory.id]

            # WatchEvents (operators): the same cap, per identity.
            def events(party: Party) -> grpc.aio.UnaryStreamCall[object, object]:
                req = scheduler_pb2.WatchEventsRequest(follow=True)
                return party.sched.WatchEvents(req, timeout=60)

            followers = [events(op1) for _ in range(2)]
            for call in followers:
                assert (await call.read()).id > 0
            await refused(events(op1).read(), S.RESOURCE_EXHAUSTED, "per identity")
            other = events(op2)
            assert (await other.read()).id > 0
            for call in [*held, again, *followers, other]:
                call.cancel()
        finally:
            for party in (alice, mallory, op1, op2):
                await party.close()


def _watching(coord: Coordinator, party: Party) -> int:
    return coord.watchers.open_streams(party.id)


async def test_fetch_streams_are_capped_per_identity(tmp_path: Path) -> None:
    """FetchBlob streams each hold a stored file open: a caller holding two (read one chunk,
    then silent: flow control keeps the server's side open) gets RESOURCE_EXHAUSTED for a
    third, another caller fetches as before, and a closed stream frees its slot."""
    async with in_process_coordinator(
        tmp_path / "coord", max_fetch_streams=2, max_fetch_streams_total=8
    ) as coord:
        alice, hog, other = await parties(coord, "submitter", "operator", "operator")
        try:
            big = os.urandom(48 * MIB)  # far more than the HTTP/2 windows hold in flight
            digest = (await alice.put(big)).sha256
            small = await alice.put(b"small blob")

            def fetch(party: Party) -> grpc.aio.UnaryStreamCall[object, object]:
                return party.agent.FetchBlob(agent_pb2.FetchBlobRequest(sha256=digest), timeout=60)

            held = [fetch(hog) for _ in range(2)]
            for call in held:
                assert (await call.read()).chunk.offset == 0
            await refused(
                fetch(hog).read(),
                S.RESOURCE_EXHAUSTED,
                "at most 2 per identity",
                "--max-fetch-streams",
            )
            assert await other.fetch(small.sha256) == b"small blob"
            held[0].cancel()
            await async_wait_until(lambda: _fetching(coord, hog) == 1, timeout=10)
            assert await hog.fetch(small.sha256) == b"small blob"
            held[1].cancel()
        finally:
            for party in (alice, hog, other):
                await party.close()


def _fetching(coord: Coordinator, party: Party) -> int:
    return coord.fetchers.open_streams(party.id)


async def test_submit_reads_only_the_headers_of_shards(tmp_path: Path, packed: PackedJob) -> None:
    """A shard of 1 GiB (sparse on disk) is checked without reading its tensor data."""
    samples = 1 << 24  # 16 Mi samples: x float32 [N, 12] would be 768 MiB, y int64 [N] 128 MiB
    x_bytes, y_bytes = samples * 12 * 4, samples * 8
    head = json.dumps(
        {
            "x": {"dtype": "F32", "shape": [samples, 12], "data_offsets": [0, x_bytes]},
            "y": {"dtype": "I64", "shape": [samples], "data_offsets": [x_bytes, x_bytes + y_bytes]},
        }
    ).encode()
    async with in_process_coordinator(tmp_path / "coord", engine_factory=Engine) as coord:
        alice = Party(coord, "submitter")
        try:
            await alice.put(packed.program)
            await alice.put(packed.initial_state)
            # The shard's file is written sparse straight into the store (an upload of 900 MiB
            # would take the test's time): its bytes are what they say, recorded for alice.
            path = tmp_path / "shard"
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(head)) + head)
                f.truncate(8 + len(head) + x_bytes + y_bytes)
            digest = "0" * 63 + "1"  # any id: SubmitJob never hashes the shard again
            final = coord.blobs.path(digest)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, final)
            size = final.stat().st_size
            await coord.store.add_blob(digest, size)
            await coord.store.add_blob_owner(digest, alice.id)
            shard = common_pb2.BlobRef(sha256=digest, size=size)
            spec = common_pb2.JobSpec()
            spec.CopyFrom(packed.spec)
            grew_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            started = time.monotonic()
            job = await alice.jobs.SubmitJob(
                job_pb2.SubmitJobRequest(
                    spec=spec,
                    program=common_pb2.BlobRef(sha256=sha(packed.program)),
                    initial_state=common_pb2.BlobRef(sha256=sha(packed.initial_state)),
                    shards=[common_pb2.Shard(blob=shard, start=0, count=samples)],
                ),
                timeout=60,
            )
            assert job.num_samples == samples
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
            assert (peak - grew_before) * 1024 < 256 * MIB, "SubmitJob read the shard's data"
            assert time.monotonic() - started < 30
        finally:
            await alice.close()
