"""Which `Store` a coordinator opens: SQLite in its data directory, or the PostgreSQL database a
``postgresql://`` URL names (``--store``)."""

from __future__ import annotations

from pathlib import Path

from coordinator.core.errors import StoreError
from coordinator.store.base import Store

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def describe_store(store: str, sqlite_path: Path) -> str:
    """Where the state lives, for messages (a URL's password left out)."""
    if not store:
        return str(sqlite_path)
    from coordinator.store.postgres import redact_url

    return redact_url(store)


async def open_store(store: str, sqlite_path: Path) -> Store:
    """``store`` empty: the SQLite database at ``sqlite_path``; a postgresql:// (or
    postgres://) URL: that PostgreSQL database. StoreError for anything else, or when the
    database cannot be opened."""
    if not store:
        from coordinator.store.sqlite import SqliteStore

        return await SqliteStore.open(sqlite_path)
    if store.startswith(POSTGRES_SCHEMES):
        from coordinator.store.postgres import PostgresStore

        return await PostgresStore.open(store)
    raise StoreError(
        f"unknown store {describe_store(store, sqlite_path)!r}: give a postgresql://"
        "USER@HOST:PORT/DB URL, or nothing for SQLite in the data directory"
    )
