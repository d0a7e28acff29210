"""The active coordinator's lease on a PostgreSQL database, with a fencing epoch.

Why a session advisory lock *and* a fencing epoch: the lock decides who is active with no
clock and no expiry to tune (PostgreSQL releases it the moment the holder's session ends: a
kill -9 closes the socket, so a standby polling `pg_try_advisory_lock` takes over within one
poll), but a lock alone cannot stop the old holder's other connections from writing once its
lock session died unnoticed. So the winner also bumps ``coordinator_lease.epoch`` (and writes
its name and address there, for the standbys' redirects), and the store checks that epoch in
every write transaction (`PostgresStore.fence`): a coordinator that lost the lock writes
nothing once another one has taken over, whatever it has or has not noticed yet.

The lock lives on a connection of its own (not the store's pool, whose connections are reset
and shared). The holder pings it every ``timeout_s / 5``; a failed ping, a ping slower than
``timeout_s`` or the connection's end is the lease lost (`watch` returns why). Cut off from
the database, the holder's session is ended by the server after ``timeout_s`` of silence
(``idle_session_timeout``, PostgreSQL 14+; TCP keepalives besides), which frees the lock for a
standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from coordinator.core.errors import StoreError
from epochmesh.timeutil import now_ms

log = logging.getLogger(__name__)

# The advisory lock key of the lease (coordinator/store/postgres_schema.py's SCHEMA_LOCK_KEY is
# ...0001).
LEASE_LOCK_KEY = 0x65706F6368_0002  # "epoch", 2
DEFAULT_POLL_S = 1.0
DEFAULT_TIMEOUT_S = 8.0
_DB_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)


@dataclass(frozen=True)
class LeaseRow:
    """What ``coordinator_lease`` says: the last winner's epoch, name and address."""

    epoch: int
    holder: str
    address: str


class PostgresLease:
    """``await lease.acquire(on_standby)`` waits until this coordinator is the active one and
    returns the new epoch; then ``await lease.watch()`` returns when the lease is lost (the
    reason). `held` is what the store's fence asks before every write transaction. Lost, the
    lease may be acquired again (after `close`), with a new epoch."""

    def __init__(
        self,
        url: str,
        holder: str,
        address: str,
        *,
        poll_s: float = DEFAULT_POLL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._url = url
        self.holder = holder
        self.address = address
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._conn: Any = None
        self._held = False
        self._lost = asyncio.Event()
        self.epoch = 0

    def held(self) -> bool:
        return self._held and not self._lost.is_set()

    async def _connect(self) -> Any:
        conn = await asyncio.wait_for(
            asyncpg.connect(
                self._url,
                timeout=self.timeout_s,
                server_settings={"application_name": "epochmesh-coordinator-lease"},
            ),
            timeout=self.timeout_s * 2,
        )
        quiet_s = max(1, round(self.timeout_s))
        for setting in (
            f"SET idle_session_timeout = '{quiet_s}s'",
            "SET tcp_keepalives_idle = 2",
            "SET tcp_keepalives_interval = 1",
            f"SET tcp_keepalives_count = {quiet_s}",
        ):
            with contextlib.suppress(asyncpg.PostgresError):  # older servers lack some
                await conn.execute(setting)
        return conn

    async def read(self) -> LeaseRow:
        """The lease row as it stands (on the lease's connection)."""
        row = await self._conn.fetchrow(
            "SELECT epoch, holder, address FROM coordinator_lease WHERE id = 1"
        )
        if row is None:
            raise StoreError("the database has no coordinator_lease row: schema too old")
        return LeaseRow(int(row["epoch"]), str(row["holder"]), str(row["address"]))

    async def try_acquire(self) -> bool:
        """One attempt: take the lock without waiting; on success bump the epoch (waiting for
        the old holder's write transactions still under way) and record who holds it."""
        if self._conn is None or self._conn.is_closed():
            self._conn = await self._connect()
        got = await self._conn.fetchval("SELECT pg_try_advisory_lock($1)", LEASE_LOCK_KEY)
        if not got:
            return False
        try:
            epoch = await self._conn.fetchval(
                """UPDATE coordinator_lease SET epoch = epoch + 1, holder = $1, address = $2,
                       acquired_ms = $3 WHERE id = 1 RETURNING epoch""",
                self.holder,
                self.address,
                now_ms(),
            )
        except BaseException:
            await self._hang_up()
            raise
        if epoch is None:
            await self._hang_up()
            raise StoreError("the database has no coordinator_lease row: schema too old")
        self.epoch = int(epoch)
        # A new tenure: the last one's loss (if any) is behind, and its connection's end,
        # heard late, must not end this one.
        lost = self._lost = asyncio.Event()
        self._held = True
        self._conn.add_termination_listener(lambda _conn: self._lose(lost))
        log.info("acquired the coordinator lease (epoch %d) as %s", self.epoch, self.address)
        return True

    async def acquire(self, on_standby: Callable[[LeaseRow], None]) -> int:
        """Wait until this coordinator holds the lease; the new epoch. While another one does,
        ``on_standby`` hears the lease row every poll (its address may change)."""
        reported = ""
        while True:
            try:
                if await self.try_acquire():
                    return self.epoch
                row = await self.read()
                on_standby(row)
                if row.address != reported:
                    log.info(
                        "standby: the coordinator lease is held by %s at %s",
                        row.holder or "?",
                        row.address or "?",
                    )
                    reported = row.address
            except _DB_ERRORS as exc:
                log.warning("standby: cannot reach the database for the lease (%s)", exc)
                await self._hang_up()
            await asyncio.sleep(self.poll_s)

    async def watch(self) -> str:
        """Ping the lease's connection until the lease is lost; why it was."""
        interval = self.timeout_s / 5
        while not self._lost.is_set():
            try:
                await asyncio.wait_for(self._conn.fetchval("SELECT 1"), timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - whatever the ping died of, the lease is gone
                self._lose()
                return f"the lease's database connection failed ({exc or type(exc).__name__})"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), timeout=interval)
        return "the lease's database connection ended"

    def _lose(self, lost: asyncio.Event | None = None) -> None:
        lost = lost or self._lost
        if lost is self._lost and self._held and not lost.is_set():
            log.error("lost the coordinator lease (epoch %d)", self.epoch)
        lost.set()

    async def _hang_up(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=self.timeout_s)
            if not conn.is_closed():
                conn.terminate()

    async def close(self) -> None:
        """Release the lease (a standby may take over at once); `acquire` may take it again."""
        self._held = False
        await self._hang_up()
