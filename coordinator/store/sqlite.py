"""`Store` on SQLite through aiosqlite.

- WAL journal with synchronous=NORMAL: a commit is in the WAL (the OS page cache) when it
  returns, so it survives kill -9 of the coordinator; only an OS crash or power cut can lose
  the last commits, and even then the database stays consistent (never torn). FULL would fsync
  the WAL at every commit for that last bit, at a cost on every state change; blobs are
  fsynced before they are recorded, so the database never references a blob that is missing.
- Two connections: one writer (every write, serialized by an asyncio lock, explicit BEGIN
  IMMEDIATE / COMMIT) and one read-only reader, which in WAL mode sees only committed data and
  never blocks the writer.
- The schema version is recorded in table ``schema_version`` (one row per applied migration);
  `MIGRATIONS` (coordinator/store/migrations.py) are applied in order at open, each in its own
  transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from pathlib import Path

import aiosqlite

from coordinator.accounting.credit_book import Entry
from coordinator.core.errors import AlreadyExistsError, NotFoundError, StoreError
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
from coordinator.store.migrations import LATEST_SCHEMA_VERSION, migrate
from coordinator.store.permissions import create_private_file
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)


def _placeholders(n: int) -> str:
    return ",".join("?" * n)


class SqliteStore(Store):
    """Open with ``await SqliteStore.open(path)``; close with ``await store.close()``."""

    def __init__(
        self, path: Path, writer: aiosqlite.Connection, reader: aiosqlite.Connection, version: int
    ) -> None:
        self._path = path
        self._w = writer
        self._r = reader
        self._version = version
        self._lock = asyncio.Lock()
        self._txn_task: asyncio.Task[object] | None = None
        self._pending_events: list[common_pb2.Event] = []
        self._listeners: list[EventListener] = []
        self._closed = False

    # -- opening and migrations -----------------------------------------------------------------

    @classmethod
    async def open(
        cls, path: Path | str, *, target_version: int | None = None, synchronous: str = "NORMAL"
    ) -> SqliteStore:
        """Open (creating if needed) the database at ``path`` and migrate it to
        ``target_version`` (default: the latest). StoreError if the database was written by a
        newer program."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        create_private_file(path)  # 0600, and so are the WAL files SQLite makes beside it
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise ValueError("synchronous must be NORMAL or FULL")
        target = LATEST_SCHEMA_VERSION if target_version is None else target_version
        writer = await aiosqlite.connect(path, isolation_level=None)
        try:
            await writer.execute("PRAGMA busy_timeout = 10000")
            async with writer.execute("PRAGMA journal_mode = WAL") as cur:
                row = await cur.fetchone()
            if row is None or str(row[0]).lower() != "wal":
                raise StoreError(f"cannot put {path} in WAL mode (got {row})")
            await writer.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            await writer.execute("PRAGMA foreign_keys = ON")
            version = await migrate(writer, target)
            reader = await aiosqlite.connect(path, isolation_level=None)
        except BaseException:
            await writer.close()
            raise
        try:
            await reader.execute("PRAGMA busy_timeout = 10000")
            await reader.execute("PRAGMA query_only = 1")
        except BaseException:
            await reader.close()
            await writer.close()
            raise
        log.info("store %s open (schema version %d)", path, version)
        return cls(path, writer, reader, version)

    @property
    def schema_version(self) -> int:
        return self._version

    @property
    def path(self) -> Path:
        return self._path

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            with contextlib.suppress(sqlite3.Error):
                await self._w.execute("PRAGMA optimize")
            await self._r.close()
            await self._w.close()

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
            await self._begin()
            self._txn_task = asyncio.current_task()
            try:
                yield
            except BaseException:
                await self._rollback()
                raise
            else:
                await self._commit()
            finally:
                self._txn_task = None

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[aiosqlite.Connection]:
        """The writer connection, inside the caller's transaction or a new one of its own."""
        if self._in_txn():
            yield self._w
            return
        async with self._lock:
            self._check_open()
            await self._begin()
            try:
                yield self._w
            except BaseException:
                await self._rollback()
                raise
            else:
                await self._commit()

    async def _commit(self) -> None:
        # Shielded: once COMMIT is queued it runs anyway, so a cancelled caller must not skip
        # announcing the committed events (or undo them).
        await asyncio.shield(self._commit_and_announce())

    async def _commit_and_announce(self) -> None:
        try:
            await self._w.execute("COMMIT")
        except BaseException:
            await self._rollback()
            raise
        events, self._pending_events = self._pending_events, []
        for event in events:
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("event listener failed on event %d", event.id)

    async def _begin(self) -> None:
        """BEGIN IMMEDIATE that a cancellation cannot leave half done: the statement runs on
        aiosqlite's thread whatever happens to the awaiting task, so a task cancelled while it
        is in flight must wait for it and roll it back; otherwise the connection stays inside a
        transaction and every later write fails ("cannot start a transaction within a
        transaction")."""
        begin = asyncio.ensure_future(self._w.execute("BEGIN IMMEDIATE"))
        try:
            await asyncio.shield(begin)
        except BaseException:
            with contextlib.suppress(BaseException):
                await begin
            await self._rollback()
            raise

    async def _rollback(self) -> None:
        self._pending_events = []
        with contextlib.suppress(sqlite3.Error):
            await asyncio.shield(self._w.execute("ROLLBACK"))

    def _reader(self) -> aiosqlite.Connection:
        self._check_open()
        return self._w if self._in_txn() else self._r

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def add_event_listener(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    async def _fetchall(self, sql: str, params: Sequence[object] = ()) -> list[sqlite3.Row]:
        async with self._reader().execute(sql, params) as cur:
            return list(await cur.fetchall())

    async def _fetchone(self, sql: str, params: Sequence[object] = ()) -> sqlite3.Row | None:
        async with self._reader().execute(sql, params) as cur:
            return await cur.fetchone()

    # -- nodes ----------------------------------------------------------------------------------

    async def upsert_node(self, record: NodeRecord) -> None:
        info = record.info
        data = info.SerializeToString()
        async with self._write() as db:
            await db.execute(
                """INSERT INTO nodes (node_id, name, state, lease_id, registered_ms,
                       last_heartbeat_ms, lease_expires_ms, info)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (node_id) DO UPDATE SET
                       name = excluded.name, state = excluded.state,
                       lease_id = excluded.lease_id, registered_ms = excluded.registered_ms,
                       last_heartbeat_ms = excluded.last_heartbeat_ms,
                       lease_expires_ms = excluded.lease_expires_ms, info = excluded.info""",
                (
                    info.node_id,
                    info.name,
                    int(info.state),
                    record.lease_id,
                    info.registered_at_ms,
                    info.last_heartbeat_ms,
                    info.lease_expires_ms,
                    data,
                ),
            )

    async def update_heartbeats(self, updates: Sequence[HeartbeatUpdate]) -> None:
        if not updates:
            return
        async with self._write() as db:
            await db.executemany(
                "UPDATE nodes SET last_heartbeat_ms = ?, lease_expires_ms = ? WHERE node_id = ?",
                [(u.last_heartbeat_ms, u.lease_expires_ms, u.node_id) for u in updates],
            )

    @staticmethod
    def _node_from_row(row: sqlite3.Row) -> NodeRecord:
        info = common_pb2.NodeInfo.FromString(row[3])
        # Heartbeat times are written in batches to their columns only: those are current.
        info.last_heartbeat_ms = row[1]
        info.lease_expires_ms = row[2]
        return NodeRecord(info=info, lease_id=row[0])

    async def get_node(self, node_id: str) -> NodeRecord | None:
        row = await self._fetchone(
            "SELECT lease_id, last_heartbeat_ms, lease_expires_ms, info FROM nodes"
            " WHERE node_id = ?",
            (node_id,),
        )
        return None if row is None else self._node_from_row(row)

    async def list_nodes(self, states: Collection[int] = ()) -> list[NodeRecord]:
        sql = "SELECT lease_id, last_heartbeat_ms, lease_expires_ms, info FROM nodes"
        params: list[object] = []
        if states:
            sql += f" WHERE state IN ({_placeholders(len(states))})"
            params.extend(int(s) for s in states)
        sql += " ORDER BY registered_ms, node_id"
        return [self._node_from_row(row) for row in await self._fetchall(sql, params)]

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
            cur = await db.execute(
                "INSERT INTO events (time_ms, kind, node_id, job_id, data) VALUES (?, ?, ?, ?, ?)",
                (event.time_ms, kind, node_id, job_id, event.SerializeToString()),
            )
            assert cur.lastrowid is not None
            event.id = cur.lastrowid
            await cur.close()
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
        sql = "SELECT id, data FROM events WHERE id > ?"
        params: list[object] = [since_id]
        if node_id:
            sql += " AND node_id = ?"
            params.append(node_id)
        if job_id:
            sql += " AND job_id = ?"
            params.append(job_id)
        if kinds:
            clauses = []
            for pattern in kinds:
                if pattern.endswith("*"):
                    clauses.append("substr(kind, 1, ?) = ?")
                    params.extend((len(pattern) - 1, pattern[:-1]))
                else:
                    clauses.append("kind = ?")
                    params.append(pattern)
            sql += " AND (" + " OR ".join(clauses) + ")"
        sql += " ORDER BY id"
        if limit > 0:
            sql += " LIMIT ?"
            params.append(limit)
        events = []
        for row in await self._fetchall(sql, params):
            event = common_pb2.Event.FromString(row[1])
            event.id = row[0]
            events.append(event)
        return events

    async def last_event_id(self) -> int:
        # The AUTOINCREMENT counter too: retention may have deleted the newest events' rows.
        row = await self._fetchone(
            "SELECT MAX(COALESCE((SELECT MAX(id) FROM events), 0),"
            " COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0))"
        )
        return int(row[0]) if row is not None and row[0] is not None else 0

    async def prune_events(
        self, before_ms: int, *, keep_job_states: Collection[int] = (), limit: int = 10_000
    ) -> int:
        sql = "SELECT id FROM events WHERE time_ms < ?"
        params: list[object] = [before_ms]
        if keep_job_states:
            sql += (
                " AND (job_id = '' OR job_id NOT IN (SELECT job_id FROM jobs"
                f" WHERE state IN ({_placeholders(len(keep_job_states))})))"
            )
            params.extend(int(s) for s in keep_job_states)
        if limit > 0:
            sql += " LIMIT ?"
            params.append(limit)
        async with self._write() as db:
            cur = await db.execute(f"DELETE FROM events WHERE id IN ({sql})", params)
            n = cur.rowcount
            await cur.close()
        return int(n)

    async def count_events(self) -> int:
        row = await self._fetchone("SELECT COUNT(*) FROM events")
        return int(row[0]) if row is not None else 0

    # -- blobs ----------------------------------------------------------------------------------

    async def add_blob(self, sha256: str, size: int) -> BlobRecord:
        created = now_ms()
        async with self._write() as db:
            await db.execute(
                "INSERT INTO blobs (sha256, size, created_ms) VALUES (?, ?, ?)"
                " ON CONFLICT (sha256) DO NOTHING",
                (sha256, size, created),
            )
            async with db.execute(
                "SELECT sha256, size, created_ms FROM blobs WHERE sha256 = ?", (sha256,)
            ) as cur:
                row = await cur.fetchone()
        assert row is not None
        return BlobRecord(row[0], row[1], row[2])

    async def get_blob(self, sha256: str) -> BlobRecord | None:
        row = await self._fetchone(
            "SELECT sha256, size, created_ms FROM blobs WHERE sha256 = ?", (sha256,)
        )
        return None if row is None else BlobRecord(row[0], row[1], row[2])

    async def list_blobs(self, after: str = "", limit: int = 0) -> list[BlobRecord]:
        sql = "SELECT sha256, size, created_ms FROM blobs WHERE sha256 > ? ORDER BY sha256"
        params: list[object] = [after]
        if limit > 0:
            sql += " LIMIT ?"
            params.append(limit)
        return [BlobRecord(r[0], r[1], r[2]) for r in await self._fetchall(sql, params)]

    async def remove_blob(self, sha256: str) -> bool:
        async with self._write() as db:
            cur = await db.execute("DELETE FROM blobs WHERE sha256 = ?", (sha256,))
            removed = cur.rowcount > 0
            await cur.close()
        return removed

    async def touch_blob(self, sha256: str) -> bool:
        async with self._write() as db:
            cur = await db.execute(
                "UPDATE blobs SET created_ms = ? WHERE sha256 = ?", (now_ms(), sha256)
            )
            touched = cur.rowcount > 0
            await cur.close()
        return touched

    async def blob_stats(self) -> BlobStats:
        row = await self._fetchone("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM blobs")
        assert row is not None
        return BlobStats(count=int(row[0]), total_bytes=int(row[1]))

    # -- blob ownership -------------------------------------------------------------------------

    async def add_blob_owner(self, sha256: str, owner: str) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO blob_owners (sha256, owner, created_ms) VALUES (?, ?, ?)"
                " ON CONFLICT (sha256, owner) DO NOTHING",
                (sha256, owner, now_ms()),
            )

    async def blob_visible_to(self, sha256: str, owner: str) -> bool:
        row = await self._fetchone(
            """SELECT 1 FROM blobs WHERE sha256 = ? AND (
                EXISTS (SELECT 1 FROM blob_owners o WHERE o.sha256 = blobs.sha256 AND o.owner = ?)
                OR EXISTS (SELECT 1 FROM job_blobs jb JOIN jobs j ON j.job_id = jb.job_id
                           WHERE jb.sha256 = blobs.sha256 AND j.owner = ?))""",
            (sha256, owner, owner),
        )
        return row is not None

    async def blob_owners(self, sha256: str) -> set[str]:
        rows = await self._fetchall("SELECT owner FROM blob_owners WHERE sha256 = ?", (sha256,))
        return {str(r[0]) for r in rows}

    async def remove_blob_owners(self, sha256: str, owners: Collection[str]) -> int:
        async with self._write() as db:
            cur = await db.executemany(
                "DELETE FROM blob_owners WHERE sha256 = ? AND owner = ?",
                [(sha256, owner) for owner in dict.fromkeys(owners)],
            )
            removed = cur.rowcount
            await cur.close()
        return max(0, removed)

    async def owned_blob_bytes(self, owner: str) -> int:
        row = await self._fetchone(
            "SELECT COALESCE(SUM(b.size), 0) FROM blob_owners o JOIN blobs b"
            " ON b.sha256 = o.sha256 WHERE o.owner = ?",
            (owner,),
        )
        return int(row[0]) if row is not None else 0

    async def add_job_blobs(self, job_id: str, sha256s: Collection[str]) -> None:
        async with self._write() as db:
            await db.executemany(
                "INSERT INTO job_blobs (job_id, sha256) VALUES (?, ?)"
                " ON CONFLICT (job_id, sha256) DO NOTHING",
                [(job_id, sha) for sha in dict.fromkeys(sha256s)],
            )

    async def job_blobs(self, job_id: str) -> set[str]:
        rows = await self._fetchall("SELECT sha256 FROM job_blobs WHERE job_id = ?", (job_id,))
        return {str(r[0]) for r in rows}

    # -- jobs -----------------------------------------------------------------------------------

    async def create_job(self, job: common_pb2.Job, owner: str) -> common_pb2.Job:
        stored = new_job_record(job, owner)
        async with self._write() as db:
            try:
                await db.execute(
                    "INSERT INTO jobs (job_id, owner, state, created_ms, data)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (
                        stored.job_id,
                        owner,
                        int(stored.state),
                        stored.created_ms,
                        stored.SerializeToString(),
                    ),
                )
            except sqlite3.IntegrityError:
                raise AlreadyExistsError(f"job {stored.job_id} already exists") from None
        return stored

    async def get_job(self, job_id: str) -> common_pb2.Job | None:
        row = await self._fetchone("SELECT data FROM jobs WHERE job_id = ?", (job_id,))
        return None if row is None else common_pb2.Job.FromString(row[0])

    async def list_jobs(
        self, states: Collection[int] = (), owner: str | None = None, limit: int = 0
    ) -> list[common_pb2.Job]:
        sql = "SELECT data FROM jobs"
        where: list[str] = []
        params: list[object] = []
        if states:
            where.append(f"state IN ({_placeholders(len(states))})")
            params.extend(int(s) for s in states)
        if owner is not None:
            where.append("owner = ?")
            params.append(owner)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_ms DESC, job_id DESC"
        if limit > 0:
            sql += " LIMIT ?"
            params.append(limit)
        return [common_pb2.Job.FromString(r[0]) for r in await self._fetchall(sql, params)]

    async def update_job(self, job: common_pb2.Job) -> None:
        async with self._write() as db:
            cur = await db.execute(
                "UPDATE jobs SET owner = ?, state = ?, created_ms = ?, data = ? WHERE job_id = ?",
                (job.owner, int(job.state), job.created_ms, job.SerializeToString(), job.job_id),
            )
            updated = cur.rowcount
            await cur.close()
            if updated == 0:
                raise NotFoundError(f"job {job.job_id!r} not found")

    async def count_jobs_by_state(self) -> dict[int, int]:
        rows = await self._fetchall("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        return {int(r[0]): int(r[1]) for r in rows}

    # -- rounds ---------------------------------------------------------------------------------

    async def add_round(self, record: common_pb2.RoundRecord) -> None:
        async with self._write() as db:
            async with db.execute("SELECT 1 FROM jobs WHERE job_id = ?", (record.job_id,)) as c:
                if await c.fetchone() is None:
                    raise NotFoundError(f"job {record.job_id!r} not found")
            try:
                await db.execute(
                    "INSERT INTO rounds (job_id, round, epoch, data) VALUES (?, ?, ?, ?)",
                    (record.job_id, record.round, record.epoch, record.SerializeToString()),
                )
            except sqlite3.IntegrityError:
                raise AlreadyExistsError(
                    f"job {record.job_id} already has round {record.round}"
                ) from None

    async def list_rounds(
        self,
        job_id: str,
        since_round: int = 0,
        limit: int = 0,
        include_rolled_back: bool = False,
    ) -> list[common_pb2.RoundRecord]:
        sql = "SELECT data, rolled_back FROM rounds WHERE job_id = ? AND round > ?"
        params: list[object] = [job_id, since_round]
        if not include_rolled_back:
            sql += " AND rolled_back = 0"
        sql += " ORDER BY round, id"
        if limit > 0:
            sql += " LIMIT ?"
            params.append(limit)
        out = []
        for row in await self._fetchall(sql, params):
            record = common_pb2.RoundRecord.FromString(row[0])
            record.rolled_back = bool(row[1])
            out.append(record)
        return out

    async def rollback_rounds(self, job_id: str, after_round: int) -> int:
        async with self._write() as db:
            cur = await db.execute(
                "UPDATE rounds SET rolled_back = 1"
                " WHERE job_id = ? AND round > ? AND rolled_back = 0",
                (job_id, after_round),
            )
            n = cur.rowcount
            await cur.close()
        return int(n)

    # -- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(self, job_id: str, round: int, manifest: bytes) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO checkpoints (job_id, round, created_ms, manifest) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, round) DO UPDATE SET"
                " created_ms = excluded.created_ms, manifest = excluded.manifest",
                (job_id, round, now_ms(), bytes(manifest)),
            )

    async def latest_checkpoint(self, job_id: str) -> tuple[int, bytes] | None:
        row = await self._fetchone(
            "SELECT round, manifest FROM checkpoints WHERE job_id = ? ORDER BY round DESC LIMIT 1",
            (job_id,),
        )
        return None if row is None else (int(row[0]), bytes(row[1]))

    async def checkpoint_before(self, job_id: str, round: int) -> tuple[int, bytes] | None:
        row = await self._fetchone(
            "SELECT round, manifest FROM checkpoints WHERE job_id = ? AND round < ?"
            " ORDER BY round DESC LIMIT 1",
            (job_id, round),
        )
        return None if row is None else (int(row[0]), bytes(row[1]))

    async def drop_checkpoints_after(self, job_id: str, round: int) -> int:
        async with self._write() as db:
            cur = await db.execute(
                "DELETE FROM checkpoints WHERE job_id = ? AND round > ?", (job_id, round)
            )
            n = cur.rowcount
            await cur.close()
        return int(n)

    async def list_checkpoints(self, job_id: str = "") -> list[tuple[str, int, bytes]]:
        sql = "SELECT job_id, round, manifest FROM checkpoints"
        params: list[object] = []
        if job_id:
            sql += " WHERE job_id = ?"
            params.append(job_id)
        sql += " ORDER BY job_id, round"
        rows = await self._fetchall(sql, params)
        return [(str(r[0]), int(r[1]), bytes(r[2])) for r in rows]

    async def drop_checkpoints(self, job_id: str, rounds: Collection[int]) -> list[bytes]:
        dropped: list[bytes] = []
        if not rounds:
            return dropped
        async with self._write() as db:
            for r in sorted(set(rounds)):
                async with db.execute(
                    "DELETE FROM checkpoints WHERE job_id = ? AND round = ? RETURNING manifest",
                    (job_id, int(r)),
                ) as cur:
                    dropped.extend(bytes(row[0]) for row in await cur.fetchall())
        return dropped

    # -- per-job engine state -------------------------------------------------------------------

    async def put_job_state(self, job_id: str, key: str, value: bytes) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO job_state (job_id, key, value) VALUES (?, ?, ?)"
                " ON CONFLICT (job_id, key) DO UPDATE SET value = excluded.value",
                (job_id, key, bytes(value)),
            )

    async def get_job_state(self, job_id: str, key: str) -> bytes | None:
        row = await self._fetchone(
            "SELECT value FROM job_state WHERE job_id = ? AND key = ?", (job_id, key)
        )
        return None if row is None else bytes(row[0])

    async def delete_job_state(self, job_id: str, key: str) -> bool:
        async with self._write() as db:
            cur = await db.execute(
                "DELETE FROM job_state WHERE job_id = ? AND key = ?", (job_id, key)
            )
            removed = cur.rowcount > 0
            await cur.close()
        return removed

    # -- trust ----------------------------------------------------------------------------------

    async def add_token(self, record: TokenRecord) -> None:
        async with self._write() as db:
            try:
                await db.execute(
                    "INSERT INTO tokens (token_hash, role, created_ms, expires_ms, reusable, uses,"
                    " donor, max_uses, cert_ttl_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.token_hash,
                        record.role,
                        record.created_ms,
                        record.expires_ms,
                        int(record.reusable),
                        record.uses,
                        record.donor,
                        record.max_uses,
                        record.cert_ttl_ms,
                    ),
                )
            except sqlite3.IntegrityError:
                raise AlreadyExistsError("token already exists") from None

    _TOKEN_COLUMNS = (
        "token_hash, role, created_ms, expires_ms, reusable, uses, donor, max_uses, cert_ttl_ms"
    )

    @staticmethod
    def _token_of(row: sqlite3.Row) -> TokenRecord:
        return TokenRecord(
            row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6], row[7], row[8]
        )

    async def redeem_token(self, token_hash: str, now_ms: int) -> TokenRecord | None:
        async with self._write() as db:
            cur = await db.execute(
                "UPDATE tokens SET uses = uses + 1 WHERE token_hash = ? AND expires_ms > ?"
                " AND (reusable = 1 OR uses = 0) AND (max_uses = 0 OR uses < max_uses)",
                (token_hash, now_ms),
            )
            changed = cur.rowcount > 0
            await cur.close()
            if not changed:
                return None
            async with db.execute(
                f"SELECT {self._TOKEN_COLUMNS} FROM tokens WHERE token_hash = ?", (token_hash,)
            ) as cur2:
                row = await cur2.fetchone()
        assert row is not None
        return self._token_of(row)

    async def get_token(self, token_hash: str) -> TokenRecord | None:
        row = await self._fetchone(
            f"SELECT {self._TOKEN_COLUMNS} FROM tokens WHERE token_hash = ?", (token_hash,)
        )
        return None if row is None else self._token_of(row)

    async def quarantined_nodes_of_donor(self, donor: str) -> list[str]:
        rows = await self._fetchall(
            "SELECT n.node_id FROM nodes n JOIN node_donors d ON d.node_id = n.node_id"
            " WHERE d.donor = ? AND n.state = ? ORDER BY n.node_id",
            (donor, int(common_pb2.NODE_STATE_QUARANTINED)),
        )
        return [str(r[0]) for r in rows]

    async def set_node_donor(self, node_id: str, donor: str) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO node_donors (node_id, donor) VALUES (?, ?)"
                " ON CONFLICT (node_id) DO UPDATE SET donor = excluded.donor",
                (node_id, donor),
            )

    async def get_node_donor(self, node_id: str) -> str:
        row = await self._fetchone("SELECT donor FROM node_donors WHERE node_id = ?", (node_id,))
        return "" if row is None else str(row[0])

    async def list_node_donors(self) -> dict[str, str]:
        rows = await self._fetchall("SELECT node_id, donor FROM node_donors")
        return {str(r[0]): str(r[1]) for r in rows}

    async def add_revocation(self, principal: str, role: str, reason: str) -> bool:
        async with self._write() as db:
            cur = await db.execute(
                "INSERT INTO revocations (principal, role, revoked_ms, reason) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (principal) DO NOTHING",
                (principal, role, now_ms(), reason),
            )
            added = cur.rowcount > 0
            await cur.close()
        return added

    async def list_revocations(self) -> list[str]:
        return [str(r[0]) for r in await self._fetchall("SELECT principal FROM revocations")]

    # -- cluster scheduler ----------------------------------------------------------------------

    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO tenant_weights (tenant, weight) VALUES (?, ?)"
                " ON CONFLICT (tenant) DO UPDATE SET weight = excluded.weight",
                (tenant, float(weight)),
            )

    async def list_tenant_weights(self) -> dict[str, float]:
        rows = await self._fetchall("SELECT tenant, weight FROM tenant_weights")
        return {str(r[0]): float(r[1]) for r in rows}

    async def add_ledger_entries(self, entries: Sequence[Entry]) -> list[int]:
        ids: list[int] = []
        async with self._write() as db:
            for e in entries:
                cursor = await db.execute(
                    """INSERT INTO ledger_entries (time_ms, from_account, to_account, amount,
                           reason, job_id, round, node_id, samples)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                    (
                        e.at_ms,
                        e.from_account,
                        e.to_account,
                        e.amount,
                        e.reason,
                        e.job_id,
                        e.round,
                        e.node_id,
                        e.samples,
                    ),
                )
                ids.append(int(cursor.lastrowid or 0))
        return ids

    async def list_ledger_entries(
        self, account: str = "", job_id: str = "", after_id: int = 0, limit: int = 0
    ) -> list[tuple[int, Entry]]:
        where: list[str] = ["id > ?"]
        args: list[object] = [after_id]
        if account:
            where.append("(from_account = ? OR to_account = ?)")
            args += [account, account]
        if job_id:
            where.append("job_id = ?")
            args.append(job_id)
        sql = (
            "SELECT id, time_ms, from_account, to_account, amount, reason, job_id, round,"
            f" node_id, samples FROM ledger_entries WHERE {' AND '.join(where)} ORDER BY id"
        )
        if limit > 0:
            sql += f" LIMIT {int(limit)}"
        rows = await self._fetchall(sql, tuple(args))
        return [
            (
                int(r[0]),
                Entry(int(r[1]), r[2], r[3], int(r[4]), r[5], r[6], int(r[7]), r[8], int(r[9])),
            )
            for r in rows
        ]

    async def ledger_balances(self) -> dict[str, int]:
        rows = await self._fetchall(
            """SELECT account, SUM(amount) FROM (
                   SELECT to_account AS account, amount FROM ledger_entries
                   UNION ALL SELECT from_account, -amount FROM ledger_entries
               ) GROUP BY account"""
        )
        return {str(r[0]): int(r[1]) for r in rows}

    async def put_scheduler_state(self, key: str, value: bytes) -> None:
        async with self._write() as db:
            await db.execute(
                "INSERT INTO scheduler_state (key, value) VALUES (?, ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, bytes(value)),
            )

    async def get_scheduler_state(self, key: str) -> bytes | None:
        row = await self._fetchone("SELECT value FROM scheduler_state WHERE key = ?", (key,))
        return None if row is None else bytes(row[0])
