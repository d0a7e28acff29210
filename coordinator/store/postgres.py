"""`Store` on PostgreSQL through asyncpg: several coordinators' worth of state on one server.

Why asyncpg rather than psycopg 3: it speaks the protocol itself (no libpq to install beside
it), in binary, and is the fastest asyncio driver; it comes with its own connection pool, and
every statement it runs is prepared once per connection and cached, so the fixed SQL below is
parsed by the server once per connection, not per call. It is maintained by MagicStack (the
uvloop authors) with wheels for current CPythons. Its cost: no type hints (it is typed Any
here), and prepared statements need ``statement_cache_size=0`` behind a transaction-pooling
PgBouncer (not needed against a server directly).

- Connections: one pool (``asyncpg.create_pool``). Writes are serialized inside the process by
  an asyncio lock, as on SQLite, each in a transaction on one pooled connection (BEGIN ...
  COMMIT, the commit shielded from cancellation so committed events are always announced);
  reads outside a transaction take any pooled connection and, at READ COMMITTED, see only
  committed data. A transaction's own reads use its connection. Something that must hold a
  session for its lifetime (a session advisory lock as a coordinator's lease) takes a
  connection of its own with `acquire_connection`: the pool resets the connections it gets
  back (advisory locks released), so a lease must not live on a pooled one.
- Schema: the SQLite schema's versions (coordinator/store/postgres_schema.py), applied at open
  under an advisory transaction lock, so coordinators opening one database concurrently apply
  each version once.
- Money is BIGINT; a round's record and its charges, the epoch ledger and escrow commit in the
  transactions their callers open, as on SQLite. Statements that may meet a duplicate use
  ``ON CONFLICT DO NOTHING`` and report it, so a refused insert inside a caller's transaction
  raises the domain error without aborting the transaction on the server.
- Fencing (several coordinators on one database, coordinator/ha/lease.py): once `fence` is
  given the epoch of the lease this coordinator holds, every write transaction first reads the
  lease row ``FOR SHARE`` and refuses (FencedError, UNAVAILABLE to a caller; nothing written)
  when the epoch moved on or the lease is known lost. A takeover bumps the epoch with an
  UPDATE of that row, which waits for every write transaction still holding the share lock:
  the old coordinator's writes all commit before the new one's first, or not at all.
- Opening fails fast: an unreachable server, a wrong database or role raise StoreError with a
  one-line reason (password left out) within ``connect_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from coordinator.accounting.credit_book import Entry
from coordinator.core.errors import AlreadyExistsError, FencedError, NotFoundError, StoreError
from coordinator.store.base import (
    BlobRecord,
    BlobStats,
    EventListener,
    HeartbeatUpdate,
    NodeRecord,
    Store,
    TokenRecord,
    new_event,
    new_job_record,
)
from coordinator.store.migrations import LATEST_SCHEMA_VERSION
from coordinator.store.postgres_schema import migrate
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
# asyncpg is untyped: its pool, connections and records are Any.
Connection = Any
Record = Any

URL_SCHEMES = ("postgresql", "postgres")
DEFAULT_CONNECT_TIMEOUT_S = 5.0


def is_postgres_url(text: str) -> bool:
    """Whether ``text`` names a PostgreSQL database (postgresql://... or postgres://...)."""
    return urlsplit(text).scheme in URL_SCHEMES and "://" in text


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ""
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def _count(status: str) -> int:
    """The row count of a command status ("DELETE 3", "INSERT 0 1")."""
    tail = status.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0


async def _to_the_end(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end even when the caller is cancelled meanwhile (the cancellation
    is raised after it): a BEGIN, COMMIT or ROLLBACK left half done would leave the
    connection in a state nobody knows."""
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await fut
        raise


async def probe(url: str, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
    """Connect once and hang up: StoreError with the reason when the database named by ``url``
    cannot be used (for a start that should fail before it loads everything else)."""
    if not is_postgres_url(url):
        raise StoreError(f"not a PostgreSQL URL: {redact_url(url)!r}")
    try:
        conn = await asyncio.wait_for(
            asyncpg.connect(url, timeout=connect_timeout_s), timeout=connect_timeout_s * 2
        )
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise StoreError(_connect_error(url, exc)) from None
    await conn.close()


def _connect_error(url: str, exc: BaseException) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"cannot connect to PostgreSQL at {redact_url(url)}: {reason}"


class _Params:
    """Positional parameters of a statement built piece by piece: ``p.add(x)`` -> "$n"."""

    def __init__(self, *values: object) -> None:
        self.values: list[object] = list(values)

    def add(self, value: object) -> str:
        self.values.append(value)
        return f"${len(self.values)}"


class PostgresStore(Store):
    """Open with ``await PostgresStore.open(url)``; close with ``await store.close()``."""

    def __init__(self, url: str, pool: Any, version: int) -> None:
        self._url = url
        self._pool = pool
        self._version = version
        self._lock = asyncio.Lock()
        self._txn_task: asyncio.Task[object] | None = None
        self._txn_conn: Connection | None = None
        self._pending_events: list[common_pb2.Event] = []
        self._listeners: list[EventListener] = []
        self._closed = False
        # (epoch, whether the lease is still held) once `fence` was called; None: unfenced.
        self._fence: tuple[int, Callable[[], bool]] | None = None

    # -- opening and migrations -----------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        target_version: int | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        min_connections: int = 1,
        max_connections: int = 8,
    ) -> PostgresStore:
        """Connect to the database ``url`` names (postgresql://USER[:PASSWORD]@HOST[:PORT]/DB,
        libpq's parameters in the query string, PG* environment variables for what it leaves
        out) and migrate it to ``target_version`` (default: the latest). StoreError with the
        reason when the server cannot be reached, refuses the role or lacks the database, or
        when the database was written by a newer program."""
        if not is_postgres_url(url):
            raise StoreError(f"not a PostgreSQL URL: {redact_url(url)!r}")
        target = LATEST_SCHEMA_VERSION if target_version is None else target_version
        where = redact_url(url)
        try:
            pool = await asyncio.wait_for(
                asyncpg.create_pool(
                    url,
                    min_size=min_connections,
                    max_size=max_connections,
                    timeout=connect_timeout_s,
                    server_settings={"application_name": "epochmesh-coordinator"},
                ),
                timeout=connect_timeout_s * 2,
            )
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise StoreError(_connect_error(url, exc)) from None
        try:
            async with pool.acquire() as conn:
                version = await migrate(conn, target)
        except BaseException:
            pool.terminate()
            raise
        log.info("store %s open (schema version %d)", where, version)
        return cls(url, pool, version)

    @property
    def schema_version(self) -> int:
        return self._version

    @property
    def url(self) -> str:
        """The database's URL, password left out."""
        return redact_url(self._url)

    @contextlib.asynccontextmanager
    async def acquire_connection(self) -> AsyncIterator[Connection]:
        """A pooled connection held until the block ends, outside the store's transactions (for
        what needs a session of its own: advisory locks, LISTEN). It is reset when handed back:
        session settings and advisory locks do not outlive the block."""
        self._check_open()
        async with self._pool.acquire() as conn:
            yield conn

    def fence(self, epoch: int, held: Callable[[], bool]) -> None:
        """Refuse every write transaction from now on unless the lease row still carries
        ``epoch`` and ``held()`` is true (see the module docstring)."""
        self._fence = (epoch, held)

    async def _check_fence(self, conn: Connection) -> None:
        if self._fence is None:
            return
        epoch, held = self._fence
        if held():
            current = await conn.fetchval(
                "SELECT epoch FROM coordinator_lease WHERE id = 1 FOR SHARE"
            )
            if current == epoch:
                return
        raise FencedError(
            f"this coordinator lost its lease (epoch {epoch}): another one is active; "
            "nothing was written"
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            try:
                await asyncio.wait_for(self._pool.close(), timeout=10)
            except TimeoutError:
                log.warning("PostgreSQL connections still busy at close: terminated")
                self._pool.terminate()

    # -- transactions ---------------------------------------------------------------------------

    def _in_txn(self) -> bool:
        return self._txn_task is not None and self._txn_task is asyncio.current_task()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        if self._in_txn():
            yield  # join the enclosing transaction
            return
        async with self._lock:
            self._check_open()
            async with self._pool.acquire() as conn:
                try:
                    await _to_the_end(conn.execute("BEGIN"))
                    await self._check_fence(conn)
                except BaseException:
                    await self._rollback(conn)
                    raise
                self._txn_task = asyncio.current_task()
                self._txn_conn = conn
                try:
                    yield
                except asyncpg.InternalClientError as exc:
                    # asyncpg's protocol confused by a connection the server ended mid-way:
                    # reported as the lost connection it is.
                    await self._rollback(conn)
                    raise asyncpg.InterfaceError(
                        f"the database connection broke in a transaction ({exc})"
                    ) from exc
                except BaseException:
                    await self._rollback(conn)
                    raise
                else:
                    await _to_the_end(self._commit_and_announce(conn))
                finally:
                    self._txn_task = None
                    self._txn_conn = None

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[Connection]:
        """The connection of the caller's transaction, or of a new one of its own."""
        if not self._in_txn():
            async with self.transaction():
                yield self._txn_conn
            return
        yield self._txn_conn

    async def _commit_and_announce(self, conn: Connection) -> None:
        try:
            await conn.execute("COMMIT")
        except BaseException:
            await self._rollback(conn)
            raise
        events, self._pending_events = self._pending_events, []
        for event in events:
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("event listener failed on event %d", event.id)

    async def _rollback(self, conn: Connection) -> None:
        """Roll back; when that fails (a cancelled statement, a lost connection), the pool's
        reset of the connection rolls back or drops it."""
        self._pending_events = []
        with contextlib.suppress(Exception):
            if conn.is_in_transaction():
                await _to_the_end(conn.execute("ROLLBACK"))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def add_event_listener(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    def _reader(self) -> Any:
        """What reads run on: the transaction's connection, or the pool."""
        self._check_open()
        return self._txn_conn if self._in_txn() else self._pool

    async def _fetch(self, sql: str, *args: object) -> list[Record]:
        return list(await self._reader().fetch(sql, *args))

    async def _fetchrow(self, sql: str, *args: object) -> Record | None:
        return await self._reader().fetchrow(sql, *args)

    async def _fetchval(self, sql: str, *args: object) -> Any:
        return await self._reader().fetchval(sql, *args)

    # -- nodes ----------------------------------------------------------------------------------

    async def upsert_node(self, record: NodeRecord) -> None:
        info = record.info
        async with self._write() as db:
            await db.execute(
                """INSERT INTO nodes (node_id, name, state, lease_id, registered_ms,
                       last_heartbeat_ms, lease_expires_ms, info)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                   ON CONFLICT (node_id) DO UPDATE SET
                       name = excluded.name, state = excluded.state,
                       lease_id = excluded.lease_id, registered_ms = excluded.registered_ms,
                       last_heartbeat_ms = excluded.last_heartbeat_ms,
                       lease_expires_ms = excluded.lease_expires_ms, info = excluded.info""",
                info.node_id,
                info.name,
                int(info.state),
                record.lease_id,
                info.registered_at_ms,
                info.last_heartbeat_ms,
                info.lease_expires_ms,
                info.SerializeToString(),
            )

    async def update_heartbeats(self, updates: Sequence[HeartbeatUpdate]) -> None:
        if not updates:
            return
        latest = {u.node_id: u for u in updates}  # the last update of a node wins
        async with self._write() as db:
            await db.execute(
                "UPDATE nodes SET last_heartbeat_ms = u.hb, lease_expires_ms = u.exp"
                " FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS u(id, hb, exp)"
                " WHERE nodes.node_id = u.id",
                list(latest),
                [u.last_heartbeat_ms for u in latest.values()],
                [u.lease_expires_ms for u in latest.values()],
            )

    @staticmethod
    def _node_from_row(row: Record) -> NodeRecord:
        info = common_pb2.NodeInfo.FromString(row["info"])
        # Heartbeat times are written in batches to their columns only: those are current.
        info.last_heartbeat_ms = row["last_heartbeat_ms"]
        info.lease_expires_ms = row["lease_expires_ms"]
        return NodeRecord(info=info, lease_id=row["lease_id"])

    _NODE_COLUMNS = "lease_id, last_heartbeat_ms, lease_expires_ms, info"

    async def get_node(self, node_id: str) -> NodeRecord | None:
        row = await self._fetchrow(
            f"SELECT {self._NODE_COLUMNS} FROM nodes WHERE node_id = $1", node_id
        )
        return None if row is None else self._node_from_row(row)

    async def list_nodes(self, states: Collection[int] = ()) -> list[NodeRecord]:
        sql = f"SELECT {self._NODE_COLUMNS} FROM nodes"
        params = _Params()
        if states:
            sql += f" WHERE state = ANY({params.add([int(s) for s in states])}::bigint[])"
        sql += " ORDER BY registered_ms, node_id"
        return [self._node_from_row(row) for row in await self._fetch(sql, *params.values)]

    # -- events ---------------------------------------------------------------------------------

    async def append_event(
        self,
        kind: str,
        *,
        node_id: str = "",
        job_id: str = "",
        message: str = "",
        attrs: Mapping[str, str] | None = None,
        time_ms: int | None = None,
    ) -> common_pb2.Event:
        event = new_event(
            kind, node_id=node_id, job_id=job_id, message=message, attrs=attrs, time_ms=time_ms
        )
        async with self._write() as db:
            event_id = await db.fetchval(
                "WITH next AS (UPDATE id_counters SET value = value + 1"
                " WHERE name = 'events' RETURNING value)"
                " INSERT INTO events (id, time_ms, kind, node_id, job_id, data)"
                " SELECT value, $1, $2, $3, $4, $5 FROM next RETURNING id",
                event.time_ms,
                kind,
                node_id,
                job_id,
                event.SerializeToString(),
            )
            event.id = int(event_id)
            self._pending_events.append(event)
        out = common_pb2.Event()
        out.CopyFrom(event)
        return out

    async def list_events(
        self,
        since_id: int = 0,
        *,
        node_id: str = "",
        job_id: str = "",
        kinds: Collection[str] = (),
        limit: int = 1000,
    ) -> list[common_pb2.Event]:
        params = _Params(since_id)
        sql = "SELECT id, data FROM events WHERE id > $1"
        if node_id:
            sql += f" AND node_id = {params.add(node_id)}"
        if job_id:
            sql += f" AND job_id = {params.add(job_id)}"
        if kinds:
            clauses = []
            for pattern in kinds:
                if pattern.endswith("*"):
                    prefix = pattern[:-1]
                    clauses.append(
                        f"left(kind, {params.add(len(prefix))}::int) = {params.add(prefix)}"
                    )
                else:
                    clauses.append(f"kind = {params.add(pattern)}")
            sql += " AND (" + " OR ".join(clauses) + ")"
        sql += " ORDER BY id"
        if limit > 0:
            sql += f" LIMIT {params.add(limit)}"
        events = []
        for row in await self._fetch(sql, *params.values):
            event = common_pb2.Event.FromString(row["data"])
            event.id = row["id"]
            events.append(event)
        return events

    async def last_event_id(self) -> int:
        value = await self._fetchval("SELECT value FROM id_counters WHERE name = 'events'")
        return 0 if value is None else int(value)

    async def prune_events(
        self, before_ms: int, *, keep_job_states: Collection[int] = (), limit: int = 10_000
    ) -> int:
        params = _Params(before_ms)
        sql = "SELECT id FROM events WHERE time_ms < $1"
        if keep_job_states:
            states = params.add([int(s) for s in keep_job_states])
            sql += (
                " AND (job_id = '' OR job_id NOT IN (SELECT job_id FROM jobs"
                f" WHERE state = ANY({states}::bigint[])))"
            )
        sql += " ORDER BY time_ms, id"
        if limit > 0:
            sql += f" LIMIT {params.add(limit)}"
        async with self._write() as db:
            status = await db.execute(f"DELETE FROM events WHERE id IN ({sql})", *params.values)
        return _count(status)

    async def count_events(self) -> int:
        return int(await self._fetchval("SELECT COUNT(*) FROM events"))

    # -- blobs ----------------------------------------------------------------------------------

    async def add_blob(self, sha256: str, size: int) -> BlobRecord:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO blobs (sha256, size, created_ms) VALUES ($1, $2, $3)"
                " ON CONFLICT (sha256) DO NOTHING",
                sha256,
                size,
                now_ms(),
            )
            row = await db.fetchrow(
                "SELECT sha256, size, created_ms FROM blobs WHERE sha256 = $1", sha256
            )
        return BlobRecord(row["sha256"], row["size"], row["created_ms"])

    async def get_blob(self, sha256: str) -> BlobRecord | None:
        row = await self._fetchrow(
            "SELECT sha256, size, created_ms FROM blobs WHERE sha256 = $1", sha256
        )
        return None if row is None else BlobRecord(row["sha256"], row["size"], row["created_ms"])

    async def list_blobs(self, after: str = "", limit: int = 0) -> list[BlobRecord]:
        params = _Params(after)
        sql = "SELECT sha256, size, created_ms FROM blobs WHERE sha256 > $1 ORDER BY sha256"
        if limit > 0:
            sql += f" LIMIT {params.add(limit)}"
        rows = await self._fetch(sql, *params.values)
        return [BlobRecord(r["sha256"], r["size"], r["created_ms"]) for r in rows]

    async def remove_blob(self, sha256: str) -> bool:
        async with self._write() as db:
            status = await db.execute("DELETE FROM blobs WHERE sha256 = $1", sha256)
        return _count(status) > 0

    async def touch_blob(self, sha256: str) -> bool:
        async with self._write() as db:
            status = await db.execute(
                "UPDATE blobs SET created_ms = $1 WHERE sha256 = $2", now_ms(), sha256
            )
        return _count(status) > 0

    async def blob_stats(self) -> BlobStats:
        row = await self._fetchrow("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM blobs")
        assert row is not None
        return BlobStats(count=int(row[0]), total_bytes=int(row[1]))

    # -- blob ownership -------------------------------------------------------------------------

    async def add_blob_owner(self, sha256: str, owner: str) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO blob_owners (sha256, owner, created_ms) VALUES ($1, $2, $3)"
                " ON CONFLICT (sha256, owner) DO NOTHING",
                sha256,
                owner,
                now_ms(),
            )

    async def blob_visible_to(self, sha256: str, owner: str) -> bool:
        row = await self._fetchrow(
            """SELECT 1 FROM blobs WHERE sha256 = $1 AND (
                EXISTS (SELECT 1 FROM blob_owners o WHERE o.sha256 = blobs.sha256 AND o.owner = $2)
                OR EXISTS (SELECT 1 FROM job_blobs jb JOIN jobs j ON j.job_id = jb.job_id
                           WHERE jb.sha256 = blobs.sha256 AND j.owner = $2))""",
            sha256,
            owner,
        )
        return row is not None

    async def blob_owners(self, sha256: str) -> set[str]:
        rows = await self._fetch("SELECT owner FROM blob_owners WHERE sha256 = $1", sha256)
        return {str(r[0]) for r in rows}

    async def remove_blob_owners(self, sha256: str, owners: Collection[str]) -> int:
        async with self._write() as db:
            status = await db.execute(
                "DELETE FROM blob_owners WHERE sha256 = $1 AND owner = ANY($2::text[])",
                sha256,
                list(dict.fromkeys(owners)),
            )
        return _count(status)

    async def owned_blob_bytes(self, owner: str) -> int:
        value = await self._fetchval(
            "SELECT COALESCE(SUM(b.size), 0) FROM blob_owners o JOIN blobs b"
            " ON b.sha256 = o.sha256 WHERE o.owner = $1",
            owner,
        )
        return int(value)

    async def add_job_blobs(self, job_id: str, sha256s: Collection[str]) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO job_blobs (job_id, sha256) SELECT $1, unnest($2::text[])"
                " ON CONFLICT (job_id, sha256) DO NOTHING",
                job_id,
                list(dict.fromkeys(sha256s)),
            )

    async def job_blobs(self, job_id: str) -> set[str]:
        rows = await self._fetch("SELECT sha256 FROM job_blobs WHERE job_id = $1", job_id)
        return {str(r[0]) for r in rows}

    # -- jobs -----------------------------------------------------------------------------------

    async def create_job(self, job: common_pb2.Job, owner: str) -> common_pb2.Job:
        stored = new_job_record(job, owner)
        async with self._write() as db:
            inserted = await db.fetchval(
                "INSERT INTO jobs (job_id, owner, state, created_ms, data)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (job_id) DO NOTHING RETURNING job_id",
                stored.job_id,
                owner,
                int(stored.state),
                stored.created_ms,
                stored.SerializeToString(),
            )
            if inserted is None:
                raise AlreadyExistsError(f"job {stored.job_id} already exists")
        return stored

    async def get_job(self, job_id: str) -> common_pb2.Job | None:
        data = await self._fetchval("SELECT data FROM jobs WHERE job_id = $1", job_id)
        return None if data is None else common_pb2.Job.FromString(data)

    async def list_jobs(
        self, states: Collection[int] = (), owner: str | None = None, limit: int = 0
    ) -> list[common_pb2.Job]:
        params = _Params()
        where: list[str] = []
        if states:
            where.append(f"state = ANY({params.add([int(s) for s in states])}::bigint[])")
        if owner is not None:
            where.append(f"owner = {params.add(owner)}")
        sql = "SELECT data FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_ms DESC, job_id DESC"
        if limit > 0:
            sql += f" LIMIT {params.add(limit)}"
        rows = await self._fetch(sql, *params.values)
        return [common_pb2.Job.FromString(r[0]) for r in rows]

    async def update_job(self, job: common_pb2.Job) -> None:
        async with self._write() as db:
            status = await db.execute(
                "UPDATE jobs SET owner = $1, state = $2, created_ms = $3, data = $4"
                " WHERE job_id = $5",
                job.owner,
                int(job.state),
                job.created_ms,
                job.SerializeToString(),
                job.job_id,
            )
            if _count(status) == 0:
                raise NotFoundError(f"job {job.job_id!r} not found")

    async def count_jobs_by_state(self) -> dict[int, int]:
        rows = await self._fetch("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        return {int(r[0]): int(r[1]) for r in rows}

    # -- rounds ---------------------------------------------------------------------------------

    async def add_round(self, record: common_pb2.RoundRecord) -> None:
        async with self._write() as db:
            if await db.fetchval("SELECT 1 FROM jobs WHERE job_id = $1", record.job_id) is None:
                raise NotFoundError(f"job {record.job_id!r} not found")
            inserted = await db.fetchval(
                "INSERT INTO rounds (job_id, round, epoch, data) VALUES ($1, $2, $3, $4)"
                " ON CONFLICT (job_id, round) WHERE NOT rolled_back DO NOTHING RETURNING id",
                record.job_id,
                record.round,
                record.epoch,
                record.SerializeToString(),
            )
            if inserted is None:
                raise AlreadyExistsError(f"job {record.job_id} already has round {record.round}")

    async def list_rounds(
        self,
        job_id: str,
        since_round: int = 0,
        limit: int = 0,
        include_rolled_back: bool = False,
    ) -> list[common_pb2.RoundRecord]:
        params = _Params(job_id, since_round)
        sql = "SELECT data, rolled_back FROM rounds WHERE job_id = $1 AND round > $2"
        if not include_rolled_back:
            sql += " AND NOT rolled_back"
        sql += " ORDER BY round, id"
        if limit > 0:
            sql += f" LIMIT {params.add(limit)}"
        out = []
        for row in await self._fetch(sql, *params.values):
            record = common_pb2.RoundRecord.FromString(row["data"])
            record.rolled_back = bool(row["rolled_back"])
            out.append(record)
        return out

    async def rollback_rounds(self, job_id: str, after_round: int) -> int:
        async with self._write() as db:
            status = await db.execute(
                "UPDATE rounds SET rolled_back = TRUE"
                " WHERE job_id = $1 AND round > $2 AND NOT rolled_back",
                job_id,
                after_round,
            )
        return _count(status)

    # -- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(self, job_id: str, round: int, manifest: bytes) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO checkpoints (job_id, round, created_ms, manifest)"
                " VALUES ($1, $2, $3, $4) ON CONFLICT (job_id, round) DO UPDATE SET"
                " created_ms = excluded.created_ms, manifest = excluded.manifest",
                job_id,
                round,
                now_ms(),
                bytes(manifest),
            )

    async def latest_checkpoint(self, job_id: str) -> tuple[int, bytes] | None:
        row = await self._fetchrow(
            "SELECT round, manifest FROM checkpoints WHERE job_id = $1 ORDER BY round DESC LIMIT 1",
            job_id,
        )
        return None if row is None else (int(row[0]), bytes(row[1]))

    async def checkpoint_before(self, job_id: str, round: int) -> tuple[int, bytes] | None:
        row = await self._fetchrow(
            "SELECT round, manifest FROM checkpoints WHERE job_id = $1 AND round < $2"
            " ORDER BY round DESC LIMIT 1",
            job_id,
            round,
        )
        return None if row is None else (int(row[0]), bytes(row[1]))

    async def drop_checkpoints_after(self, job_id: str, round: int) -> int:
        async with self._write() as db:
            status = await db.execute(
                "DELETE FROM checkpoints WHERE job_id = $1 AND round > $2", job_id, round
            )
        return _count(status)

    async def list_checkpoints(self, job_id: str = "") -> list[tuple[str, int, bytes]]:
        params = _Params()
        sql = "SELECT job_id, round, manifest FROM checkpoints"
        if job_id:
            sql += f" WHERE job_id = {params.add(job_id)}"
        sql += " ORDER BY job_id, round"
        rows = await self._fetch(sql, *params.values)
        return [(str(r[0]), int(r[1]), bytes(r[2])) for r in rows]

    async def drop_checkpoints(self, job_id: str, rounds: Collection[int]) -> list[bytes]:
        if not rounds:
            return []
        async with self._write() as db:
            rows = await db.fetch(
                "DELETE FROM checkpoints WHERE job_id = $1 AND round = ANY($2::bigint[])"
                " RETURNING round, manifest",
                job_id,
                sorted({int(r) for r in rounds}),
            )
        return [bytes(r["manifest"]) for r in sorted(rows, key=lambda r: int(r["round"]))]

    # -- per-job engine state -------------------------------------------------------------------

    async def put_job_state(self, job_id: str, key: str, value: bytes) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO job_state (job_id, key, value) VALUES ($1, $2, $3)"
                " ON CONFLICT (job_id, key) DO UPDATE SET value = excluded.value",
                job_id,
                key,
                bytes(value),
            )

    async def get_job_state(self, job_id: str, key: str) -> bytes | None:
        value = await self._fetchval(
            "SELECT value FROM job_state WHERE job_id = $1 AND key = $2", job_id, key
        )
        return None if value is None else bytes(value)

    async def delete_job_state(self, job_id: str, key: str) -> bool:
        async with self._write() as db:
            status = await db.execute(
                "DELETE FROM job_state WHERE job_id = $1 AND key = $2", job_id, key
            )
        return _count(status) > 0

    # -- trust ----------------------------------------------------------------------------------

    async def add_token(self, record: TokenRecord) -> None:
        async with self._write() as db:
            inserted = await db.fetchval(
                "INSERT INTO tokens (token_hash, role, created_ms, expires_ms, reusable, uses,"
                " donor, max_uses, cert_ttl_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
                " ON CONFLICT (token_hash) DO NOTHING RETURNING token_hash",
                record.token_hash,
                record.role,
                record.created_ms,
                record.expires_ms,
                bool(record.reusable),
                record.uses,
                record.donor,
                record.max_uses,
                record.cert_ttl_ms,
            )
            if inserted is None:
                raise AlreadyExistsError("token already exists")

    _TOKEN_COLUMNS = (
        "token_hash, role, created_ms, expires_ms, reusable, uses, donor, max_uses, cert_ttl_ms"
    )

    @staticmethod
    def _token_of(row: Record) -> TokenRecord:
        return TokenRecord(
            row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6], row[7], row[8]
        )

    async def redeem_token(self, token_hash: str, now_ms: int) -> TokenRecord | None:
        async with self._write() as db:
            row = await db.fetchrow(
                "UPDATE tokens SET uses = uses + 1 WHERE token_hash = $1 AND expires_ms > $2"
                " AND (reusable OR uses = 0) AND (max_uses = 0 OR uses < max_uses)"
                f" RETURNING {self._TOKEN_COLUMNS}",
                token_hash,
                now_ms,
            )
        return None if row is None else self._token_of(row)

    async def get_token(self, token_hash: str) -> TokenRecord | None:
        row = await self._fetchrow(
            f"SELECT {self._TOKEN_COLUMNS} FROM tokens WHERE token_hash = $1", token_hash
        )
        return None if row is None else self._token_of(row)

    async def quarantined_nodes_of_donor(self, donor: str) -> list[str]:
        rows = await self._fetch(
            "SELECT n.node_id FROM nodes n JOIN node_donors d ON d.node_id = n.node_id"
            " WHERE d.donor = $1 AND n.state = $2 ORDER BY n.node_id",
            donor,
            int(common_pb2.NODE_STATE_QUARANTINED),
        )
        return [str(r[0]) for r in rows]

    async def set_node_donor(self, node_id: str, donor: str) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO node_donors (node_id, donor) VALUES ($1, $2)"
                " ON CONFLICT (node_id) DO UPDATE SET donor = excluded.donor",
                node_id,
                donor,
            )

    async def get_node_donor(self, node_id: str) -> str:
        donor = await self._fetchval("SELECT donor FROM node_donors WHERE node_id = $1", node_id)
        return "" if donor is None else str(donor)

    async def list_node_donors(self) -> dict[str, str]:
        rows = await self._fetch("SELECT node_id, donor FROM node_donors")
        return {str(r[0]): str(r[1]) for r in rows}

    async def add_revocation(self, principal: str, role: str, reason: str) -> bool:
        async with self._write() as db:
            status = await db.execute(
                "INSERT INTO revocations (principal, role, revoked_ms, reason)"
                " VALUES ($1, $2, $3, $4) ON CONFLICT (principal) DO NOTHING",
                principal,
                role,
                now_ms(),
                reason,
            )
        return _count(status) > 0

    async def list_revocations(self) -> list[str]:
        return [str(r[0]) for r in await self._fetch("SELECT principal FROM revocations")]

    # -- cluster scheduler ----------------------------------------------------------------------

    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO tenant_weights (tenant, weight) VALUES ($1, $2)"
                " ON CONFLICT (tenant) DO UPDATE SET weight = excluded.weight",
                tenant,
                float(weight),
            )

    async def list_tenant_weights(self) -> dict[str, float]:
        rows = await self._fetch("SELECT tenant, weight FROM tenant_weights")
        return {str(r[0]): float(r[1]) for r in rows}

    # -- credit ledger --------------------------------------------------------------------------

    async def add_ledger_entries(self, entries: Sequence[Entry]) -> list[int]:
        """Refuses a batch with a non-positive amount with asyncpg's CheckViolationError (its
        CHECK constraint), before writing any of it."""
        if not entries:
            return []
        async with self._write() as db:
            rows = await db.fetch(
                """INSERT INTO ledger_entries (time_ms, from_account, to_account, amount,
                       reason, job_id, round, node_id, samples)
                   SELECT t, f, d, a, r, j, rd, n, s FROM unnest($1::bigint[], $2::text[],
                       $3::text[], $4::bigint[], $5::text[], $6::text[], $7::bigint[],
                       $8::text[], $9::bigint[]) WITH ORDINALITY AS e(t, f, d, a, r, j, rd, n, s, i)
                   ORDER BY i RETURNING id""",
                [e.at_ms for e in entries],
                [e.from_account for e in entries],
                [e.to_account for e in entries],
                [e.amount for e in entries],
                [e.reason for e in entries],
                [e.job_id for e in entries],
                [e.round for e in entries],
                [e.node_id for e in entries],
                [e.samples for e in entries],
            )
        return sorted(int(r["id"]) for r in rows)

    async def list_ledger_entries(
        self, account: str = "", job_id: str = "", after_id: int = 0, limit: int = 0
    ) -> list[tuple[int, Entry]]:
        params = _Params(after_id)
        where = ["id > $1"]
        if account:
            p = params.add(account)
            where.append(f"(from_account = {p} OR to_account = {p})")
        if job_id:
            where.append(f"job_id = {params.add(job_id)}")
        sql = (
            "SELECT id, time_ms, from_account, to_account, amount, reason, job_id, round,"
            f" node_id, samples FROM ledger_entries WHERE {' AND '.join(where)} ORDER BY id"
        )
        if limit > 0:
            sql += f" LIMIT {params.add(limit)}"
        rows = await self._fetch(sql, *params.values)
        return [
            (
                int(r[0]),
                Entry(int(r[1]), r[2], r[3], int(r[4]), r[5], r[6], int(r[7]), r[8], int(r[9])),
            )
            for r in rows
        ]

    async def ledger_balances(self) -> dict[str, int]:
        rows = await self._fetch(
            """SELECT account, SUM(amount) FROM (
                   SELECT to_account AS account, amount FROM ledger_entries
                   UNION ALL SELECT from_account, -amount FROM ledger_entries
               ) AS moves GROUP BY account"""
        )
        return {str(r[0]): int(r[1]) for r in rows}

    async def put_scheduler_state(self, key: str, value: bytes) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO scheduler_state (key, value) VALUES ($1, $2)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                key,
                bytes(value),
            )

    async def get_scheduler_state(self, key: str) -> bytes | None:
        value = await self._fetchval("SELECT value FROM scheduler_state WHERE key = $1", key)
        return None if value is None else bytes(value)
