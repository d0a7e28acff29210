"""The node registry: leases, node states and operator actions.

Leases live in memory (monotonic clock). Heartbeats only touch memory; their times are written
to the store in batches every ``flush_interval_s``. Every state change is written at once,
together with its event, in one store transaction. The parts counted per round (`count_parts`)
only touch memory too: they are stored with the node's next write.

States (common.proto NodeState):
  ONLINE      leased, idle, eligible for work (after Register; Uncordon)
  BUSY        leased, working for a job (set by the engine through `set_busy`)
  DRAINING    finishes its current round, then gets no new work. After an operator's Drain
              its agent stays up and idle, heartbeating, until Uncordon (drained = up and
              idle, as in Slurm and Kubernetes); after a heartbeat with draining=True the
              agent is stopping on its own (SIGTERM) and Leaves
  CORDONED    leased but no new work (operator Cordon; Uncordon undoes it)
  OFFLINE     lease lapsed (the sweeper) or the node left; it must Register again
  QUARANTINED leased but excluded (set by a later issue)
CORDONED and QUARANTINED survive a re-registration; a draining node that registers again is
ONLINE. A cordoned or draining node may still carry ``current_job_id`` (it finishes its round).

Leaving is separate from draining and explicit: an operator's Drain with ``stop`` also asks the
agent to leave. The request lives in memory with the lease and is answered in every heartbeat
(`leave_requested`, HeartbeatResponse.leave) until the agent finishes its task and Leaves; it
ends with the lease (Leave, expiry, a re-registration) or with Uncordon, and a coordinator
restart forgets it (the node stays drained). It is no reason to keep anything: an agent that is
gone is simply gone.

A node earns for its donor: the one its join token named (the store's node_donors), else the
node itself. The registry reads it at load and at register and shows it as the label
``donor`` (set by the coordinator, never by the agent).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.core.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from coordinator.core.ids import new_node_id
from coordinator.store.base import HeartbeatUpdate, NodeRecord, Store
from coordinator.store.events import EventLog
from coordinator.verification.reputation import (
    ReputationRecord,
    check_probability,
    check_reason,
    record_failed,
    record_verified,
)
from epochmesh.money import MAX_CREDITS, MICRO, format_credits
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

NS = common_pb2.NodeState
ONLINE = NS.NODE_STATE_ONLINE
BUSY = NS.NODE_STATE_BUSY
DRAINING = NS.NODE_STATE_DRAINING
CORDONED = NS.NODE_STATE_CORDONED
OFFLINE = NS.NODE_STATE_OFFLINE
QUARANTINED = NS.NODE_STATE_QUARANTINED

DONOR_LABEL = "donor"
LEASE_EXPIRED = "lease expired: register again"
# Refused updates a node may send before it is quarantined.
DEFAULT_STRIKE_LIMIT = 3
# After a restart, a lease loaded from the store lasts this many TTLs from the restart: its agent
# first has to notice that the coordinator is back (its channel retries the connection with a
# backoff of up to ~1.2 s, and its heartbeat may be waiting out a failed call), so one TTL from
# the restart would expire agents that did nothing wrong.
RESTORED_LEASE_TTLS = 2

# The highest price a node may ask, micro-credits per hour (as epochmesh.money's amounts).
MAX_PRICE_MICRO_PER_HOUR = MAX_CREDITS * MICRO

# A node's price changes are stored and logged (node.price) at most once per this many seconds,
# with its latest price; the price itself counts at once (the market reads it from here).
PRICE_EVENT_INTERVAL_S = 10.0

OfflineListener = Callable[[str], Awaitable[None]]


def require_price(value: int, field: str = "price_micro_per_hour") -> int:
    """A node's price in micro-credits per hour: 0 (donated) .. MAX_PRICE_MICRO_PER_HOUR."""
    if not 0 <= value <= MAX_PRICE_MICRO_PER_HOUR:
        raise InvalidArgumentError(
            f"{field} must be 0..{MAX_PRICE_MICRO_PER_HOUR} micro-credits per hour, got {value}"
        )
    return value


def describe_price(micro_per_hour: int) -> str:
    return f"{format_credits(micro_per_hour)} credits/h" if micro_per_hour else "donated"


def state_name(state: int) -> str:
    """ "ONLINE" for NODE_STATE_ONLINE, and so on."""
    name: str = NS.Name(state)
    return name.removeprefix("NODE_STATE_")


