"""The agent's link to the coordinator: channel, retries, registration, lease and heartbeats.

Rules:
- No network error ever ends the agent. Calls that fail with a transient status (UNAVAILABLE,
  DEADLINE_EXCEEDED, ...) are retried with exponential backoff and full jitter: the n-th retry
  waits a uniformly random time in [0, min(5 s, 0.2 s * 2**n)]; a success resets it.
  Registration, the first call and the one that finds a coordinator that may be gone for long,
  backs off further: 1 s doubling to 60 s (node_agent/link/backoff.py), waking early when the
  channel connects again. The first failure is a warning that says what is retried and when;
  later ones are debug lines, with a reminder warning every 10 minutes while it lasts.
- The lease: Register returns a lease; the heartbeat task renews it every heartbeat interval.
  A call answered FAILED_PRECONDITION (lease expired) -- or NOT_FOUND for a heartbeat (unknown
  lease or node) -- makes the agent register again with the same node id, then retry.
- The node id that the coordinator assigned is persisted in DATA_DIR/node.json.
- TLS: the channel trusts only the coordinator's CA and every call carries the node's
  certificate (epochmesh.identity.CertificateAuth) from DATA_DIR (node_agent/core/identity.py);
  plaintext only after ``--insecure``.
- Calls wait for the connection (wait_for_ready) up to their timeout rather than failing at
  once, and gRPC's own reconnect backoff is capped at 1 s, so an agent notices a restarted
  coordinator within about a second. Leave and the final draining heartbeat do not wait: an
  agent told to stop exits promptly even when the coordinator is gone.
- Several addresses (``--coordinator a:7070,b:7070``: an active coordinator and standbys on one
  database): the agent talks to one; a failed call makes it ask every address's health
  (epochmesh.coordinators) and move to the one that serves. A round in flight at a takeover
  fails and is retried like a round after a coordinator restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from epochmesh.coordinators import find_active_async
from epochmesh.grpc_util import CHANNEL_OPTIONS
from epochmesh.identity import (
    Identity,
    auth_interceptors,
    channel_credentials,
    coordinator_channel_options,
    secure_aio_channel,
)
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from node_agent.core.identity import load_node_id, save_node_id, transport_identity
from node_agent.core.measure import bandwidth_bytes_per_second
from node_agent.link.backoff import RetrySchedule, UnreachableReport

log = logging.getLogger(__name__)

Resp = TypeVar("Resp")

BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0

# Statuses that say "the coordinator is not reachable right now", not "your request is wrong".
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)
# Statuses that may mean the lease is gone (a heartbeat tells): register again. NOT_FOUND: the
# coordinator does not know the node (one that never saw it, after a move between addresses).
LEASE_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})
HEARTBEAT_LEASE_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})

# gRPC reconnects by itself, with its own backoff (default: up to 120 s). Calls wait for the
# connection (wait_for_ready), so this bound is how late the agent notices a coordinator that
# is back: keep it short.
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
REGISTER_TIMEOUT_S = 5.0

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
# A call that keeps hitting a lost lease after this many renewals gives up.
MAX_RENEWALS_PER_CALL = 3
# With several coordinator addresses: how often, at most, failed calls make the agent ask every
# address's health to find the serving (active) coordinator.
SEARCH_EVERY_S = 1.0
# How long a channel left behind by such a move keeps its calls in flight before it is closed.
MOVED_CHANNEL_GRACE_S = 120.0


class Backoff:
    """Exponential backoff with full jitter: delay n is uniform in [0, min(cap, base * 2**n)]."""

    def __init__(
        self,
        base: float = BACKOFF_BASE_S,
        cap: float = BACKOFF_CAP_S,
        rng: random.Random | None = None,
    ) -> None:
        if base <= 0 or cap < base:
            raise ValueError(f"backoff needs 0 < base <= cap, got base={base} cap={cap}")
        self.base = base
        self.cap = cap
        self.attempts = 0
        self._rng = rng or random.Random()

    def ceiling(self) -> float:
        """Upper bound of the next delay."""
        return min(self.cap, self.base * (2.0 ** min(self.attempts, 62)))

    def next_delay(self) -> float:
        delay = self._rng.uniform(0.0, self.ceiling())
        self.attempts += 1
        return delay

    def reset(self) -> None:
        self.attempts = 0


class Stopped(Exception):
    """The agent is shutting down; the call was abandoned."""


class Expired(Exception):
    """A call kept failing until its deadline passed."""


class Refused(Exception):
    """The coordinator does not accept this agent's certificate (revoked, expired, or from
    another CA): no retry can help; the agent must be enrolled again."""


class _LeaseUnknown(ConnectionError):
    """A lease refusal that could not be checked (the coordinator is unreachable)."""

    def __init__(self, cause: grpc.aio.AioRpcError) -> None:
        super().__init__(describe(cause))
        self.cause = cause


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in TRANSIENT_CODES
    return isinstance(exc, ConnectionError | TimeoutError)


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def open_channel(
    address: str,
    identity: Identity | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """The agent's channel: the shared options plus a short reconnect backoff; TLS with the
    node's certificate when ``identity`` is given, else plaintext (--insecure).
    ``interceptors`` (the metrics' byte counters) come after the authentication's."""
    if identity is None:
        return grpc.aio.insecure_channel(
            address,
            options=[*CHANNEL_OPTIONS, *RECONNECT_OPTIONS],
            interceptors=list(interceptors) or None,
        )
    # The signed call metadata is added by client interceptors on the event loop (grpc's
    # call-credentials plugin would start a Python thread for every call).
    if not interceptors:
        return secure_aio_channel(address, identity, RECONNECT_OPTIONS)
    return grpc.aio.secure_channel(
        address,
        channel_credentials(identity.ca_pem),
        options=[*coordinator_channel_options(), *RECONNECT_OPTIONS],
        interceptors=[*auth_interceptors(identity), *interceptors],
    )


class _Moved(Exception):
    """A call's channel moved to another coordinator before it answered."""


@dataclass
class HeartbeatHooks:
    """How the heartbeat task talks to the rest of the agent."""

    current_task_id: Callable[[], str]
    draining: Callable[[], bool]
    on_state: Callable[[int], None]  # NodeState the coordinator reports
    on_cancel_task: Callable[[str], None]  # task id the coordinator wants abandoned
    # Whether an operator asks this node to leave (drain --stop: finish the task, Leave, exit),
    # after every heartbeat the coordinator answers (False: not, or no longer).
    on_leave_request: Callable[[bool], None] = lambda wanted: None


class CoordinatorConnection:
    """Channel, session (node id + lease) and retrying calls to the coordinator's AgentService."""

    def __init__(
        self,
        address: str | Sequence[str],
        data_dir: Path,
        make_register_request: Callable[[], agent_pb2.RegisterRequest],
        *,
        stop: asyncio.Event | None = None,
        on_registered: Callable[[], Coroutine[Any, Any, None]] | None = None,
        on_refused: Callable[[str], None] | None = None,
        price: Callable[[], int] = lambda: 0,
        backoff_base: float = BACKOFF_BASE_S,
        backoff_cap: float = BACKOFF_CAP_S,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        insecure: bool = False,
    ) -> None:
        # Several addresses: an active coordinator and its standbys. The agent talks to one
        # (`address`) and, when calls to it fail, asks every address's health and moves to the
        # one that serves (`_follow_active`).
        self.addresses = (address,) if isinstance(address, str) else tuple(address)
        self.address = self.addresses[0]
        self.data_dir = data_dir
        # --insecure: plaintext to the coordinator, and to peers, without a certificate.
        self.insecure = insecure
        self._make_register_request = make_register_request
        self._stop = stop or asyncio.Event()
        self._on_registered = on_registered
        self._on_refused = on_refused
        # The price in force (micro-credits per hour), sent with every heartbeat: the
        # coordinator takes each heartbeat's price as the node's price now.
        self._price = price
        self.refused = ""  # why the coordinator refuses this agent's certificate, once it does
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._identity = transport_identity(data_dir, insecure)
        self._interceptors = tuple(interceptors)
        self._channel = open_channel(self.address, self._identity, self._interceptors)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._last_search = -math.inf
        self._moved = asyncio.Event()  # set (and replaced) when the channel moves
        self.node_id = load_node_id(data_dir)
        self.lease_id = ""
        self.lease_ttl_s = 0.0
        self.heartbeat_interval_s = DEFAULT_HEARTBEAT_INTERVAL_S
        self.registrations = 0
        self._register_lock = asyncio.Lock()
        self._reachable = True
        self._unreachable = UnreachableReport()
        # The heartbeat loop's wake-up (set while it runs): the first call to succeed after the
        # coordinator was unreachable sends a heartbeat at once, so that a lease carried across
        # a coordinator restart is renewed as soon as the agent reaches it again.
        self._heartbeat_wake: asyncio.Event | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- basics ---------------------------------------------------------------------------------

    @property
    def stub(self) -> agent_pb2_grpc.AgentServiceStub:
        return self._stub

    @property
    def registered(self) -> bool:
        return bool(self.lease_id)

    @property
    def reachable(self) -> bool:
        """False from a call's transient failure until a call gets through again."""
        return self._reachable

    def new_backoff(self) -> Backoff:
        return Backoff(self._backoff_base, self._backoff_cap)

    def heartbeat_request(
        self, lease_id: str, task_id: str = "", draining: bool = False
    ) -> agent_pb2.HeartbeatRequest:
        return agent_pb2.HeartbeatRequest(
            node_id=self.node_id,
            lease_id=lease_id,
            task_id=task_id,
            draining=draining,
            price_micro_per_hour=self._price(),
        )

    def _refuse(self, exc: grpc.aio.AioRpcError) -> Refused:
        """The coordinator answered UNAUTHENTICATED: note it (once) and say so."""
        if not self.refused:
            self.refused = describe(exc)
            if self._on_refused is not None:
                self._on_refused(self.refused)
        return Refused(self.refused)

    async def _follow_active(self) -> None:
        """After a failed call with several addresses: ask each one's health (at most once per
        `SEARCH_EVERY_S`) and move the channel to the serving one if it is another."""
        now = time.monotonic()
        if len(self.addresses) < 2 or now - self._last_search < SEARCH_EVERY_S:
            return
        self._last_search = now
        active, probes = await find_active_async(
            self.addresses, lambda a: open_channel(a, self._identity)
        )
        if active is None:
            log.debug("no serving coordinator: %s", "; ".join(p.describe() for p in probes))
            return
        if active == self.address:
            return
        log.warning("coordinator moved: %s serves now (was %s)", active, self.address)
        old = self._channel
        self._moved.set()
        self._moved = asyncio.Event()
        self.address = active
        self._channel = open_channel(active, self._identity, self._interceptors)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)  # type: ignore[no-untyped-call]
        # Calls in flight on the old channel end by themselves (their deadlines; a standby or a
        # dead address fails them) and are retried here; closing it without a grace would
        # cancel them, which their callers would take for their own cancellation.
        task = asyncio.create_task(old.close(grace=MOVED_CHANNEL_GRACE_S))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._channel.close(grace=None)

    async def _sleep_or_stop(self, seconds: float) -> None:
        """Sleep, but raise Stopped as soon as the agent stops."""
        if self._stop.is_set():
            raise Stopped()
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except TimeoutError:
            return
        raise Stopped()

    async def _wait_for_coordinator(self, seconds: float) -> None:
        """Sleep like `_sleep_or_stop`, but wake as soon as the channel connects (gRPC retries
        the connection by itself every second at most), unless it was connected already."""
        if self._channel.get_state() == grpc.ChannelConnectivity.READY:
            await self._sleep_or_stop(seconds)
            return
        if self._stop.is_set():
            raise Stopped()
        ready = asyncio.ensure_future(self._channel.channel_ready())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({ready, stop}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            stop.cancel()
        if self._stop.is_set():
            raise Stopped()

    def _note_failure(self, what: str, exc: BaseException, delay: float) -> None:
        """A call found no coordinator; `delay`: seconds until it is tried again."""
        first = self._reachable
        self._reachable = False
        now = time.monotonic()
        if self._unreachable.failed(now):
            if first:
                log.warning(
                    "coordinator %s unreachable (%s: %s); retrying in %.1f s with backoff "
                    "(said again every %.0f min while it lasts)",
                    self.address,
                    what,
                    describe(exc),
                    delay,
                    self._unreachable.remind_every_s / 60,
                )
            else:
                log.warning(
                    "coordinator %s still unreachable after %d failed calls over %.0f s (%s: "
                    "%s); next attempt in %.1f s",
                    self.address,
                    self._unreachable.failures,
                    self._unreachable.down_for(now),
                    what,
                    describe(exc),
                    delay,
                )
        else:
            log.debug("%s failed again (%s); next attempt in %.1f s", what, describe(exc), delay)

    def _note_success(self, heartbeat: bool = False) -> None:
        if not self._reachable:
            log.info("coordinator %s reachable again", self.address)
            self._reachable = True
            self._unreachable.succeeded()
            if not heartbeat and self._heartbeat_wake is not None:
                self._heartbeat_wake.set()

    # -- registration ---------------------------------------------------------------------------

    async def register(self) -> None:
        """Register (with the persisted node id, if any), retrying until it succeeds.

        Raises Stopped if the agent stops first.
        """
        async with self._register_lock:
            await self._register_locked()

    async def _register_locked(self) -> None:
        backoff = self.new_backoff()
        schedule = RetrySchedule()
        while True:
            request = self._make_register_request()
            request.node_id = self.node_id
            try:
                response = await self._stub.Register(
                    request, timeout=REGISTER_TIMEOUT_S, wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                if is_transient(exc):
                    delay = schedule.next_delay()
                    self._note_failure("Register", exc, delay)
                    await self._follow_active()
                    await self._wait_for_coordinator(delay)
                    continue
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise self._refuse(exc) from None
                if self.node_id and exc.code() in (
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.INVALID_ARGUMENT,
                ):
                    log.warning(
                        "coordinator refused node id %s (%s); registering as a new node",
                        self.node_id,
                        describe(exc),
                    )
                    self.node_id = ""
                    continue
                log.error("registration refused: %s; retrying", describe(exc))
                await self._sleep_or_stop(max(1.0, backoff.next_delay()))
                continue
            self._note_success()
            break
        if response.node_id != self.node_id:
            save_node_id(self.data_dir, response.node_id)
        self.node_id = response.node_id
        self.lease_id = response.lease_id
        self.lease_ttl_s = response.lease_ttl_ms / 1000.0
        if response.heartbeat_interval_ms > 0:
            self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000.0
        elif self.lease_ttl_s > 0:
            self.heartbeat_interval_s = self.lease_ttl_s / 3.0
        self.registrations += 1
        log.info(
            "registered as node %s (lease %s, ttl %.1fs, heartbeat every %.1fs)",
            self.node_id,
            self.lease_id,
            self.lease_ttl_s,
            self.heartbeat_interval_s,
        )
        if self._on_registered is not None:
            task = asyncio.create_task(self._on_registered())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def renew_lease(self, stale_lease_id: str) -> None:
        """Register again, unless someone already did since `stale_lease_id` was seen."""
        async with self._register_lock:
            if self.lease_id != stale_lease_id:
                return
            log.warning("lease %s lost; registering again as node %s", stale_lease_id, self.node_id)
            await self._register_locked()

    # -- calls ----------------------------------------------------------------------------------

    async def call(
        self,
        method: str,
        make_request: Callable[[], Any],
        *,
        timeout: float = 10.0,
        deadline: float | None = None,
        lease_codes: frozenset[grpc.StatusCode] = LEASE_CODES,
    ) -> Any:
        """Call a unary AgentService method, retrying transient failures with backoff.

        `make_request()` is called for every attempt, so a request built from `self.node_id` /
        `self.lease_id` picks up a renewed lease. A status in `lease_codes` may mean that the
        lease is gone, or something else (FAILED_PRECONDITION is also a plain domain error): a
        heartbeat tells which; a lost lease is renewed and the call retried, any other cause is
        raised. `deadline` (time.monotonic()) bounds the retries: past it, Expired is raised.
        Raises Stopped when the agent stops; other statuses raise grpc.aio.AioRpcError.
        """
        backoff = self.new_backoff()
        renewals = 0
        while True:
            if self._stop.is_set():
                raise Stopped()
            rpc = getattr(self._stub, method)  # the channel may have moved to another address
            lease = self.lease_id
            attempt_timeout = timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Expired(f"{method}: deadline passed")
                attempt_timeout = min(timeout, max(left, 0.05))
            try:
                response = await self._attempt(
                    rpc(make_request(), timeout=attempt_timeout, wait_for_ready=True)
                )
            except _Moved:
                continue  # the channel moved to the serving coordinator: ask it at once
            except grpc.aio.AioRpcError as exc:
                if exc.code() in lease_codes and renewals < MAX_RENEWALS_PER_CALL:
                    valid = await self._lease_is_valid(lease)
                    if valid is False:
                        renewals += 1
                        await self.renew_lease(lease)
                        continue
                    if valid is True:
                        raise  # the lease is fine: the refusal has another cause
                    exc = _LeaseUnknown(exc)  # cannot tell now: retry like a network error
                if not is_transient(exc):
                    raise
                delay = backoff.next_delay()
                self._note_failure(method, exc, delay)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise Expired(f"{method}: {describe(exc)}") from exc
                await self._follow_active()
                await self._sleep_or_stop(delay)
                continue
            self._note_success()
            return response

    async def _attempt(self, call: Any) -> Any:
        """Awaits one unary call; raises _Moved (the call cancelled) when the channel moves to
        another coordinator first, so that a call waiting on a dead or standby address does
        not hold its caller until its deadline."""
        moved = self._moved
        attempt = asyncio.ensure_future(call)
        mover = asyncio.ensure_future(moved.wait())
        try:
            await asyncio.wait({attempt, mover}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            attempt.cancel()
            raise
        finally:
            mover.cancel()
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await attempt
            raise _Moved()
        return attempt.result()

    async def _lease_is_valid(self, lease_id: str) -> bool | None:
        """Whether `lease_id` is still alive (one Heartbeat); None when that cannot be told."""
        if lease_id != self.lease_id:
            return True  # renewed meanwhile
        try:
            await self._stub.Heartbeat(
                self.heartbeat_request(lease_id),
                timeout=5.0,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in HEARTBEAT_LEASE_CODES:
                return False
            return None
        return True

    async def fetch_stream(
        self, sha256: str, offset: int
    ) -> AsyncIterator[agent_pb2.FetchBlobResponse]:
        """FetchBlob from `offset` (no retries here: the cache resumes, the caller retries)."""
        call = self._stub.FetchBlob(
            agent_pb2.FetchBlobRequest(sha256=sha256, offset=offset), wait_for_ready=True
        )
        async for response in call:
            yield response

    # -- heartbeats -----------------------------------------------------------------------------

    async def heartbeat_loop(self, hooks: HeartbeatHooks, wake: asyncio.Event) -> None:
        """Renew the lease every heartbeat interval until the agent stops (or the loop is
        cancelled). `wake` sends one at once.

        The stop ends the loop on its own, not only a cancellation: a cancellation can be
        lost, when it arrives as the wake-up is already in (Python 3.11's `asyncio.wait_for`
        then returns) or as the heartbeat's call finishes (gRPC's unary call catches the
        cancellation and raises an RpcError instead); a loop that only a cancellation ends
        would then beat for ever, and an agent told to leave would never get past waiting
        for it."""
        self._heartbeat_wake = wake
        backoff = self.new_backoff()
        delay = 0.0
        while not self._stop.is_set():
            await self._wait_wake_or_stop(wake, delay)
            if self._stop.is_set():
                return
            wake.clear()
            try:
                delay = await self._heartbeat_once(hooks, backoff)
            except (Stopped, Refused):
                return
            except Exception:  # a bug here must not silently end the lease
                log.exception("heartbeat failed unexpectedly")
                delay = self.heartbeat_interval_s

    async def _wait_wake_or_stop(self, wake: asyncio.Event, seconds: float) -> None:
        """Wait until `wake` or the stop is set, or `seconds` have passed."""
        if wake.is_set() or seconds <= 0:
            return
        waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(self._stop.wait())}
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _heartbeat_once(self, hooks: HeartbeatHooks, backoff: Backoff) -> float:
        """One heartbeat; returns the delay until the next one."""
        lease = self.lease_id
        request = self.heartbeat_request(lease, hooks.current_task_id(), hooks.draining())
        try:
            response = await self._stub.Heartbeat(
                request, timeout=max(1.0, self.heartbeat_interval_s), wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in HEARTBEAT_LEASE_CODES:
                await self.renew_lease(lease)
                backoff.reset()
                return 0.0 if hooks.draining() else self.heartbeat_interval_s
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise self._refuse(exc) from None
            delay = min(backoff.next_delay(), max(self.heartbeat_interval_s, 0.2))
            if is_transient(exc):
                self._note_failure("Heartbeat", exc, delay)
                await self._follow_active()
            else:
                log.error("heartbeat refused: %s", describe(exc))
            return delay
        self._note_success(heartbeat=True)
        backoff.reset()
        if response.heartbeat_interval_ms > 0:
            self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000.0
        if response.lease_ttl_ms > 0:
            self.lease_ttl_s = response.lease_ttl_ms / 1000.0
        hooks.on_state(response.state)
        if response.cancel_task and request.task_id:
            hooks.on_cancel_task(request.task_id)
        hooks.on_leave_request(response.leave)
        return self.heartbeat_interval_s

    async def leave(self, reason: str, timeout: float = 2.0) -> bool:
        """Tell the coordinator the node leaves; best effort, one attempt."""
        if not self.lease_id:
            return False
        try:
            await self._stub.Leave(
                agent_pb2.LeaveRequest(node_id=self.node_id, lease_id=self.lease_id, reason=reason),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not tell the coordinator that this node leaves: %s", describe(exc))
            return False
        log.info("left the coordinator (%s)", reason)
        return True

    async def send_draining(self, task_id: str, timeout: float = 2.0) -> None:
        """One Heartbeat(draining=True), best effort."""
        if not self.lease_id:
            return
        try:
            await self._stub.Heartbeat(
                self.heartbeat_request(self.lease_id, task_id, draining=True),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("draining heartbeat failed: %s", describe(exc))

    # -- network measurement --------------------------------------------------------------------

    async def measure_rtt_ms(self, samples: int = 5, timeout: float = 5.0) -> float:
        """Median round-trip time of an empty Probe, in milliseconds."""
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await self._stub.Probe(agent_pb2.ProbeRequest(), timeout=timeout)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000.0

    async def measure_bandwidth(
        self, rtt_ms: float, rounds: int = 3, size: int = MAX_CHUNK_BYTES, timeout: float = 20.0
    ) -> float:
        """Bytes/s to and from the coordinator: the slower of uploads (1 MiB payload) and
        downloads (1 MiB response), each the median of `rounds` probes, less one RTT."""
        payload = b"\0" * size
        figures = []
        for request in (
            agent_pb2.ProbeRequest(payload=payload, response_bytes=0),
            agent_pb2.ProbeRequest(response_bytes=size),
        ):
            times = []
            moved = 0
            for _ in range(rounds):
                t0 = time.perf_counter()
                response = await self._stub.Probe(request, timeout=timeout)
                times.append(time.perf_counter() - t0)
                moved = len(request.payload) + len(response.payload)
            figures.append(bandwidth_bytes_per_second(moved, times, rtt_ms / 1000.0))
        return min(figures)

    async def measure_network(self) -> tuple[float, float]:
        """(rtt_ms, bandwidth bytes/s); zeros when the coordinator cannot be probed."""
        try:
            rtt_ms = await self.measure_rtt_ms()
            bandwidth = await self.measure_bandwidth(rtt_ms)
        except grpc.aio.AioRpcError as exc:
            log.warning("network probe failed (%s); reporting no RTT/bandwidth", describe(exc))
            return 0.0, 0.0
        log.info(
            "network to coordinator: rtt %.2f ms, bandwidth %.1f MB/s", rtt_ms, bandwidth / 1e6
        )
        return rtt_ms, bandwidth


def device_summary(device: common_pb2.Device) -> str:
    if device.kind == "cuda":
        return (
            f"cuda:{device.index} {device.name} ({device.total_memory_bytes / 2**30:.1f} GiB, "
            f"sm {device.compute_capability}, {device.driver})"
        )
    return f"cpu {device.name} ({device.cores} cores, {device.total_memory_bytes / 2**30:.1f} GiB)"
