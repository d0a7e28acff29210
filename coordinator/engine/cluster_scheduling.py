"""The engine's side of the cluster scheduler: its inputs kept between passes and persisted.

`ClusterScheduling` turns the live runners, the registry's eligible nodes and the node claims
into a `coordinator.scheduling.cluster_scheduler.schedule` pass, and keeps what a pass needs from the
past: when each node was claimed (its hold), each tenant's decayed usage and each job's
attained service (both accounted from the value of the nodes the last plan gave each job, for
the time since), and the operators' tenant weights. Weights persist at once; usage and
attained service every SAVE_EVERY_S (after a restart a little of either may be forgotten).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from coordinator.accounting.billing import per_credit
from coordinator.nodes.kinds import node_kind
from coordinator.scheduling.cluster_scheduler import (
    Holding,
    JobRequest,
    NodeOffer,
    Plan,
    Tenants,
    TenantUsage,
    check_weight,
    schedule,
    tier_of,
)
from coordinator.store.base import Store
from epochmesh.quote import max_price_of
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

SAVE_EVERY_S = 10.0
# Hysteresis: a node a job claimed stays with it (against moves within its tier) for at least
# HOLD_ROUNDS of the job's rounds, and long enough that its job benchmark costs at most
# MAX_BENCH_OVERHEAD of its time with the job; never less than MIN_HOLD_S.
HOLD_ROUNDS = 3
MAX_BENCH_OVERHEAD = 0.2
MIN_HOLD_S = 1.0
# A pass is reused until something it reads changes (a claim, a release, a job starting or
# ending, a benchmark, a weight, a priority: `invalidate`) or it is this old (node states the engine is not told
# of, holds running out). Every runner asks for the plan at each of its rounds.
MAX_PLAN_AGE_MS = 1000
STATE_KEY = "usage"


class ScheduledJob(Protocol):
    """What the scheduler reads of a job runner."""

    job_id: str
    job: common_pb2.Job
    spec: common_pb2.JobSpec
    budget_paused: bool  # paused until its budget is topped up: it wants no node

    @property
    def bench(self) -> Mapping[str, common_pb2.BenchmarkResult]:
        """The nodes' benchmarks on the job's program."""
        ...

    @property
    def terminal(self) -> bool: ...

    def round_seconds(self) -> float:
        """How long the job's rounds take lately (0: none yet)."""
        ...

    def bench_seconds(self, node_id: str) -> float:
        """How long the node's job benchmark took (so far, while it runs; 0: none)."""
        ...


def hold_seconds(round_s: float, bench_s: float) -> float:
    """How long a job keeps a node it claimed, against moves within its tier: HOLD_ROUNDS of
    its rounds of ``round_s``, and long enough to pay back a job benchmark of ``bench_s``."""
    return max(MIN_HOLD_S, HOLD_ROUNDS * round_s, bench_s / MAX_BENCH_OVERHEAD)


def share_hold_seconds(round_s: float) -> float:
    """How long a job keeps a node it claimed against a tenant of its tier below its fair
    share, while its own tenant is above its share: HOLD_ROUNDS of its rounds of ``round_s``
    (no benchmark payback: a job benchmark that takes long, e.g. a cold sandbox, must not
    keep a new tenant waiting for minutes)."""
    return max(MIN_HOLD_S, HOLD_ROUNDS * round_s)


@dataclass(frozen=True)
class Preemption:
    job_id: str
    nodes: tuple[str, ...]
    reason: str