class LeaseExpiredError(FailedPreconditionError):
    def __init__(self, message: str = LEASE_EXPIRED) -> None:
        super().__init__(message)


@dataclass
class _Node:
    info: common_pb2.NodeInfo
    lease_id: str
    expires: float  # monotonic deadline of the lease; meaningless when OFFLINE
    # An operator asked this lease's agent to leave (Drain with stop); never stored.
    leave_requested: bool = False


@dataclass(frozen=True)
class Registration:
    node_id: str
    lease_id: str
    rejoined: bool


class NodeRegistry:
    def __init__(
        self,
        store: Store,
        events: EventLog,
        *,
        heartbeat_interval_s: float,
        lease_ttl_s: float,
        max_heartbeats_per_s: float = 0.0,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._events = events
        self._base_interval_s = heartbeat_interval_s
        self._base_ttl_s = lease_ttl_s
        self._max_heartbeats_per_s = max_heartbeats_per_s
        self._stretch = 1.0  # see `heartbeat_interval_s`
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._donors: dict[str, str] = {}  # node id -> donor, where not the node itself
        self._dirty: set[str] = set()
        self._counted: set[str] = set()  # nodes with parts counted since their last persist
        # Price changes (coalesced): when each node's price was last stored and logged, and the
        # nodes whose newer price waits for its interval.
        self._price_logged: dict[str, float] = {}
        self._price_due: set[str] = set()
        self._offline_listeners: list[OfflineListener] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.heartbeats_total = 0

    @property
    def heartbeat_interval_s(self) -> float:
        """The interval every agent is told to heartbeat at: the configured one, stretched
        while the leased nodes at that interval would send more than ``max_heartbeats_per_s``
        heartbeats a second (0: never), so that the coordinator's heartbeat load stays bounded
        however large the fleet (the lease TTL stretches with it). Agents take both from each
        Register and Heartbeat answer; the stretch is recomputed at every lease sweep."""
        return self._base_interval_s * self._stretch

    @property
    def lease_ttl_s(self) -> float:
        return self._base_ttl_s * self._stretch

    def _restretch(self, leased: int) -> None:
        cap = self._max_heartbeats_per_s
        rate = leased / self._base_interval_s
        stretch = max(1.0, rate / cap) if cap > 0 else 1.0
        if abs(stretch - self._stretch) > 0.05 * self._stretch:
            log.info(
                "%d leased nodes: heartbeat interval %.1f s, lease %.1f s (at most %.0f "
                "heartbeats a second)",
                leased,
                self._base_interval_s * stretch,
                self._base_ttl_s * stretch,
                cap,
            )
            self._stretch = stretch

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    @property
    def heartbeat_interval_ms(self) -> int:
        return int(self.heartbeat_interval_s * 1000)

    # -- lifecycle ------------------------------------------------------------------------------

    async def load(self) -> None:
        """Load nodes from the store. Nodes that were leased keep their lease id and get
        RESTORED_LEASE_TTLS fresh TTLs from now, so their agents carry on heartbeating across a
        coordinator restart."""
        now, wall = self._clock(), now_ms()
        donors = await self._store.list_node_donors()
        for record in await self._store.list_nodes():
            info = record.info
            node = _Node(info=info, lease_id=record.lease_id, expires=0.0)
            self._set_donor(info, donors.get(info.node_id, ""))
            if info.state != OFFLINE:
                node.expires = now + RESTORED_LEASE_TTLS * self.lease_ttl_s
                info.lease_expires_ms = wall + RESTORED_LEASE_TTLS * self.lease_ttl_ms
                self._dirty.add(info.node_id)
            self._nodes[info.node_id] = node
        log.info(
            "loaded %d nodes (%d leased)",
            len(self._nodes),
            sum(1 for n in self._nodes.values() if n.info.state != OFFLINE),
        )

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._sweep_loop(), name="lease-sweeper"),
            asyncio.create_task(self._flush_loop(), name="heartbeat-flusher"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.flush_heartbeats()
        await self.flush_part_counts()

    def add_offline_listener(self, listener: OfflineListener) -> None:
        """``await listener(node_id)`` runs whenever a node's lease ends: expiry, Leave, or a
        re-registration that replaces a live lease (the old incarnation's work is void)."""
        self._offline_listeners.append(listener)

    # -- queries (synchronous, from memory) -----------------------------------------------------

    def get(self, node_id: str) -> common_pb2.NodeInfo | None:
        node = self._nodes.get(node_id)
        return None if node is None else _copy(node.info)

    def require(self, node_id: str) -> common_pb2.NodeInfo:
        return _copy(self._require(node_id).info)

    def find(self, id_or_name: str) -> common_pb2.NodeInfo:
        """A node by id, else by name. A name shared by several nodes resolves to the only
        one that is not OFFLINE, if there is exactly one; otherwise FailedPreconditionError."""
        node = self._nodes.get(id_or_name)
        if node is not None:
            return _copy(node.info)
        named = [n for n in self._nodes.values() if n.info.name == id_or_name]
        if len(named) > 1:
            live = [n for n in named if n.info.state != OFFLINE]
            if len(live) != 1:
                ids = ", ".join(sorted(n.info.node_id for n in named))
                raise FailedPreconditionError(
                    f"node name {id_or_name!r} is ambiguous ({ids}): use the node id"
                )
            named = live
        if not named:
            raise NotFoundError(f"no node with id or name {id_or_name!r}")
        return _copy(named[0].info)

    def list(self, states: Collection[int] = ()) -> list[common_pb2.NodeInfo]:
        wanted = set(states)
        return [_copy(n.info) for n in self._nodes.values() if not wanted or n.info.state in wanted]

    def donor_of(self, node_id: str) -> str:
        """The donor whose account ``node_id`` earns for: its join token's donor, else (and
        for an unknown node) the node id itself."""
        return self._donors.get(node_id, node_id)

    def is_alive(self, node_id: str) -> bool:
        """Leased: known, not OFFLINE and the lease has not lapsed (QUARANTINED is alive)."""
        node = self._nodes.get(node_id)
        return node is not None and self._leased(node, self._clock())

    def eligible_nodes(self) -> builtins.list[common_pb2.NodeInfo]:
        """Leased nodes that may get new work: ONLINE or BUSY."""
        now = self._clock()
        return [
            _copy(n.info)
            for n in self._nodes.values()
            if n.info.state in (ONLINE, BUSY) and self._leased(n, now)
        ]

    def counts_by_state(self) -> dict[int, int]:
        counts = dict.fromkeys(NS.values(), 0)
        counts.pop(NS.NODE_STATE_UNSPECIFIED, None)
        for n in self._nodes.values():
            counts[n.info.state] = counts.get(n.info.state, 0) + 1
        return counts

    def leave_requested(self, node_id: str) -> bool:
        """An operator asked the node's agent to leave (Drain with stop) and it has not yet."""
        node = self._nodes.get(node_id)
        return node is not None and node.leave_requested and node.info.state != OFFLINE

    def check_lease(self, node_id: str, lease_id: str) -> common_pb2.NodeInfo:
        """NotFoundError for an unknown node, LeaseExpiredError for a wrong or lapsed lease;
        returns (a copy of) the node otherwise. Does not renew the lease."""
        node = self._require(node_id)
        if node.lease_id != lease_id or not self._leased(node, self._clock()):
            raise LeaseExpiredError()
        return _copy(node.info)

    def __len__(self) -> int:
        return len(self._nodes)

    def _set_donor(self, info: common_pb2.NodeInfo, donor: str) -> None:
        """Record ``donor`` ("": the node itself) for the node and show it as its label."""
        if donor and donor != info.node_id:
            self._donors[info.node_id] = donor
        else:
            self._donors.pop(info.node_id, None)
        info.labels[DONOR_LABEL] = donor or info.node_id

    # -- agent calls ----------------------------------------------------------------------------

    async def register(
        self,
        *,
        name: str,
        devices: Sequence[common_pb2.Device] = (),
        peer_address: str = "",
        agent_version: str = "",
        labels: Mapping[str, str] | None = None,
        node_id: str = "",
        new_id_ok: bool = False,
        price_micro_per_hour: int = 0,
        ring_seal_digests: Sequence[str] = (),
        ring_features: Sequence[str] = (),
    ) -> Registration:
        """Join with a new id, or re-join as ``node_id`` (NotFoundError if unknown, unless
        ``new_id_ok``: a node whose certificate names its id joins under that id the first
        time), keeping the id and history. Either way a new lease starts, at the price the
        node asks now (micro-credits per hour; InvalidArgumentError if negative)."""
        require_price(price_micro_per_hour)
        donor = await self._store.get_node_donor(node_id) if node_id else ""
        now, wall = self._clock(), now_ms()
        lease_id = secrets.token_hex(8)
        replaced_live_lease = False
        if node_id and new_id_ok and node_id not in self._nodes:
            info = common_pb2.NodeInfo(node_id=node_id, state=ONLINE, registered_at_ms=wall)
            node = _Node(info=info, lease_id="", expires=0.0)
            kind = "node.registered"
        elif node_id:
            node = self._require(node_id)
            info = node.info
            replaced_live_lease = self._leased(node, now)
            previous = info.state
            if previous not in (CORDONED, QUARANTINED):
                info.state = info.return_state or ONLINE
            info.current_job_id = ""
            kind = "node.rejoined"
        else:
            node_id = new_node_id()
            while node_id in self._nodes:
                node_id = new_node_id()
            info = common_pb2.NodeInfo(node_id=node_id, state=ONLINE, registered_at_ms=wall)
            node = _Node(info=info, lease_id="", expires=0.0)
            kind = "node.registered"
        if not info.HasField("reputation"):
            set_reputation(info, ReputationRecord())  # new: checked every round
        info.name = name
        del info.devices[:]
        info.devices.extend(devices)
        info.peer_address = peer_address
        info.agent_version = agent_version
        del info.ring_seal_digests[:]
        info.ring_seal_digests.extend(ring_seal_digests)
        del info.ring_features[:]
        info.ring_features.extend(ring_features)
        info.labels.clear()
        info.labels.update(labels or {})
        self._set_donor(info, donor)
        info.price_micro_per_hour = price_micro_per_hour
        info.last_heartbeat_ms = wall
        info.lease_expires_ms = wall + self.lease_ttl_ms
        info.online_since_ms = wall
        node.lease_id = lease_id
        node.expires = now + self.lease_ttl_s
        node.leave_requested = False  # a leave request was the old incarnation's
        self._nodes[node_id] = node
        self._dirty.discard(node_id)
        await self._persist(
            node,
            kind,
            f"{name} {'re-joined' if kind == 'node.rejoined' else 'registered'}"
            f" ({len(info.devices)} devices, {describe_price(price_micro_per_hour)})",
            {"price_micro_per_hour": str(price_micro_per_hour)},
        )
        if replaced_live_lease:
            await self._notify_offline(node_id)
        log.info("%s %s (%s) state %s", kind, node_id, name, state_name(info.state))
        return Registration(node_id=node_id, lease_id=lease_id, rejoined=kind == "node.rejoined")

    async def heartbeat(
        self,
        node_id: str,
        lease_id: str,
        draining: bool = False,
        *,
        price_micro_per_hour: int = 0,
    ) -> int:
        """Renew the lease; returns the node's state. NotFoundError / LeaseExpiredError.
        ``price_micro_per_hour`` is the node's price now: a change is stored at once, with a
        ``node.price`` event (InvalidArgumentError if negative)."""
        require_price(price_micro_per_hour)
        node = self._require(node_id)
        info = node.info
        if node.lease_id != lease_id or info.state == OFFLINE:
            raise LeaseExpiredError()
        now = self._clock()
        if now > node.expires:
            await self._expire(node)
            raise LeaseExpiredError()
        wall = now_ms()
        node.expires = now + self.lease_ttl_s
        info.last_heartbeat_ms = wall
        info.lease_expires_ms = wall + self.lease_ttl_ms
        self._dirty.add(node_id)
        self.heartbeats_total += 1
        if price_micro_per_hour != info.price_micro_per_hour:
            info.price_micro_per_hour = price_micro_per_hour  # the market's from now on
            self._price_due.add(node_id)
            await self._log_price(node, now)
        if draining and info.state in (ONLINE, BUSY, CORDONED):
            info.state = DRAINING
            await self._persist(node, "node.draining", "agent is draining", {"by": "agent"})
        return int(info.state)

    async def leave(self, node_id: str, lease_id: str, reason: str = "") -> None:
        node = self._require(node_id)
        if node.lease_id != lease_id or node.info.state == OFFLINE:
            raise LeaseExpiredError()
        node.info.state = OFFLINE
        node.info.current_job_id = ""
        node.leave_requested = False
        await self._persist(
            node, "node.left", f"left: {reason or 'no reason given'}", {"reason": reason}
        )
        log.info("node %s (%s) left: %s", node_id, node.info.name, reason)
        await self._notify_offline(node_id)

    # -- operator calls -------------------------------------------------------------------------

    async def cordon(self, node_id: str) -> common_pb2.NodeInfo:
        """No new work for the node (its current round goes on). Idempotent; a DRAINING node
        stays DRAINING."""
        node = self._require_live(node_id, "cordon")
        if node.info.state in (ONLINE, BUSY):
            node.info.state = CORDONED
            node.info.return_state = CORDONED
            await self._persist(node, "node.cordoned", "cordoned by an operator")
        return _copy(node.info)

    async def uncordon(self, node_id: str) -> common_pb2.NodeInfo:
        """Back to ONLINE (BUSY if it carries a job) from CORDONED or DRAINING; a leave
        request its agent has not acted on yet is withdrawn. Idempotent."""
        node = self._require_live(node_id, "uncordon")
        withdrawn, node.leave_requested = node.leave_requested, False
        if node.info.state in (CORDONED, DRAINING):
            node.info.state = BUSY if node.info.current_job_id else ONLINE
            node.info.return_state = NS.NODE_STATE_UNSPECIFIED
            message = "uncordoned by an operator" + (
                " (its leave request withdrawn)" if withdrawn else ""
            )
            await self._persist(node, "node.uncordoned", message)
        return _copy(node.info)

    async def drain(self, node_id: str, *, stop: bool = False) -> common_pb2.NodeInfo:
        """The node finishes its current round and gets no new work; its agent stays up and
        idle, heartbeating, until an operator uncordons it. When the agent comes back after
        going OFFLINE the node is CORDONED (no work until uncordoned). With ``stop`` the agent
        is also asked to leave (`leave_requested`): it finishes its task, Leaves and exits.
        Idempotent; ``stop`` on a drained node adds the leave request."""
        node = self._require_live(node_id, "drain")
        node.info.return_state = CORDONED
        ask_leave = stop and not node.leave_requested
        node.leave_requested = node.leave_requested or stop
        if node.info.state != DRAINING:
            node.info.state = DRAINING
            message = "drained by an operator" + ("; its agent is asked to leave" if stop else "")
            attrs = {"by": "operator", "stop": "true" if stop else "false"}
            await self._persist(node, "node.draining", message, attrs)
        elif ask_leave:
            attrs = {"by": "operator", "stop": "true"}
            await self._persist(node, "node.draining", "its agent is asked to leave", attrs)
        if ask_leave:
            log.info("node %s (%s): its agent is asked to leave", node_id, node.info.name)
        return _copy(node.info)

    # -- strikes -----------------------------------------------------------------------------

    async def add_strike(
        self, node_id: str, reason: str, *, limit: int = DEFAULT_STRIKE_LIMIT, job_id: str = ""
    ) -> common_pb2.NodeInfo:
        """Count a strike against the node (it sent an update the coordinator refused: wrong
        shape, dtype or size, NaN/Inf, ...): a ``node.strike`` event, and at ``limit``
        strikes the node is QUARANTINED (no more work; it survives re-registration) with a
        ``node.quarantined`` event. Strikes count against the node's donor too (a named donor
        of its join token): at ``limit`` strikes over all the donor's nodes, the one struck
        last is quarantined, so that a fresh certificate (a node enrolled again with the
        donor's token) does not wipe the record. An unknown node is ignored (returns an empty
        NodeInfo)."""
        node = self._nodes.get(node_id)
        if node is None:
            log.warning("strike for unknown node %s ignored: %s", node_id, reason)
            return common_pb2.NodeInfo()
        info = node.info
        info.strikes += 1
        reason = reason[:512]
        donor = self._donors.get(node_id, "")
        donor_strikes = self.donor_strikes(donor) if donor else info.strikes
        attrs = {"strikes": str(info.strikes), "limit": str(limit), "reason": reason}
        if donor:
            attrs.update({"donor": donor, "donor_strikes": str(donor_strikes)})
        text = f"strike {info.strikes}/{limit}: {reason}"
        if donor and donor_strikes != info.strikes:
            text = f"strike {info.strikes} ({donor_strikes}/{limit} of donor {donor}): {reason}"
        await self._persist(node, "node.strike", text, attrs, job_id=job_id)
        if max(info.strikes, donor_strikes) >= limit and info.state != QUARANTINED:
            info.state = QUARANTINED
            info.return_state = QUARANTINED
            whose = (
                f"{info.strikes} strikes"
                if info.strikes >= limit
                else f"{donor_strikes} strikes of its donor {donor}'s nodes"
            )
            await self._persist(
                node,
                "node.quarantined",
                f"quarantined after {whose} (last: {reason})",
                attrs,
                job_id=job_id,
            )
            log.warning("node %s quarantined after %s: %s", node_id, whose, reason)
        return _copy(info)

    def donor_strikes(self, donor: str) -> int:
        """Strikes of every node (live or not) enrolled for the named ``donor``."""
        return sum(
            n.info.strikes for nid, n in self._nodes.items() if self._donors.get(nid) == donor
        )

    async def quarantine(
        self, node_id: str, reason: str, attrs: Mapping[str, str], *, job_id: str = ""
    ) -> common_pb2.NodeInfo:
        """QUARANTINE the node at once (its work was proven wrong: verification), with a
        ``node.quarantined`` event carrying the evidence in ``attrs``. It survives a lapsed
        lease and re-registration, like a quarantine after strikes."""
        node = self._nodes.get(node_id)
        if node is None:
            log.warning("quarantine of unknown node %s ignored: %s", node_id, reason)
            return common_pb2.NodeInfo()
        node.info.state = QUARANTINED
        node.info.return_state = QUARANTINED
        await self._persist(
            node, "node.quarantined", f"quarantined: {reason}"[:1024], dict(attrs), job_id=job_id
        )
        log.warning("node %s quarantined: %s", node_id, reason)
        return _copy(node.info)

    # -- verification record ------------------------------------------------------------------

    def reputation(self, node_id: str) -> ReputationRecord:
        """The node's verification record (new for an unknown node)."""
        node = self._nodes.get(node_id)
        return ReputationRecord() if node is None else reputation_of(node.info)

    async def record_check(
        self, node_id: str, round: int, passed: bool, evidence: str = ""
    ) -> ReputationRecord:
        """A check of the node's work in ``round`` passed or failed (confirmed): its record,
        stored with the node (no event for a pass: one per checked round would flood the
        events; a failure's event is the quarantine's)."""
        node = self._nodes.get(node_id)
        if node is None:
            return ReputationRecord()
        record = reputation_of(node.info)
        record = (
            record_verified(record, round)
            if passed
            else record_failed(record, round, evidence or "check failed", time_ms=now_ms())
        )
        set_reputation(node.info, record)
        await self._persist(node, None, "")
        return record

    # -- engine calls ---------------------------------------------------------------------------

    async def set_busy(self, node_id: str, job_id: str | None) -> common_pb2.NodeInfo:
        """Record that the node works for ``job_id`` (ONLINE -> BUSY) or is idle again (None:
        BUSY -> ONLINE). CORDONED / DRAINING nodes keep their state but carry the job id.
        FailedPreconditionError when giving work to an OFFLINE or QUARANTINED node."""
        node = self._require(node_id)
        info = node.info
        if job_id:
            if info.state in (OFFLINE, QUARANTINED):
                raise FailedPreconditionError(
                    f"node {node_id} is {state_name(info.state)}: it cannot work for {job_id}"
                )
            if info.current_job_id == job_id and info.state != ONLINE:
                return _copy(info)
            info.current_job_id = job_id
            if info.state == ONLINE:
                info.state = BUSY
            await self._persist(node, "node.busy", f"working for {job_id}", job_id=job_id)
        else:
            if not info.current_job_id and info.state != BUSY:
                return _copy(info)
            previous_job = info.current_job_id
            info.current_job_id = ""
            if info.state == BUSY:
                info.state = ONLINE
            await self._persist(node, "node.idle", "idle", job_id=previous_job)
        return _copy(info)

    async def set_benchmark(
        self, node_id: str, result: common_pb2.BenchmarkResult
    ) -> common_pb2.NodeInfo:
        """Record a benchmark. The reference benchmark (empty job_id) is kept on the node
        (NodeInfo.benchmark); a job's benchmark is only logged as an event (the engine keeps
        per-job figures). measured_at_ms defaults to now."""
        node = self._require(node_id)
        if result.job_id:
            await self._events.append(
                "node.benchmark",
                node_id=node_id,
                job_id=result.job_id,
                message=f"benchmark for {result.job_id}: {result.samples_per_second:.1f} samples/s",
                attrs={"samples_per_second": f"{result.samples_per_second:.3f}"},
            )
            return _copy(node.info)
        node.info.benchmark.CopyFrom(result)
        if not node.info.benchmark.measured_at_ms:
            node.info.benchmark.measured_at_ms = now_ms()
        await self._persist(
            node,
            "node.benchmark",
            f"reference benchmark: {result.samples_per_second:.1f} samples/s",
            {"samples_per_second": f"{result.samples_per_second:.3f}"},
        )
        return _copy(node.info)

    def count_parts(self, applied: Iterable[str], failed: Iterable[str]) -> None:
        """Count a closed round's parts on their nodes (NodeInfo.parts_applied, parts_failed;
        a node once per id listed, unknown nodes ignored). In memory only, no store write per
        round: the counts are stored with the node's next persist (any state change, and at
        `stop`), so a coordinator crash loses the parts counted since then."""
        for node_id in applied:
            if (node := self._nodes.get(node_id)) is not None:
                node.info.parts_applied += 1
                self._counted.add(node_id)
        for node_id in failed:
            if (node := self._nodes.get(node_id)) is not None:
                node.info.parts_failed += 1
                self._counted.add(node_id)

    async def flush_part_counts(self) -> int:
        """Store the nodes whose parts were counted since their last persist (no event);
        returns how many."""
        nodes = [n for node_id in sorted(self._counted) if (n := self._nodes.get(node_id))]
        for node in nodes:
            await self._persist(node, None, "")
        return len(nodes)

    async def set_observed_throughput(self, node_id: str, samples_per_second: float) -> None:
        """The engine's running estimate of the node's throughput (no event)."""
        node = self._require(node_id)
        node.info.observed_samples_per_second = samples_per_second
        await self._persist(node, None, "")

    # -- lease expiry and heartbeat flushing ----------------------------------------------------

    async def sweep(self) -> builtins.list[str]:
        """Mark every node whose lease lapsed OFFLINE; returns their ids."""
        now = self._clock()
        # One pass: the lapsed leases, and the live ones the heartbeat rate limit counts.
        lapsed: builtins.list[_Node] = []
        leased = 0
        for n in self._nodes.values():
            if n.info.state == OFFLINE:
                continue
            if now > n.expires:
                lapsed.append(n)
            else:
                leased += 1
        self._restretch(leased)
        if not lapsed:
            return []
        # One transaction for every lease that lapsed (a coordinator that fell behind may find
        # thousands at once: one commit each would put it further behind), then the listeners.
        # The listeners hear of every node marked OFFLINE here, even when the store failed:
        # the registry in memory is what hands out work.
        expired: builtins.list[_Node] = []
        try:
            async with self._store.transaction():
                for node in lapsed:
                    if node.info.state != OFFLINE and self._clock() > node.expires:
                        expired.append(node)
                        await self._mark_expired(node)
        finally:
            for node in expired:
                info = node.info
                log.info("node %s (%s) is OFFLINE: lease expired", info.node_id, info.name)
                await self._notify_offline(info.node_id)
        return [n.info.node_id for n in lapsed]

    async def _log_price(self, node: _Node, now: float) -> None:
        """Store and log the node's latest price if one waits and its interval is over (one
        ``node.price`` event per node per PRICE_EVENT_INTERVAL_S, however often it changes)."""
        node_id = node.info.node_id
        last = self._price_logged.get(node_id)
        if node_id not in self._price_due or (
            last is not None and now - last < PRICE_EVENT_INTERVAL_S
        ):
            return
        self._price_due.discard(node_id)
        self._price_logged[node_id] = now
        price = node.info.price_micro_per_hour
        await self._persist(
            node,
            "node.price",
            f"price set to {format_credits(price)} credits/h" + ("" if price else ": donated"),
            {"price_micro_per_hour": str(price)},
        )

    async def flush_prices(self) -> int:
        """Store and log the prices whose interval is over (see `_log_price`); how many."""
        now = self._clock()
        due = [n for node_id in sorted(self._price_due) if (n := self._nodes.get(node_id))]
        self._price_due &= {n.info.node_id for n in due}
        for node in due:
            await self._log_price(node, now)
        return len(due) - len(self._price_due)

    async def flush_heartbeats(self) -> int:
        if not self._dirty:
            return 0
        dirty, self._dirty = self._dirty, set()
        updates = [
            HeartbeatUpdate(n.info.node_id, n.info.last_heartbeat_ms, n.info.lease_expires_ms)
            for node_id in dirty
            if (n := self._nodes.get(node_id)) is not None
        ]
        try:
            await self._store.update_heartbeats(updates)
        except BaseException:
            self._dirty |= dirty
            raise
        return len(updates)

    def _sweep_interval(self) -> float:
        return max(0.02, min(1.0, self.lease_ttl_s / 10))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval())
            try:
                await self.sweep()
            except Exception:
                log.exception("lease sweep failed")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval_s)
            try:
                await self.flush_heartbeats()
                await self.flush_prices()
                await self._events.report_drops()
            except Exception:
                log.exception("heartbeat flush failed")

    async def _expire(self, node: _Node) -> None:
        await self._mark_expired(node)
        info = node.info
        log.info("node %s (%s) is OFFLINE: lease expired", info.node_id, info.name)
        await self._notify_offline(info.node_id)

    async def _mark_expired(self, node: _Node) -> None:
        """OFFLINE, stored with its ``node.offline`` event; the listeners are the caller's."""
        info = node.info
        info.state = OFFLINE
        info.current_job_id = ""
        node.leave_requested = False
        await self._persist(
            node,
            "node.offline",
            f"lease expired (last heartbeat {info.last_heartbeat_ms} ms)",
            {"reason": "lease expired"},
        )

    # -- helpers --------------------------------------------------------------------------------

    def _leased(self, node: _Node, now: float) -> bool:
        return node.info.state != OFFLINE and now <= node.expires

    def _require(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise NotFoundError(f"unknown node {node_id!r}")
        return node

    def _require_live(self, node_id: str, action: str) -> _Node:
        node = self._require(node_id)
        if node.info.state in (OFFLINE, QUARANTINED):
            raise FailedPreconditionError(
                f"cannot {action} node {node_id}: it is {state_name(node.info.state)}"
            )
        return node

    async def _persist(
        self,
        node: _Node,
        kind: str | None,
        message: str,
        attrs: Mapping[str, str] | None = None,
        job_id: str = "",
    ) -> None:
        record = NodeRecord(info=_copy(node.info), lease_id=node.lease_id)
        async with self._store.transaction():
            await self._store.upsert_node(record)
            if kind:
                await self._events.append(
                    kind, node_id=node.info.node_id, job_id=job_id, message=message, attrs=attrs
                )
        self._counted.discard(node.info.node_id)

    async def _notify_offline(self, node_id: str) -> None:
        for listener in list(self._offline_listeners):
            try:
                await listener(node_id)
            except Exception:
                log.exception("offline listener failed for node %s", node_id)


def reputation_of(info: common_pb2.NodeInfo) -> ReputationRecord:
    """The verification record a NodeInfo carries (0 stands for "none" in its rounds/times)."""
    r = info.reputation
    return ReputationRecord(
        verified_in_a_row=r.verified_in_a_row,
        verified_total=r.verified_total,
        failed_total=r.failed_total,
        last_verified_round=r.last_verified_round or None,
        last_failure_round=r.last_failure_round or None,
        last_failure_ms=r.last_failure_ms or None,
        last_failure_evidence=r.last_failure_evidence,
    )


def set_reputation(info: common_pb2.NodeInfo, record: ReputationRecord) -> None:
    """Store ``record`` in ``info``, with its check probability and the reason for it."""
    info.reputation.CopyFrom(
        common_pb2.Reputation(
            verified_in_a_row=record.verified_in_a_row,
            verified_total=record.verified_total,
            failed_total=record.failed_total,
            last_verified_round=record.last_verified_round or 0,
            last_failure_round=record.last_failure_round or 0,
            last_failure_ms=record.last_failure_ms or 0,
            last_failure_evidence=record.last_failure_evidence,
            check_probability=check_probability(record),
            check_reason=check_reason(record),
        )
    )


def _copy(info: common_pb2.NodeInfo) -> common_pb2.NodeInfo:
    out = common_pb2.NodeInfo()
    out.CopyFrom(info)
    return out
