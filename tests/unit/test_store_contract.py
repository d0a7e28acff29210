"""The `Store` contract, run against every backend (SQLite on a file, memory, PostgreSQL).

One suite, one factory per backend (as Flower's linkstate_test.py): every test takes the
``store`` fixture and runs once per name in `BACKENDS`; a new backend adds its name and a
branch in `open_store`. PostgreSQL runs on a real server (tests/pg.py: one per test process, a
fresh database per test; skipped, saying why, where PostgreSQL is not installed). What only
one backend has (SQLite's WAL mode, schema migrations, persistence across a reopen) is tested
in tests/unit/test_store.py and tests/unit/test_store_postgres.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from coordinator.accounting.credit_book import Entry
from coordinator.core.errors import AlreadyExistsError, NotFoundError, StoreError
from coordinator.core.ids import is_job_id
from coordinator.store.base import HeartbeatUpdate, NodeRecord, Store, TokenRecord, kind_matches
from coordinator.store.memory import MemoryStore
from coordinator.store.migrations import LATEST_SCHEMA_VERSION
from coordinator.store.postgres import PostgresStore
from coordinator.store.sqlite import SqliteStore
from epochmesh.v1 import common_pb2
from tests.pg import pg_server, pg_url  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(30)

BACKENDS = ("sqlite", "memory", "postgresql")

# What a backend raises for a ledger entry that moves no positive amount (SQLite and
# PostgreSQL: their CHECK constraint; memory: ValueError, as the credit book's own check).
LEDGER_REFUSALS = (ValueError, sqlite3.IntegrityError, asyncpg.CheckViolationError)


async def open_store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if backend == "sqlite":
        return await SqliteStore.open(tmp_path / "c.db")
    if backend == "memory":
        return MemoryStore()
    if backend == "postgresql":
        return await PostgresStore.open(request.getfixturevalue("pg_url"))
    raise ValueError(f"no store backend {backend!r}")


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    s = await open_store(request.param, request, tmp_path)
    yield s
    await s.close()


def node(node_id: str, name: str, state: int = common_pb2.NODE_STATE_ONLINE) -> NodeRecord:
    info = common_pb2.NodeInfo(node_id=node_id, name=name, state=state, registered_at_ms=1)
    info.devices.add(kind="cpu", cores=2)
    info.labels["zone"] = "a"
    return NodeRecord(info=info, lease_id="lease-" + node_id)


def job(name: str, state: int = common_pb2.JOB_STATE_QUEUED, created: int = 0) -> common_pb2.Job:
    return common_pb2.Job(name=name, state=state, created_ms=created, num_samples=10)


def entry(src: str, dst: str, amount: int, job_id: str = "", at_ms: int = 1) -> Entry:
    return Entry(at_ms, src, dst, amount, "test", job_id, 1, "n-1", 4)


def test_every_store_method_is_exercised() -> None:
    """Each abstract method of `Store` is called somewhere in this suite."""
    source = inspect.getsource(sys.modules[__name__])
    missing = sorted(name for name in Store.__abstractmethods__ if f".{name}" not in source)
    assert missing == []


# -- lifecycle --------------------------------------------------------------------------------


async def test_schema_version_is_the_latest(store: Store) -> None:
    assert store.schema_version == LATEST_SCHEMA_VERSION


async def test_closed_store_refuses_use(store: Store) -> None:
    await store.close()
    await store.close()  # closing twice is harmless
    with pytest.raises(StoreError, match="closed"):
        await store.append_event("late")
    with pytest.raises(StoreError, match="closed"):
        await store.get_job("j-0000000000")
    with pytest.raises(StoreError, match="closed"):
        async with store.transaction():
            pass


# -- nodes ------------------------------------------------------------------------------------


async def test_nodes_round_trip_filter_and_heartbeat_batches(store: Store) -> None:
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
    await store.update_heartbeats([])  # nothing to do


async def test_nodes_listed_in_registration_order_then_by_id(store: Store) -> None:
    for node_id, registered in (("n-3", 5), ("n-2", 9), ("n-1", 5)):
        record = node(node_id, node_id)
        record.info.registered_at_ms = registered
        await store.upsert_node(record)
    assert [r.info.node_id for r in await store.list_nodes()] == ["n-1", "n-3", "n-2"]
    assert await store.list_nodes([common_pb2.NODE_STATE_QUARANTINED]) == []


async def test_node_records_are_copies(store: Store) -> None:
    record = node("n-1", "a")
    await store.upsert_node(record)
    record.info.name = "changed after upsert"
    got = await store.get_node("n-1")
    assert got is not None and got.info.name == "a"
    got.info.name = "changed after get"
    listed = await store.list_nodes()
    assert listed[0].info.name == "a"
    listed[0].info.labels["zone"] = "b"
    again = await store.get_node("n-1")
    assert again is not None and again.info.labels["zone"] == "a"


# -- events -----------------------------------------------------------------------------------


async def test_events_ids_filters_and_limits(store: Store) -> None:
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


async def test_events_fields_patterns_and_default_limit(store: Store) -> None:
    assert await store.last_event_id() == 0 and await store.count_events() == 0
    e = await store.append_event(
        "job.running", node_id="n-1", job_id="j-1", message="m", attrs={"a": "1"}, time_ms=42
    )
    got = (await store.list_events())[0]
    assert got == e
    assert (got.kind, got.node_id, got.job_id, got.message, got.time_ms) == (
        "job.running",
        "n-1",
        "j-1",
        "m",
        42,
    )
    assert dict(got.attrs) == {"a": "1"}
    assert await store.list_events(node_id="n-1", job_id="j-2") == []
    assert [x.id for x in await store.list_events(kinds=["*"])] == [e.id]
    assert await store.list_events(kinds=["job"]) == []
    # The returned event is a copy.
    e.kind = "changed"
    got.kind = "changed"
    assert (await store.list_events())[0].kind == "job.running"
    # At most 1000 by default; limit 0: all.
    async with store.transaction():
        for i in range(1000):
            await store.append_event("bulk", time_ms=i)
    assert len(await store.list_events()) == 1000
    assert len(await store.list_events(limit=0)) == 1001
    assert await store.count_events() == 1001


async def test_prune_events_keeps_live_jobs_and_never_reuses_ids(store: Store) -> None:
    live = await store.create_job(job("live", common_pb2.JOB_STATE_RUNNING), "t")
    done = await store.create_job(job("done", common_pb2.JOB_STATE_SUCCEEDED), "t")
    await store.append_event("node.registered", node_id="n1", time_ms=100)
    await store.append_event("job.running", job_id=live.job_id, time_ms=100)
    await store.append_event("job.succeeded", job_id=done.job_id, time_ms=100)
    await store.append_event("job.other", job_id="j-0000000000", time_ms=100)
    recent = await store.append_event("node.offline", node_id="n1", time_ms=5_000)
    keep = [common_pb2.JOB_STATE_RUNNING]
    assert await store.prune_events(1_000, keep_job_states=keep, limit=2) == 2
    assert await store.prune_events(1_000, keep_job_states=keep, limit=2) == 1
    assert await store.prune_events(1_000, keep_job_states=keep, limit=2) == 0
    assert [(e.kind, e.job_id) for e in await store.list_events()] == [
        ("job.running", live.job_id),
        ("node.offline", ""),
    ]
    assert await store.prune_events(10_000, limit=0) == 2
    assert await store.count_events() == 0
    assert await store.last_event_id() == recent.id
    again = await store.append_event("node.registered", node_id="n2")
    assert again.id > recent.id


async def test_prune_events_with_a_limit_takes_the_oldest(store: Store) -> None:
    late = await store.append_event("a", time_ms=300)
    await store.append_event("b", time_ms=100)
    await store.append_event("c", time_ms=200)
    assert await store.prune_events(1_000, limit=2) == 2
    assert [e.id for e in await store.list_events()] == [late.id]


async def test_listeners_hear_committed_events_in_order_and_may_fail(store: Store) -> None:
    heard: list[tuple[str, int]] = []

    def failing(event: common_pb2.Event) -> None:
        raise RuntimeError("a listener's failure is logged, not raised")

    store.add_event_listener(failing)
    store.add_event_listener(lambda e: heard.append((e.kind, e.id)))
    a = await store.append_event("a")
    async with store.transaction():
        b = await store.append_event("b")
        c = await store.append_event("c")
        assert heard == [("a", a.id)]
    assert heard == [("a", a.id), ("b", b.id), ("c", c.id)]


# -- blobs ------------------------------------------------------------------------------------


async def test_blobs(store: Store) -> None:
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


async def test_blob_records_order_limit_and_touch(store: Store) -> None:
    stats = await store.blob_stats()
    assert (stats.count, stats.total_bytes) == (0, 0)
    for sha in ("cc" * 32, "aa" * 32, "bb" * 32):
        await store.add_blob(sha, 1)
    assert [b.sha256 for b in await store.list_blobs(limit=2)] == ["aa" * 32, "bb" * 32]
    first = await store.add_blob("dd" * 32, 7)
    assert first.size == 7 and first.created_ms > 0
    assert await store.add_blob("dd" * 32, 99) == first  # unchanged
    assert await store.get_blob("dd" * 32) == first
    await asyncio.sleep(0.01)
    assert await store.touch_blob("dd" * 32)
    touched = await store.get_blob("dd" * 32)
    assert touched is not None and touched.created_ms > first.created_ms
    assert touched.size == 7
    assert not await store.touch_blob("ee" * 32)


async def test_blob_ownership_and_visibility(store: Store) -> None:
    mine, shared, gone = "aa" * 32, "bb" * 32, "cc" * 32
    await store.add_blob(mine, 10)
    await store.add_blob(shared, 20)
    await store.add_blob_owner(mine, "alice")
    await store.add_blob_owner(mine, "alice")  # idempotent
    await store.add_blob_owner(mine, "bob")
    await store.add_blob_owner(gone, "alice")  # not stored: held, but neither seen nor counted
    assert await store.blob_owners(mine) == {"alice", "bob"}
    assert await store.blob_owners("dd" * 32) == set()
    assert await store.owned_blob_bytes("alice") == 10
    assert await store.owned_blob_bytes("nobody") == 0
    assert await store.blob_visible_to(mine, "alice")
    assert not await store.blob_visible_to(shared, "alice")
    assert not await store.blob_visible_to(gone, "alice")
    # A job's blobs are visible to the job's owner.
    j = await store.create_job(job("uses"), owner="carol")
    await store.add_job_blobs(j.job_id, [shared, mine, shared])
    await store.add_job_blobs(j.job_id, [shared])
    assert await store.job_blobs(j.job_id) == {shared, mine}
    assert await store.job_blobs("j-0000000000") == set()
    assert await store.blob_visible_to(shared, "carol")
    assert not await store.blob_visible_to(shared, "bob")
    # Dropping holds.
    assert await store.remove_blob_owners(mine, ["alice", "alice", "mallory"]) == 1
    assert await store.remove_blob_owners(mine, []) == 0
    assert await store.blob_owners(mine) == {"bob"}
    assert await store.owned_blob_bytes("alice") == 0
    assert not await store.blob_visible_to(mine, "alice")
    # Removing a blob leaves its holds and job records, but it is seen by nobody.
    assert await store.remove_blob(mine)
    assert await store.blob_owners(mine) == {"bob"}
    assert not await store.blob_visible_to(mine, "bob")
    assert await store.owned_blob_bytes("bob") == 0
    assert await store.job_blobs(j.job_id) == {shared, mine}


# -- jobs -------------------------------------------------------------------------------------


async def test_jobs_crud(store: Store) -> None:
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


async def test_job_ids_defaults_order_and_copies(store: Store) -> None:
    assert await store.count_jobs_by_state() == {}
    given = job("given", created=50)
    given.job_id, given.owner, given.updated_ms = "j-00000000aa", "ignored", 60
    stored = await store.create_job(given, owner="")
    assert (stored.job_id, stored.owner, stored.created_ms, stored.updated_ms) == (
        "j-00000000aa",
        "",
        50,
        60,
    )
    assert given.owner == "ignored"  # the caller's message is not changed
    tie = job("tie", created=50)
    tie.job_id = "j-00000000bb"
    await store.create_job(tie, owner="bob")
    # Newest first, then by id (descending); owner "" is an owner like any other.
    assert [j.job_id for j in await store.list_jobs()] == ["j-00000000bb", "j-00000000aa"]
    assert [j.job_id for j in await store.list_jobs(owner="")] == ["j-00000000aa"]
    assert await store.list_jobs(owner="nobody") == []
    # Copies: neither the returned message nor the one handed in reaches the store.
    stored.name = "changed"
    got = await store.get_job("j-00000000aa")
    assert got is not None and got.name == "given"
    got.name = "changed"
    listed = await store.list_jobs(owner="")
    assert listed[0].name == "given"
    # update_job stores the record as given: owner, state, creation time included.
    got.owner, got.state, got.created_ms = "carol", common_pb2.JOB_STATE_RUNNING, 10
    await store.update_job(got)
    got.name = "changed after update"
    assert [j.name for j in await store.list_jobs(owner="carol")] == ["changed"]
    assert [j.job_id for j in await store.list_jobs()] == ["j-00000000bb", "j-00000000aa"]


# -- rounds -----------------------------------------------------------------------------------


async def test_rounds_rollback_and_rerecord(store: Store) -> None:
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


async def test_rounds_flags_order_and_other_jobs(store: Store) -> None:
    a = await store.create_job(job("a"), "t")
    b = await store.create_job(job("b"), "t")
    for r in (3, 1, 2):
        await store.add_round(common_pb2.RoundRecord(job_id=a.job_id, round=r, epoch=r))
    await store.add_round(common_pb2.RoundRecord(job_id=b.job_id, round=1))
    assert [r.round for r in await store.list_rounds(a.job_id)] == [1, 2, 3]
    assert await store.list_rounds("j-0000000000") == []
    assert await store.rollback_rounds(a.job_id, after_round=5) == 0
    assert await store.rollback_rounds(a.job_id, after_round=1) == 2
    assert await store.rollback_rounds(a.job_id, after_round=1) == 0  # already rolled back
    flags = [(r.round, r.rolled_back) for r in await store.list_rounds(a.job_id, 0, 0, True)]
    assert flags == [(1, False), (2, True), (3, True)]
    # A record stored with the flag set is live until rolled back.
    await store.add_round(common_pb2.RoundRecord(job_id=a.job_id, round=2, rolled_back=True))
    assert [(r.round, r.rolled_back) for r in await store.list_rounds(a.job_id)] == [
        (1, False),
        (2, False),
    ]
    assert [r.round for r in await store.list_rounds(b.job_id)] == [1]
    listed = await store.list_rounds(a.job_id)
    listed[0].loss = 9.0
    assert (await store.list_rounds(a.job_id))[0].loss == 0.0


# -- checkpoints and per-job state ------------------------------------------------------------


async def test_checkpoints_and_job_state(store: Store) -> None:
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


async def test_checkpoints_before_after_list_and_drop(store: Store) -> None:
    a, b = "j-000000000a", "j-000000000b"
    for r in (0, 2, 1, 5):
        await store.save_checkpoint(a, r, f"a{r}".encode())
    await store.save_checkpoint(b, 5, b"b5")
    assert await store.checkpoint_before(a, 5) == (2, b"a2")
    assert await store.checkpoint_before(a, 0) is None
    assert await store.checkpoint_before("j-0000000000", 9) is None
    assert await store.list_checkpoints() == [
        (a, 0, b"a0"),
        (a, 1, b"a1"),
        (a, 2, b"a2"),
        (a, 5, b"a5"),
        (b, 5, b"b5"),
    ]
    assert await store.list_checkpoints(b) == [(b, 5, b"b5")]
    assert await store.drop_checkpoints_after(a, 1) == 2
    assert await store.drop_checkpoints_after(a, 1) == 0
    assert [r for _, r, _ in await store.list_checkpoints(a)] == [0, 1]
    assert await store.drop_checkpoints(a, [1, 0, 7, 1]) == [b"a0", b"a1"]
    assert await store.drop_checkpoints(a, []) == []
    assert await store.latest_checkpoint(a) is None
    assert await store.latest_checkpoint(b) == (5, b"b5")


async def test_job_state_keys_are_per_job(store: Store) -> None:
    await store.put_job_state("j-1", "k", b"1")
    await store.put_job_state("j-2", "k", bytearray(b"2"))
    assert await store.get_job_state("j-2", "k") == b"2"
    assert not await store.delete_job_state("j-1", "other")
    assert await store.delete_job_state("j-1", "k")
    assert not await store.delete_job_state("j-1", "k")
    assert await store.get_job_state("j-2", "k") == b"2"


# -- trust ------------------------------------------------------------------------------------


async def test_tokens_add_get_and_redeem(store: Store) -> None:
    once = TokenRecord("h-once", "node", 1, 1_000, reusable=False, donor="dana", cert_ttl_ms=5)
    await store.add_token(once)
    with pytest.raises(AlreadyExistsError):
        await store.add_token(once)
    assert await store.get_token("h-once") == once
    assert await store.get_token("h-unknown") is None
    assert await store.redeem_token("h-unknown", 10) is None
    assert await store.redeem_token("h-once", 1_000) is None  # expired at expires_ms
    used = await store.redeem_token("h-once", 999)
    assert used is not None and used.uses == 1 and used.donor == "dana" and used.exhausted()
    assert await store.redeem_token("h-once", 10) is None  # single use
    assert await store.get_token("h-once") == used

    limited = TokenRecord("h-three", "node", 1, 1_000, reusable=True, max_uses=3)
    await store.add_token(limited)
    uses = [await store.redeem_token("h-three", 10) for _ in range(4)]
    assert [u.uses if u else None for u in uses] == [1, 2, 3, None]
    stored = await store.get_token("h-three")
    assert stored is not None and stored.uses == 3 and stored.exhausted()

    endless = TokenRecord("h-many", "user", 1, 1_000, reusable=True)
    await store.add_token(endless)
    for _ in range(5):
        assert await store.redeem_token("h-many", 10) is not None
    stored = await store.get_token("h-many")
    assert stored is not None and stored.uses == 5 and not stored.exhausted()


async def test_node_donors_and_quarantined_nodes(store: Store) -> None:
    assert await store.get_node_donor("n-1") == ""
    assert await store.list_node_donors() == {}
    await store.upsert_node(node("n-2", "b", common_pb2.NODE_STATE_QUARANTINED))
    await store.upsert_node(node("n-1", "a", common_pb2.NODE_STATE_QUARANTINED))
    await store.upsert_node(node("n-3", "c", common_pb2.NODE_STATE_ONLINE))
    for node_id in ("n-2", "n-1", "n-3", "n-9"):  # n-9: not registered
        await store.set_node_donor(node_id, "dana")
    await store.set_node_donor("n-3", "erin")  # replaces
    assert await store.get_node_donor("n-3") == "erin"
    assert await store.list_node_donors() == {
        "n-1": "dana",
        "n-2": "dana",
        "n-3": "erin",
        "n-9": "dana",
    }
    assert await store.quarantined_nodes_of_donor("dana") == ["n-1", "n-2"]
    assert await store.quarantined_nodes_of_donor("erin") == []


async def test_revocations(store: Store) -> None:
    assert await store.list_revocations() == []
    assert await store.add_revocation("u-1", "user", "left")
    assert await store.add_revocation("n-1", "node", "stolen")
    assert not await store.add_revocation("u-1", "user", "again")
    assert sorted(await store.list_revocations()) == ["n-1", "u-1"]


# -- cluster scheduler ------------------------------------------------------------------------


async def test_tenant_weights_and_scheduler_state(store: Store) -> None:
    assert await store.list_tenant_weights() == {}
    await store.set_tenant_weight("alice", 2.0)
    await store.set_tenant_weight("bob", 1)
    await store.set_tenant_weight("alice", 3.5)
    weights = await store.list_tenant_weights()
    assert weights == {"alice": 3.5, "bob": 1.0} and isinstance(weights["bob"], float)
    assert await store.get_scheduler_state("usage") is None
    await store.put_scheduler_state("usage", b"{}")
    await store.put_scheduler_state("usage", b'{"a": 1}')
    assert await store.get_scheduler_state("usage") == b'{"a": 1}'


# -- credit ledger ----------------------------------------------------------------------------


async def test_ledger_entries_ids_filters_and_balances(store: Store) -> None:
    assert await store.add_ledger_entries([]) == []
    assert await store.ledger_balances() == {}
    ids = await store.add_ledger_entries(
        [entry("mint", "tenant:a", 100), entry("tenant:a", "escrow:j-1", 60, "j-1")]
    )
    more = await store.add_ledger_entries([entry("escrow:j-1", "donor:d", 60, "j-1", at_ms=7)])
    assert ids[0] < ids[1] < more[0]
    everything = await store.list_ledger_entries()
    assert [i for i, _ in everything] == [*ids, *more]
    assert everything[2][1] == entry("escrow:j-1", "donor:d", 60, "j-1", at_ms=7)
    assert [i for i, _ in await store.list_ledger_entries(account="tenant:a")] == ids
    assert [i for i, _ in await store.list_ledger_entries(job_id="j-1")] == [ids[1], more[0]]
    assert [i for i, _ in await store.list_ledger_entries("escrow:j-1", "j-1", ids[1])] == more
    assert [i for i, _ in await store.list_ledger_entries(limit=2)] == ids
    assert [i for i, _ in await store.list_ledger_entries(after_id=more[0])] == []
    assert await store.ledger_balances() == {
        "mint": -100,
        "tenant:a": 40,
        "escrow:j-1": 0,
        "donor:d": 60,
    }


async def test_ledger_refuses_a_batch_with_a_non_positive_amount_whole(store: Store) -> None:
    for bad in (0, -5):
        with pytest.raises(LEDGER_REFUSALS):
            await store.add_ledger_entries([entry("mint", "a", 10), entry("mint", "a", bad)])
    assert await store.list_ledger_entries() == []
    assert await store.ledger_balances() == {}


# -- transactions -----------------------------------------------------------------------------


async def test_transaction_commits_together_and_announces_after_commit(store: Store) -> None:
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


async def test_transaction_rolls_back_everything_on_error(store: Store) -> None:
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


async def test_a_round_with_its_charges_is_all_or_nothing(store: Store) -> None:
    """The engine's billed round: the round record, its ledger entries, the job and an event
    in one transaction; a refused round record takes the entries with it."""
    j = await store.create_job(job("billed"), "alice")
    await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=1))
    before = await store.last_event_id()
    with pytest.raises(AlreadyExistsError):
        async with store.transaction():
            await store.add_ledger_entries([entry("escrow:j", "donor:d", 5, j.job_id)])
            await store.append_event("round.billed", job_id=j.job_id)
            await store.put_job_state(j.job_id, "ledger", b"L")
            await store.save_checkpoint(j.job_id, 1, b"m")
            await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=1))
    assert await store.list_ledger_entries() == []
    assert await store.ledger_balances() == {}
    assert await store.last_event_id() == before
    assert await store.get_job_state(j.job_id, "ledger") is None
    assert await store.latest_checkpoint(j.job_id) is None
    async with store.transaction():
        ids = await store.add_ledger_entries([entry("escrow:j", "donor:d", 5, j.job_id)])
        await store.add_round(common_pb2.RoundRecord(job_id=j.job_id, round=2))
    assert [i for i, _ in await store.list_ledger_entries(job_id=j.job_id)] == ids
    assert [r.round for r in await store.list_rounds(j.job_id)] == [1, 2]


async def test_other_tasks_see_only_committed_data_and_wait_to_write(store: Store) -> None:
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


async def test_nested_transaction_joins_outer(store: Store) -> None:
    j = await store.create_job(job("n"), "alice")
    with pytest.raises(ValueError):
        async with store.transaction():
            await store.put_job_state(j.job_id, "a", b"1")
            async with store.transaction():
                await store.put_job_state(j.job_id, "b", b"2")
            raise ValueError("outer fails")
    assert await store.get_job_state(j.job_id, "a") is None
    assert await store.get_job_state(j.job_id, "b") is None


@pytest.mark.timeout(60)
async def test_a_write_cancelled_at_any_moment_leaves_the_store_writable(store: Store) -> None:
    """Cancel an event append after 0..8 event-loop yields (on SQLite also while BEGIN
    IMMEDIATE is in flight on aiosqlite's thread): later writes must still work."""
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
