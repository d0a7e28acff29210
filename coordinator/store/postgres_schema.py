"""The PostgreSQL store's schema: the SQLite schema's versions, in PostgreSQL's types.

Every version of `coordinator.store.migrations.MIGRATIONS` has its counterpart here, with the
same number and description (checked at import), so a version means the same tables on both
backends. The differences are types only: integers are BIGINT (milliseconds, money, rounds),
blobs BYTEA, flags BOOLEAN, weights DOUBLE PRECISION; ids of rounds and ledger entries are
identity columns. Event ids come from the one-row counter ``id_counters('events')``, taken in
the appending transaction: a rolled-back append gives its id back (as SQLite's AUTOINCREMENT
does), ids are handed out in commit order, and the counter remembers the highest id after
retention has deleted its event.

`migrate` applies what a database lacks, each version in its own transaction that first takes
``pg_advisory_xact_lock(SCHEMA_LOCK_KEY)``: coordinators opening one database at the same
moment apply every version once, in order, the later ones waiting and then finding nothing to
do. The lock ends with each transaction, so it never outlives a crashed migrator.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coordinator.core.errors import StoreError
from coordinator.store.migrations import LATEST_SCHEMA_VERSION, MIGRATIONS
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

# The advisory lock key (any 64-bit number, held per transaction) that serializes migrations.
# Other keys (a coordinator's lease, say) must not reuse it.
SCHEMA_LOCK_KEY = 0x65706F6368_0001  # "epoch", 1

# asyncpg is untyped: its connection is handed around as Any.
Connection = Any


@dataclass(frozen=True)
class PgMigration:
    version: int
    description: str
    statements: tuple[str, ...]
    backfill: Callable[[Connection], Awaitable[None]] | None = None


async def _backfill_job_blobs(db: Connection) -> None:
    """As the SQLite migration of the same version: jobs stored before version 9 get records
    of their program, initial state and shards, held by their owner."""
    now = now_ms()
    for row in await db.fetch("SELECT job_id, owner, data FROM jobs"):
        job = common_pb2.Job.FromString(row["data"])
        inputs = {job.program.sha256, job.initial_state.sha256}
        inputs.update(shard.blob.sha256 for shard in job.shards)
        inputs.discard("")
        for sha in sorted(inputs):
            await db.execute(
                "INSERT INTO job_blobs (job_id, sha256) VALUES ($1, $2)"
                " ON CONFLICT (job_id, sha256) DO NOTHING",
                row["job_id"],
                sha,
            )
            if row["owner"]:
                await db.execute(
                    "INSERT INTO blob_owners (sha256, owner, created_ms)"
                    " SELECT sha256, $1, $2 FROM blobs WHERE sha256 = $3"
                    " ON CONFLICT (sha256, owner) DO NOTHING",
                    row["owner"],
                    now,
                    sha,
                )


PG_MIGRATIONS: tuple[PgMigration, ...] = (
    PgMigration(
        1,
        "control plane: nodes, events, blobs",
        (
            """CREATE TABLE nodes (
                node_id TEXT PRIMARY KEY,
                name TEXT NOT NULL,
                state BIGINT NOT NULL,
                lease_id TEXT NOT NULL,
                registered_ms BIGINT NOT NULL,
                last_heartbeat_ms BIGINT NOT NULL,
                lease_expires_ms BIGINT NOT NULL,
                info BYTEA NOT NULL
            )""",
            "CREATE INDEX nodes_name ON nodes (name)",
            """CREATE TABLE id_counters (
                name TEXT PRIMARY KEY,
                value BIGINT NOT NULL
            )""",
            "INSERT INTO id_counters (name, value) VALUES ('events', 0)",
            """CREATE TABLE events (
                id BIGINT PRIMARY KEY,
                time_ms BIGINT NOT NULL,
                kind TEXT NOT NULL,
                node_id TEXT NOT NULL,
                job_id TEXT NOT NULL,
                data BYTEA NOT NULL
            )""",
            """CREATE TABLE blobs (
                sha256 TEXT PRIMARY KEY,
                size BIGINT NOT NULL,
                created_ms BIGINT NOT NULL
            )""",
        ),
    ),
    PgMigration(
        2,
        "training: jobs, rounds, checkpoints, job_state",
        (
            """CREATE TABLE jobs (
                job_id TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                state BIGINT NOT NULL,
                created_ms BIGINT NOT NULL,
                data BYTEA NOT NULL
            )""",
            "CREATE INDEX jobs_state ON jobs (state)",
            """CREATE TABLE rounds (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                job_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                epoch BIGINT NOT NULL,
                rolled_back BOOLEAN NOT NULL DEFAULT FALSE,
                data BYTEA NOT NULL
            )""",
            "CREATE UNIQUE INDEX rounds_live ON rounds (job_id, round) WHERE NOT rolled_back",
            "CREATE INDEX rounds_job ON rounds (job_id, round)",
            """CREATE TABLE checkpoints (
                job_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                created_ms BIGINT NOT NULL,
                manifest BYTEA NOT NULL,
                PRIMARY KEY (job_id, round)
            )""",
            """CREATE TABLE job_state (
                job_id TEXT NOT NULL,
                key TEXT NOT NULL,
                value BYTEA NOT NULL,
                PRIMARY KEY (job_id, key)
            )""",
        ),
    ),
    PgMigration(
        3,
        "indexes for event filters and job owners",
        (
            "CREATE INDEX events_node ON events (node_id, id)",
            "CREATE INDEX events_job ON events (job_id, id)",
            "CREATE INDEX jobs_owner ON jobs (owner, created_ms)",
        ),
    ),
    PgMigration(
        4,
        "trust: join tokens and revoked principals",
        (
            """CREATE TABLE tokens (
                token_hash TEXT PRIMARY KEY,
                role TEXT NOT NULL,
                created_ms BIGINT NOT NULL,
                expires_ms BIGINT NOT NULL,
                reusable BOOLEAN NOT NULL,
                uses BIGINT NOT NULL DEFAULT 0
            )""",
            """CREATE TABLE revocations (
                principal TEXT PRIMARY KEY,
                role TEXT NOT NULL,
                revoked_ms BIGINT NOT NULL,
                reason TEXT NOT NULL
            )""",
        ),
    ),
    PgMigration(
        5,
        "cluster scheduler: tenants' weights and the scheduler's own state",
        (
            """CREATE TABLE tenant_weights (
                tenant TEXT PRIMARY KEY,
                weight DOUBLE PRECISION NOT NULL
            )""",
            """CREATE TABLE scheduler_state (
                key TEXT PRIMARY KEY,
                value BYTEA NOT NULL
            )""",
        ),
    ),
    PgMigration(
        6,
        "the market: the credit ledger",
        (
            """CREATE TABLE ledger_entries (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                time_ms BIGINT NOT NULL,
                from_account TEXT NOT NULL,
                to_account TEXT NOT NULL,
                amount BIGINT NOT NULL CHECK (amount > 0),
                reason TEXT NOT NULL,
                job_id TEXT NOT NULL,
                round BIGINT NOT NULL,
                node_id TEXT NOT NULL,
                samples BIGINT NOT NULL
            )""",
            "CREATE INDEX ledger_from ON ledger_entries (from_account, id)",
            "CREATE INDEX ledger_to ON ledger_entries (to_account, id)",
            "CREATE INDEX ledger_job ON ledger_entries (job_id, id)",
        ),
    ),
    PgMigration(
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
    PgMigration(
        8,
        "identities: use limits of reusable tokens and the lifetime of their certificates",
        (
            "ALTER TABLE tokens ADD COLUMN max_uses BIGINT NOT NULL DEFAULT 0",
            "ALTER TABLE tokens ADD COLUMN cert_ttl_ms BIGINT NOT NULL DEFAULT 0",
        ),
    ),
    PgMigration(
        9,
        "blob ownership: who uploaded each blob, which jobs use it",
        (
            """CREATE TABLE blob_owners (
                sha256 TEXT NOT NULL,
                owner TEXT NOT NULL,
                created_ms BIGINT NOT NULL,
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
    PgMigration(
        10,
        "retention: events found by age",
        ("CREATE INDEX IF NOT EXISTS events_time ON events (time_ms)",),
    ),
    PgMigration(
        11,
        "blob ownership of jobs stored before version 9",
        (),
        backfill=_backfill_job_blobs,
    ),
    PgMigration(
        12,
        "coordinators sharing one database: the lease and the trust root",
        (
            # One row: which coordinator is active (its fencing epoch, name and address).
            """CREATE TABLE IF NOT EXISTS coordinator_lease (
                id SMALLINT PRIMARY KEY CHECK (id = 1),
                epoch BIGINT NOT NULL,
                holder TEXT NOT NULL,
                address TEXT NOT NULL,
                acquired_ms BIGINT NOT NULL
            )""",
            "INSERT INTO coordinator_lease VALUES (1, 0, '', '', 0) ON CONFLICT DO NOTHING",
            # The CA every coordinator on the database shares (coordinator/trust/shared_ca.py).
            """CREATE TABLE IF NOT EXISTS trust_root (
                id SMALLINT PRIMARY KEY CHECK (id = 1),
                ca_cert BYTEA NOT NULL,
                ca_key BYTEA NOT NULL,
                created_ms BIGINT NOT NULL
            )""",
        ),
    ),
)

