"""Content-addressed blob store: files under DATA_DIR/blobs/<sha[:2]>/<sha>.

A blob becomes visible (readable, listed, deduplicated) only after its bytes have been hashed
and match their sha256, the file is fsynced and renamed into place, and the store records it.
Uploads in progress live under DATA_DIR/blobs/partial/<uploader>/<sha> (with <sha>.size
holding the announced size; <uploader> is a hash of the uploader's identity), so that two
uploaders of the same blob never touch each other's bytes, and can be resumed from the bytes
held: everything an upload's resumption needs is in the directory, so coordinators sharing one
(``serve --blob-dir``, coordinator/ha/blob_dir.py) resume each other's uploads; a partial file
being written is locked (flock), and the same upload through another coordinator meanwhile is
answered ABORTED. A hash mismatch at the end of an upload discards the partial and is answered DATA_LOSS
(the bytes were corrupted somewhere: start again from offset 0). A partial upload not written
to for `UploadLimits.partial_ttl_s` is deleted (swept at start and periodically).

Blobs belong to their uploaders (table blob_owners) and to the jobs that use them (job_blobs):
a submitter sees, resumes and names only those (`BlobCaller`); operators and --insecure
callers see every blob. A caller who uploads a blob stored already but not its own sends the
bytes like anyone (that is its proof of holding them); the copy is not stored twice. Each
identity may hold `UploadLimits.quota_bytes` in the blobs it uploaded plus the announced sizes
of its partial uploads.

At open, the directory and the store are reconciled: a blob file the store does not know (a
crash between rename and record) is verified and recorded, or deleted if its bytes are wrong; a
record whose file is gone is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from coordinator.core.config import CoordinatorConfig
from coordinator.core.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from coordinator.core.ids import is_sha256, require_sha256
from coordinator.core.stream_caps import StreamCaps
from coordinator.store.base import BlobRecord, BlobStats, Store
from coordinator.store.events import EventLog
from coordinator.store.retention import LIVE_STATES, job_references
from epochmesh.identity import ROLE_OPERATOR, Principal
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

_READ_BLOCK = 1 << 20
# Upload file I/O runs here, so that a cancelled upload can wait for its last write to end.
_UPLOAD_IO = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="blob-io")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class BlobStatus:
    complete: bool
    received_bytes: int
    size: int  # announced size of a partial upload; the size of a complete blob; else 0


@dataclass(frozen=True)
class BlobCaller:
    """Who reaches for a blob: an identity (a principal id; "" with --insecure) and whether it
    may see every blob (operators, --insecure) or only its own and its jobs' ones."""

    identity: str
    full_access: bool

    @classmethod
    def of(cls, principal: Principal | None) -> BlobCaller:
        """The blob caller acting for ``principal``, the caller of the RPC being handled
        (coordinator/core/principal.py `current_principal()`; None with --insecure)."""
        if principal is None:
            return cls("", True)
        return cls(principal.id, principal.role == ROLE_OPERATOR)


@dataclass(frozen=True)
class UploadLimits:
    """Per-identity storage quota (bytes of uploaded blobs plus announced sizes of partial
    uploads), concurrent upload streams per identity and in all, how long an upload stream
    may stay silent, and how long a partial upload lives without a write."""

    quota_bytes: int
    max_streams: int
    max_streams_total: int
    idle_timeout_s: float
    partial_ttl_s: float

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> UploadLimits:
        return cls(
            quota_bytes=config.blob_quota_bytes,
            max_streams=config.max_upload_streams,
            max_streams_total=config.max_upload_streams_total,
            idle_timeout_s=config.upload_idle_timeout_s,
            partial_ttl_s=config.partial_upload_ttl_s,
        )

    @property
    def sweep_interval_s(self) -> float:
        return min(max(self.partial_ttl_s / 4, 0.05), 600.0)


def uploader_key(identity: str) -> str:
    """The folder name of an identity's partial uploads (any identity, a safe name)."""
    return hashlib.sha256(b"uploader:" + identity.encode()).hexdigest()[:32]


