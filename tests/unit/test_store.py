"""SqliteStore on real SQLite files under tmp_path: what only this backend has (WAL mode, the
schema and its migrations, data that survives a reopen). The `Store` contract every backend
keeps is tests/unit/test_store_contract.py."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.core.errors import StoreError
from coordinator.store.migrations import LATEST_SCHEMA_VERSION, MIGRATIONS
from coordinator.store.sqlite import SqliteStore
from epochmesh.v1 import common_pb2
from tests.unit.test_store_contract import job, node

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "c.db")
    yield s
    await s.close()


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
