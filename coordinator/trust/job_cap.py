"""How many live jobs (queued, running or paused) one tenant may have: SubmitJob beyond
``--max-live-jobs`` (default `DEFAULT_MAX_LIVE_JOBS`) is refused with RESOURCE_EXHAUSTED,
naming the cap, before the program is inspected or anything is stored.

A tenant's submissions pass `LiveJobCap.hold` one at a time (an asyncio lock per tenant), so
that two at once cannot both take the last place; each counts the tenant's live jobs in the
store. Every principal that submits is a tenant (operators too; without TLS, the one anonymous
tenant).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from coordinator.core.errors import ResourceExhaustedError
from coordinator.store.base import Store
from epochmesh.v1 import common_pb2

DEFAULT_MAX_LIVE_JOBS = 100
LIVE_STATES = (
    common_pb2.JOB_STATE_QUEUED,
    common_pb2.JOB_STATE_RUNNING,
    common_pb2.JOB_STATE_PAUSED,
)


class LiveJobCap:
    def __init__(self, store: Store, limit: int = DEFAULT_MAX_LIVE_JOBS) -> None:
        if limit < 1:
            raise ValueError("the cap on live jobs per tenant must be at least 1")
        self.limit = limit
        self._store = store
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}

    @asynccontextmanager
    async def hold(self, owner: str) -> AsyncIterator[None]:
        """Around one submission of ``owner``'s: ResourceExhaustedError when it has
        `limit` live jobs already."""
        lock = self._locks.setdefault(owner, asyncio.Lock())
        self._users[owner] = self._users.get(owner, 0) + 1
        try:
            async with lock:
                live = await self._store.list_jobs(
                    states=LIVE_STATES, owner=owner, limit=self.limit
                )
                if len(live) >= self.limit:
                    raise ResourceExhaustedError(
                        f"{owner or 'this tenant'} has {len(live)} live jobs (queued, running "
                        f"or paused), the most one tenant may have (--max-live-jobs "
                        f"{self.limit}): wait for one to end, or cancel one (epochmesh cancel)"
                    )
                yield
        finally:
            self._users[owner] -= 1
            if not self._users[owner]:
                del self._users[owner]
                del self._locks[owner]
