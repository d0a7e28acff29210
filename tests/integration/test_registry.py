"""NodeRegistry and EventLog on a real SQLite store, with a controlled clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.core.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from coordinator.core.ids import is_node_id
from coordinator.nodes.registry import RESTORED_LEASE_TTLS, LeaseExpiredError, NodeRegistry
from coordinator.store.events import EventLog
from coordinator.store.sqlite import SqliteStore
from epochmesh.v1 import common_pb2
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(30)

NS = common_pb2.NodeState
TTL = 6.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "c.db")
    yield s
    await s.close()


async def make_registry(store: SqliteStore, clock: Clock) -> tuple[NodeRegistry, EventLog]:
    events = EventLog(store)
    await events.start()
    reg = NodeRegistry(store, events, heartbeat_interval_s=2.0, lease_ttl_s=TTL, clock=clock)
    await reg.load()
    return reg, events


async def test_expiry_by_sweep_and_by_late_heartbeat(store: SqliteStore) -> None:
    clock = Clock()
    reg, _ = await make_registry(store, clock)
    offline: list[str] = []

    async def listener(node_id: str) -> None:
        offline.append(node_id)

    reg.add_offline_listener(listener)
    a = await reg.register(name="a")
    b = await reg.register(name="b")
    assert is_node_id(a.node_id) and not a.rejoined
    clock.t += TTL - 1
    assert await reg.heartbeat(a.node_id, a.lease_id) == NS.NODE_STATE_ONLINE
    clock.t += 2  # b lapsed (TTL + 1 since its registration), a renewed 2 s ago
    assert await reg.sweep() == [b.node_id]
    assert offline == [b.node_id]
    assert reg.get(b.node_id).state == NS.NODE_STATE_OFFLINE  # type: ignore[union-attr]
    assert reg.is_alive(a.node_id) and not reg.is_alive(b.node_id)

    # A heartbeat that arrives after expiry but before the sweeper: refused, node OFFLINE.
    clock.t += TTL + 0.1
    with pytest.raises(LeaseExpiredError, match="lease expired: register again"):
        await reg.heartbeat(a.node_id, a.lease_id)
    assert offline == [b.node_id, a.node_id]
    stored = await store.get_node(a.node_id)
    assert stored is not None and stored.info.state == NS.NODE_STATE_OFFLINE
    kinds = [(e.kind, e.node_id) for e in await store.list_events(kinds=["node.offline"])]
    assert kinds == [("node.offline", b.node_id), ("node.offline", a.node_id)]
    with pytest.raises(NotFoundError):
        await reg.heartbeat("n-0123456789", "x")


async def test_heartbeats_are_flushed_in_batches(store: SqliteStore) -> None:
    clock = Clock()
    reg, _ = await make_registry(store, clock)
    a = await reg.register(name="a")
    registered = await store.get_node(a.node_id)
    assert registered is not None
    first_hb = registered.info.last_heartbeat_ms
    await asyncio.sleep(0.01)
    await reg.heartbeat(a.node_id, a.lease_id)
    in_memory = reg.get(a.node_id)
    assert in_memory is not None and in_memory.last_heartbeat_ms > first_hb
    stale = await store.get_node(a.node_id)
    assert stale is not None and stale.info.last_heartbeat_ms == first_hb
    assert await reg.flush_heartbeats() == 1
    assert await reg.flush_heartbeats() == 0
    fresh = await store.get_node(a.node_id)
    assert fresh is not None and fresh.info.last_heartbeat_ms == in_memory.last_heartbeat_ms
    assert reg.heartbeats_total == 1


async def test_reload_keeps_leases_with_a_fresh_ttl(store: SqliteStore) -> None:
    clock = Clock()
    reg, _ = await make_registry(store, clock)
    a = await reg.register(name="a")
    gone = await reg.register(name="gone")
    await reg.leave(gone.node_id, gone.lease_id, "bye")
    silent = await reg.register(name="silent")
    clock.t += TTL - 0.5  # about to lapse when the coordinator "restarts"
    reg2, _ = await make_registry(store, clock)
    # A restored lease lasts RESTORED_LEASE_TTLS TTLs from the restart: its agent needs a while
    # to notice that the coordinator is back.
    clock.t += RESTORED_LEASE_TTLS * TTL - 0.5  # past the old deadline and past one fresh TTL
    assert await reg2.sweep() == []
    assert await reg2.heartbeat(a.node_id, a.lease_id) == NS.NODE_STATE_ONLINE
    with pytest.raises(LeaseExpiredError):
        await reg2.heartbeat(gone.node_id, gone.lease_id)
    assert reg2.get(gone.node_id).state == NS.NODE_STATE_OFFLINE  # type: ignore[union-attr]
    # ... and no longer: a node that never comes back goes OFFLINE RESTORED_LEASE_TTLS TTLs
    # after the restart.
    clock.t += 1.0
    assert await reg2.sweep() == [silent.node_id]
    # After the first heartbeat since the restart, a lease is back to one TTL.
    clock.t += TTL - 1.5  # TTL - 0.5 since a's heartbeat
    assert await reg2.sweep() == []
    clock.t += 1.0
    assert await reg2.sweep() == [a.node_id]


async def test_rejoin_replacing_a_live_lease_notifies_and_keeps_cordon(
    store: SqliteStore,
) -> None:
    clock = Clock()
    reg, _ = await make_registry(store, clock)
    offline: list[str] = []

    async def listener(node_id: str) -> None:
        offline.append(node_id)

    reg.add_offline_listener(listener)
    a = await reg.register(name="a")
    await reg.set_busy(a.node_id, "j-0123456789")
    await reg.cordon(a.node_id)
    again = await reg.register(name="a", node_id=a.node_id)
    assert again.rejoined and again.node_id == a.node_id and again.lease_id != a.lease_id
    assert offline == [a.node_id]  # the old incarnation's work is void
    info = reg.get(a.node_id)
    assert info is not None and info.state == NS.NODE_STATE_CORDONED and not info.current_job_id
    with pytest.raises(LeaseExpiredError):
        await reg.heartbeat(a.node_id, a.lease_id)
    with pytest.raises(NotFoundError):
        await reg.register(name="x", node_id="n-ffffffffff")


async def test_cordon_drain_and_quarantine_outlive_a_lapsed_lease_and_a_restart(
    store: SqliteStore,
) -> None:
    """Seen on a GPU machine: a coordinator stalled past the lease TTL, every node went OFFLINE
    and re-joined ONLINE, and an operator's cordon was gone (a quarantine too, by the same
    path). A node that comes back returns to where the operator or its strikes put it."""
    clock = Clock()
    reg, _ = await make_registry(store, clock)
    cordoned = await reg.register(name="cordoned")
    drained = await reg.register(name="drained")
    hostile = await reg.register(name="hostile")
    freed = await reg.register(name="freed")
    await reg.cordon(cordoned.node_id)
    await reg.drain(drained.node_id)
    for _ in range(3):
        await reg.add_strike(hostile.node_id, "NaN in the update", limit=3)
    await reg.cordon(freed.node_id)
    await reg.uncordon(freed.node_id)
    clock.t += TTL + 1
    await reg.sweep()
    nodes = (cordoned, drained, hostile, freed)
    assert all(reg.get(n.node_id).state == NS.NODE_STATE_OFFLINE for n in nodes)
    reg2, _ = await make_registry(store, clock)  # and the coordinator restarts meanwhile
    for node, state in zip(
        nodes,
        (
            NS.NODE_STATE_CORDONED,
            NS.NODE_STATE_CORDONED,
            NS.NODE_STATE_QUARANTINED,
            NS.NODE_STATE_ONLINE,
        ),
        strict=True,
    ):
        again = await reg2.register(name=reg2.get(node.node_id).name, node_id=node.node_id)
        assert again.rejoined
        assert reg2.get(node.node_id).state == state, reg2.get(node.node_id).name
    assert hostile.node_id not in {n.node_id for n in reg2.eligible_nodes()}
    await reg2.uncordon(cordoned.node_id)
    await reg2.leave(
        cordoned.node_id, (await reg2.register(name="c", node_id=cordoned.node_id)).lease_id
    )
    await reg2.register(name="c", node_id=cordoned.node_id)
    assert reg2.get(cordoned.node_id).state == NS.NODE_STATE_ONLINE


async def test_busy_idle_eligibility_and_names(store: SqliteStore) -> None:
    clock = Clock()
    reg, _ = await make_registry(store, clock)
    a = await reg.register(name="same")
    b = await reg.register(name="same")
    c = await reg.register(name="other")
    assert {n.node_id for n in reg.eligible_nodes()} == {a.node_id, b.node_id, c.node_id}
    info = await reg.set_busy(a.node_id, "j-0123456789")
    assert info.state == NS.NODE_STATE_BUSY and info.current_job_id == "j-0123456789"
    assert a.node_id in {n.node_id for n in reg.eligible_nodes()}  # BUSY stays eligible
    info = await reg.set_busy(a.node_id, None)
    assert info.state == NS.NODE_STATE_ONLINE and not info.current_job_id
    await reg.drain(c.node_id)
    assert c.node_id not in {n.node_id for n in reg.eligible_nodes()}
    with pytest.raises(FailedPreconditionError, match="ambiguous"):
        reg.find("same")
    await reg.leave(b.node_id, b.lease_id)
    assert reg.find("same").node_id == a.node_id  # the only live one of that name
    assert reg.find(c.node_id).name == "other"
    with pytest.raises(NotFoundError):
        reg.find("nobody")
    with pytest.raises(FailedPreconditionError, match="OFFLINE"):
        await reg.set_busy(b.node_id, "j-0123456789")
    counts = reg.counts_by_state()
    assert counts[NS.NODE_STATE_ONLINE] == 1 and counts[NS.NODE_STATE_DRAINING] == 1
    assert counts[NS.NODE_STATE_OFFLINE] == 1 and counts[NS.NODE_STATE_QUARANTINED] == 0


async def test_event_log_watch_past_the_buffer_then_follow(store: SqliteStore) -> None:
    events = EventLog(store, buffer_events=3)
    for i in range(4):
        await events.append("old", message=str(i))  # before start: only in the store
    await events.start()
    for i in range(6):
        await events.append("node.x" if i % 2 else "job.y", message=str(i))
    everything = [e async for e in events.watch()]
    assert [e.kind for e in everything][:4] == ["old"] * 4 and len(everything) == 10
    assert [e.id for e in everything] == sorted(e.id for e in everything)
    only_nodes = [e.message async for e in events.watch(kinds=["node.*"])]
    assert only_nodes == ["1", "3", "5"]
    tail = [e.id async for e in events.watch(everything[7].id)]
    assert tail == [e.id for e in everything[8:]]

    got: list[str] = []

    async def follow() -> None:
        async for e in events.watch(everything[-1].id, follow=True, kinds=["node.*"]):
            got.append(e.message)

    follower = asyncio.create_task(follow())
    await events.append("job.y", message="skip")
    await events.append("node.x", message="new")
    # A transaction that rolls back announces nothing.
    with pytest.raises(RuntimeError):
        async with store.transaction():
            await events.append("node.x", message="rolled back")
            raise RuntimeError("abort")
    async with store.transaction():
        await events.append("node.x", message="committed")
    await async_wait_until(lambda: len(got) >= 2, timeout=5)
    assert got == ["new", "committed"]
    events.close()
    await asyncio.wait_for(follower, timeout=5)


async def test_price_at_register_changes_at_heartbeat_and_survives_a_reload(
    store: SqliteStore,
) -> None:
    clock = Clock()
    reg, _ = await make_registry(store, clock)
    priced = await reg.register(name="priced", price_micro_per_hour=2_500_000)
    donated = await reg.register(name="donated")
    assert reg.require(priced.node_id).price_micro_per_hour == 2_500_000
    assert reg.require(donated.node_id).price_micro_per_hour == 0
    with pytest.raises(InvalidArgumentError, match="price_micro_per_hour"):
        await reg.register(name="negative", price_micro_per_hour=-1)

    # The same price again: no event; a new one: stored at once, with its event.
    clock.t += 1
    await reg.heartbeat(priced.node_id, priced.lease_id, price_micro_per_hour=2_500_000)
    assert await store.list_events(kinds=["node.price"]) == []
    await reg.heartbeat(priced.node_id, priced.lease_id, price_micro_per_hour=4_000_000)
    await reg.heartbeat(donated.node_id, donated.lease_id, price_micro_per_hour=0)
    assert reg.require(priced.node_id).price_micro_per_hour == 4_000_000
    events = await store.list_events(kinds=["node.price"])
    assert [(e.node_id, e.message) for e in events] == [
        (priced.node_id, "price set to 4 credits/h")
    ]
    assert events[0].attrs["price_micro_per_hour"] == "4000000"
    stored = await store.get_node(priced.node_id)
    assert stored is not None and stored.info.price_micro_per_hour == 4_000_000
    with pytest.raises(InvalidArgumentError, match="price_micro_per_hour"):
        await reg.heartbeat(priced.node_id, priced.lease_id, price_micro_per_hour=-5)
    assert reg.require(priced.node_id).price_micro_per_hour == 4_000_000

    # A coordinator restart keeps the price; back to a donation is an event too.
    reg2, _ = await make_registry(store, clock)
    assert reg2.require(priced.node_id).price_micro_per_hour == 4_000_000
    assert reg2.require(donated.node_id).price_micro_per_hour == 0
    await reg2.heartbeat(priced.node_id, priced.lease_id, price_micro_per_hour=0)
    last = (await store.list_events(kinds=["node.price"]))[-1]
    assert last.message == "price set to 0 credits/h: donated"
    # A re-registration asks its price afresh.
    again = await reg2.register(name="priced", node_id=priced.node_id, price_micro_per_hour=1)
    assert reg2.require(again.node_id).price_micro_per_hour == 1
    reg3, _ = await make_registry(store, clock)
    assert reg3.require(priced.node_id).price_micro_per_hour == 1


async def test_online_since_and_part_counts_are_kept_in_memory_then_stored(
    store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    wall = [1_000_000]
    monkeypatch.setattr("coordinator.nodes.registry.now_ms", lambda: wall[0])
    reg, _ = await make_registry(store, clock)
    a = await reg.register(name="a")
    b = await reg.register(name="b")
    assert reg.require(a.node_id).online_since_ms == 1_000_000

    # A round: a's part applied, b's failed; an unknown node is ignored.
    reg.count_parts(applied=[a.node_id], failed=[b.node_id, "n-0000000000"])
    reg.count_parts(applied=[a.node_id, b.node_id], failed=[])
    info_a, info_b = reg.require(a.node_id), reg.require(b.node_id)
    assert (info_a.parts_applied, info_a.parts_failed) == (2, 0)
    assert (info_b.parts_applied, info_b.parts_failed) == (1, 1)
    # No store write per round: the stored nodes do not have them yet ...
    stored = await store.get_node(a.node_id)
    assert stored is not None and stored.info.parts_applied == 0
    # ... until the node's next write (here a state change) ...
    await reg.cordon(a.node_id)
    stored = await store.get_node(a.node_id)
    assert stored is not None and stored.info.parts_applied == 2
    # ... or the registry's stop, which stores the nodes counted since their last write.
    stored = await store.get_node(b.node_id)
    assert stored is not None and (stored.info.parts_applied, stored.info.parts_failed) == (0, 0)
    assert await reg.flush_part_counts() == 1  # b only: a was stored with its cordon
    await reg.stop()
    assert await reg.flush_part_counts() == 0

    # A restart keeps the counts and the time online; a re-registration restarts the latter.
    reg2, _ = await make_registry(store, clock)
    info_b = reg2.require(b.node_id)
    assert (info_b.parts_applied, info_b.parts_failed, info_b.online_since_ms) == (
        1,
        1,
        1_000_000,
    )
    wall[0] = 5_000_000
    clock.t += 2 * TTL * RESTORED_LEASE_TTLS
    await reg2.sweep()
    assert reg2.require(b.node_id).state == NS.NODE_STATE_OFFLINE
    again = await reg2.register(name="b", node_id=b.node_id)
    info_b = reg2.require(again.node_id)
    assert info_b.online_since_ms == 5_000_000
    assert (info_b.parts_applied, info_b.parts_failed) == (1, 1)  # over its whole history
    reg2.count_parts(applied=[], failed=[b.node_id])
    assert reg2.require(b.node_id).parts_failed == 2


async def test_a_fleet_past_the_heartbeat_rate_is_told_to_heartbeat_less_often(
    store: SqliteStore,
) -> None:
    """At most 2 heartbeats a second at a 2 s interval: up to 4 leased nodes heartbeat at 2 s;
    10 are told 5 s with a lease 2.5 times as long (a node that stops is still found out, later);
    when they are fewer again, the configured interval comes back."""
    clock = Clock()
    events = EventLog(store)
    await events.start()
    reg = NodeRegistry(
        store,
        events,
        heartbeat_interval_s=2.0,
        lease_ttl_s=TTL,
        max_heartbeats_per_s=2.0,
        clock=clock,
    )
    await reg.load()
    regs = [await reg.register(name=f"n{i}") for i in range(4)]
    await reg.sweep()
    assert (reg.heartbeat_interval_ms, reg.lease_ttl_ms) == (2000, 6000)
    regs += [await reg.register(name=f"n{i}") for i in range(4, 10)]
    await reg.sweep()
    assert (reg.heartbeat_interval_ms, reg.lease_ttl_ms) == (5000, 15000)
    # a heartbeat now holds the lease 15 s: alive past the configured 6 s, gone after 15 s
    await reg.heartbeat(regs[0].node_id, regs[0].lease_id)
    for r in regs[1:]:
        await reg.heartbeat(r.node_id, r.lease_id)
    clock.t += TTL + 1
    assert await reg.sweep() == []
    for r in regs[1:4]:  # n0 stops; n1..n3 go on; n4..n9 leave
        await reg.heartbeat(r.node_id, r.lease_id)
    for r in regs[4:]:
        await reg.leave(r.node_id, r.lease_id)
    await reg.sweep()  # three leased nodes: the configured interval again
    assert (reg.heartbeat_interval_ms, reg.lease_ttl_ms) == (2000, 6000)
    clock.t += 15 - (TTL + 1) + 0.5
    assert await reg.sweep() == [regs[0].node_id]
    assert (reg.heartbeat_interval_ms, reg.lease_ttl_ms) == (2000, 6000)