class ClusterScheduling:
    def __init__(self, store: Store, hold_s: float | None) -> None:
        """``hold_s``: a fixed hold for every claim, or None to derive it (`hold_seconds`)."""
        self.store = store
        self.hold_s = hold_s
        self.weights: dict[str, float] = {}
        self.usage = TenantUsage()
        self.attained: dict[str, float] = {}  # job -> node-equivalent seconds of service
        self.claimed_ms: dict[str, int] = {}  # node -> when its job claimed it
        self.last_plan: Plan | None = None
        self._tenant_of: dict[str, str] = {}
        self._accounted_ms: int | None = None
        self._saved_ms = 0
        self._announced: dict[str, tuple[str, ...]] = {}  # job -> nodes announced preempted
        self._planned_ms = 0
        self._stale = True

    async def load(self) -> None:
        self.weights = await self.store.list_tenant_weights()
        raw = await self.store.get_scheduler_state(STATE_KEY)
        if raw is None:
            return
        try:
            state = json.loads(raw)
            self.usage = TenantUsage.from_state(state["usage"])
            self.attained = {str(k): float(v) for k, v in state["attained"].items()}
        except (ValueError, KeyError, TypeError) as e:
            log.warning("scheduler state unreadable (%s): usage starts afresh", e)

    async def save_if_due(self, now_ms: int, live_jobs: Iterable[str]) -> None:
        if now_ms - self._saved_ms < SAVE_EVERY_S * 1000:
            return
        self._saved_ms = now_ms
        live = set(live_jobs)
        self.attained = {j: v for j, v in self.attained.items() if j in live}
        state = {"usage": self.usage.to_state(), "attained": self.attained}
        await self.store.put_scheduler_state(STATE_KEY, json.dumps(state).encode())

    async def set_weight(self, tenant: str, weight: float) -> float:
        """ValueError for a weight that is not a positive number."""
        if not tenant:
            raise ValueError("name the tenant (the principal id that submits its jobs)")
        weight = check_weight(weight)
        await self.store.set_tenant_weight(tenant, weight)
        self.weights[tenant] = weight
        self.invalidate()
        return weight

    # -- claims ---------------------------------------------------------------------------------

    def claimed(self, node_id: str, now_ms: int) -> None:
        self.claimed_ms[node_id] = now_ms
        self.invalidate()

    def released(self, node_id: str) -> None:
        self.claimed_ms.pop(node_id, None)
        self.invalidate()

    def invalidate(self) -> None:
        """The next `plan` call runs a new pass."""
        self._stale = True

    # -- a pass ---------------------------------------------------------------------------------

    def _account(self, now_ms: int) -> None:
        """Usage and attained service since the last pass, from the last plan's values."""
        if self._accounted_ms is not None and self.last_plan is not None:
            dt = max(0, now_ms - self._accounted_ms) / 1000
            for p in self.last_plan.jobs.values():
                if p.value > 0 and dt > 0:
                    self.attained[p.job_id] = self.attained.get(p.job_id, 0.0) + p.value * dt
                    tenant = self._tenant_of.get(p.job_id)
                    if tenant is not None:
                        self.usage.add(tenant, p.value * dt, now_ms)
        self._accounted_ms = now_ms

    def plan(
        self,
        now_ms: int,
        runners: Iterable[ScheduledJob],
        eligible: Iterable[common_pb2.NodeInfo],
        claims: Mapping[str, str],
    ) -> Plan:
        """The last pass while nothing it reads has changed (see MAX_PLAN_AGE_MS), else a
        new one."""
        live = [r for r in runners if not r.terminal]
        fresh = now_ms - self._planned_ms < MAX_PLAN_AGE_MS
        plan = self.last_plan
        if plan is not None and not self._stale and fresh and len(plan.jobs) == len(live):
            return plan  # (a job that ended leaves the plan at once)
        self._stale = False
        self._planned_ms = now_ms
        self._account(now_ms)
        jobs = []
        for r in live:
            spec = r.spec
            self._tenant_of[r.job_id] = r.job.owner
            jobs.append(
                JobRequest(
                    job_id=r.job_id,
                    tenant=r.job.owner,
                    tier=tier_of(spec.priority),
                    min_nodes=spec.min_nodes,
                    max_nodes=max(spec.min_nodes, min(spec.max_nodes, spec.global_batch)),
                    submitted_ms=r.job.created_ms,
                    attained_s=self.attained.get(r.job_id, 0.0),
                    remaining_samples=float(
                        max(0, spec.epochs * r.job.num_samples - r.job.samples_done)
                    ),
                    max_price=max_price_of(spec),
                    per_credit=per_credit(spec),
                    hold_reason=r.job.message if r.budget_paused else "",
                )
            )
        nodes = [
            NodeOffer(
                node_id=info.node_id,
                reference_rate=info.benchmark.samples_per_second,
                job_rates={
                    r.job_id: r.bench[info.node_id].samples_per_second
                    for r in live
                    if info.node_id in r.bench
                },
                kind=node_kind(info),
                price=info.price_micro_per_hour,
            )
            for info in eligible
        ]
        by_id = {r.job_id: r for r in live}
        holdings = {}
        for n, job_id in claims.items():
            claimed = self.claimed_ms.get(n, 0)
            hold_ms, share_ms = self._hold_ms(by_id.get(job_id), n)
            holdings[n] = Holding(job_id, claimed + hold_ms, claimed + share_ms)
        tenants = Tenants(self.weights, self.usage.snapshot(now_ms))
        self.last_plan = schedule(now_ms, jobs, nodes, holdings, tenants)
        return self.last_plan

    def _hold_ms(self, runner: ScheduledJob | None, node_id: str) -> tuple[int, int]:
        """(the node's hold, its hold against a tenant below its fair share), ms."""
        if self.hold_s is not None:
            return int(self.hold_s * 1000), int(self.hold_s * 1000)
        if runner is None:
            return 0, 0
        round_s = runner.round_seconds()
        hold = hold_seconds(round_s, runner.bench_seconds(node_id))
        return int(1000 * hold), int(1000 * share_hold_seconds(round_s))

    def preemption(self, job_id: str, claims: Mapping[str, str]) -> Preemption | None:
        """The nodes the last plan takes from `job_id` for other jobs (once per change)."""
        plan = self.last_plan
        if plan is None:
            return None
        moves = [m for m in plan.moves if m.from_job == job_id and m.to_job]
        nodes = tuple(sorted(m.node_id for m in moves if claims.get(m.node_id) == job_id))
        if not nodes or self._announced.get(job_id) == nodes:
            return None
        self._announced[job_id] = nodes
        reasons = sorted({m.reason for m in moves if m.node_id in nodes})
        return Preemption(job_id, nodes, "; ".join(reasons))

    def moves_from(self, node_id: str, job_id: str) -> dict[str, str]:
        """Where the last plan sends `job_id`'s nodes: other job -> the reason, `node_id`'s own
        move first. A node a job lets go may be claimed by any of them: once one node is free,
        the next pass gives the taker that node rather than one the job still holds."""
        plan = self.last_plan
        if plan is None:
            return {}
        moves = sorted(
            (m for m in plan.moves if m.from_job == job_id and m.to_job),
            key=lambda m: (m.node_id != node_id, m.node_id),
        )
        found: dict[str, str] = {}
        for m in moves:
            found.setdefault(m.to_job, m.reason)
        return found
