# ruff: noqa: F811
"""What only the PostgreSQL store has, on a real server (tests/pg.py): its migrations applied
once by whichever coordinator gets there first, several stores (connections, coordinators) on
one database, failed transactions that leave nothing behind, and opening errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from coordinator.accounting.credit_book import Entry
from coordinator.core.errors import AlreadyExistsError, StoreError
from coordinator.store.base import TokenRecord
from coordinator.store.migrations import LATEST_SCHEMA_VERSION, MIGRATIONS
from coordinator.store.opening import open_store
from coordinator.store.postgres import PostgresStore, redact_url
from epochmesh.v1 import common_pb2

# The fixtures pg_server and pg_url, imported: tests name them as parameters (F811).
from tests.pg import PgServer, pg_server, pg_url  # noqa: F401
from tests.procs import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def two(pg_url: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    """Two stores on one database, as two coordinators would hold."""
    a = await PostgresStore.open(pg_url)
    b = await PostgresStore.open(pg_url)
    yield a, b
    await a.close()
    await b.close()


async def _schema_rows(url: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT version, description FROM schema_version ORDER BY 1")
    finally:
        await conn.close()
    return [(int(r[0]), str(r[1])) for r in rows]


def entry(src: str, dst: str, amount: int, job_id: str = "") -> Entry:
    return Entry(1, src, dst, amount, "test", job_id, 1, "n-1", 4)


# -- schema and migrations --------------------------------------------------------------------


async def test_an_empty_database_is_migrated_to_the_latest_version(pg_url: str) -> None:
    store = await PostgresStore.open(pg_url)
    try:
        assert store.schema_version == LATEST_SCHEMA_VERSION
    finally:
        await store.close()
    assert await _schema_rows(pg_url) == [(m.version, m.description) for m in MIGRATIONS]
    again = await PostgresStore.open(pg_url)  # a second open finds nothing to do
    await again.close()
    assert len(await _schema_rows(pg_url)) == len(MIGRATIONS)


async def test_stores_opening_one_empty_database_at_once_apply_the_schema_once(
    pg_url: str,
) -> None:
    stores = await asyncio.gather(*(PostgresStore.open(pg_url) for _ in range(4)))
    try:
        assert [s.schema_version for s in stores] == [LATEST_SCHEMA_VERSION] * 4
        job = await stores[0].create_job(common_pb2.Job(name="j"), "alice")
        assert await stores[3].get_job(job.job_id) == job
    finally:
        for s in stores:
            await s.close()
    assert await _schema_rows(pg_url) == [(m.version, m.description) for m in MIGRATIONS]


async def test_an_older_schema_is_migrated_and_backfilled(pg_url: str) -> None:
    old = await PostgresStore.open(pg_url, target_version=8)
    assert old.schema_version == 8
    await old.add_blob("aa" * 32, 3)
    job = common_pb2.Job(name="before 9")
    job.program.sha256 = "aa" * 32
    stored = await old.create_job(job, "alice")
    await old.close()
    store = await PostgresStore.open(pg_url)
    try:
        assert store.schema_version == LATEST_SCHEMA_VERSION
        assert await store.job_blobs(stored.job_id) == {"aa" * 32}
        assert await store.blob_owners("aa" * 32) == {"alice"}
    finally:
        await store.close()


async def test_a_database_of_a_newer_program_is_refused(pg_url: str) -> None:
    await (await PostgresStore.open(pg_url)).close()
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            "INSERT INTO schema_version VALUES ($1, 0, 'from the future')",
            LATEST_SCHEMA_VERSION + 1,
        )
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="newer than this coordinator supports"):
        await PostgresStore.open(pg_url)


# -- two stores on one database ---------------------------------------------------------------


async def test_two_stores_see_each_others_commits(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    job = await a.create_job(common_pb2.Job(name="shared"), "alice")
    assert await b.get_job(job.job_id) == job
    await b.add_round(common_pb2.RoundRecord(job_id=job.job_id, round=1))
    assert [r.round for r in await a.list_rounds(job.job_id)] == [1]
    inside = asyncio.Event()
    release = asyncio.Event()

    async def long_transaction() -> None:
        async with a.transaction():
            await a.put_job_state(job.job_id, "k", b"uncommitted")
            inside.set()
            await release.wait()

    txn = asyncio.create_task(long_transaction())
    await inside.wait()
    assert await b.get_job_state(job.job_id, "k") is None  # not committed yet
    release.set()
    await txn
    assert await b.get_job_state(job.job_id, "k") == b"uncommitted"


async def test_concurrent_writers_on_two_stores_never_collide(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    """Event ids stay unique and increasing, a single-use token is redeemed once, a round
    number is taken once, and every ledger entry lands, when two stores write at once."""
    a, b = two
    job = await a.create_job(common_pb2.Job(name="race"), "alice")
    await a.add_token(TokenRecord("h-once", "node", 1, 10**15, reusable=False))

    async def burst(store: PostgresStore, who: str) -> tuple[list[int], int, int]:
        ids = []
        redeemed = 0
        rounds = 0
        for i in range(20):
            ids.append((await store.append_event("race", message=f"{who}{i}")).id)
            if await store.redeem_token("h-once", 5) is not None:
                redeemed += 1
            try:
                await store.add_round(common_pb2.RoundRecord(job_id=job.job_id, round=i))
                rounds += 1
            except AlreadyExistsError:
                pass
            async with store.transaction():
                await store.add_ledger_entries([entry("mint", f"tenant:{who}", 1)])
        return ids, redeemed, rounds

    (ids_a, red_a, rounds_a), (ids_b, red_b, rounds_b) = await asyncio.gather(
        burst(a, "a"), burst(b, "b")
    )
    assert ids_a == sorted(ids_a) and ids_b == sorted(ids_b)
    assert len(set(ids_a) | set(ids_b)) == 40
    assert red_a + red_b == 1
    assert rounds_a + rounds_b == 20
    assert [r.round for r in await b.list_rounds(job.job_id, since_round=-1)] == list(range(20))
    assert [e.id for e in await a.list_events(limit=0)] == sorted(ids_a + ids_b)
    assert await b.last_event_id() == max(ids_a + ids_b)
    assert await a.ledger_balances() == {"mint": -40, "tenant:a": 20, "tenant:b": 20}


# -- failed transactions ----------------------------------------------------------------------


async def test_a_transaction_refused_by_the_server_leaves_nothing(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    job = await a.create_job(common_pb2.Job(name="billed"), "alice")
    before = await a.last_event_id()
    with pytest.raises(asyncpg.CheckViolationError):
        async with a.transaction():
            await a.add_round(common_pb2.RoundRecord(job_id=job.job_id, round=1))
            await a.append_event("round.billed", job_id=job.job_id)
            await a.add_ledger_entries([entry("escrow:j", "donor:d", 5, job.job_id)])
            await a.add_ledger_entries([entry("escrow:j", "donor:d", 0, job.job_id)])
    for store in (a, b):
        assert await store.list_rounds(job.job_id) == []
        assert await store.list_ledger_entries() == []
        assert await store.last_event_id() == before
    await a.add_round(common_pb2.RoundRecord(job_id=job.job_id, round=1))  # still usable
    assert [r.round for r in await b.list_rounds(job.job_id)] == [1]


async def test_a_transaction_whose_connection_dies_leaves_nothing(pg_url: str) -> None:
    store = await PostgresStore.open(pg_url)
    try:
        job = await store.create_job(common_pb2.Job(name="cut"), "alice")
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, OSError)):
            async with store.transaction():
                await store.add_round(common_pb2.RoundRecord(job_id=job.job_id, round=1))
                await store.add_ledger_entries([entry("escrow:j", "donor:d", 5, job.job_id)])
                killer = await asyncpg.connect(pg_url)
                try:
                    await killer.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                finally:
                    await killer.close()
                await store.append_event("round.billed", job_id=job.job_id)
        assert await store.list_rounds(job.job_id) == []
        assert await store.list_ledger_entries() == []
        # The pool replaces the connections it lost: the store goes on.
        await store.add_round(common_pb2.RoundRecord(job_id=job.job_id, round=1))
        assert [r.round for r in await store.list_rounds(job.job_id)] == [1]
    finally:
        await store.close()


# -- opening ----------------------------------------------------------------------------------


async def test_an_unreachable_server_fails_fast_with_the_reason() -> None:
    url = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nowhere"
    started = time.monotonic()
    with pytest.raises(StoreError, match="cannot connect to PostgreSQL at") as info:
        await PostgresStore.open(url, connect_timeout_s=2)
    assert time.monotonic() - started < 5
    assert "secret" not in str(info.value) and "postgres:***@" in str(info.value)


async def test_a_missing_database_or_a_wrong_url_is_refused(pg_server: PgServer) -> None:
    with pytest.raises(StoreError, match='database "absent" does not exist'):
        await PostgresStore.open(pg_server.url("absent"))
    with pytest.raises(StoreError, match="not a PostgreSQL URL"):
        await PostgresStore.open("mysql://x@127.0.0.1/db")
    with pytest.raises(StoreError, match="unknown store"):
        await open_store("sqlite:///x.db", pg_server.root / "unused.db")


def test_redact_url_hides_only_the_password() -> None:
    assert redact_url("postgresql://u:pw@h:5/db?sslmode=require") == (
        "postgresql://u:***@h:5/db?sslmode=require"
    )
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"


async def test_open_store_opens_postgres_from_a_url(pg_url: str) -> None:
    store = await open_store(pg_url, Path("/nonexistent/c.db"))
    try:
        assert isinstance(store, PostgresStore)
        assert "postgres@127.0.0.1" in store.url
        async with store.acquire_connection() as conn:
            assert await conn.fetchval("SELECT count(*) FROM schema_version") == len(MIGRATIONS)
    finally:
        await store.close()
