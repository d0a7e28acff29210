"""Blob store over gRPC: round trip, resume, corruption, limits, dedup, reconciliation."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2, job_pb2, job_pb2_grpc
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20
LIMIT = 8 * MIB


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with in_process_coordinator(tmp_path / "data", max_blob_bytes=LIMIT) as c:
        yield c


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def header(digest: str, size: int, offset: int = 0) -> job_pb2.UploadBlobRequest:
    return job_pb2.UploadBlobRequest(
        header=job_pb2.UploadBlobHeader(sha256=digest, size=size, offset=offset)
    )


def chunk(offset: int, data: bytes) -> job_pb2.UploadBlobRequest:
    return job_pb2.UploadBlobRequest(chunk=common_pb2.DataChunk(offset=offset, data=data))


def chunks(
    data: bytes, start: int = 0, size: int = MAX_CHUNK_BYTES
) -> list[job_pb2.UploadBlobRequest]:
    return [chunk(o, data[o : o + size]) for o in range(start, len(data), size)]


async def messages(
    items: Sequence[job_pb2.UploadBlobRequest],
) -> AsyncIterator[job_pb2.UploadBlobRequest]:
    for item in items:
        yield item


async def upload(
    jobs: job_pb2_grpc.JobServiceStub, items: Sequence[job_pb2.UploadBlobRequest]
) -> job_pb2.UploadBlobResponse:
    resp: job_pb2.UploadBlobResponse = await jobs.UploadBlob(messages(items))
    return resp


async def fetch(agent: agent_pb2_grpc.AgentServiceStub, digest: str, offset: int = 0) -> bytes:
    out = bytearray()
    async for part in agent.FetchBlob(agent_pb2.FetchBlobRequest(sha256=digest, offset=offset)):
        assert len(part.chunk.data) <= MAX_CHUNK_BYTES
        assert part.chunk.offset == offset + len(out)
        out += part.chunk.data
    return bytes(out)


async def status(jobs: job_pb2_grpc.JobServiceStub, digest: str) -> job_pb2.GetBlobStatusResponse:
    """The caller's view of the blob; nothing of the caller's (NOT_FOUND) reads as empty."""
    try:
        resp: job_pb2.GetBlobStatusResponse = await jobs.GetBlobStatus(
            job_pb2.GetBlobStatusRequest(sha256=digest)
        )
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return job_pb2.GetBlobStatusResponse()
    return resp


async def expect_status(call: object, code: grpc.StatusCode, match: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    assert match in details, details
    return details


async def test_round_trip_and_fetch_from_offset(
    coord: Coordinator, jobs: job_pb2_grpc.JobServiceStub, agent: agent_pb2_grpc.AgentServiceStub
) -> None:
    data = os.urandom(3 * MIB + 12345)
    digest = sha(data)
    await expect_status(
        jobs.GetBlobStatus(job_pb2.GetBlobStatusRequest(sha256=digest)),
        grpc.StatusCode.NOT_FOUND,
        "of yours",
    )
    resp = await upload(jobs, [header(digest, len(data)), *chunks(data)])
    assert resp.blob.sha256 == digest and resp.blob.size == len(data)
    assert resp.received_bytes == len(data)
    st = await status(jobs, digest)
    assert (st.complete, st.received_bytes, st.size) == (True, len(data), len(data))
    assert await fetch(agent, digest) == data
    assert await fetch(agent, digest, offset=MIB + 7) == data[MIB + 7 :]
    tail = [
        p
        async for p in agent.FetchBlob(agent_pb2.FetchBlobRequest(sha256=digest, offset=len(data)))
    ]
    assert len(tail) == 1 and tail[0].total_size == len(data) and tail[0].chunk.data == b""
    assert await coord.blobs.read_bytes(digest) == data
    stored = await coord.store.list_events(kinds=["blob.stored"])
    assert [e.attrs["sha256"] for e in stored] == [digest]
    assert coord.blobs.path(digest).read_bytes() == data

    # Uploading it again is answered at once (dedup), without reading the bytes.
    again = await upload(jobs, [header(digest, len(data))])
    assert again.blob.sha256 == digest and again.received_bytes == len(data)
    assert len(await coord.store.list_events(kinds=["blob.stored"])) == 1


async def test_empty_blob_and_engine_side_api(
    coord: Coordinator, jobs: job_pb2_grpc.JobServiceStub, agent: agent_pb2_grpc.AgentServiceStub
) -> None:
    empty = sha(b"")
    resp = await upload(jobs, [header(empty, 0)])
    assert resp.blob.sha256 == empty and resp.blob.size == 0
    assert await fetch(agent, empty) == b""

    ref = await coord.blobs.put_bytes(b"checkpoint bytes")
    assert ref.sha256 == sha(b"checkpoint bytes") and ref.size == 16
    assert await fetch(agent, ref.sha256) == b"checkpoint bytes"
    with await coord.blobs.open(ref.sha256) as f:
        assert f.read() == b"checkpoint bytes"
    src = coord.config.data_dir / "local.bin"
    src.write_bytes(b"from a file")
    ref2 = await coord.blobs.put_file(src)
    assert await coord.blobs.read_bytes(ref2.sha256) == b"from a file"
    stats = await coord.blobs.stats()
    assert stats.count == 3 and stats.total_bytes == 16 + 11


async def test_resumed_upload_after_half_close(
    coord: Coordinator, jobs: job_pb2_grpc.JobServiceStub, agent: agent_pb2_grpc.AgentServiceStub
) -> None:
    data = os.urandom(3 * MIB + 5)
    digest = sha(data)
    parts = chunks(data)
    first = await upload(jobs, [header(digest, len(data)), *parts[:2]])
    assert first.received_bytes == 2 * MIB and not first.blob.sha256
    st = await status(jobs, digest)
    assert (st.complete, st.received_bytes, st.size) == (False, 2 * MIB, len(data))
    # Not visible until complete.
    await expect_status(fetch(agent, digest), grpc.StatusCode.NOT_FOUND)
    # Resuming at another offset is refused, saying how many bytes are held.
    await expect_status(
        upload(jobs, [header(digest, len(data), offset=MIB), *parts[1:]]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "holds 2097152 bytes",
    )
    done = await upload(jobs, [header(digest, len(data), offset=st.received_bytes), *parts[2:]])
    assert done.blob.sha256 == digest and done.blob.size == len(data)
    assert await fetch(agent, digest) == data


async def test_resume_after_a_cancelled_upload(
    coord: Coordinator, jobs: job_pb2_grpc.JobServiceStub, agent: agent_pb2_grpc.AgentServiceStub
) -> None:
    data = os.urandom(2 * MIB + 100)
    digest = sha(data)
    parts = chunks(data)
    stall = asyncio.Event()

    async def stalled() -> AsyncIterator[job_pb2.UploadBlobRequest]:
        yield header(digest, len(data))
        yield parts[0]
        await stall.wait()  # never: the client gives up

    call = jobs.UploadBlob(stalled())

    async def first_chunk_held() -> bool:
        return (await status(jobs, digest)).received_bytes == MIB

    await async_wait_until(first_chunk_held, timeout=10)
    # While that upload is open, a second one of the same blob is refused.
    await expect_status(
        upload(jobs, [header(digest, len(data))]), grpc.StatusCode.ABORTED, "in progress"
    )
    call.cancel()
    await async_wait_until(lambda: not coord.blobs.uploads_in_progress(), timeout=10)
    st = await status(jobs, digest)
    assert st.received_bytes == MIB and not st.complete
    done = await upload(jobs, [header(digest, len(data), offset=MIB), *parts[1:]])
    assert done.blob.size == len(data)
    assert await fetch(agent, digest) == data


async def test_corrupted_upload_is_refused_and_discarded(
    coord: Coordinator, jobs: job_pb2_grpc.JobServiceStub, agent: agent_pb2_grpc.AgentServiceStub
) -> None:
    data = os.urandom(MIB + 10)
    digest = sha(data)
    corrupted = bytearray(data)
    corrupted[MIB + 3] ^= 0xFF
    await expect_status(
        upload(jobs, [header(digest, len(data)), *chunks(bytes(corrupted))]),
        grpc.StatusCode.DATA_LOSS,
        "hash to",
    )
    st = await status(jobs, digest)
    assert (st.complete, st.received_bytes) == (False, 0)
    assert (await coord.blobs.stats()).count == 0
    await expect_status(fetch(agent, digest), grpc.StatusCode.NOT_FOUND)
    assert not [p for p in (coord.config.blob_dir / "partial").rglob("*") if p.is_file()]
    # The right bytes are accepted afterwards.
    ok = await upload(jobs, [header(digest, len(data)), *chunks(data)])
    assert ok.blob.sha256 == digest


async def test_upload_limits_and_protocol_errors(
    coord: Coordinator, jobs: job_pb2_grpc.JobServiceStub
) -> None:
    data = os.urandom(2 * MIB)
    digest = sha(data)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    await expect_status(
        upload(jobs, [header(digest, LIMIT + 1), chunk(0, data[:MIB])]),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "exceeds the limit",
    )
    assert (await status(jobs, digest)).received_bytes == 0  # nothing was stored
    await expect_status(upload(jobs, []), invalid, "header")
    await expect_status(upload(jobs, [chunk(0, data[:10])]), invalid, "header")
    await expect_status(upload(jobs, [header(digest.upper(), 10)]), invalid, "lowercase hex")
    await expect_status(upload(jobs, [header("abc", 10)]), invalid, "64 lowercase hex")
    await expect_status(upload(jobs, [header(digest, -1)]), invalid, "negative")
    await expect_status(upload(jobs, [header(digest, 10, offset=11)]), invalid, "outside")
    await expect_status(
        upload(jobs, [header(digest, len(data)), chunk(0, data[: MIB + 1])]),
        invalid,
        "chunk limit",
    )
    await expect_status(
        upload(jobs, [header(digest, len(data)), chunk(5, data[:10])]), invalid, "does not follow"
    )
    await expect_status(
        upload(jobs, [header(digest, 10), chunk(0, data[:11])]), invalid, "past the announced size"
    )
    await expect_status(
        upload(jobs, [header(digest, len(data)), header(digest, len(data))]),
        invalid,
        "only the first",
    )
    assert (await coord.blobs.stats()).count == 0
    assert await coord.store.list_events(kinds=["blob.*"]) == []
    # The server still serves uploads.
    ok = await upload(jobs, [header(digest, len(data)), *chunks(data)])
    assert ok.blob.size == len(data)


async def test_reconcile_blob_files_with_the_store(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    good, bad = b"good blob", b"bad blob"
    async with in_process_coordinator(data_dir) as coord:
        kept = await coord.blobs.put_bytes(b"kept")
        lost = await coord.blobs.put_bytes(b"lost")
        blob_dir = coord.config.blob_dir
    # As after a crash between rename and record: files with no record, one of them corrupt;
    # and a record whose file disappeared.
    for content, name in ((good, sha(good)), (b"tampered", sha(bad))):
        (blob_dir / name[:2]).mkdir(exist_ok=True)
        (blob_dir / name[:2] / name).write_bytes(content)
    (blob_dir / lost.sha256[:2] / lost.sha256).unlink()
    (blob_dir / "partial" / "tmp-leftover").write_bytes(b"x")
    async with in_process_coordinator(data_dir) as coord:
        assert await coord.blobs.exists(kept.sha256)
        assert await coord.blobs.read_bytes(sha(good)) == good
        assert not await coord.blobs.exists(sha(bad))
        assert not (blob_dir / sha(bad)[:2] / sha(bad)).exists()
        assert not await coord.blobs.exists(lost.sha256)
        assert not (blob_dir / "partial" / "tmp-leftover").exists()
