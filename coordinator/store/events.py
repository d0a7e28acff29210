"""The cluster event log: events are persisted in the store first, then announced to watchers.

Event kinds written by the control plane (attrs in brackets):
  coordinator.started [address, schema_version], coordinator.stopping,
  node.registered, node.rejoined, node.offline [reason], node.left [reason],
  node.cordoned, node.uncordoned, node.draining [by], node.busy, node.idle,
  node.benchmark [samples_per_second], blob.stored [sha256, size].
The training engine adds its own ("job.*", "round.*", ...) through `EventLog.append` or
`Store.append_event` (inside a store transaction if it likes: the event is announced only once
the transaction commits).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Collection, Mapping

from coordinator.store.base import Store, event_matches
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

DEFAULT_BUFFER_EVENTS = 10_000
READ_BATCH = 500


class EventLog:
    """Append events and watch them. Every committed event of the store (whoever appended
    it) reaches watchers, in id order, with no gaps."""

    def __init__(self, store: Store, buffer_events: int = DEFAULT_BUFFER_EVENTS) -> None:
        self._store = store
        self._buffer: deque[common_pb2.Event] = deque()
        self._buffer_max = buffer_events
        # The buffer holds every committed event with id > _floor.
        self._floor = 0
        self._last_id = 0
        self._waker = asyncio.Event()
        self._closed = False
        self._started = False
        store.add_event_listener(self._on_committed)

    async def start(self) -> None:
        self._last_id = self._floor = await self._store.last_event_id()
        self._started = True

    def close(self) -> None:
        """End every watch (followers return after the events already read)."""
        self._closed = True
        self._wake()

    @property
    def last_id(self) -> int:
        return self._last_id

    async def append(
        self,
        kind: str,
        *,
        node_id: str = "",
        job_id: str = "",
        message: str = "",
        attrs: Mapping[str, str] | None = None,
    ) -> common_pb2.Event:
        """Persist an event (joining the caller's store transaction if any); watchers see it once
        it is committed. Returns it with its id."""
        event = await self._store.append_event(
            kind, node_id=node_id, job_id=job_id, message=message, attrs=attrs
        )
        log.debug("event %d %s node=%s job=%s %s", event.id, kind, node_id, job_id, message)
        return event

    def _on_committed(self, event: common_pb2.Event) -> None:
        if event.id <= self._last_id and self._started:
            return  # already seen (cannot happen with one store; be safe)
        self._buffer.append(event)
        while len(self._buffer) > self._buffer_max:
            self._floor = self._buffer.popleft().id
        self._last_id = event.id
        self._wake()

    def _wake(self) -> None:
        waker, self._waker = self._waker, asyncio.Event()
        waker.set()

    async def _read_after(
        self, last: int, node_id: str, job_id: str, kinds: Collection[str]
    ) -> tuple[list[common_pb2.Event], int]:
        """Matching events after ``last`` (at most READ_BATCH) and the id up to which every
        event has been examined."""
        if self._started and last >= self._floor:
            newer = []
            for event in reversed(self._buffer):  # the unread tail is usually short
                if event.id <= last:
                    break
                newer.append(event)
            newer.reverse()
            out = []
            scanned = last
            for event in newer:
                scanned = event.id
                if event_matches(event, node_id, job_id, kinds):
                    out.append(event)
                    if len(out) >= READ_BATCH:
                        break
            return out, scanned
        # Every event with id <= announced was committed before the query starts.
        announced = self._last_id
        events = await self._store.list_events(
            last, node_id=node_id, job_id=job_id, kinds=kinds, limit=READ_BATCH
        )
        if len(events) < READ_BATCH:
            return events, max(last, announced, events[-1].id if events else 0)
        return events, events[-1].id

    async def watch(
        self,
        since_id: int = 0,
        *,
        node_id: str = "",
        job_id: str = "",
        kinds: Collection[str] = (),
        follow: bool = False,
    ) -> AsyncIterator[common_pb2.Event]:
        """Stored events with id > since_id matching the filters, oldest first; then, with
        ``follow``, new ones as they are committed, until `close` (or the consumer stops)."""
        last = since_id
        while not self._closed:
            waker = self._waker
            events, scanned = await self._read_after(last, node_id, job_id, kinds)
            for event in events:
                yield event
            last = max(last, scanned)
            if events and len(events) >= READ_BATCH:
                continue
            if last < self._last_id:
                continue
            if not follow:
                return
            await waker.wait()
