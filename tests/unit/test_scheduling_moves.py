"""Where the scheduler sends a job's nodes (ClusterScheduling.moves_from), as the engine reads it
when a job lets a node go, to say which job took it (event node.reassigned).

A normal job holds four nodes and needs all four; a high-priority job needs three. The job lets
its nodes go one by one at its round boundary, and each claim or release starts a new pass: once
a node is free the taker gets that one, so the node whose own move was "idle" may be the one it
claims. Every node the job lets go while others move to the taker names the taker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.engine.cluster_scheduling import ClusterScheduling
from coordinator.store.sqlite import SqliteStore
from tests.unit.test_scheduling_holds import Runner, nodes

pytestmark = pytest.mark.timeout(30)


def test_each_node_let_go_names_the_job_that_preempted_its_job(tmp_path: Path) -> None:
    ring = Runner("ring", "alice", 0)
    ring.spec.min_nodes = ring.spec.max_nodes = 4
    high = Runner("high", "bob", 1)
    high.spec.min_nodes = high.spec.max_nodes = 3
    high.spec.priority = "high"

    async def run() -> None:
        store = await SqliteStore.open(tmp_path / "store.db")
        try:
            scheduling = ClusterScheduling(store, hold_s=0.0)
            claims = {}
            for info in nodes(4):
                scheduling.claimed(info.node_id, 0)
                claims[info.node_id] = ring.job_id
            now = 10_000
            first = scheduling.plan(now, [ring, high], nodes(4), claims)
            assert len(first.jobs["high"].nodes) == 3 and first.jobs["ring"].waiting
            idle = next(m.node_id for m in first.moves if not m.to_job)
            # The ring job lets the node bound for "idle" go first: it still names the taker.
            order = [idle] + sorted(n for n in claims if n != idle)
            named = {}
            for node_id in order:
                del claims[node_id]
                scheduling.released(node_id)
                named[node_id] = scheduling.moves_from(node_id, ring.job_id)
                now += 10
                plan = scheduling.plan(now, [ring, high], nodes(4), claims)
                # The taker claims what the new pass gives it and no other job holds.
                for n in plan.jobs["high"].nodes:
                    if n not in claims and sum(j == "high" for j in claims.values()) < 3:
                        scheduling.claimed(n, now)
                        claims[n] = high.job_id
            taken = sorted(n for n, j in claims.items() if j == "high")
            assert len(taken) == 3
            assert idle in taken  # the free node went first
            for n in taken:
                assert "high" in named[n], (n, named)
                assert "priority high" in named[n]["high"]
            assert scheduling.moves_from("n0", "nobody") == {}
        finally:
            await store.close()

    asyncio.run(run())
