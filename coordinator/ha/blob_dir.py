"""Which database a blob directory belongs to.

Several coordinators on one PostgreSQL database may share one blob directory (``serve
--blob-dir``, a shared filesystem): the blobs' records live in the database, their bytes in
the directory. A coordinator on another database pointed at the same directory would take the
other's blobs for strays (recorded ones it does not know, files it has no record of) and
collect them, so the directory names its database in ``.epochmesh-database`` and a coordinator
on any other is refused at start.

The database's identity is a random id kept in the database itself (``scheduler_state`` key
``store.identity``, written once, the first writer winning), so that it is the same through
every coordinator and every address the server is reached at (a restored backup keeps its id,
as it keeps its blobs' records). SQLite databases get one the same way.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from coordinator.store.base import Store
from coordinator.store.postgres import PostgresStore

MARKER_FILE = ".epochmesh-database"
IDENTITY_KEY = "store.identity"


class BlobDirError(RuntimeError):
    """The blob directory belongs to another database."""


async def store_identity(store: Store) -> str:
    """The database's id, created (once: the first writer wins) when it has none."""
    if isinstance(store, PostgresStore):
        async with store.acquire_connection() as conn:
            await conn.execute(
                "INSERT INTO scheduler_state (key, value) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                IDENTITY_KEY,
                secrets.token_hex(16).encode(),
            )
            value = await conn.fetchval(
                "SELECT value FROM scheduler_state WHERE key = $1", IDENTITY_KEY
            )
        return bytes(value).decode()
    value = await store.get_scheduler_state(IDENTITY_KEY)
    if value is None:
        value = secrets.token_hex(16).encode()
        await store.put_scheduler_state(IDENTITY_KEY, value)
    return value.decode()


def _describe(database: str) -> str:
    return database or "a SQLite database"


async def claim_blob_dir(store: Store, blob_dir: Path, database: str) -> str:
    """Mark ``blob_dir`` as ``store``'s (``database`` names it in messages: a redacted URL or
    the SQLite file); BlobDirError when it is another database's. The id."""
    identity = await store_identity(store)
    blob_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    marker = blob_dir / MARKER_FILE
    line = f"{identity} {database}\n"
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        return identity
    text = marker.read_text().strip()
    owner, _, named = text.partition(" ")
    if owner != identity:
        raise BlobDirError(
            f"blob dir {blob_dir} holds the blobs of another database ({_describe(named)}, id "
            f"{owner or '?'}), not of {_describe(database)} (id {identity}): give each "
            "database a blob dir of its own (--blob-dir)"
        )
    return identity
