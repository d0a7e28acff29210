"""Raw gRPC calls of the blob tests, each party on its own channel with its own certificate
(mutual TLS against an in-process coordinator): uploads, blob status, fetches, submissions."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from epochmesh import identity as idm
from epochmesh.export_cache import ExportCache
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.packaging import PackedJob, build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2_grpc,
)
from tests.fixtures import write_mlp_job

if TYPE_CHECKING:
    from coordinator.app import Coordinator

MIB = 1 << 20
S = grpc.StatusCode


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def header(digest: str, size: int, offset: int = 0) -> job_pb2.UploadBlobRequest:
    return job_pb2.UploadBlobRequest(
        header=job_pb2.UploadBlobHeader(sha256=digest, size=size, offset=offset)
    )


def chunks(data: bytes, start: int = 0) -> list[job_pb2.UploadBlobRequest]:
    return [
        job_pb2.UploadBlobRequest(
            chunk=common_pb2.DataChunk(offset=o, data=data[o : o + MAX_CHUNK_BYTES])
        )
        for o in range(start, len(data), MAX_CHUNK_BYTES)
    ]


async def refused(call: Awaitable[object], code: grpc.StatusCode, *words: str) -> str:
    """The call fails with ``code`` and a message holding ``words``; the message."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    for word in words:
        assert word in details, details
    return details


def tiny_job(tmp_path: Path, name: str = "tiny") -> PackedJob:
    """The tiny MLP job (exported once per test session: the shared export cache)."""
    job_toml = write_mlp_job(
        tmp_path / name,
        64,
        overrides={"name": name, "train": {"epochs": 1, "global_batch": 16}},
    )
    return build_job(load_spec(job_toml), cache=ExportCache.default())


class Party:
    """One identity (submitter, node or operator) with its own channel and stubs."""

    def __init__(self, coord: Coordinator, role: str) -> None:
        self.identity = coord.issue_identity(role)
        self.id = self.identity.principal.id
        self.channel = idm.secure_aio_channel(coord.address, self.identity)
        self.jobs = job_pb2_grpc.JobServiceStub(self.channel)
        self.agent = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.sched = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self._stalls: list[asyncio.Event] = []

    async def close(self) -> None:
        for stall in self._stalls:
            stall.set()
        await self.channel.close()

    async def upload(
        self, items: Sequence[job_pb2.UploadBlobRequest]
    ) -> job_pb2.UploadBlobResponse:
        async def stream() -> AsyncIterator[job_pb2.UploadBlobRequest]:
            for item in items:
                yield item

        reply: job_pb2.UploadBlobResponse = await self.jobs.UploadBlob(stream(), timeout=30)
        return reply

    async def put(self, data: bytes) -> common_pb2.BlobRef:
        reply = await self.upload([header(sha(data), len(data)), *chunks(data)])
        assert reply.blob.sha256 == sha(data), reply
        return reply.blob

    def stalled_upload(
        self, items: Sequence[job_pb2.UploadBlobRequest]
    ) -> grpc.aio.StreamUnaryCall[job_pb2.UploadBlobRequest, job_pb2.UploadBlobResponse]:
        """An upload that sends ``items`` and then nothing until the party closes."""
        stall = asyncio.Event()
        self._stalls.append(stall)

        async def stream() -> AsyncIterator[job_pb2.UploadBlobRequest]:
            for item in items:
                yield item
            await stall.wait()

        return self.jobs.UploadBlob(stream(), timeout=60)

    async def status(self, digest: str) -> job_pb2.GetBlobStatusResponse:
        reply: job_pb2.GetBlobStatusResponse = await self.jobs.GetBlobStatus(
            job_pb2.GetBlobStatusRequest(sha256=digest), timeout=10
        )
        return reply

    async def fetch(self, digest: str) -> bytes:
        out = bytearray()
        async for part in self.agent.FetchBlob(
            agent_pb2.FetchBlobRequest(sha256=digest), timeout=30
        ):
            out += part.chunk.data
        return bytes(out)

    async def submit(
        self, packed: PackedJob, refs: dict[str, common_pb2.BlobRef] | None = None
    ) -> common_pb2.Job:
        """SubmitJob of ``packed`` naming ``refs`` ("program", "initial_state", "shard0", ...)
        where given, else the sha256 of the packed bytes."""
        refs = refs or {}
        program = refs.get("program") or common_pb2.BlobRef(sha256=sha(packed.program))
        state = refs.get("initial_state") or common_pb2.BlobRef(sha256=sha(packed.initial_state))
        shards = [
            common_pb2.Shard(
                blob=refs.get(f"shard{i}") or common_pb2.BlobRef(sha256=sha(data)),
                start=start,
                count=count,
            )
            for i, (start, count, data) in enumerate(packed.shards)
        ]
        job: common_pb2.Job = await self.jobs.SubmitJob(
            job_pb2.SubmitJobRequest(
                spec=packed.spec, program=program, initial_state=state, shards=shards
            ),
            timeout=60,
        )
        return job

    async def put_job(self, packed: PackedJob) -> None:
        """Upload every blob of ``packed`` as this party."""
        for data in (packed.program, packed.initial_state, *(d for _, _, d in packed.shards)):
            await self.put(data)