if [(m.version, m.description) for m in PG_MIGRATIONS] != [
    (m.version, m.description) for m in MIGRATIONS
]:  # pragma: no cover - a schema change made on one backend only
    raise ImportError("the PostgreSQL schema versions differ from SQLite's (migrations.py)")


_SCHEMA_VERSION_TABLE = """CREATE TABLE IF NOT EXISTS schema_version (
    version BIGINT PRIMARY KEY,
    applied_ms BIGINT NOT NULL,
    description TEXT NOT NULL
)"""


async def _locked_version(db: Connection) -> int:
    """Take the migration lock (for the caller's transaction) and read the version."""
    await db.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK_KEY)
    await db.execute(_SCHEMA_VERSION_TABLE)
    version = await db.fetchval("SELECT MAX(version) FROM schema_version")
    return 0 if version is None else int(version)


async def migrate(db: Connection, target: int) -> int:
    """Bring the database on connection ``db`` to version ``target``; the version it is in
    afterwards (higher than ``target`` when another coordinator migrated it further).
    StoreError if it was written by a newer program."""
    if not 0 < target <= LATEST_SCHEMA_VERSION:
        raise ValueError(f"no schema version {target} (latest is {LATEST_SCHEMA_VERSION})")
    current = 0
    for migration in PG_MIGRATIONS:
        if migration.version > target:
            break
        async with db.transaction():
            current = await _locked_version(db)
            if current > LATEST_SCHEMA_VERSION:
                raise StoreError(
                    f"database schema version {current} is newer than this coordinator "
                    f"supports ({LATEST_SCHEMA_VERSION}): upgrade epochmesh"
                )
            if migration.version <= current:
                continue
            log.info("migrating schema to version %d: %s", migration.version, migration.description)
            for statement in migration.statements:
                await db.execute(statement)
            if migration.backfill is not None:
                await migration.backfill(db)
            await db.execute(
                "INSERT INTO schema_version (version, applied_ms, description) VALUES ($1, $2, $3)",
                migration.version,
                now_ms(),
                migration.description,
            )
            current = migration.version
    if current == 0:  # pragma: no cover - target >= 1 always runs a loop turn
        raise StoreError("no schema version recorded")
    return current
