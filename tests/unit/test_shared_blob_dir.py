"""One blob directory shared by two coordinators (``serve --blob-dir``): an upload begun
through one is resumed and finished through the other, with the same hash check; the same
upload through both at once is refused; a directory holding another database's blobs is
refused (coordinator/ha/blob_dir.py); a collector that may not collect deletes nothing.
Real SQLite files, two BlobStore instances on one directory."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.core.errors import AbortedError, DataLossError
from coordinator.ha.blob_dir import MARKER_FILE, BlobDirError, claim_blob_dir, store_identity
from coordinator.store.blobs import BlobCaller, BlobStore, Upload
from coordinator.store.gc import GarbageCollector
from coordinator.store.retention import RetentionPolicy
from coordinator.store.sqlite import SqliteStore

pytestmark = pytest.mark.timeout(30)

ALICE = BlobCaller("alice", False)
DATA = bytes(range(256)) * 64
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "c.db")
    yield s
    await s.close()


async def _begin(blobs: BlobStore, offset: int) -> Upload:
    upload = await blobs.begin_upload(SHA, len(DATA), offset, ALICE)
    assert isinstance(upload, Upload)
    return upload


async def test_an_upload_begun_through_one_coordinator_is_finished_through_the_other(
    store: SqliteStore, tmp_path: Path
) -> None:
    first = BlobStore(tmp_path / "shared", store, max_blob_bytes=1 << 20)
    second = BlobStore(tmp_path / "shared", store, max_blob_bytes=1 << 20)
    await first.start()
    try:
        half = len(DATA) // 2
        async with await _begin(first, 0) as upload:
            await upload.write(0, DATA[:half])
            # Meanwhile the same upload through the other coordinator is refused.
            with pytest.raises(AbortedError, match="another coordinator"):
                await second.begin_upload(SHA, len(DATA), half, ALICE)
        # The first goes away (its upload ended mid-way); the second takes over.
        await first.stop()
        await second.start()
        status = await second.status(SHA, ALICE)
        assert status is not None and not status.complete
        assert (status.received_bytes, status.size) == (half, len(DATA))
        async with await _begin(second, half) as upload:
            await upload.write(half, DATA[half:])
            record = await upload.finish()
        assert record.sha256 == SHA and record.size == len(DATA)
        assert second.path(SHA).read_bytes() == DATA
        assert await first.visible(SHA, ALICE)
    finally:
        await second.stop()


async def test_a_resumed_upload_is_checked_against_its_hash_whole(
    store: SqliteStore, tmp_path: Path
) -> None:
    first = BlobStore(tmp_path / "shared", store, max_blob_bytes=1 << 20)
    second = BlobStore(tmp_path / "shared", store, max_blob_bytes=1 << 20)
    half = len(DATA) // 2
    await first.start()
    async with await _begin(first, 0) as upload:
        await upload.write(0, b"x" * half)  # corrupted on the way to the first
    await first.stop()
    await second.start()
    try:
        async with await _begin(second, half) as upload:
            await upload.write(half, DATA[half:])
            with pytest.raises(DataLossError):
                await upload.finish()
        assert not await second.exists(SHA)
        assert await second.status(SHA, ALICE) is None
    finally:
        await second.stop()


async def test_a_blob_dir_of_another_database_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    a = await SqliteStore.open(tmp_path / "a.db")
    b = await SqliteStore.open(tmp_path / "b.db")
    try:
        ident = await claim_blob_dir(a, shared, str(tmp_path / "a.db"))
        assert ident == await store_identity(a)  # stable
        assert await claim_blob_dir(a, shared, str(tmp_path / "a.db")) == ident
        assert (shared / MARKER_FILE).read_text().split()[0] == ident
        with pytest.raises(BlobDirError) as caught:
            await claim_blob_dir(b, shared, str(tmp_path / "b.db"))
        message = str(caught.value)
        assert "\n" not in message
        assert f"{shared} holds the blobs of another database" in message
        assert str(tmp_path / "a.db") in message and "--blob-dir" in message
    finally:
        await a.close()
        await b.close()


async def test_a_collector_that_may_not_collect_deletes_nothing(
    store: SqliteStore, tmp_path: Path
) -> None:
    blobs = BlobStore(tmp_path / "blobs", store, max_blob_bytes=1 << 20)
    await blobs.start()
    active = False
    gc = GarbageCollector(
        store,
        blobs,
        RetentionPolicy(blob_grace_ms=0, released_grace_ms=0),
        interval_s=60,
        may_collect=lambda: active,
    )
    try:
        ref = await blobs.put_bytes(b"nothing names this")
        with sqlite3.connect(tmp_path / "c.db") as db:
            db.execute("UPDATE blobs SET created_ms = 0")
        assert (await gc.run_once()).blobs_deleted == 0
        assert blobs.path(ref.sha256).exists() and await blobs.exists(ref.sha256)
        active = True
        assert (await gc.run_once()).blobs_deleted == 1
        assert not blobs.path(ref.sha256).exists()
    finally:
        await blobs.stop()
