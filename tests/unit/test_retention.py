"""Retention: the pure policy (coordinator/store/retention.py), the store's retention queries on a real
SQLite file, the agent's blob cache cap (node_agent/link/cache.py) and the program child's device
warm-up on a CPU (node_agent/sandbox/child.py)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from coordinator.store.base import BlobRecord
from coordinator.store.blobs import BlobStore
from coordinator.store.gc import GarbageCollector
from coordinator.store.retention import (
    FLOOR_UNKNOWN,
    LIVE_STATES,
    ManifestError,
    RetentionPolicy,
    blobs_to_sweep,
    checkpoints_to_drop,
    job_references,
    keep_for,
    manifest_references,
)
from coordinator.store.sqlite import SqliteStore
from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.link.cache import BlobCache
from node_agent.sandbox.child import warm_up_device_libraries

pytestmark = pytest.mark.timeout(30)

JS = common_pb2.JobState


# -- the policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rounds", "keep", "floor", "dropped"),
    [
        ([], 3, None, []),
        ([1, 2], 3, None, []),
        ([0, 1, 2, 3, 4, 5], 3, None, [0, 1, 2]),
        ([0, 1, 2, 3, 4, 5], 1, None, [0, 1, 2, 3, 4]),
        # A rollback may undo round 3: the newest checkpoint before it (round 2) stays.
        ([0, 1, 2, 3, 4, 5], 3, 3, [0, 1]),
        # ... round 4: the newest before it (3) is among the newest three anyway.
        ([0, 1, 2, 3, 4, 5], 3, 4, [0, 1, 2]),
        # ... round 1: checkpoint 0 is what checkpoint_before(job, 1) returns.
        ([0, 2, 4, 6, 8], 2, 1, [2, 4]),
        # Nothing before the floor: nothing more to keep.
        ([5, 6, 7], 1, 5, [5, 6]),
        # The floor is not known yet (the coordinator is starting): nothing is dropped.
        ([0, 1, 2, 3, 4, 5], 1, FLOOR_UNKNOWN, []),
    ],
)
def test_checkpoints_to_drop(
    rounds: list[int], keep: int, floor: int | None, dropped: list[int]
) -> None:
    assert checkpoints_to_drop(rounds, keep=keep, rollback_floor=floor) == dropped


def test_ended_jobs_keep_their_last_checkpoint() -> None:
    policy = RetentionPolicy(keep_checkpoints=4)
    assert keep_for(JS.JOB_STATE_RUNNING, policy) == 4
    assert keep_for(JS.JOB_STATE_PAUSED, policy) == 4
    for ended in (JS.JOB_STATE_SUCCEEDED, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED):
        assert keep_for(ended, policy) == 1
        assert ended not in LIVE_STATES
    with pytest.raises(ValueError, match="at least one"):
        RetentionPolicy(keep_checkpoints=0)


def test_references_of_jobs_and_manifests() -> None:
    job = common_pb2.Job(
        program=common_pb2.BlobRef(sha256="a" * 64),
        initial_state=common_pb2.BlobRef(sha256="b" * 64),
        shards=[common_pb2.Shard(blob=common_pb2.BlobRef(sha256="c" * 64))],
    )
    assert job_references(job) == {"a" * 64, "b" * 64, "c" * 64}
    job.result.sha256 = "d" * 64
    assert "d" * 64 in job_references(job)
    assert manifest_references(json.dumps({"tensors_sha256": "e" * 64}).encode()) == {"e" * 64}
    assert manifest_references(b'{"round": 3}') == set()
    for bad in (b"\xff", b"not json", b"[1]", b'{"tensors_sha256": 3}'):
        with pytest.raises(ManifestError):
            manifest_references(bad)


def test_blobs_to_sweep_grace_periods() -> None:
    policy = RetentionPolicy(blob_grace_ms=1000, released_grace_ms=100)
    now = 10_000
    blobs = [
        BlobRecord("1" * 64, 10, created_ms=0),  # old, referenced
        BlobRecord("2" * 64, 10, created_ms=0),  # old, unreferenced
        BlobRecord("3" * 64, 10, created_ms=9_500),  # young upload, unreferenced
        BlobRecord("4" * 64, 10, created_ms=9_800),  # young, released long enough ago
        BlobRecord("5" * 64, 10, created_ms=9_990),  # young, released just now
        BlobRecord("6" * 64, 10, created_ms=9_950),  # released long ago, stored again since
    ]
    released = {"4" * 64: 9_850, "5" * 64: 9_990, "1" * 64: 0, "6" * 64: 5_000}
    decisions = blobs_to_sweep(blobs, {"1" * 64}, released, now_ms=now, policy=policy)
    assert {d.blob.sha256: d.reason for d in decisions} == {
        "2" * 64: "nothing has named it within the grace period",
        "4" * 64: "its checkpoint was dropped",
    }


# -- the store's side ---------------------------------------------------------------------------


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "c.db")
    yield s
    await s.close()


async def test_bytes_stored_again_are_not_collected_before_they_are_named(
    store: SqliteStore, tmp_path: Path
) -> None:
    """The coordinator stores bytes equal to an old blob nothing names (a checkpoint's tensors
    identical to a dropped one's): one copy is kept and made new again, so that a pass landing
    before the new checkpoint names it leaves it alone; an old blob not stored again goes."""
    blobs = BlobStore(tmp_path / "blobs", store, max_blob_bytes=1 << 20)
    await blobs.start()
    gc = GarbageCollector(
        store, blobs, RetentionPolicy(blob_grace_ms=3_600_000, released_grace_ms=0), interval_s=60
    )
    try:
        again = await blobs.put_bytes(b"the same tensors")
        old = await blobs.put_bytes(b"nobody stores these again")
        with sqlite3.connect(tmp_path / "c.db") as db:  # both stored long ago
            db.execute("UPDATE blobs SET created_ms = 0")
        assert (await blobs.put_bytes(b"the same tensors")) == again
        report = await gc.run_once()
        assert report.blobs_deleted == 1
        assert await blobs.exists(again.sha256) and blobs.path(again.sha256).exists()
        assert not await blobs.exists(old.sha256) and not blobs.path(old.sha256).exists()
    finally:
        await blobs.stop()


async def test_a_blob_stored_and_not_named_yet_is_never_collected(
    store: SqliteStore, tmp_path: Path
) -> None:
    """With no grace at all, a pass between the coordinator storing a blob and naming it (a
    checkpoint's tensors, a job's result: `BlobStore.stored`) leaves it; after the block a
    blob nothing names goes."""
    blobs = BlobStore(tmp_path / "blobs", store, max_blob_bytes=1 << 20)
    await blobs.start()
    gc = GarbageCollector(
        store, blobs, RetentionPolicy(blob_grace_ms=0, released_grace_ms=0), interval_s=60
    )
    try:
        async with blobs.stored(b"a result") as ref:
            assert blobs.pinned() == {ref.sha256}
            assert (await gc.run_once()).blobs_deleted == 0
            assert await blobs.exists(ref.sha256)
        assert blobs.pinned() == frozenset()
        assert (await gc.run_once()).blobs_deleted == 1  # never named: collected now
        assert not blobs.path(ref.sha256).exists()
    finally:
        await blobs.stop()


async def test_store_lists_and_drops_checkpoints(store: SqliteStore) -> None:
    a = await store.create_job(common_pb2.Job(name="a"), owner="t")
    b = await store.create_job(common_pb2.Job(name="b"), owner="t")
    for r in (0, 1, 2):
        await store.save_checkpoint(a.job_id, r, f"a{r}".encode())
    await store.save_checkpoint(b.job_id, 5, b"b5")
    listed = await store.list_checkpoints()
    assert sorted(listed) == sorted(
        [(a.job_id, 0, b"a0"), (a.job_id, 1, b"a1"), (a.job_id, 2, b"a2"), (b.job_id, 5, b"b5")]
    )
    assert [r for _, r, _ in await store.list_checkpoints(a.job_id)] == [0, 1, 2]
    assert await store.drop_checkpoints(a.job_id, [0, 1, 7]) == [b"a0", b"a1"]
    assert await store.drop_checkpoints(a.job_id, []) == []
    assert await store.latest_checkpoint(a.job_id) == (2, b"a2")
    assert await store.checkpoint_before(a.job_id, 2) is None
    assert await store.list_checkpoints(b.job_id) == [(b.job_id, 5, b"b5")]


async def test_store_prunes_old_events_but_not_live_jobs(store: SqliteStore) -> None:
    live = await store.create_job(common_pb2.Job(name="live", state=JS.JOB_STATE_RUNNING), "t")
    done = await store.create_job(common_pb2.Job(name="done", state=JS.JOB_STATE_SUCCEEDED), "t")
    await store.append_event("node.registered", node_id="n1", time_ms=100)
    await store.append_event("job.running", job_id=live.job_id, time_ms=100)
    await store.append_event("job.succeeded", job_id=done.job_id, time_ms=100)
    await store.append_event("job.other", job_id="j-0000000000", time_ms=100)
    recent = await store.append_event("node.offline", node_id="n1", time_ms=5_000)
    n = await store.prune_events(1_000, keep_job_states=LIVE_STATES, limit=2)
    assert n == 2  # batches of `limit`
    n += await store.prune_events(1_000, keep_job_states=LIVE_STATES, limit=2)
    assert n == 3
    left = await store.list_events()
    assert [(e.kind, e.job_id, e.node_id) for e in left] == [
        ("job.running", live.job_id, ""),
        ("node.offline", "", "n1"),
    ]
    # Ids are never reused, even when the newest events are gone.
    assert await store.prune_events(10_000) == 2
    assert await store.last_event_id() == recent.id
    again = await store.append_event("node.registered", node_id="n2")
    assert again.id > recent.id


# -- the agent's blob cache ---------------------------------------------------------------------


def _blob(i: int, size: int = 1000) -> tuple[common_pb2.BlobRef, bytes]:
    data = bytes([i % 256]) * size
    return common_pb2.BlobRef(sha256=hashlib.sha256(data).hexdigest(), size=size), data


class _Clock:
    """Wall-clock seconds (the cache compares them with file times) that the test moves."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def test_agent_cache_stays_under_its_cap_in_lru_order(tmp_path: Path) -> None:
    blobs = [_blob(i) for i in range(6)]
    served = {ref.sha256: data for ref, data in blobs}
    fetched: list[str] = []

    async def fetch(sha: str, offset: int) -> AsyncIterator[agent_pb2.FetchBlobResponse]:
        fetched.append(sha)
        data = served[sha]
        yield agent_pb2.FetchBlobResponse(
            total_size=len(data), chunk=common_pb2.DataChunk(offset=offset, data=data[offset:])
        )

    clock = _Clock()
    cache = BlobCache(tmp_path / "cache", max_bytes=3500, protect_s=5.0, clock=clock)
    refs = [ref for ref, _ in blobs]

    def on_disk() -> set[str]:
        return {p.name for p in cache.root.iterdir()}

    for ref in refs[:3]:
        clock.now += 10
        await cache.get(ref, fetch)
    assert cache.total_bytes() == 3000
    clock.now += 10
    await cache.get(refs[0], fetch)  # a hit: 0 is now the most recently used
    assert len(fetched) == 3 and cache.hits == 1
    clock.now += 10
    await cache.get(refs[3], fetch)  # 4000 > 3500: the least recently used (1) goes
    assert on_disk() == {refs[i].sha256 for i in (0, 2, 3)}
    assert cache.entries() == [refs[i].sha256 for i in (2, 0, 3)]
    assert cache.total_bytes() <= 3500 and cache.evictions == 1

    # Entries used within protect_s stay, even past the cap: a task may be about to read them.
    clock.now += 10
    await cache.get(refs[2], fetch)  # hit
    clock.now += 1
    await cache.get(refs[4], fetch)  # 4000 bytes: 0 (unused for 21 s) goes
    assert on_disk() == {refs[i].sha256 for i in (2, 3, 4)}
    clock.now += 1
    await cache.get(refs[0], fetch)  # 3 (unused for 12 s) goes
    clock.now += 1
    await cache.get(refs[1], fetch)  # everything else was used in the last 5 s: all stay
    assert on_disk() == {refs[i].sha256 for i in (0, 1, 2, 4)}
    assert cache.total_bytes() == 4000
    clock.now += 10
    await cache.get(refs[3], fetch)  # back under the cap, least recently used first: 2, 4
    assert on_disk() == {refs[i].sha256 for i in (0, 1, 3)}
    assert cache.total_bytes() == 3000

    # A stale partial download counts and goes first; a restart ranks entries by download time.
    part = cache.part_path_for(refs[5].sha256)
    part.write_bytes(b"x" * 3000)
    clock.now += 100
    reopened = BlobCache(tmp_path / "cache", max_bytes=3500, protect_s=5.0, clock=clock)
    assert not part.exists()
    assert reopened.total_bytes() == 3000
    assert await reopened.lookup(refs[3]) is not None


async def test_agent_cache_never_evicts_the_blob_it_just_fetched(tmp_path: Path) -> None:
    ref, data = _blob(7, size=5000)

    async def fetch(sha: str, offset: int) -> AsyncIterator[agent_pb2.FetchBlobResponse]:
        yield agent_pb2.FetchBlobResponse(
            total_size=len(data), chunk=common_pb2.DataChunk(offset=offset, data=data[offset:])
        )

    cache = BlobCache(tmp_path / "cache", max_bytes=1000, protect_s=0.0)
    path = await cache.get(ref, fetch)
    assert path.read_bytes() == data  # over the cap, but the caller is about to read it


# -- the program child's warm-up ----------------------------------------------------------------


def test_device_warm_up_is_a_no_op_on_a_cpu() -> None:
    before = torch.cuda.is_initialized()
    assert warm_up_device_libraries("cpu") == ()
    assert torch.cuda.is_initialized() == before  # no CUDA context was made
