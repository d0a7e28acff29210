"""A job's verification state in the store: written soon after each change, read after a restart.

What a restarted coordinator must know of a job's checks (`StoredVerification`, job state
STATE_KEY; coordinator/engine/verifier.py says what it holds and why): the `Verifier` hands it
to a `StateWriter` after every change and reads it back with `read_stored`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from coordinator.core.errors import FencedError
from coordinator.engine.ports import JobPort
from coordinator.store.base import Store
from coordinator.verification.restart_state import StoredVerification

log = logging.getLogger(__name__)

# The job state key of what a restarted coordinator must know (see the module docstring).
STATE_KEY = "verification"


class StateWriter:
    """Stores ``state()`` of one job soon after each `changed`."""

    def __init__(self, runner: JobPort, state: Callable[[], StoredVerification]) -> None:
        self.runner = runner
        self._state = state
        self._dirty = False
        self._saver: asyncio.Task[None] | None = None

    def changed(self) -> None:
        """Store the state soon (one writer task; it writes the newest state when it runs)."""
        self._dirty = True
        if self._saver is None or self._saver.done():
            self._saver = asyncio.get_running_loop().create_task(
                self._save(), name=f"verify-save-{self.runner.job_id}"
            )

    async def _save(self) -> None:
        while self._dirty:
            self._dirty = False
            data = self._state().to_bytes()
            try:
                await self.runner.ctx.store.put_job_state(self.runner.job_id, STATE_KEY, data)
            except FencedError as exc:  # stepping down: the next active one reloads it
                log.warning("job %s: verification state not stored: %s", self.runner.job_id, exc)
                return
            except Exception:
                log.exception("job %s: verification state not stored", self.runner.job_id)
                return

    async def written(self) -> None:
        """Until the writer task (if any) is done."""
        if self._saver is not None:
            await self._saver


async def read_stored(runner: JobPort, kept_up_to: int) -> StoredVerification | None:
    """The stored state (None: none, or unreadable), its unverified rounds completed with the
    applied parts of rounds recorded after it was written, up to round ``kept_up_to`` (the
    checkpoint the runner restored; later rounds were rolled back)."""
    store, job_id = runner.ctx.store, runner.job_id
    raw = await store.get_job_state(job_id, STATE_KEY)
    if raw is None:
        return None
    try:
        stored = StoredVerification.from_bytes(raw)
    except ValueError as e:
        log.warning("job %s: %s", job_id, e)
        return None
    unverified = stored.unverified
    for rec in await store.list_rounds(job_id):
        if stored.as_of_round < rec.round <= kept_up_to:
            for part in rec.parts:
                if part.status == "applied":
                    unverified.setdefault(part.node_id, set()).add(rec.round)
    return stored


async def stored_accused(store: Store, job_id: str) -> frozenset[str]:
    """The nodes the job's stored verification state accuses (none: nothing stored, or
    unreadable), for settling an ended job without its runner."""
    raw = await store.get_job_state(job_id, STATE_KEY)
    if raw is None:
        return frozenset()
    try:
        return frozenset(StoredVerification.from_bytes(raw).accused)
    except ValueError as e:
        log.warning("job %s: %s", job_id, e)
        return frozenset()
