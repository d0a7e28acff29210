"""JobService: submitters -> coordinator (blob uploads, job queries, job events).

SubmitJob, WatchJob, CancelJob, DownloadResult and GetRounds go to the training engine, and
so do GetQueue and SetJobPriority (the cluster scheduler's), once the caller's rights are
checked here: a submitter sees the queue entries of its own jobs only (plus how many others
there are) and may lower its own job's priority, never raise it.

UploadBlob protocol: the first message is the header (sha256 lowercase hex, size, offset); the
others are chunks of at most 1 MiB whose offsets follow each other from the header's offset.
- The blob already stored: answered at once (dedup), the rest of the stream is not read.
- offset must equal the bytes held for this blob (GetBlobStatus.received_bytes), else
  FAILED_PRECONDITION saying how many are held; offset 0 always starts afresh.
- size over --max-blob-bytes: RESOURCE_EXHAUSTED before any byte is stored.
- The stream ends with every byte received: the hash is verified and the blob published; the
  response carries ``blob``. A mismatch is DATA_LOSS and the partial upload is discarded.
- The stream ends early: OK with ``received_bytes`` (< size) and an empty ``blob``: resume
  later from received_bytes. A call cut off (cancelled, connection lost) keeps the bytes
  written so far for the same purpose.
- Another upload of the same blob by the same identity in progress: ABORTED.
- Uploads are per identity (coordinator/store/blobs.py): a blob stored already but not the caller's
  (not uploaded by it, not used by its jobs) is not answered at once: the caller sends its
  bytes like anyone; two identities' partial uploads of one blob never touch each other.
- Limits (RESOURCE_EXHAUSTED naming them): the identity's storage quota (--blob-quota-bytes),
  concurrent upload streams per identity and in all (--max-upload-streams[-total]). A stream
  silent for --upload-idle-timeout is closed with DEADLINE_EXCEEDED; the bytes received are
  kept for a resume. Partial uploads not written to for --partial-upload-ttl are deleted.

DeleteBlob (coordinator/store/blobs.py BlobStore.delete): the caller's hold on a blob it uploaded
goes (its quota freed), and the bytes once nobody holds it and no job in progress uses it.

GetBlobStatus answers NOT_FOUND for anything the caller may not see (a blob of others, or
none at all: the two look the same). WatchJob streams count against the per-identity cap of
watch streams shared with WatchEvents (--max-watch-streams). SubmitJob is refused with
RESOURCE_EXHAUSTED when the caller has --max-live-jobs live jobs (coordinator/trust/job_cap.py),
or has as many submissions in progress as one tenant may (coordinator/engine/submit_gate.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from coordinator.api.queries import (
    check_priority,
    clamp_limit,
    get_job,
    get_queue,
    list_jobs,
    watch_caps,
)
from coordinator.core.errors import DeadlineExceededError, InvalidArgumentError, NotFoundError
from coordinator.core.ids import is_job_id, require_sha256
from coordinator.core.principal import current_principal, current_principal_id
from coordinator.core.stream_caps import StreamCaps, fetch_caps
from coordinator.engine.api import TrainingEngine
from coordinator.store.base import Store
from coordinator.store.blobs import BlobCaller, BlobStore, Upload
from coordinator.trust.auth import owner_filter, require_job_access, require_priority_change
from coordinator.trust.job_cap import DEFAULT_MAX_LIVE_JOBS, LiveJobCap
from epochmesh.v1 import common_pb2, job_pb2, scheduler_pb2

Ctx: TypeAlias = grpc.aio.ServicerContext


async def _next_part(
    messages: AsyncIterator[job_pb2.UploadBlobRequest], idle_s: float, upload: Upload | None
) -> job_pb2.UploadBlobRequest | None:
    """The stream's next message (None at its end); DEADLINE_EXCEEDED after ``idle_s`` of
    silence (the bytes received so far are kept)."""
    try:
        async with asyncio.timeout(idle_s):
            return await anext(messages, None)
    except TimeoutError:
        if upload is None:
            raise DeadlineExceededError(
                f"UploadBlob sent no header within {idle_s:g}s (--upload-idle-timeout): closed"
            ) from None
        raise DeadlineExceededError(
            f"UploadBlob stream silent for {idle_s:g}s (--upload-idle-timeout): closed; "
            f"{upload.received} bytes of blob {upload.sha256} are held, resume at that offset"
        ) from None


class JobService:
    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        engine: TrainingEngine,
        watchers: StreamCaps | None = None,
        fetchers: StreamCaps | None = None,
        max_live_jobs: int = DEFAULT_MAX_LIVE_JOBS,
    ) -> None:
        self._store = store
        self._live_jobs = LiveJobCap(store, max_live_jobs)
        self._blobs = blobs
        self._engine = engine
        self._watchers = watchers or watch_caps()
        self._fetchers = fetchers or fetch_caps()

    async def _check_owner(self, job_id: str) -> None:
        """Before handing a job RPC to the engine: a submitter may touch only its own jobs
        (an unknown job is left to the engine to answer)."""
        if owner_filter() is None or not is_job_id(job_id):
            return
        job = await self._store.get_job(job_id)
        if job is not None:
            require_job_access(job)

    async def UploadBlob(
        self, request_iterator: AsyncIterator[job_pb2.UploadBlobRequest], ctx: Ctx
    ) -> job_pb2.UploadBlobResponse:
        caller = BlobCaller.of(current_principal())
        with self._blobs.streams.hold(caller.identity):
            return await self._upload(aiter(request_iterator), caller)

    async def _upload(
        self, messages: AsyncIterator[job_pb2.UploadBlobRequest], caller: BlobCaller
    ) -> job_pb2.UploadBlobResponse:
        idle_s = self._blobs.limits.idle_timeout_s
        first = await _next_part(messages, idle_s, None)
        if first is None:
            raise InvalidArgumentError("empty UploadBlob stream: send the header first")
        if first.WhichOneof("part") != "header":
            raise InvalidArgumentError("the first UploadBlob message must be the header")
        header = first.header
        started = await self._blobs.begin_upload(header.sha256, header.size, header.offset, caller)
        if not isinstance(started, Upload):
            ref = common_pb2.BlobRef(sha256=started.sha256, size=started.size)
            return job_pb2.UploadBlobResponse(blob=ref, received_bytes=started.size)
        async with started as upload:
            while (msg := await _next_part(messages, idle_s, upload)) is not None:
                if msg.WhichOneof("part") != "chunk":
                    raise InvalidArgumentError("only the first UploadBlob message is a header")
                await upload.write(msg.chunk.offset, msg.chunk.data)
            if not upload.complete:
                return job_pb2.UploadBlobResponse(received_bytes=upload.received)
            record = await upload.finish()
        ref = common_pb2.BlobRef(sha256=record.sha256, size=record.size)
        return job_pb2.UploadBlobResponse(blob=ref, received_bytes=record.size)

    async def GetBlobStatus(
        self, req: job_pb2.GetBlobStatusRequest, ctx: Ctx
    ) -> job_pb2.GetBlobStatusResponse:
        require_sha256(req.sha256)
        status = await self._blobs.status(req.sha256, BlobCaller.of(current_principal()))
        if status is None:
            raise NotFoundError(
                f"no blob {req.sha256} of yours: a caller sees the blobs it uploaded or its "
                "jobs use, and its own partial uploads"
            )
        return job_pb2.GetBlobStatusResponse(
            complete=status.complete, received_bytes=status.received_bytes, size=status.size
        )

    async def DeleteBlob(
        self, req: job_pb2.DeleteBlobRequest, ctx: Ctx
    ) -> job_pb2.DeleteBlobResponse:
        released, deleted = await self._blobs.delete(req.sha256, BlobCaller.of(current_principal()))
        return job_pb2.DeleteBlobResponse(released_bytes=released, deleted=deleted)

    async def SubmitJob(self, req: job_pb2.SubmitJobRequest, ctx: Ctx) -> common_pb2.Job:
        # A tenant at its cap of live jobs is refused here, before anything else. The engine
        # counts again when it stores the job: this lock is not held through the program
        # check, whose queue serves tenants in turn (coordinator/engine/submit_gate.py).
        async with self._live_jobs.hold(current_principal_id()):
            pass
        return await self._engine.submit_job(req, ctx)

    async def GetJob(self, req: job_pb2.GetJobRequest, ctx: Ctx) -> common_pb2.Job:
        return await get_job(self._store, req.job_id)

    async def ListJobs(self, req: job_pb2.ListJobsRequest, ctx: Ctx) -> job_pb2.ListJobsResponse:
        return job_pb2.ListJobsResponse(jobs=await list_jobs(self._store, req.states, req.limit))

    async def WatchJob(
        self, req: job_pb2.WatchJobRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.JobUpdate]:
        await self._check_owner(req.job_id)
        with self._watchers.hold(current_principal_id()):
            async for update in self._engine.watch_job(req, ctx):
                yield update

    async def CancelJob(self, req: job_pb2.CancelJobRequest, ctx: Ctx) -> common_pb2.Job:
        await self._check_owner(req.job_id)
        return await self._engine.cancel_job(req, ctx)

    async def DownloadResult(
        self, req: job_pb2.DownloadResultRequest, ctx: Ctx
    ) -> AsyncIterator[job_pb2.DownloadResultResponse]:
        await self._check_owner(req.job_id)
        with self._fetchers.hold(current_principal_id()):
            async for part in self._engine.download_result(req, ctx):
                yield part

    async def GetRounds(self, req: job_pb2.GetRoundsRequest, ctx: Ctx) -> job_pb2.GetRoundsResponse:
        await self._check_owner(req.job_id)
        return await self._engine.get_rounds(req, ctx)

    async def GetJobEvents(
        self, req: job_pb2.GetJobEventsRequest, ctx: Ctx
    ) -> job_pb2.GetJobEventsResponse:
        await get_job(self._store, req.job_id)
        if req.since_id < 0:
            raise InvalidArgumentError(f"since_id must not be negative, got {req.since_id}")
        events = await self._store.list_events(
            req.since_id, job_id=req.job_id, limit=clamp_limit(req.limit)
        )
        return job_pb2.GetJobEventsResponse(events=events)

    async def GetQueue(
        self, req: scheduler_pb2.GetQueueRequest, ctx: Ctx
    ) -> scheduler_pb2.GetQueueResponse:
        return get_queue(self._engine)

    async def SetJobPriority(self, req: job_pb2.SetJobPriorityRequest, ctx: Ctx) -> common_pb2.Job:
        check_priority(req.priority)
        job = await get_job(self._store, req.job_id)
        require_priority_change(job, req.priority)
        return await self._engine.set_job_priority(job.job_id, req.priority)
