# ruff: noqa: F811
"""The coordinators' lease on a real PostgreSQL server (tests/pg.py): one holder at a time, the
standby sees the holder's address, a takeover bumps the fencing epoch, and a store fenced with
a lost lease writes nothing, even when its own process has not noticed the loss yet."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.core.errors import FencedError
from coordinator.ha.lease import PostgresLease
from coordinator.store.postgres import PostgresStore
from tests.pg import PgServer, pg_server, pg_url  # noqa: F401 (fixtures)


def terminate_lease_holder_sql(database: str) -> str:
    """SQL ending the session that holds the coordinator lease's advisory lock."""
    return (
        "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_stat_activity a "
        "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
        f"AND a.datname = '{database}' AND a.application_name = 'epochmesh-coordinator-lease'"
    )


def _terminate_lease_sessions(pg_server: PgServer, database: str) -> None:
    """End the session holding the lease's advisory lock on ``database``."""
    pg_server.sql(terminate_lease_holder_sql(database))


@pytest.mark.timeout(120)
def test_one_holder_a_takeover_bumps_the_epoch_and_fences_the_old_store(
    pg_server: PgServer, pg_url: str
) -> None:
    database = pg_url.rsplit("/", 1)[1]

    async def scenario() -> None:
        store_a = await PostgresStore.open(pg_url)
        store_b = await PostgresStore.open(pg_url)
        a = PostgresLease(pg_url, "a", "127.0.0.1:1001", poll_s=0.1, timeout_s=5)
        b = PostgresLease(pg_url, "b", "127.0.0.1:1002", poll_s=0.1, timeout_s=5)
        try:
            assert await a.try_acquire()
            assert a.epoch == 1 and a.held()
            store_a.fence(a.epoch, a.held)
            await store_a.put_scheduler_state("k", b"from a")
            assert not await b.try_acquire()
            seen = []
            standby = asyncio.create_task(b.acquire(seen.append))
            await asyncio.sleep(0.5)
            assert not standby.done()
            assert seen and seen[-1].address == "127.0.0.1:1001" and seen[-1].holder == "a"

            # A's lease connection dies (pg_terminate_backend): B takes over, epoch 2.
            watch = asyncio.create_task(a.watch())
            _terminate_lease_sessions(pg_server, database)
            assert await asyncio.wait_for(standby, timeout=30) == 2
            assert "connection" in await asyncio.wait_for(watch, timeout=30)
            assert not a.held()
            store_b.fence(b.epoch, b.held)
            await store_b.put_scheduler_state("k", b"from b")
            with pytest.raises(FencedError, match="lost its lease"):
                await store_a.put_scheduler_state("k", b"from a, too late")

            # The database's check alone (the old process not knowing it lost): refused too.
            store_a.fence(1, lambda: True)
            with pytest.raises(FencedError, match="lost its lease"):
                await store_a.put_scheduler_state("k", b"from a, unaware")
            assert await store_b.get_scheduler_state("k") == b"from b"
            row = await b.read()
            assert (row.epoch, row.holder, row.address) == (2, "b", "127.0.0.1:1002")
        finally:
            await a.close()
            await b.close()
            await store_a.close()
            await store_b.close()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_takeover_waits_for_the_old_holders_write_in_flight(
    pg_server: PgServer, pg_url: str
) -> None:
    database = pg_url.rsplit("/", 1)[1]

    async def scenario() -> None:
        store_a = await PostgresStore.open(pg_url)
        a = PostgresLease(pg_url, "a", "127.0.0.1:1001", poll_s=0.1, timeout_s=5)
        b = PostgresLease(pg_url, "b", "127.0.0.1:1002", poll_s=0.1, timeout_s=5)
        try:
            assert await a.try_acquire()
            store_a.fence(a.epoch, lambda: True)
            entered, release = asyncio.Event(), asyncio.Event()

            async def slow_write() -> None:
                async with store_a.transaction():
                    await store_a.put_scheduler_state("k", b"in flight")
                    entered.set()
                    await release.wait()

            writer = asyncio.create_task(slow_write())
            await entered.wait()
            _terminate_lease_sessions(pg_server, database)
            takeover = asyncio.create_task(b.acquire(lambda _row: None))
            await asyncio.sleep(1.0)
            assert not takeover.done(), "the epoch moved while the old holder's write was open"
            release.set()
            await writer
            assert await asyncio.wait_for(takeover, timeout=30) == 2
            assert await store_a.get_scheduler_state("k") == b"in flight"
        finally:
            await a.close()
            await b.close()
            await store_a.close()

    asyncio.run(scenario())
