"""Resumable, content-addressed blob uploads from the CLI to the coordinator.

For every distinct blob (by sha256) the uploader first asks ``GetBlobStatus``:

- a blob the coordinator already holds completely for this user is skipped (nothing is sent);
- a partial upload of this user's continues from ``received_bytes``;
- otherwise (NOT_FOUND: nothing of this user's, whatever others hold) the whole blob is
  streamed: one header, then chunks of at most 1 MiB.

A connection lost during an upload is retried (up to ``attempts`` times, with a short
backoff), each time resuming from what the coordinator reports it holds. Given several
coordinator addresses, the retry goes to the one serving then (`Coordinator.follow`): a standby
that took over from a killed active one resumes the upload from the bytes in the blob directory
they share.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from client.rpc import CliError, Coordinator, ExitCode, error_from_rpc
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import common_pb2, job_pb2

log = logging.getLogger(__name__)

# (bytes done so far, bytes in total) -> None
ProgressFn = Callable[[int, int], None]

# DEADLINE_EXCEEDED: the coordinator closed a stream that stalled (--upload-idle-timeout),
# keeping its bytes; the upload resumes from them.
_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


class _Interrupted(Exception):
    """The coordinator ended an upload before the whole blob arrived."""


@dataclass
class UploadStats:
    blobs: int = 0  # distinct blobs
    total_bytes: int = 0  # their total size
    sent_bytes: int = 0  # bytes actually streamed
    skipped_blobs: int = 0  # already complete on the coordinator
    skipped_bytes: int = 0
    resumed_bytes: int = 0  # bytes of partial uploads the coordinator already held
    seconds: float = 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.sent_bytes / self.seconds if self.seconds > 0 else 0.0


def blob_ref(data: bytes) -> common_pb2.BlobRef:
    return common_pb2.BlobRef(sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def upload_requests(
    ref: common_pb2.BlobRef,
    data: bytes | memoryview,
    offset: int,
    on_chunk: Callable[[int], None] | None = None,
    chunk_size: int = MAX_CHUNK_BYTES,
) -> Iterator[job_pb2.UploadBlobRequest]:
    """The UploadBlob client stream: a header, then chunks of ``data[offset:]``."""
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in 1..{MAX_CHUNK_BYTES}")
    yield job_pb2.UploadBlobRequest(
        header=job_pb2.UploadBlobHeader(sha256=ref.sha256, size=ref.size, offset=offset)
    )
    view = memoryview(data)
    pos = offset
    while pos < len(view):
        piece = bytes(view[pos : pos + chunk_size])
        yield job_pb2.UploadBlobRequest(chunk=common_pb2.DataChunk(offset=pos, data=piece))
        pos += len(piece)
        if on_chunk is not None:
            on_chunk(len(piece))


class Uploader:
    def __init__(
        self,
        coordinator: Coordinator,
        progress: ProgressFn | None = None,
        *,
        attempts: int = 5,
        chunk_size: int = MAX_CHUNK_BYTES,
    ) -> None:
        self.coord = coordinator
        self.progress = progress
        self.attempts = attempts
        self.chunk_size = chunk_size
        self.stats = UploadStats()
        self._done = 0

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self._done, self.stats.total_bytes)

    def _held_bytes(self, ref: common_pb2.BlobRef) -> int | None:
        """Bytes the coordinator holds of ``ref``; None when it has the whole blob."""
        coord = self.coord
        try:
            status = coord.jobs.GetBlobStatus(
                job_pb2.GetBlobStatusRequest(sha256=ref.sha256), timeout=coord.call_timeout
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise
        if status.complete:
            return None
        held = status.received_bytes
        return held if 0 <= held <= ref.size else 0

    def _upload_one(self, ref: common_pb2.BlobRef, data: bytes) -> bool:
        """Uploads one blob; returns False when the coordinator already had it."""
        coord = self.coord
        delay = 0.2
        start_done = self._done
        for attempt in range(1, self.attempts + 1):
            try:
                held = self._held_bytes(ref)
                if held is None:
                    return attempt > 1
                if attempt == 1:
                    self.stats.resumed_bytes += held
                else:
                    log.warning(
                        "upload of %s resumes at byte %d of %d on %s",
                        ref.sha256[:12],
                        held,
                        ref.size,
                        coord.address,
                    )
                self._done = start_done + held
                self._report()

                def on_chunk(n: int) -> None:
                    self._done += n
                    self.stats.sent_bytes += n
                    self._report()

                reply = coord.jobs.UploadBlob(
                    upload_requests(ref, data, held, on_chunk, self.chunk_size)
                )
                if not reply.blob.sha256 and reply.received_bytes < ref.size:
                    # The coordinator closed the upload early: resume from what it holds.
                    raise _Interrupted(f"upload ended at {reply.received_bytes} bytes")
                if reply.blob.sha256 and reply.blob.sha256 != ref.sha256:
                    raise CliError(
                        ExitCode.INTERNAL,
                        f"the coordinator stored blob {reply.blob.sha256[:12]} "
                        f"instead of {ref.sha256[:12]}",
                        "run submit again",
                    )
                return True
            except _Interrupted as err:
                if attempt == self.attempts:
                    raise CliError(
                        ExitCode.INTERNAL,
                        f"upload of blob {ref.sha256[:12]} did not complete: {err}",
                        "run submit again; it resumes",
                    ) from None
                log.warning("%s; resuming", err)
            except grpc.RpcError as err:
                if err.code() not in _RETRYABLE or attempt == self.attempts:
                    what = f"upload of blob {ref.sha256[:12]}"
                    raise error_from_rpc(err, what, coord.address) from None
                log.warning(
                    "upload of %s interrupted (%s); resuming (attempt %d of %d)",
                    ref.sha256[:12],
                    err.code().name,
                    attempt + 1,
                    self.attempts,
                )
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 3.0)
                lost = coord.address
                if coord.follow():
                    log.warning(
                        "following the active coordinator at %s (was %s)", coord.address, lost
                    )
        raise AssertionError("unreachable")  # pragma: no cover

    def upload_all(self, blobs: Sequence[bytes]) -> list[common_pb2.BlobRef]:
        """Uploads every blob (deduplicated by content); returns their refs in order."""
        self.coord.connect()
        refs = [blob_ref(b) for b in blobs]
        unique: dict[str, tuple[common_pb2.BlobRef, bytes]] = {}
        for ref, data in zip(refs, blobs, strict=True):
            unique.setdefault(ref.sha256, (ref, data))
        self.stats.blobs = len(unique)
        self.stats.total_bytes = sum(ref.size for ref, _ in unique.values())
        t0 = time.monotonic()
        self._report()
        for ref, data in unique.values():
            before = self._done
            sent = self._upload_one(ref, data)
            if not sent:
                self.stats.skipped_blobs += 1
                self.stats.skipped_bytes += ref.size
            self._done = before + ref.size
            self._report()
        self.stats.seconds = time.monotonic() - t0
        return refs