class BlobStore:
    def __init__(
        self,
        root: Path,
        store: Store,
        *,
        max_blob_bytes: int,
        events: EventLog | None = None,
        limits: UploadLimits | None = None,
    ) -> None:
        self.root = Path(root)
        self.partial_dir = self.root / "partial"
        self.max_blob_bytes = max_blob_bytes
        self.limits = limits or UploadLimits.from_config(CoordinatorConfig())
        # Concurrent UploadBlob streams (the service holds one for each call).
        self.streams = StreamCaps(
            "UploadBlob",
            self.limits.max_streams,
            self.limits.max_streams_total,
            "--max-upload-streams",
        )
        self._store = store
        self._events = events
        self._active: set[tuple[str, str]] = set()  # (uploader key, sha256)
        # Held while partial uploads are opened (quota reserved) and while they are swept.
        self._partials_lock = asyncio.Lock()
        # Serializes publishing: two uploaders of one blob store it once.
        self._publish_lock = asyncio.Lock()
        self._sweeper: asyncio.Task[None] | None = None
        # Blobs the coordinator stored and has not named yet (`stored`): never collected.
        self._pins: dict[str, int] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the directories, drop leftovers of interrupted writes, reconcile, delete
        expired partial uploads, and sweep them periodically from now on."""
        await asyncio.to_thread(self._prepare_dirs)
        await self._reconcile()
        await self.sweep_partials()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    def _prepare_dirs(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # private, like the data dir
        self.partial_dir.mkdir(mode=0o700, exist_ok=True)
        for leftover in self.partial_dir.iterdir():
            if leftover.name.startswith("tmp-"):
                leftover.unlink(missing_ok=True)
            elif leftover.is_file():  # a partial upload of before per-uploader folders
                leftover.unlink(missing_ok=True)
                log.info("deleted partial upload %s: it has no uploader", leftover.name)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                await self.sweep_partials()
            except OSError:
                log.exception("sweeping partial uploads failed")

    async def sweep_partials(self) -> int:
        """Delete partial uploads not written to for the TTL (none in progress); how many."""
        async with self._partials_lock:
            active = set(self._active)
            removed = await asyncio.to_thread(self._sweep_sync, active, time.time())
        if removed:
            log.info(
                "deleted %d partial upload(s) idle for over %gs", removed, self.limits.partial_ttl_s
            )
        return removed

    def _sweep_sync(self, active: set[tuple[str, str]], now: float) -> int:
        removed = 0
        for folder in self.partial_dir.iterdir():
            if not folder.is_dir():
                continue
            for path in list(folder.iterdir()):
                sha = path.name.removesuffix(".size")
                if (folder.name, sha) in active:
                    continue
                data, meta = folder / sha, folder / f"{sha}.size"
                written = max(_mtime(data), _mtime(meta))
                if now - written > self.limits.partial_ttl_s:
                    removed += int(data.exists())
                    data.unlink(missing_ok=True)
                    meta.unlink(missing_ok=True)
        return removed

    async def _reconcile(self) -> None:
        on_disk = await asyncio.to_thread(self._scan)
        recorded = {r.sha256: r for r in await self._store.list_blobs()}
        for sha, path in on_disk.items():
            if sha in recorded:
                continue
            actual = await asyncio.to_thread(sha256_file, path)
            if actual == sha:
                size = path.stat().st_size
                await self._store.add_blob(sha, size)
                log.warning("recorded blob %s (%d bytes) found on disk without a record", sha, size)
            else:
                path.unlink(missing_ok=True)
                log.warning("deleted blob file %s: its bytes hash to %s", path, actual)
        for sha in recorded:
            if sha not in on_disk:
                await self._store.remove_blob(sha)
                log.error("blob %s is recorded but its file is missing: record dropped", sha)

    def _scan(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        for sub in self.root.iterdir():
            if sub.name == "partial" or not sub.is_dir():
                continue
            for path in sub.iterdir():
                if is_sha256(path.name) and path.name[:2] == sub.name and path.is_file():
                    found[path.name] = path
        return found

    # -- paths and queries ----------------------------------------------------------------------

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def _partial(self, key: str, sha256: str) -> Path:
        return self.partial_dir / key / sha256

    def _partial_meta(self, key: str, sha256: str) -> Path:
        return self.partial_dir / key / f"{sha256}.size"

    async def get(self, sha256: str) -> BlobRecord | None:
        return await self._store.get_blob(sha256)

    async def exists(self, sha256: str) -> bool:
        return await self._store.get_blob(sha256) is not None

    async def visible(self, sha256: str, caller: BlobCaller) -> bool:
        """Whether the blob is stored and the caller may see it: it uploaded it, one of its
        jobs uses it, or it sees every blob."""
        if caller.full_access:
            return await self.exists(sha256)
        return await self._store.blob_visible_to(sha256, caller.identity)

    def uploads_in_progress(self) -> set[str]:
        return {sha for _, sha in self._active}

    async def stats(self) -> BlobStats:
        return await self._store.blob_stats()

    async def status(self, sha256: str, caller: BlobCaller) -> BlobStatus | None:
        """The blob as the caller sees it: complete (one it may see), the caller's own partial
        upload, or None (nothing of the caller's: NOT_FOUND, whether or not others hold it)."""
        require_sha256(sha256)
        if await self.visible(sha256, caller):
            record = await self._store.get_blob(sha256)
            if record is not None:
                return BlobStatus(complete=True, received_bytes=record.size, size=record.size)
        key = uploader_key(caller.identity)
        held, size = await asyncio.to_thread(self._partial_state, key, sha256)
        if size == 0 and not self._partial_meta(key, sha256).exists():
            return None
        return BlobStatus(complete=False, received_bytes=held, size=size)

    def _partial_state(self, key: str, sha256: str) -> tuple[int, int]:
        try:
            held = self._partial(key, sha256).stat().st_size
            size = int(self._partial_meta(key, sha256).read_text())
        except (FileNotFoundError, ValueError):
            return 0, 0
        return held, size

    def _reserved_sync(self, key: str, but: str) -> int:
        """The announced sizes of an uploader's partial uploads, but the one of ``but``."""
        total = 0
        folder = self.partial_dir / key
        if not folder.is_dir():
            return 0
        for meta in folder.glob("*.size"):
            if meta.name.removesuffix(".size") == but:
                continue
            with contextlib.suppress(FileNotFoundError, ValueError):
                total += int(meta.read_text())
        return total

    async def _check_quota(self, caller: BlobCaller, key: str, sha256: str, size: int) -> None:
        owned = await self._store.owned_blob_bytes(caller.identity)
        reserved = await asyncio.to_thread(self._reserved_sync, key, sha256)
        quota = self.limits.quota_bytes
        if owned + reserved + size > quota:
            raise ResourceExhaustedError(
                f"storage quota exceeded: each identity may hold {quota} bytes of uploaded blobs "
                f"and partial uploads (--blob-quota-bytes); you hold {owned} bytes of blobs and "
                f"{reserved} bytes of other partial uploads, this blob needs {size}"
            )

    # -- uploads --------------------------------------------------------------------------------

    async def begin_upload(
        self, sha256: str, size: int, offset: int, caller: BlobCaller
    ) -> Upload | BlobRecord:
        """Start (offset 0) or resume (offset = bytes held) the caller's upload. Returns the
        record if the caller may see the blob already (nothing to upload). Errors:
        InvalidArgumentError (bad sha/size/offset), ResourceExhaustedError (size over the
        limit, or the caller's quota), FailedPreconditionError (offset differs from the bytes
        held), AbortedError (the caller's other upload of the same blob is in progress)."""
        require_sha256(sha256)
        if size < 0:
            raise InvalidArgumentError(f"size must not be negative, got {size}")
        if offset < 0 or offset > size:
            raise InvalidArgumentError(f"offset {offset} is outside the blob (size {size})")
        if size > self.max_blob_bytes:
            raise ResourceExhaustedError(
                f"blob of {size} bytes exceeds the limit of {self.max_blob_bytes} bytes "
                "(--max-blob-bytes)"
            )
        if await self.visible(sha256, caller):
            record = await self._store.get_blob(sha256)
            if record is not None:
                if record.size != size:
                    raise InvalidArgumentError(
                        f"blob {sha256} is stored with size {record.size}, not {size}"
                    )
                return record
        key = uploader_key(caller.identity)
        if (key, sha256) in self._active:
            raise AbortedError(f"an upload of blob {sha256} is already in progress: retry later")
        self._active.add((key, sha256))
        try:
            async with self._partials_lock:
                await self._check_quota(caller, key, sha256, size)
                upload = Upload(self, key, caller.identity, sha256, size)
                await asyncio.to_thread(upload._open, offset)
        except BaseException:
            self._active.discard((key, sha256))
            raise
        return upload

    async def _publish(self, sha256: str, size: int, src: Path, owner: str) -> BlobRecord:
        """A verified, fsynced upload of ``owner``: placed and recorded, or, when the blob is
        stored already (another uploader's), discarded; ``owner`` owns it either way."""
        async with self._publish_lock:
            record = await self._store.get_blob(sha256)
            if record is None or not await self._store.touch_blob(sha256):
                return await self._commit_file(sha256, size, src, owner=owner)
            await asyncio.to_thread(src.unlink, missing_ok=True)
            await self._store.add_blob_owner(sha256, owner)
        log.info("blob %s uploaded again, by %s: stored once", sha256, owner or "-")
        return record

    async def _commit_file(
        self, sha256: str, size: int, src: Path, owner: str | None = None
    ) -> BlobRecord:
        """Move a verified, fsynced file into place and record it (with its uploader)."""
        final = self.path(sha256)

        def place() -> None:
            final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(src, 0o600)  # the data dir is private, and so is each blob
            os.replace(src, final)
            _fsync_dir(final.parent)

        await asyncio.to_thread(place)
        async with self._store.transaction():
            record = await self._store.add_blob(sha256, size)
            if owner is not None:
                await self._store.add_blob_owner(sha256, owner)
        if self._events is not None:
            await self._events.append(
                "blob.stored",
                message=f"blob {sha256[:12]} stored ({size} bytes)",
                attrs={"sha256": sha256, "size": str(size)},
            )
        log.info("blob %s stored (%d bytes)", sha256, size)
        return record

    # -- giving blobs up -------------------------------------------------------------------------

    async def delete(self, sha256: str, caller: BlobCaller) -> tuple[int, bool]:
        """The caller gives the blob up (DeleteBlob): its hold on it (an operator's: everyone's)
        and its partial upload of it go, and the bytes go too once nobody holds the blob and no
        job in progress uses it (an ended job that named it keeps only its record). Returns
        (bytes no longer counted against the caller's quota, whether the bytes went).

        NotFoundError when the caller holds neither the blob nor a partial upload of it (a blob
        of others looks like none); FailedPreconditionError while the caller's upload of it is
        under way or a job in progress of the caller's (an operator's: any) uses it."""
        require_sha256(sha256)
        key = uploader_key(caller.identity)
        if (key, sha256) in self._active:
            raise FailedPreconditionError(
                f"your upload of blob {sha256} is in progress: end it before deleting the blob"
            )
        async with self._publish_lock:
            record = await self._store.get_blob(sha256)
            owners = await self._store.blob_owners(sha256) if record is not None else set()
            holds = record is not None and (caller.identity in owners or caller.full_access)
            partial = await asyncio.to_thread(self._partial_meta(key, sha256).exists)
            if not holds and not partial:
                raise NotFoundError(
                    f"no blob {sha256} of yours: you may delete the blobs you uploaded and "
                    "your partial uploads"
                )
            users = [
                j for j in await self._store.list_jobs(LIVE_STATES) if sha256 in job_references(j)
            ]
            mine = [j.job_id for j in users if caller.full_access or j.owner == caller.identity]
            if holds and mine:
                raise FailedPreconditionError(
                    f"blob {sha256} is used by your job(s) in progress ({', '.join(mine)}): "
                    "cancel them or wait for their end before deleting it"
                )
            await asyncio.to_thread(self._drop_partial, key, sha256)
            if not holds:
                return 0, False
            assert record is not None
            dropping = owners if caller.full_access else {caller.identity}
            await self._store.remove_blob_owners(sha256, dropping)
            released = record.size if caller.identity in owners else 0
            if owners - dropping or users:
                log.info("blob %s given up by %s; others still hold it", sha256, caller.identity)
                return released, False
            await self._store.remove_blob(sha256)
            await asyncio.to_thread(self.path(sha256).unlink, missing_ok=True)
        if self._events is not None:
            await self._events.append(
                "blob.deleted",
                message=f"blob {sha256[:12]} deleted ({record.size} bytes) by its last holder",
                attrs={"sha256": sha256, "size": str(record.size)},
            )
        log.info("blob %s deleted (%d bytes) by %s", sha256, record.size, caller.identity or "-")
        return released, True

    def _drop_partial(self, key: str, sha256: str) -> None:
        self._partial(key, sha256).unlink(missing_ok=True)
        self._partial_meta(key, sha256).unlink(missing_ok=True)

    # -- blobs the coordinator makes itself -----------------------------------------------------

    @contextlib.asynccontextmanager
    async def stored(self, data: bytes) -> AsyncIterator[common_pb2.BlobRef]:
        """`put_bytes` for a blob the caller names in the ``async with`` block (a checkpoint's
        tensors, a job's result): until the block ends the collector leaves it alone, however
        short its grace, so that it is never taken between being stored and being named."""
        sha = hashlib.sha256(data).hexdigest()
        self._pins[sha] = self._pins.get(sha, 0) + 1
        try:
            yield await self.put_bytes(data)
        finally:
            left = self._pins[sha] - 1
            if left:
                self._pins[sha] = left
            else:
                del self._pins[sha]

    def pinned(self) -> frozenset[str]:
        """The blobs stored and not named yet (`stored`)."""
        return frozenset(self._pins)

    async def put_bytes(self, data: bytes, owner: str | None = None) -> common_pb2.BlobRef:
        """Store bytes made by the coordinator (checkpoints, results); no size limit or quota
        applies. ``owner``: an identity that owns the blob from now on (None: nobody)."""
        sha = hashlib.sha256(data).hexdigest()
        # Stored already (an old blob nothing names, perhaps): made new again, so that the
        # collector does not take it before the caller names it; collected meanwhile: written.
        if not await self._store.touch_blob(sha):
            tmp = self.partial_dir / f"tmp-{secrets.token_hex(8)}"

            def write() -> None:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())

            try:
                await asyncio.to_thread(write)
                await self._commit_file(sha, len(data), tmp, owner=owner)
            finally:
                tmp.unlink(missing_ok=True)
        elif owner is not None:
            await self._store.add_blob_owner(sha, owner)
        return common_pb2.BlobRef(sha256=sha, size=len(data))

    async def put_file(self, src: Path) -> common_pb2.BlobRef:
        """Store a copy of a local file (the file is left as it is)."""
        tmp = self.partial_dir / f"tmp-{secrets.token_hex(8)}"

        def copy() -> tuple[str, int]:
            h = hashlib.sha256()
            n = 0
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                while block := fin.read(_READ_BLOCK):
                    h.update(block)
                    fout.write(block)
                    n += len(block)
                fout.flush()
                os.fsync(fout.fileno())
            return h.hexdigest(), n

        try:
            sha, size = await asyncio.to_thread(copy)
            if not await self._store.touch_blob(sha):  # see put_bytes
                await self._commit_file(sha, size, tmp)
        finally:
            tmp.unlink(missing_ok=True)
        return common_pb2.BlobRef(sha256=sha, size=size)

    # -- reading --------------------------------------------------------------------------------

    async def _require(self, sha256: str) -> BlobRecord:
        require_sha256(sha256)
        record = await self._store.get_blob(sha256)
        if record is None:
            raise NotFoundError(f"blob {sha256} not found")
        return record

    async def open(self, sha256: str) -> BinaryIO:
        """An open binary file of a stored blob (the caller closes it)."""
        await self._require(sha256)
        return await asyncio.to_thread(open, self.path(sha256), "rb")

    async def read_bytes(self, sha256: str) -> bytes:
        await self._require(sha256)
        return await asyncio.to_thread(self.path(sha256).read_bytes)

    async def read_chunks(
        self, sha256: str, offset: int = 0, chunk_size: int = MAX_CHUNK_BYTES
    ) -> AsyncIterator[tuple[int, bytes, int]]:
        """(offset, data, total_size) for the bytes from ``offset`` on, in chunks of at most
        ``chunk_size``; a single empty chunk when nothing is left (so the size is known)."""
        record = await self._require(sha256)
        if offset < 0 or offset > record.size:
            raise InvalidArgumentError(f"offset {offset} is outside the blob (size {record.size})")
        chunk_size = max(1, min(chunk_size, MAX_CHUNK_BYTES))
        f = await asyncio.to_thread(open, self.path(sha256), "rb")
        try:
            await asyncio.to_thread(f.seek, offset)
            pos = offset
            if pos == record.size:
                yield pos, b"", record.size
                return
            while pos < record.size:
                data = await asyncio.to_thread(f.read, chunk_size)
                if not data:
                    raise DataLossError(f"blob {sha256} is shorter on disk than recorded")
                yield pos, data, record.size
                pos += len(data)
        finally:
            f.close()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


