"""Who may have how many job submissions in progress, and whose program is checked next.

A submission holds nothing program-sized while it waits: the program is read from the blob
store's file only once a check slot is taken (coordinator/engine/submission.py). What is left
to bound is how many submissions wait, and in what order they get the slots:

- `SubmitGate.admit`: a principal (tenant) may have `per_principal` submissions in progress at
  once (validating, waiting for a check slot or for another submission's check of the same
  program, being checked, being stored); one more is refused at once with
  RESOURCE_EXHAUSTED naming the cap. Every principal that submits is a tenant (operators too;
  without TLS, the one anonymous tenant).
- `SubmitGate.slot`: at most `slots` program checks run at once (the inspector's concurrency).
  A freed slot goes to the principals waiting in turn (round-robin: the principal served moves
  to the back of the rotation), each principal's own submissions in their order of arrival.
  One tenant's many submissions therefore delay another tenant's first one by at most one
  check per slot, not by all of them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from coordinator.core.errors import ResourceExhaustedError

DEFAULT_SUBMITS_PER_PRINCIPAL = 4


class SubmitGate:
    def __init__(self, slots: int, per_principal: int = DEFAULT_SUBMITS_PER_PRINCIPAL) -> None:
        if slots < 1:
            raise ValueError("the program check needs at least one slot")
        if per_principal < 1:
            raise ValueError("the cap on submissions per principal must be at least 1")
        self.slots = slots
        self.per_principal = per_principal
        self._free = slots
        # principal -> its waiters, oldest first; the dict's order is the rotation's.
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._in_progress: dict[str, int] = {}

    # -- admission ---------------------------------------------------------------------------

    @contextmanager
    def admit(self, principal: str) -> Iterator[None]:
        """Around one whole submission of ``principal``'s: ResourceExhaustedError when it has
        `per_principal` in progress already."""
        held = self._in_progress.get(principal, 0)
        if held >= self.per_principal:
            who = f"tenant {principal}" if principal else "this tenant"
            raise ResourceExhaustedError(
                f"{who} has {held} job submissions in progress (waiting for or in the program "
                f"check), the most one tenant may have at once ({self.per_principal}): wait "
                "for one to be answered, then submit again"
            )
        self._in_progress[principal] = held + 1
        try:
            yield
        finally:
            self._in_progress[principal] -= 1
            if not self._in_progress[principal]:
                del self._in_progress[principal]

    def in_progress(self, principal: str) -> int:
        return self._in_progress.get(principal, 0)

    # -- check slots -------------------------------------------------------------------------

    def waiting(self, principal: str | None = None) -> int:
        """Submissions waiting for a slot (of ``principal``, or of everyone)."""
        if principal is not None:
            return len(self._waiting.get(principal, ()))
        return sum(len(q) for q in self._waiting.values())

    @property
    def busy(self) -> int:
        """Slots taken."""
        return self.slots - self._free

    @asynccontextmanager
    async def slot(self, principal: str) -> AsyncIterator[None]:
        """Hold one check slot; waiting, if all are taken, for ``principal``'s turn."""
        if self._free > 0 and not self._waiting:
            self._free -= 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(principal, deque()).append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._release()  # granted just as the wait was cancelled: pass it on
                else:
                    self._forget(principal, turn)
                raise
        try:
            yield
        finally:
            self._release()

    def _forget(self, principal: str, turn: asyncio.Future[None]) -> None:
        queue = self._waiting.get(principal)
        if queue is None:
            return
        try:
            queue.remove(turn)
        except ValueError:
            return
        if not queue:
            del self._waiting[principal]

    def _release(self) -> None:
        """A slot is free: the next principal in the rotation gets it, or it stays free."""
        while self._waiting:
            principal = next(iter(self._waiting))
            queue = self._waiting.pop(principal)
            turn = queue.popleft()
            if queue:
                self._waiting[principal] = queue  # to the back of the rotation
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1
