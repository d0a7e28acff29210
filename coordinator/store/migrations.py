"""The SQLite store's schema: its `MIGRATIONS`, in order, and how they are applied at open.

The schema version is recorded in table ``schema_version`` (one row per applied migration);
`migrate` applies the migrations a database lacks, each in its own transaction (a migration's
statements, then its backfill, then its row in ``schema_version``), and refuses a database
written by a newer program (StoreError).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiosqlite

from coordinator.core.errors import StoreError
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]
    # Rewrites rows SQL alone cannot (decoding stored records), after the statements, in the
    # migration's transaction.
    backfill: Callable[[aiosqlite.Connection], Awaitable[None]] | None = None


async def _backfill_job_blobs(db: aiosqlite.Connection) -> None:
    """Jobs stored before schema 9 have no record of their blobs: their program, initial state
    and shards are the job's, and its owner's (SubmitJob took only blobs its owner uploaded),
    as SubmitJob records them now. Jobs recorded since are left as they are."""
    async with db.execute("SELECT job_id, owner, data FROM jobs") as cur:
        rows = await cur.fetchall()
    now = now_ms()
    for job_id, owner, data in rows:
        job = common_pb2.Job.FromString(data)
        inputs = {job.program.sha256, job.initial_state.sha256}
        inputs.update(shard.blob.sha256 for shard in job.shards)
        inputs.discard("")
        for sha in sorted(inputs):
            await db.execute(
                "INSERT INTO job_blobs (job_id, sha256) VALUES (?, ?)"
                " ON CONFLICT (job_id, sha256) DO NOTHING",
                (job_id, sha),
            )
            if owner:
                await db.execute(
                    "INSERT INTO blob_owners (sha256, owner, created_ms)"
                    " SELECT sha256, ?, ? FROM blobs WHERE sha256 = ?"
                    " ON CONFLICT (sha256, owner) DO NOTHING",
                    (owner, now, sha),
                )


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "control plane: nodes, events, blobs",
        (
            """CREATE TABLE nodes (
                node_id TEXT PRIMARY KEY,
                name TEXT NOT NULL,
                state INTEGER NOT NULL,
                lease_id TEXT NOT NULL,
                registered_ms INTEGER NOT NULL,
                last_heartbeat_ms INTEGER NOT NULL,
                lease_expires_ms INTEGER NOT NULL,
                info BLOB NOT NULL
            )""",
            "CREATE INDEX nodes_name ON nodes (name)",
            """CREATE TABLE events (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                time_ms INTEGER NOT NULL,
                kind TEXT NOT NULL,
                node_id TEXT NOT NULL,
                job_id TEXT NOT NULL,
                data BLOB NOT NULL
            )""",
            """CREATE TABLE blobs (
                sha256 TEXT PRIMARY KEY,
                size INTEGER NOT NULL,
                created_ms INTEGER NOT NULL
            )""",
        ),
    ),
    Migration(
        2,
        "training: jobs, rounds, checkpoints, job_state",
        (
            """CREATE TABLE jobs (
                job_id TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                state INTEGER NOT NULL,
                created_ms INTEGER NOT NULL,
                data BLOB NOT NULL
            )""",
            "CREATE INDEX jobs_state ON jobs (state)",
            """CREATE TABLE rounds (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                job_id TEXT NOT NULL,
                round INTEGER NOT NULL,
                epoch INTEGER NOT NULL,
                rolled_back INTEGER NOT NULL DEFAULT 0,
                data BLOB NOT NULL
            )""",
            # At most one live record per (job, round); rolled-back ones stay for the record.
            "CREATE UNIQUE INDEX rounds_live ON rounds (job_id, round) WHERE rolled_back = 0",
            "CREATE INDEX rounds_job ON rounds (job_id, round)",
            """CREATE TABLE checkpoints (
                job_id TEXT NOT NULL,
                round INTEGER NOT NULL,
                created_ms INTEGER NOT NULL,
                manifest BLOB NOT NULL,
                PRIMARY KEY (job_id, round)
            )""",
            """CREATE TABLE job_state (
                job_id TEXT NOT NULL,
                key TEXT NOT NULL,
                value BLOB NOT NULL,
                PRIMARY KEY (job_id, key)
            )""",
        ),
    ),
    Migration(
        3,
        "indexes for event filters and job owners",
        (
            "CREATE INDEX events_node ON events (node_id, id)",
            "CREATE INDEX events_job ON events (job_id, id)",
            "CREATE INDEX jobs_owner ON jobs (owner, created_ms)",
        ),
    ),
    Migration(
        4,
        "trust: join tokens and revoked principals",
        (
            """CREATE TABLE tokens (
                token_hash TEXT PRIMARY KEY,
                role TEXT NOT NULL,
                created_ms INTEGER NOT NULL,
                expires_ms INTEGER NOT NULL,
                reusable INTEGER NOT NULL,
                uses INTEGER NOT NULL DEFAULT 0
            )""",
            """CREATE TABLE revocations (
                principal TEXT PRIMARY KEY,
                role TEXT NOT NULL,
                revoked_ms INTEGER NOT NULL,
                reason TEXT NOT NULL
            )""",
        ),
    ),
    Migration(
        5,
        "cluster scheduler: tenants' weights and the scheduler's own state",
        (
            """CREATE TABLE tenant_weights (
                tenant TEXT PRIMARY KEY,
                weight REAL NOT NULL
            )""",
            """CREATE TABLE scheduler_state (
                key TEXT PRIMARY KEY,
                value BLOB NOT NULL
            )""",
        ),
    ),
    Migration(
        6,
        "the market: the credit ledger",
        (
            """CREATE TABLE ledger_entries (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                time_ms INTEGER NOT NULL,
                from_account TEXT NOT NULL,
                to_account TEXT NOT NULL,
                amount INTEGER NOT NULL CHECK (amount > 0),
                reason TEXT NOT NULL,
                job_id TEXT NOT NULL,
                round INTEGER NOT NULL,
                node_id TEXT NOT NULL,
                samples INTEGER NOT NULL
            )""",
            "CREATE INDEX ledger_from ON ledger_entries (from_account, id)",
            "CREATE INDEX ledger_to ON ledger_entries (to_account, id)",
            "CREATE INDEX ledger_job ON ledger_entries (job_id, id)",
        ),
    ),
    Migration(
        7,
        "the market: donors of node tokens and of the nodes they enrolled",
        (
            "ALTER TABLE tokens ADD COLUMN donor TEXT NOT NULL DEFAULT ''",
            """CREATE TABLE node_donors (
                node_id TEXT PRIMARY KEY,
                donor TEXT NOT NULL
            )""",
        ),
    ),
    Migration(
        8,
        "identities: use limits of reusable tokens and the lifetime of their certificates",
        (
            "ALTER TABLE tokens ADD COLUMN max_uses INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE tokens ADD COLUMN cert_ttl_ms INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    Migration(
        9,
        "blob ownership: who uploaded each blob, which jobs use it",
        (
            """CREATE TABLE blob_owners (
                sha256 TEXT NOT NULL,
                owner TEXT NOT NULL,
                created_ms INTEGER NOT NULL,
                PRIMARY KEY (sha256, owner)
            )""",
            "CREATE INDEX blob_owners_owner ON blob_owners (owner)",
            """CREATE TABLE job_blobs (
                job_id TEXT NOT NULL,
                sha256 TEXT NOT NULL,
                PRIMARY KEY (job_id, sha256)
            )""",
            "CREATE INDEX job_blobs_sha256 ON job_blobs (sha256)",
        ),
    ),
    Migration(
        10,
        "retention: events found by age",
        ("CREATE INDEX IF NOT EXISTS events_time ON events (time_ms)",),
    ),
    Migration(
        11,
        "blob ownership of jobs stored before version 9",
        (),
        backfill=_backfill_job_blobs,
    ),
    Migration(
        12,
        "coordinators sharing one database: the lease and the trust root",
        (
            # One row: which coordinator is active (its fencing epoch, name and address).
            # Used on PostgreSQL (coordinator/ha/lease.py); a SQLite file has one coordinator.
            """CREATE TABLE IF NOT EXISTS coordinator_lease (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                epoch INTEGER NOT NULL,
                holder TEXT NOT NULL,
                address TEXT NOT NULL,
                acquired_ms INTEGER NOT NULL
            )""",
            "INSERT OR IGNORE INTO coordinator_lease VALUES (1, 0, '', '', 0)",
            # The CA every coordinator on the database shares (coordinator/trust/shared_ca.py).
            """CREATE TABLE IF NOT EXISTS trust_root (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                ca_cert BLOB NOT NULL,
                ca_key BLOB NOT NULL,
                created_ms INTEGER NOT NULL
            )""",
        ),
    ),
)


LATEST_SCHEMA_VERSION = MIGRATIONS[-1].version


_SCHEMA_VERSION_TABLE = """CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER PRIMARY KEY,
    applied_ms INTEGER NOT NULL,
    description TEXT NOT NULL
)"""


async def _current_version(db: aiosqlite.Connection) -> int:
    await db.execute(_SCHEMA_VERSION_TABLE)
    async with db.execute("SELECT MAX(version) FROM schema_version") as cur:
        row = await cur.fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0


async def migrate(db: aiosqlite.Connection, target: int) -> int:
    if not 0 < target <= LATEST_SCHEMA_VERSION:
        raise ValueError(f"no schema version {target} (latest is {LATEST_SCHEMA_VERSION})")
    current = await _current_version(db)
    if current > LATEST_SCHEMA_VERSION:
        raise StoreError(
            f"database schema version {current} is newer than this coordinator supports "
            f"({LATEST_SCHEMA_VERSION}): upgrade epochmesh"
        )
    for migration in MIGRATIONS:
        if migration.version <= current or migration.version > target:
            continue
        log.info("migrating schema to version %d: %s", migration.version, migration.description)
        await db.execute("BEGIN IMMEDIATE")
        try:
            for statement in migration.statements:
                await db.execute(statement)
            if migration.backfill is not None:
                await migration.backfill(db)
            await db.execute(
                "INSERT INTO schema_version (version, applied_ms, description) VALUES (?, ?, ?)",
                (migration.version, now_ms(), migration.description),
            )
            await db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await db.execute("ROLLBACK")
            raise
        current = migration.version
    return current
