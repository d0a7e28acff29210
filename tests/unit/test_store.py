"""SqliteStore on real SQLite files under tmp_path."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.core.errors import AlreadyExistsError, NotFoundError, StoreError
from coordinator.core.ids import is_job_id
from coordinator.store.base import HeartbeatUpdate, NodeRecord, kind_matches
from coordinator.store.migrations import LATEST_SCHEMA_VERSION, MIGRATIONS
from coordinator.store.sqlite import SqliteStore
from epochmesh.v1 import common_pb2

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "c.db")
    yield s
    await s.close()


def node(node_id: str, name: str, state: int = common_pb2.NODE_STATE_ONLINE) -> NodeRecord:
    info = common_pb2.NodeInfo(node_id=node_id, name=name, state=state, registered_at_ms=1)
    info.devices.add(kind="cpu", cores=2)
    info.labels["zone"] = "a"
    return NodeRecord(info=info, lease_id="lease-" + node_id)


def job(name: str, state: int = common_pb2.JOB_STATE_QUEUED, created: int = 0) -> common_pb2.Job:
    return common_pb2.Job(name=name, state=state, created_ms=created, num_samples=10)


async def test_wal_mode_and_schema_version(store: SqliteStore, tmp_path: Path) -> None:
    assert store.schema_version == LATEST_SCHEMA_VERSION
    with sqlite3.connect(tmp_path / "c.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        versions = [r[0] for r in db.execute("SELECT version FROM schema_version ORDER BY 1")]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert versions == [m.version for m in MIGRATIONS]
    assert {"nodes", "events", "blobs", "jobs", "rounds", "checkpoints", "job_state"} <= tables


async def test_older_schema_is_migrated_keeping_data(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = await SqliteStore.open(path, target_version=1)
    assert old.schema_version == 1
    await old.upsert_node(node("n-0000000001", "alpha"))
    await old.append_event("node.registered", node_id="n-0000000001")
    await old.add_blob("ab" * 32, 5)
    await old.close()
    with sqlite3.connect(path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "jobs" not in tables

    new = await SqliteStore.open(path)
    try:
        assert new.schema_version == LATEST_SCHEMA_VERSION
        rec = await new.get_node("n-0000000001")
        assert rec is not None and rec.info.name == "alpha"
        assert [e.kind for e in await new.list_events()] == ["node.registered"]
        assert (await new.get_blob("ab" * 32)) is not None
        created = await new.create_job(job("after-migration"), owner="alice")
        assert (await new.get_job(created.job_id)) == created
    finally:
        await new.close()


async def test_jobs_stored_before_blob_ownership_get_their_blob_records(tmp_path: Path) -> None:
    """Migration 11: a job stored before schema 9 names blobs its owner uploaded; after the
    upgrade they are the job's and the owner's (visible, counted in its quota), as SubmitJob
    records them now; a job without an owner (--insecure) gets the job's records only."""
    path = tmp_path / "old.db"
    old = await SqliteStore.open(path, target_version=8)
    program, state, shard = "aa" * 32, "bb" * 32, "cc" * 32
    for sha, size in ((program, 10), (state, 20), (shard, 300)):
        await old.add_blob(sha, size)
    stored = job("before-9")
    stored.program.sha256, stored.initial_state.sha256 = program, state
    stored.shards.add(start=0, count=10).blob.sha256 = shard
    mine = await old.create_job(stored, owner="alice")
    anonymous = job("insecure")
    anonymous.program.sha256 = program
    theirs = await old.create_job(anonymous, owner="")
    await old.close()

    new = await SqliteStore.open(path)
    try:
        assert await new.job_blobs(mine.job_id) == {program, state, shard}
        assert await new.job_blobs(theirs.job_id) == {program}
        assert await new.owned_blob_bytes("alice") == 330
        assert all([await new.blob_visible_to(sha, "alice") for sha in (program, state, shard)])
        assert not await new.blob_visible_to(program, "mallory")
        assert await new.blob_owners(program) == {"alice"}
    finally:
        await new.close()


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    s = await SqliteStore.open(path)
    await s.close()
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO schema_version (version, applied_ms, description) VALUES (999, 0, 'x')"
        )
    with pytest.raises(StoreError, match="newer"):
        await SqliteStore.open(path)


