"""How long a job keeps a node it claimed (coordinator/engine/cluster_scheduling.py): derived from the job's
round time and the node's job benchmark unless the operator fixed it, and honoured by the
scheduler's passes (a node within its hold is not moved to a same-tier job)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.engine.cluster_scheduling import (
    HOLD_ROUNDS,
    MAX_BENCH_OVERHEAD,
    MIN_HOLD_S,
    ClusterScheduling,
    hold_seconds,
    share_hold_seconds,
)
from coordinator.store.sqlite import SqliteStore
from epochmesh.v1 import common_pb2

pytestmark = pytest.mark.timeout(30)


@dataclass
class Runner:
    """A job as the scheduler reads it (the ScheduledJob protocol), with chosen timings."""

    job_id: str
    owner: str
    created_ms: int
    round_s: float = 0.0
    bench_s: dict[str, float] = field(default_factory=dict)
    bench: dict[str, common_pb2.BenchmarkResult] = field(default_factory=dict)
    terminal: bool = False
    budget_paused: bool = False

    def __post_init__(self) -> None:
        self.spec = common_pb2.JobSpec(
            min_nodes=1, max_nodes=4, global_batch=64, priority="normal", epochs=1
        )
        self.job = common_pb2.Job(
            job_id=self.job_id, owner=self.owner, created_ms=self.created_ms, spec=self.spec
        )

    def round_seconds(self) -> float:
        return self.round_s

    def bench_seconds(self, node_id: str) -> float:
        return self.bench_s.get(node_id, 0.0)


def nodes(n: int) -> list[common_pb2.NodeInfo]:
    return [
        common_pb2.NodeInfo(
            node_id=f"n{i}", benchmark=common_pb2.BenchmarkResult(samples_per_second=100.0)
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("round_s", "bench_s", "expected"),
    [
        (0.0, 0.0, MIN_HOLD_S),  # nothing known yet: the floor
        (2.0, 0.0, HOLD_ROUNDS * 2.0),  # a few rounds
        (0.1, 3.0, 3.0 / MAX_BENCH_OVERHEAD),  # the benchmark paid back
        (10.0, 3.0, HOLD_ROUNDS * 10.0),  # whichever is longer
    ],
)
def test_a_hold_is_a_few_rounds_or_a_paid_back_benchmark(
    round_s: float, bench_s: float, expected: float
) -> None:
    assert hold_seconds(round_s, bench_s) == pytest.approx(expected)


def plan_after_claims(
    tmp_path: Path, hold_s: float | None, a: Runner, b: Runner, at_ms: int
) -> dict[str, list[str]]:
    """A holds all four nodes, claimed at t=0; B arrives. Who has which nodes at ``at_ms``?"""

    async def run() -> dict[str, list[str]]:
        store = await SqliteStore.open(tmp_path / "store.db")
        try:
            scheduling = ClusterScheduling(store, hold_s)
            claims = {}
            for info in nodes(4):
                scheduling.claimed(info.node_id, 0)
                claims[info.node_id] = a.job_id
            plan = scheduling.plan(at_ms, [a, b], nodes(4), claims)
            return {j: sorted(p.nodes) for j, p in plan.jobs.items()}
        finally:
            await store.close()

    return asyncio.run(run())


def test_a_benchmark_payback_does_not_keep_a_tenant_below_its_share_waiting(
    tmp_path: Path,
) -> None:
    a = Runner("a", "alice", 0, round_s=0.5, bench_s={f"n{i}": 4.0 for i in range(4)})
    b = Runner("b", "bob", 1)
    # 4 s of benchmark: held for 20 s, but against B's fair share only for 3 rounds (1.5 s).
    assert share_hold_seconds(0.5) == pytest.approx(1.5)
    assert hold_seconds(0.5, 4.0) == pytest.approx(20.0)
    early = plan_after_claims(tmp_path, None, a, b, at_ms=1_000)
    assert len(early["a"]) == 4 and early["b"] == []
    late = plan_after_claims(tmp_path, None, a, b, at_ms=2_000)
    assert len(late["a"]) == 2 and len(late["b"]) == 2


def test_slow_rounds_hold_longer_than_the_benchmark(tmp_path: Path) -> None:
    a = Runner("a", "alice", 0, round_s=20.0, bench_s={f"n{i}": 1.0 for i in range(4)})
    b = Runner("b", "bob", 1)
    held = plan_after_claims(tmp_path, None, a, b, at_ms=50_000)  # 3 rounds = 60 s
    assert len(held["a"]) == 4
    moved = plan_after_claims(tmp_path, None, a, b, at_ms=61_000)
    assert len(moved["b"]) == 2


def test_an_operators_fixed_hold_overrides_the_derived_one(tmp_path: Path) -> None:
    a = Runner("a", "alice", 0, round_s=20.0, bench_s={f"n{i}": 10.0 for i in range(4)})
    b = Runner("b", "bob", 1)
    moved = plan_after_claims(tmp_path, 2.0, a, b, at_ms=3_000)
    assert len(moved["a"]) == 2 and len(moved["b"]) == 2
