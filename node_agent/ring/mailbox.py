"""Where ring chunks arriving at this node go: the receive slots by attempt, and state snapshots.

`RingMailbox` routes each PushChunks or bulk stream to the `RingReceiver` that
`node_agent.ring.allreduce` registered for its (job, round, attempt), holds streams that arrive
before their slot, and remembers aborts and failures for a while; `StateSnapshot` with its
provider and authorizer callbacks is what ``TransferState`` serves.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from node_agent.ring.wire import RingChunkView, RingKey

# ---------------------------------------------------------------------------------------------
# Receive routing


class ChunkRejected(Exception):
    """A data chunk that does not fit the receive slot; `code` is the gRPC status to answer,
    `failed_node` the node the refusal names as failed (None: the chunk's sender)."""

    failed_node: str | None = None

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RingReceiver(Protocol):
    """What the mailbox routes a PushChunks stream to (see node_agent.ring.allreduce)."""

    key: RingKey
    left_node_id: str
    members: frozenset[str]
    attached: bool

    def on_chunk(self, chunk: RingChunkView) -> None:
        """Apply one data chunk; ChunkRejected if it is not the expected one."""

    def on_abort(self, failed_node_id: str, reporter: str) -> None:
        """A member reports that `failed_node_id` failed in this attempt."""

    def on_stream_end(self, reason: str) -> None:
        """The left neighbour's stream ended: done if every chunk arrived, else a failure of the
        left neighbour for `reason` (ignored once the attempt has failed)."""

    def failed_node(self) -> str | None:
        """The failed node once this attempt has failed, else None."""

    def starved_s(self) -> float:
        """Seconds this node has been waiting for the left neighbour's data (0 if it is not)."""

    def bulk_target(self, chunk: RingChunkView, nbytes: int, scratch: memoryview) -> memoryview:
        """Check the header of the next chunk (`chunk`, payload not read yet, `nbytes` long;
        ChunkRejected as `on_chunk`) and say where to receive its payload: straight into the
        destination where it is only copied, else `scratch` (or a buffer of its own when the
        receiver keeps it). Then `bulk_received` with that view."""

    def bulk_received(self, payload: memoryview) -> None:
        """The payload of the chunk `bulk_target` was asked about arrived in its target."""

    @property
    def complete(self) -> bool:
        """Every expected chunk has arrived."""


@dataclass(frozen=True)
class RingStatus:
    """A node's state in one ring attempt, as its Ping answers it (`ring_status`)."""

    known: bool  # the attempt is running here, or failed here recently
    starved_s: float  # waiting that long for its own left neighbour's data (0: not waiting)
    failed_node_id: str  # the node the attempt found failed ("" while it has not failed)


@dataclass(frozen=True)
class Announcement:
    """An attempt this node takes part in: its members and this node's left neighbour."""

    members: frozenset[str]
    left_node_id: str
    expires: float  # time.monotonic()


class AttemptExpired(Exception):
    """The (job, round, attempt) is over on this node (finished, failed or superseded)."""


class RingMailbox:
    """Receive slots of this node by (job, round, attempt), and what arrives before them.

    One slot per job at a time: registering one replaces the job's previous slot, and its
    (round, attempt) becomes the job's current one (also when it is lower, e.g. after the
    coordinator rolled the job back to a checkpoint). A stream for a (round, attempt) at or
    below the current one without a slot is over (`AttemptExpired`); a higher one may wait
    for its slot. Aborts for attempts without a slot yet are remembered (a bounded number)
    and fail the slot as soon as it registers.
    """

    def __init__(
        self, *, max_pending_aborts: int = 256, max_jobs: int = 1024, max_announced: int = 256
    ) -> None:
        self._slots: dict[RingKey, RingReceiver] = {}
        self._current: OrderedDict[str, tuple[int, int]] = OrderedDict()  # job -> (round, att.)
        self._aborts: OrderedDict[RingKey, tuple[str, str]] = OrderedDict()
        # Attempts the coordinator announced to this node (ring tasks it received), by key.
        self._announced: OrderedDict[RingKey, Announcement] = OrderedDict()
        self._max_announced = max_announced
        # Failed node of attempts whose slot closed after a failure, for neighbours that ask.
        self._failed: OrderedDict[RingKey, str] = OrderedDict()
        self._changed = asyncio.Event()
        self._max_pending_aborts = max_pending_aborts
        self._max_jobs = max_jobs

    def is_expired(self, key: RingKey) -> bool:
        job_id, round_, attempt = key
        current = self._current.get(job_id)
        return current is not None and key not in self._slots and (round_, attempt) <= current

    def announce(self, key: RingKey, node_ids: Sequence[str], rank: int, ttl_s: float) -> None:
        """The coordinator gave this node a task of attempt `key` (ring `node_ids`, this node
        at `rank`): its left neighbour may connect, and its members may report failures, from
        now until the slot closes (or `ttl_s` passes without one)."""
        n = len(node_ids)
        if n < 1 or not 0 <= rank < n or self.is_expired(key):
            return
        now = time.monotonic()
        for k in [k for k, a in self._announced.items() if a.expires <= now]:
            del self._announced[k]
        self._announced[key] = Announcement(
            frozenset(node_ids), node_ids[(rank - 1) % n], now + max(ttl_s, 1.0)
        )
        self._announced.move_to_end(key)
        while len(self._announced) > self._max_announced:
            self._announced.popitem(last=False)
        self._notify()

    def attempt(self, key: RingKey) -> Announcement | None:
        """Members and left neighbour of an open attempt (its slot is registered, or it was
        announced and is not over); None otherwise."""
        receiver = self._slots.get(key)
        if receiver is not None:
            return Announcement(receiver.members, receiver.left_node_id, math.inf)
        if self.is_expired(key):
            return None
        ann = self._announced.get(key)
        if ann is None or ann.expires <= time.monotonic():
            return None
        return ann

    async def wait_open(self, key: RingKey, timeout: float) -> Announcement | None:
        """`attempt(key)` once it is open (None after `timeout` s); AttemptExpired if over."""
        deadline = time.monotonic() + timeout
        while True:
            ann = self.attempt(key)
            if ann is not None:
                return ann
            if self.is_expired(key):
                raise AttemptExpired(f"ring attempt {key} is over on this node")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return None

    def register(self, receiver: RingReceiver) -> None:
        """Open the slot (replacing the job's previous one) and apply a pending abort."""
        job_id, round_, attempt = receiver.key
        for key in [k for k in self._slots if k[0] == job_id]:
            self.unregister(self._slots[key])
        self._current[job_id] = (round_, attempt)
        self._current.move_to_end(job_id)
        while len(self._current) > self._max_jobs:
            self._current.popitem(last=False)
        self._slots[receiver.key] = receiver
        pending = self._aborts.pop(receiver.key, None)
        if pending is not None:
            receiver.on_abort(*pending)
        self._notify()

    def unregister(self, receiver: RingReceiver) -> None:
        if self._slots.get(receiver.key) is receiver:
            del self._slots[receiver.key]
            self._announced.pop(receiver.key, None)
            failed = receiver.failed_node()
            if failed is not None:
                self._failed[receiver.key] = failed
                while len(self._failed) > self._max_pending_aborts:
                    self._failed.popitem(last=False)
            self._notify()

    def status(self, key: RingKey) -> RingStatus:
        """What this node knows of attempt `key`: for a neighbour deciding whom to blame."""
        receiver = self._slots.get(key)
        if receiver is not None:
            return RingStatus(True, receiver.starved_s(), receiver.failed_node() or "")
        failed = self._failed.get(key)
        if failed is not None:
            return RingStatus(True, 0.0, failed)
        return RingStatus(False, 0.0, "")

    def get(self, key: RingKey) -> RingReceiver | None:
        return self._slots.get(key)

    def abort(self, key: RingKey, failed_node_id: str, reporter: str) -> None:
        """Route an abort report to its slot, or remember it until the slot registers. Only
        for an open attempt (`attempt`; the caller checked that the reporter and the failed
        node are members): a report for any other attempt is dropped."""
        receiver = self._slots.get(key)
        if receiver is not None:
            receiver.on_abort(failed_node_id, reporter)
            return
        if self.attempt(key) is None:
            return
        self._aborts[key] = (failed_node_id, reporter)
        while len(self._aborts) > self._max_pending_aborts:
            self._aborts.popitem(last=False)

    async def wait_for(self, key: RingKey, timeout: float) -> RingReceiver | None:
        """The slot for `key` once registered (None after `timeout` s); AttemptExpired."""
        deadline = time.monotonic() + timeout
        while True:
            receiver = self._slots.get(key)
            if receiver is not None:
                return receiver
            if self.is_expired(key):
                raise AttemptExpired(f"ring attempt {key} is over on this node")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                return None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


# ---------------------------------------------------------------------------------------------
# State transfer


@dataclass(frozen=True)
class StateSnapshot:
    """Parameters and optimizer state of a job at `version`, in a fixed name order."""

    version: int
    tensors: Mapping[str, torch.Tensor]


# (job_id, min_version) -> the newest snapshot, or None when this node has no state of the job.
StateProvider = Callable[[str, int], Awaitable[StateSnapshot | None]]
# (job id, requesting node id) -> None when that node may have the job's state, else why not.
StateAuthorizer = Callable[[str, str], Awaitable[str | None]]