async def test_nodes_round_trip_filter_and_heartbeat_batches(store: SqliteStore) -> None:
    await store.upsert_node(node("n-0000000001", "a"))
    await store.upsert_node(node("n-0000000002", "b", common_pb2.NODE_STATE_CORDONED))
    await store.update_heartbeats(
        [HeartbeatUpdate("n-0000000001", 111, 222), HeartbeatUpdate("n-ffffffffff", 1, 2)]
    )
    rec = await store.get_node("n-0000000001")
    assert rec is not None
    assert (rec.info.last_heartbeat_ms, rec.info.lease_expires_ms) == (111, 222)
    assert rec.lease_id == "lease-n-0000000001" and rec.info.labels["zone"] == "a"
    cordoned = await store.list_nodes([common_pb2.NODE_STATE_CORDONED])
    assert [r.info.node_id for r in cordoned] == ["n-0000000002"]
    assert len(await store.list_nodes()) == 2
    assert await store.get_node("n-0000000003") is None
    # Upsert replaces.
    renamed = node("n-0000000002", "b2", common_pb2.NODE_STATE_OFFLINE)
    await store.upsert_node(renamed)
    got = await store.get_node("n-0000000002")
    assert got is not None and got.info.name == "b2"
    assert got.info.state == common_pb2.NODE_STATE_OFFLINE


async def test_events_ids_filters_and_limits(store: SqliteStore) -> None:
    e1 = await store.append_event("node.registered", node_id="n-1", attrs={"k": "v"})
    e2 = await store.append_event("node.offline", node_id="n-1", message="gone")
    e3 = await store.append_event("job.queued", job_id="j-1")
    assert e1.id < e2.id < e3.id
    assert [e.id for e in await store.list_events()] == [e1.id, e2.id, e3.id]
    assert [e.id for e in await store.list_events(e1.id)] == [e2.id, e3.id]
    assert [e.id for e in await store.list_events(node_id="n-1")] == [e1.id, e2.id]
    assert [e.id for e in await store.list_events(job_id="j-1")] == [e3.id]
    assert [e.id for e in await store.list_events(kinds=["node.*"])] == [e1.id, e2.id]
    assert [e.id for e in await store.list_events(kinds=["job.queued", "node.offline"])] == [
        e2.id,
        e3.id,
    ]
    assert [e.id for e in await store.list_events(limit=2)] == [e1.id, e2.id]
    first = (await store.list_events(limit=1))[0]
    assert first.attrs["k"] == "v" and first.time_ms > 0
    assert await store.last_event_id() == e3.id
    assert await store.count_events() == 3
    assert kind_matches("node.offline", ["node.*"]) and not kind_matches("job.x", ["node.*"])


async def test_event_ids_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    s = await SqliteStore.open(path)
    first = await s.append_event("a")
    await s.close()
    s = await SqliteStore.open(path)
    try:
        second = await s.append_event("b")
        assert second.id > first.id
        assert [e.kind for e in await s.list_events()] == ["a", "b"]
    finally:
        await s.close()


async def test_blobs(store: SqliteStore) -> None:
    a = await store.add_blob("aa" * 32, 10)
    again = await store.add_blob("aa" * 32, 10)
    assert again == a
    await store.add_blob("bb" * 32, 5)
    assert [b.sha256 for b in await store.list_blobs()] == ["aa" * 32, "bb" * 32]
    assert [b.sha256 for b in await store.list_blobs(after="aa" * 32)] == ["bb" * 32]
    stats = await store.blob_stats()
    assert (stats.count, stats.total_bytes) == (2, 15)
    assert await store.remove_blob("bb" * 32)
    assert not await store.remove_blob("bb" * 32)
    assert await store.get_blob("bb" * 32) is None


