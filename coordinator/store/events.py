"""The cluster event log: events are persisted in the store first, then announced to watchers.

Event kinds written by the control plane (attrs in brackets):
  coordinator.started [address, schema_version], coordinator.stopping,
  node.registered, node.rejoined, node.offline [reason], node.left [reason],
  node.cordoned, node.uncordoned, node.draining [by, stop], node.busy, node.idle,
  node.benchmark [samples_per_second], blob.stored [sha256, size].
The training engine adds its own ("job.*", "round.*", ...) through `EventLog.append` or
`Store.append_event` (inside a store transaction if it likes: the event is announced only once
the transaction commits).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping

from coordinator.core.token_bucket import BucketLimit, TokenBuckets
from coordinator.store.base import Store, event_matches
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

DEFAULT_BUFFER_EVENTS = 10_000
READ_BATCH = 500


# The events one node can cause: NODE_EVENTS_BURST at once, NODE_EVENTS_PER_S after that; what
# is over is dropped and counted, and reported in one NODE_EVENTS_DROPPED event per node.
NODE_EVENTS_BURST = 120.0
NODE_EVENTS_PER_S = 2.0
NODE_EVENTS_DROPPED = "node.events_dropped"
# Events about a node that the node does not cause (the coordinator's verdicts, an operator's
# acts): never dropped.
UNLIMITED_KINDS = frozenset(
    {
        NODE_EVENTS_DROPPED,
        "node.quarantined",
        "node.strike",
        "node.pay_forfeited",
        "node.check_undecided",
        "node.cordoned",
        "node.uncordoned",
        "round.disputed",
    }
)


class EventLog:
    """Append events and watch them. Every committed event of the store (whoever appended
    it) reaches watchers, in id order, with no gaps.

    Events naming a node are rate-limited per node (a token bucket, NODE_EVENTS_BURST and
    NODE_EVENTS_PER_S; kinds in UNLIMITED_KINDS are not): what is over the limit is not
    stored, but counted (``dropped_total``) and reported in one ``node.events_dropped`` event
    when the node's next event is admitted, or by `report_drops`."""

    def __init__(
        self,
        store: Store,
        buffer_events: int = DEFAULT_BUFFER_EVENTS,
        *,
        node_limit: BucketLimit | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._limits = TokenBuckets(node_limit or BucketLimit(NODE_EVENTS_BURST, NODE_EVENTS_PER_S))
        self._clock = clock
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
        it is committed. Returns it with its id (0: over its node's rate limit, not stored)."""
        if node_id and kind not in UNLIMITED_KINDS:
            if not self._limits.take(node_id, self._clock()):
                return common_pb2.Event(kind=kind, node_id=node_id, job_id=job_id, message=message)
            await self._report_drops(node_id)
        event = await self._store.append_event(
            kind, node_id=node_id, job_id=job_id, message=message, attrs=attrs
        )
        log.debug("event %d %s node=%s job=%s %s", event.id, kind, node_id, job_id, message)
        return event

    @property
    def dropped_total(self) -> int:
        """Events dropped for their node's rate limit since the start."""
        return self._limits.dropped_total

    async def report_drops(self) -> int:
        """One ``node.events_dropped`` event for each node with drops not reported yet; how
        many events it reports (call it now and then: a node whose events stop is reported
        too)."""
        total = 0
        for node_id in self._limits.pending():
            total += await self._report_drops(node_id)
        self._limits.forget_idle(self._clock())
        return total

    async def _report_drops(self, node_id: str) -> int:
        dropped = self._limits.take_dropped(node_id)
        if dropped:
            limit = self._limits.limit
            await self.append(
                NODE_EVENTS_DROPPED,
                node_id=node_id,
                message=f"{dropped} events of this node were dropped: over its limit of "
                f"{limit.per_second:g} events/s (bursts of {limit.burst:g})",
                attrs={"dropped": str(dropped)},
            )
        return dropped

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