class Upload:
    """One uploader's upload of one blob; use as ``async with`` so the file and the lock are
    released. Chunks must arrive in order: ``write(offset, data)`` with offset == ``received``."""

    def __init__(self, blobs: BlobStore, key: str, owner: str, sha256: str, size: int) -> None:
        self._blobs = blobs
        self._key = key
        self.owner = owner
        self.sha256 = sha256
        self.size = size
        self.received = 0
        self._hash = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._closed = False
        self._inflight: concurrent.futures.Future[None] | None = None

    @property
    def _path(self) -> Path:
        return self._blobs._partial(self._key, self.sha256)

    @property
    def _meta(self) -> Path:
        return self._blobs._partial_meta(self._key, self.sha256)

    async def _run(self, fn: Callable[[], None]) -> None:
        """Run file work off the loop; if the caller is cancelled, the work still finishes
        before `close` touches the file."""
        self._inflight = _UPLOAD_IO.submit(fn)
        await asyncio.wrap_future(self._inflight)

    def _open(self, offset: int) -> None:
        partial, meta = self._path, self._meta
        if offset == 0:
            partial.parent.mkdir(mode=0o700, exist_ok=True)
            f = self._locked(os.open(partial, os.O_RDWR | os.O_CREAT, 0o600))
            try:
                f.truncate(0)
                meta.write_text(str(self.size))
            except BaseException:
                f.close()
                raise
            self._file = f
            return
        held, size = self._blobs._partial_state(self._key, self.sha256)
        if size != self.size or held != offset:
            if size and size != self.size:
                detail = f"the partial upload announced size {size}, not {self.size}"
            else:
                detail = f"the coordinator holds {held} bytes"
            raise FailedPreconditionError(
                f"cannot resume blob {self.sha256} at offset {offset}: {detail}; "
                f"resume at offset {held if size == self.size else 0}"
            )
        try:
            f = self._locked(os.open(partial, os.O_RDWR))
        except FileNotFoundError:
            raise FailedPreconditionError(
                f"partial upload of {self.sha256} changed while resuming: start again"
            ) from None
        try:
            while block := f.read(_READ_BLOCK):
                self._hash.update(block)
            if f.tell() != offset:
                raise FailedPreconditionError(
                    f"partial upload of {self.sha256} changed while resuming: start again"
                )
        except BaseException:
            f.close()
            raise
        self._file = f
        self.received = offset

    def _locked(self, fd: int) -> BinaryIO:
        """The partial file, locked against the same upload through another coordinator
        sharing the blob directory (the lock goes with the file's close or the process)."""
        f = os.fdopen(fd, "r+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise AbortedError(
                f"an upload of blob {self.sha256} is in progress through another coordinator: "
                "retry later"
            ) from None
        return f

    async def write(self, offset: int, data: bytes) -> None:
        if offset != self.received:
            raise InvalidArgumentError(
                f"chunk offset {offset} does not follow the bytes received ({self.received})"
            )
        if len(data) > MAX_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"chunk of {len(data)} bytes exceeds the {MAX_CHUNK_BYTES}-byte chunk limit"
            )
        if self.received + len(data) > self.size:
            raise InvalidArgumentError(
                f"chunk at {offset} of {len(data)} bytes runs past the announced size {self.size}"
            )
        if not data:
            return
        try:
            await self._run(lambda: self._write_sync(data))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ResourceExhaustedError("the coordinator's disk is full") from exc
            raise
        self.received += len(data)

    def _write_sync(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self._hash.update(data)

    @property
    def complete(self) -> bool:
        return self.received == self.size

    async def finish(self) -> BlobRecord:
        """Verify and publish the blob (all bytes must have been received). A hash mismatch
        discards the partial upload and raises DataLossError."""
        if not self.complete:
            raise FailedPreconditionError(
                f"blob {self.sha256} is incomplete: {self.received} of {self.size} bytes"
            )
        digest = self._hash.hexdigest()

        def sync_and_close() -> None:
            assert self._file is not None
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

        await self._run(sync_and_close)
        if digest != self.sha256:
            await self._run(self._discard)
            raise DataLossError(
                f"the uploaded bytes hash to {digest}, not {self.sha256}: "
                "the upload is discarded, start again from offset 0"
            )
        # Shielded: a client going away now must not leave the blob half published.
        record = await asyncio.shield(
            self._blobs._publish(self.sha256, self.size, self._path, self.owner)
        )
        self._meta.unlink(missing_ok=True)
        return record

    def _discard(self) -> None:
        self._path.unlink(missing_ok=True)
        self._meta.unlink(missing_ok=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._inflight is not None:
            with contextlib.suppress(BaseException):
                self._inflight.result(timeout=30)  # at most one chunk's write
        if self._file is not None and not self._file.closed:
            with contextlib.suppress(OSError):
                self._file.flush()
            self._file.close()
        self._blobs._active.discard((self._key, self.sha256))

    async def __aenter__(self) -> Upload:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