async def test_jobs_crud(store: SqliteStore) -> None:
    j1 = await store.create_job(job("one", created=100), owner="alice")
    j2 = await store.create_job(job("two", common_pb2.JOB_STATE_RUNNING, created=200), "bob")
    assert is_job_id(j1.job_id) and j1.owner == "alice" and j1.updated_ms > 0
    assert await store.get_job(j1.job_id) == j1
    assert await store.get_job("j-0000000000") is None
    assert [j.name for j in await store.list_jobs()] == ["two", "one"]  # newest first
    assert [j.name for j in await store.list_jobs([common_pb2.JOB_STATE_RUNNING])] == ["two"]
    assert [j.name for j in await store.list_jobs(owner="alice")] == ["one"]
    assert len(await store.list_jobs(limit=1)) == 1
    j1.state = common_pb2.JOB_STATE_SUCCEEDED
    j1.round = 7
    await store.update_job(j1)
    assert await store.get_job(j1.job_id) == j1
    assert await store.count_jobs_by_state() == {
        common_pb2.JOB_STATE_SUCCEEDED: 1,
        common_pb2.JOB_STATE_RUNNING: 1,
    }
    with pytest.raises(AlreadyExistsError):
        await store.create_job(j2, "bob")
    with pytest.raises(NotFoundError):
        await store.update_job(common_pb2.Job(job_id="j-0123456789"))


async def test_rounds_rollback_and_rerecord(store: SqliteStore) -> None:
    j = await store.create_job(job("r"), "alice")
    for r in range(1, 6):
        await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=r, loss=float(r)))
    with pytest.raises(AlreadyExistsError):
        await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=3))
    with pytest.raises(NotFoundError):
        await store.add_round(common_pb2.RoundRecord(job_id="j-0000000000", round=1))
    assert [r.round for r in await store.list_rounds(j.job_id, since_round=2, limit=2)] == [3, 4]
    assert await store.rollback_rounds(j.job_id, after_round=3) == 2
    assert [r.round for r in await store.list_rounds(j.job_id)] == [1, 2, 3]
    # The rolled-back numbers can be recorded again; the old records stay on disk.
    await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=4, loss=40.0))
    live = await store.list_rounds(j.job_id)
    assert [(r.round, r.loss) for r in live] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    everything = await store.list_rounds(j.job_id, include_rolled_back=True)
    assert [(r.round, r.loss) for r in everything] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (4, 40.0),
        (5, 5.0),
    ]


async def test_checkpoints_and_job_state(store: SqliteStore) -> None:
    assert await store.latest_checkpoint("j-0000000001") is None
    await store.save_checkpoint("j-0000000001", 4, b"m4")
    await store.save_checkpoint("j-0000000001", 8, b"m8")
    await store.save_checkpoint("j-0000000002", 9, b"other")
    assert await store.latest_checkpoint("j-0000000001") == (8, b"m8")
    await store.save_checkpoint("j-0000000001", 8, b"m8b")
    assert await store.latest_checkpoint("j-0000000001") == (8, b"m8b")

    assert await store.get_job_state("j-0000000001", "ledger") is None
    await store.put_job_state("j-0000000001", "ledger", b"\x00\x01")
    await store.put_job_state("j-0000000001", "ledger", b"\x02")
    assert await store.get_job_state("j-0000000001", "ledger") == b"\x02"
    assert await store.delete_job_state("j-0000000001", "ledger")
    assert await store.get_job_state("j-0000000001", "ledger") is None


async def test_transaction_commits_together_and_announces_after_commit(
    store: SqliteStore,
) -> None:
    announced: list[str] = []
    store.add_event_listener(lambda e: announced.append(e.kind))
    j = await store.create_job(job("t"), "alice")
    async with store.transaction():
        await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=1))
        j.round = 1
        await store.update_job(j)
        await store.put_job_state(j.job_id, "ledger", b"L1")
        await store.append_event("round.applied", job_id=j.job_id)
        # Reads inside the transaction see its writes ...
        got = await store.get_job(j.job_id)
        assert got is not None and got.round == 1
        assert announced == []  # ... but nothing is announced before the commit.
    assert announced == ["round.applied"]
    assert [r.round for r in await store.list_rounds(j.job_id)] == [1]
    assert await store.get_job_state(j.job_id, "ledger") == b"L1"


async def test_transaction_rolls_back_everything_on_error(store: SqliteStore) -> None:
    announced: list[str] = []
    store.add_event_listener(lambda e: announced.append(e.kind))
    j = await store.create_job(job("t"), "alice")
    with pytest.raises(RuntimeError, match="boom"):
        async with store.transaction():
            await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=1))
            j.round = 1
            await store.update_job(j)
            await store.append_event("round.applied", job_id=j.job_id)
            raise RuntimeError("boom")
    assert await store.list_rounds(j.job_id) == []
    got = await store.get_job(j.job_id)
    assert got is not None and got.round == 0
    assert announced == [] and await store.list_events(kinds=["round.*"]) == []
    # The store is still usable afterwards.
    await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=1))


async def test_other_tasks_see_only_committed_data_and_wait_to_write(
    store: SqliteStore,
) -> None:
    j = await store.create_job(job("iso"), "alice")
    inside = asyncio.Event()
    release = asyncio.Event()
    order: list[str] = []

    async def long_transaction() -> None:
        async with store.transaction():
            await store.put_job_state(j.job_id, "k", b"txn")
            inside.set()
            await release.wait()
            order.append("txn-commit")

    async def other_writer() -> None:
        await store.put_job_state(j.job_id, "other", b"x")
        order.append("other-write")

    txn = asyncio.create_task(long_transaction())
    await inside.wait()
    assert await store.get_job_state(j.job_id, "k") is None  # not committed yet
    writer = asyncio.create_task(other_writer())
    await asyncio.sleep(0.05)
    assert order == []  # the other writer waits for the transaction
    release.set()
    await asyncio.gather(txn, writer)
    assert order == ["txn-commit", "other-write"]
    assert await store.get_job_state(j.job_id, "k") == b"txn"


async def test_nested_transaction_joins_outer(store: SqliteStore) -> None:
    j = await store.create_job(job("n"), "alice")
    with pytest.raises(ValueError):
        async with store.transaction():
            await store.put_job_state(j.job_id, "a", b"1")
            async with store.transaction():
                await store.put_job_state(j.job_id, "b", b"2")
            raise ValueError("outer fails")
    assert await store.get_job_state(j.job_id, "a") is None
    assert await store.get_job_state(j.job_id, "b") is None


async def test_data_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    s = await SqliteStore.open(path)
    j = await s.create_job(job("keep"), "alice")
    await s.upsert_node(node("n-0000000001", "a"))
    await s.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=1))
    await s.save_checkpoint(j.job_id, 1, b"manifest")
    await s.put_job_state(j.job_id, "ledger", b"L")
    await s.close()
    s = await SqliteStore.open(path)
    try:
        assert await s.get_job(j.job_id) == j
        assert await s.get_node("n-0000000001") is not None
        assert len(await s.list_rounds(j.job_id)) == 1
        assert await s.latest_checkpoint(j.job_id) == (1, b"manifest")
        assert await s.get_job_state(j.job_id, "ledger") == b"L"
    finally:
        await s.close()


async def test_closed_store_refuses_use(tmp_path: Path) -> None:
    s = await SqliteStore.open(tmp_path / "x.db")
    await s.close()
    with pytest.raises(StoreError, match="closed"):
        await s.append_event("late")


@pytest.mark.timeout(60)
async def test_a_write_cancelled_at_any_moment_leaves_the_store_writable(
    store: SqliteStore,
) -> None:
    """Cancel an event append after 0..8 event-loop yields (so also while BEGIN IMMEDIATE is in
    flight on aiosqlite's thread): later writes must still work."""
    for yields in range(9):
        for _ in range(3):
            task = asyncio.create_task(store.append_event("test.cancelled", message="x"))
            for _ in range(yields):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            event = await store.append_event("test.after", message=f"after {yields} yields")
            assert event.id > 0


async def test_tenant_weights_and_scheduler_state_persist(tmp_path: Path) -> None:
    path = tmp_path / "weights.db"
    store = await SqliteStore.open(path)
    try:
        assert await store.list_tenant_weights() == {}
        await store.set_tenant_weight("alice", 2.0)
        await store.set_tenant_weight("bob", 0.5)
        await store.set_tenant_weight("alice", 3.0)
        await store.put_scheduler_state("usage", b"{}")
        await store.put_scheduler_state("usage", b'{"a": 1}')
    finally:
        await store.close()
    again = await SqliteStore.open(path)
    try:
        assert await again.list_tenant_weights() == {"alice": 3.0, "bob": 0.5}
        assert await again.get_scheduler_state("usage") == b'{"a": 1}'
        assert await again.get_scheduler_state("nothing") is None
    finally:
        await again.close()
