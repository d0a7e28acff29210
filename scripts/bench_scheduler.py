"""A seeded multi-tenant trace run through the REAL cluster scheduler against a simulated round
clock, compared with first-come-first-served and an equal split. Prints one JSON line.

    .venv/bin/python scripts/bench_scheduler.py [--seeds 0,1,2] [--nodes 200] [--jobs 40]
                                                [--tenants 3] [--round-s 10] [--bench-s 5]

Model (simulated time, nothing sleeps):
- Nodes: a reference speed (log-normal) times a factor per (node type, job class): three node
  types and three job classes (transformer, conv, mlp), each type 3x faster on one class than
  on another. The scheduler sees the reference speed; a node's rate for a job becomes known
  (+-5% measurement error) only once its job benchmark there is in, as in the engine: a job
  no node has served yet is ranked on reference speeds alone.
- Jobs: tenants with weights 1, 2, 3, ...; arrivals spread over ``--arrival-s``; max_nodes
  4..64, min_nodes 1..8; work = max_nodes x a log-normal duration at the job's mean rate;
  priorities mostly normal, some low, a few high (at least two arrive mid-trace, when the
  cluster is busy).
- Round clock: at each boundary (every ``--round-s``) arrivals join, the policy assigns nodes,
  and each running job progresses by sum(rate x time) over its nodes; a node new to a job
  first benchmarks it for ``--bench-s`` (no work), so churn costs. A job finishing mid-round
  leaves its nodes idle until the next boundary. Progress is checkpointed at boundaries, so a
  preempted job loses nothing but its nodes.

Policies (same trace, same simulator):
- ours: `coordinator.scheduling.cluster_scheduler.schedule` with holdings carried over (a moved node is
  protected as long as the coordinator holds it, `coordinator.engine.cluster_scheduling.hold_seconds`: 3
  rounds, or its job benchmark paid back at 20 % overhead; against a tenant below its fair
  share only `share_hold_seconds`: 3 rounds),
  decayed tenant usage and attained service fed with each job's value x round_s, and each
  job's remaining samples (its size minus what it trained: what the engine knows from the
  job's epochs x dataset size; ``--unknown-sizes`` leaves them out, the scheduler then ranks
  a tenant's jobs by least attained service);
- fifo (the engine before issue 18, `Engine.claimable_nodes`): in submission order a job takes the free
  nodes it can use up to max_nodes, starting only with min_nodes free; an older job below its
  max_nodes blocks younger ones; no priorities, no preemption, a node stays until its job ends;
- equal: every live job the same number of nodes (max_nodes respected; a job whose share is
  below its min_nodes waits, newest first), re-split at every boundary, each job keeping the
  nodes it held where it can, the rest in node id order.

Figures: average job completion time (finish - arrival), makespan (last finish - first
arrival), the most round boundaries a normal-priority job of a tenant below its fair share
waited for its first nodes (`first_start_wait_rounds`: the tenant held fewer nodes in the
round before the job's arrival than its whole weighted max-min share of the nodes the high
tier left, all of them serving its other jobs as they asked; goal: the share hold plus one
benchmark, in rounds), Jain's index across tenants of (node-equivalents received / weight) averaged over
windows of ``--window-rounds`` rounds in which at least two tenants got less than they asked
for in every round (normal tier; also over all tiers), and the largest number of round
boundaries a high-priority job waited for its first nodes (0 = the first boundary after its
arrival).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from coordinator.engine.cluster_scheduling import hold_seconds, share_hold_seconds
from coordinator.scheduling.cluster_scheduler import (
    Holding,
    JobRequest,
    NodeOffer,
    Tenants,
    TenantUsage,
    Tier,
    schedule,
    water_fill,
)

log = logging.getLogger("bench_scheduler")

POLICIES = ("ours", "fifo", "equal")
JOB_CLASSES = ("transformer", "conv", "mlp")
# Speed factor per (node type, job class): each node type is 3x faster on one class than on
# another (e.g. tensor cores for transformers, large caches for convolutions).
CLASS_FACTOR = np.array(
    [
        [1.0, 0.6, 1 / 3],
        [1 / 3, 1.0, 0.6],
        [0.6, 1 / 3, 1.0],
    ]
)
MAX_NODES_CHOICES = (4, 8, 16, 32, 64)
MEASUREMENT_ERROR = 0.05
# Goals of the issue.
GOAL_JCT_SPEEDUP = 1.5
GOAL_JAIN = 0.95
GOAL_HIGH_WAIT_ROUNDS = 1


@dataclass(frozen=True)
class Config:
    seed: int = 0
    nodes: int = 200
    jobs: int = 40
    tenants: int = 3
    round_s: float = 10.0
    bench_s: float = 5.0
    arrival_s: float = 1200.0  # arrivals spread over this period
    duration_s: float = 300.0  # median job duration on max_nodes average nodes
    duration_sigma: float = 0.9
    speed_sigma: float = 0.35
    low_share: float = 0.15
    high_share: float = 0.07
    half_life_s: float = 3600.0
    window_rounds: int = 10
    max_rounds: int = 100_000
    known_sizes: bool = True  # ours is told each job's remaining samples (else: LAS)

    @property
    def protect_s(self) -> float:
        """The coordinator's derived hold (coordinator/scheduling.hold_seconds)."""
        return hold_seconds(self.round_s, self.bench_s)

    @property
    def share_protect_s(self) -> float:
        """The coordinator's hold against a tenant below its fair share."""
        return share_hold_seconds(self.round_s)

    @property
    def goal_first_start_rounds(self) -> int:
        """The share hold plus one job benchmark, in round boundaries."""
        return math.ceil(self.share_protect_s / self.round_s - 1e-9) + math.ceil(
            self.bench_s / self.round_s - 1e-9
        )


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    tenant: str
    tier: Tier
    job_class: int
    min_nodes: int
    max_nodes: int
    arrival_s: float
    size: float  # samples

    def request(self) -> JobRequest:
        return JobRequest(
            self.job_id,
            self.tenant,
            self.tier,
            self.min_nodes,
            self.max_nodes,
            round(self.arrival_s * 1000),
        )


@dataclass(frozen=True)
class Trace:
    jobs: list[TraceJob]
    node_ids: list[str]
    reference: dict[str, float]  # node -> reference benchmark (samples/s)
    rate: dict[tuple[str, str], float]  # (node, job) -> true samples/s
    measured: dict[tuple[str, str], float]  # (node, job) -> what a benchmark would report
    node_eq: dict[tuple[str, str], float]  # (node, job) -> rate / the job's mean rate
    weights: dict[str, float]
    kind: dict[str, str]  # node -> its device model (node type)


def make_trace(cfg: Config) -> Trace:
    """The seeded workload: the same for every policy."""
    rng = np.random.default_rng(cfg.seed)
    n, m = cfg.nodes, cfg.jobs
    node_ids = [f"n{i:04d}" for i in range(n)]
    node_type = rng.integers(0, len(CLASS_FACTOR), n)
    base = rng.lognormal(math.log(100.0), cfg.speed_sigma, n)
    tenants = [f"t{i}" for i in range(cfg.tenants)]
    weights = {t: float(i + 1) for i, t in enumerate(tenants)}
    arrival = np.sort(rng.uniform(0.0, cfg.arrival_s, m))
    arrival -= arrival[0]  # the trace starts with its first arrival
    tenant_of = rng.integers(0, cfg.tenants, m)
    job_class = rng.integers(0, len(JOB_CLASSES), m)
    scale = rng.lognormal(0.0, 0.5, m)  # samples/s of the model relative to the reference
    max_nodes = rng.choice(MAX_NODES_CHOICES, m)
    min_nodes = np.minimum(rng.integers(1, 9, m), max_nodes)
    duration = rng.lognormal(math.log(cfg.duration_s), cfg.duration_sigma, m)
    u = rng.random(m)
    tier = [
        Tier.LOW if x < cfg.low_share else Tier.HIGH if x > 1 - cfg.high_share else Tier.NORMAL
        for x in u
    ]
    # At least two high-priority jobs arrive mid-trace, when the queue is busy.
    for q in (0.4, 0.7):
        if sum(t == Tier.HIGH for t in tier) >= 2 or m < 4:
            break
        k = int(q * m)
        while tier[k] == Tier.HIGH:
            k += 1
        tier[k] = Tier.HIGH
    noise = rng.uniform(1 - MEASUREMENT_ERROR, 1 + MEASUREMENT_ERROR, (n, m))
    true = base[:, None] * CLASS_FACTOR[node_type][:, job_class] * scale[None, :]  # (n, m)
    mean = true.mean(axis=0)
    jobs = [
        TraceJob(
            job_id=f"j{k:03d}",
            tenant=tenants[int(tenant_of[k])],
            tier=tier[k],
            job_class=int(job_class[k]),
            min_nodes=int(min_nodes[k]),
            max_nodes=int(max_nodes[k]),
            arrival_s=float(arrival[k]),
            size=float(max_nodes[k] * duration[k] * mean[k]),
        )
        for k in range(m)
    ]
    rate, measured, node_eq = {}, {}, {}
    for i, nid in enumerate(node_ids):
        for k, job in enumerate(jobs):
            rate[(nid, job.job_id)] = float(true[i, k])
            measured[(nid, job.job_id)] = float(true[i, k] * noise[i, k])
            node_eq[(nid, job.job_id)] = float(true[i, k] / mean[k])
    return Trace(
        jobs=jobs,
        node_ids=node_ids,
        reference={nid: float(b) for nid, b in zip(node_ids, base, strict=True)},
        rate=rate,
        measured=measured,
        node_eq=node_eq,
        weights=weights,
        kind={nid: f"type-{int(t)}" for nid, t in zip(node_ids, node_type, strict=True)},
    )


# -- policies -----------------------------------------------------------------------------------


class Policy(Protocol):
    def assign(
        self,
        now_s: float,
        live: Sequence[TraceJob],
        held: Mapping[str, str],
        known: Mapping[str, Mapping[str, float]],
        done: Mapping[str, float],
    ) -> dict[str, str]:
        """node -> job for the coming round (`held`: last round's, live jobs only;
        `known`: node -> job -> measured rate; `done`: job -> samples trained so far)."""
        ...


class Ours:
    """The real scheduler, with the engine's side of the contract: holdings, usage."""

    def __init__(self, cfg: Config, trace: Trace) -> None:
        self.cfg = cfg
        self.trace = trace
        self.protected_until: dict[str, int] = {}  # node -> ms, set when it moved
        self.share_until: dict[str, int] = {}  # node -> ms, against tenants below their share
        self.usage = TenantUsage(cfg.half_life_s)
        self.attained: dict[str, float] = {}  # job -> node-equivalent seconds so far
        self.tenants = {j.job_id: j.tenant for j in trace.jobs}
        self.pass_ms: list[float] = []

    def assign(
        self,
        now_s: float,
        live: Sequence[TraceJob],
        held: Mapping[str, str],
        known: Mapping[str, Mapping[str, float]],
        done: Mapping[str, float],
    ) -> dict[str, str]:
        now_ms = round(now_s * 1000)
        live_ids = {j.job_id for j in live}
        jobs = [
            replace(
                j.request(),
                attained_s=self.attained.get(j.job_id, 0.0),
                remaining_samples=j.size - done[j.job_id] if self.cfg.known_sizes else None,
            )
            for j in live
        ]
        nodes = [
            NodeOffer(
                nid,
                self.trace.reference[nid],
                {j: r for j, r in known.get(nid, {}).items() if j in live_ids},
                kind=self.trace.kind[nid],
            )
            for nid in self.trace.node_ids
        ]
        holdings = {
            n: Holding(j, self.protected_until.get(n, 0), self.share_until.get(n, 0))
            for n, j in held.items()
        }
        tenants = Tenants(self.trace.weights, self.usage.snapshot(now_ms))
        t0 = time.perf_counter()
        plan = schedule(now_ms, jobs, nodes, holdings, tenants)
        self.pass_ms.append((time.perf_counter() - t0) * 1000)
        plan.check(jobs, nodes)
        owners = plan.owners()
        for n, j in owners.items():
            if held.get(n) != j:
                self.protected_until[n] = now_ms + round(self.cfg.protect_s * 1000)
                self.share_until[n] = now_ms + round(self.cfg.share_protect_s * 1000)
        for p in plan.jobs.values():
            if p.value > 0:
                self.usage.add(self.tenants[p.job_id], p.value * self.cfg.round_s, now_ms)
                self.attained[p.job_id] = (
                    self.attained.get(p.job_id, 0.0) + p.value * self.cfg.round_s
                )
        return owners


class Fifo:
    """Today's engine: submission order, an older job below its max_nodes blocks younger
    ones, no preemption."""

    def __init__(self, trace: Trace) -> None:
        self.node_ids = trace.node_ids

    def assign(
        self,
        now_s: float,
        live: Sequence[TraceJob],
        held: Mapping[str, str],
        known: Mapping[str, Mapping[str, float]],
        done: Mapping[str, float],
    ) -> dict[str, str]:
        out = dict(held)
        free = [n for n in self.node_ids if n not in out]
        count = {j.job_id: 0 for j in live}
        for j in out.values():
            count[j] += 1
        for job in sorted(live, key=lambda j: (j.arrival_s, j.job_id)):
            have = count[job.job_id]
            if have or len(free) >= job.min_nodes:
                take = min(len(free), job.max_nodes - have)
                for n in free[:take]:
                    out[n] = job.job_id
                free = free[take:]
                count[job.job_id] += take
            if count[job.job_id] < job.max_nodes:
                break  # older jobs claim first
        return out


class Equal:
    """Every live job the same number of nodes (no tiers), re-split every boundary."""

    def __init__(self, trace: Trace) -> None:
        self.node_ids = trace.node_ids

    def assign(
        self,
        now_s: float,
        live: Sequence[TraceJob],
        held: Mapping[str, str],
        known: Mapping[str, Mapping[str, float]],
        done: Mapping[str, float],
    ) -> dict[str, str]:
        active = sorted(live, key=lambda j: (j.arrival_s, j.job_id))
        while True:
            counts = equal_counts(active, len(self.node_ids))
            short = [j for j in active if counts[j.job_id] < j.min_nodes]
            if not short:
                break
            active.remove(short[-1])  # the newest job that cannot start waits
        out: dict[str, str] = {}
        for job in active:
            mine = sorted(n for n, j in held.items() if j == job.job_id)
            for n in mine[: counts[job.job_id]]:
                out[n] = job.job_id
        free = iter(n for n in self.node_ids if n not in out)
        for job in active:
            want = counts[job.job_id] - sum(1 for j in out.values() if j == job.job_id)
            for _ in range(want):
                out[next(free)] = job.job_id
        return out


def equal_counts(jobs: Sequence[TraceJob], nodes: int) -> dict[str, int]:
    """Round-robin in submission order up to each job's max_nodes."""
    counts = {j.job_id: 0 for j in jobs}
    wanting = list(jobs)
    left = nodes
    while left and wanting:
        for job in list(wanting):
            if not left:
                break
            counts[job.job_id] += 1
            left -= 1
            if counts[job.job_id] >= job.max_nodes:
                wanting.remove(job)
    return counts


# -- the simulator ------------------------------------------------------------------------------


@dataclass
class Run:
    policy: str
    finish_s: dict[str, float] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)  # samples trained
    first_round: dict[str, int] = field(default_factory=dict)  # first round with nodes
    rounds: int = 0
    node_moves: int = 0  # node newly given to a job (each pays a benchmark)
    # per round: tenant -> (demand in nodes, nodes got, node-equivalents got), by tier group
    demand: list[dict[str, tuple[int, int, float]]] = field(default_factory=list)
    demand_normal: list[dict[str, tuple[int, int, float]]] = field(default_factory=list)
    high_nodes: list[int] = field(default_factory=list)  # per round: nodes of high-tier jobs
    pass_ms: list[float] = field(default_factory=list)


def make_policy(name: str, cfg: Config, trace: Trace) -> Policy:
    if name == "ours":
        return Ours(cfg, trace)
    if name == "fifo":
        return Fifo(trace)
    if name == "equal":
        return Equal(trace)
    raise ValueError(f"unknown policy {name!r}")


def simulate(cfg: Config, trace: Trace, name: str) -> Run:
    """Run the trace under one policy on the round clock until every job has finished."""
    policy = make_policy(name, cfg, trace)
    run = Run(policy=name)
    pending = sorted(trace.jobs, key=lambda j: (j.arrival_s, j.job_id))
    live: list[TraceJob] = []
    done = {j.job_id: 0.0 for j in trace.jobs}
    known: dict[str, dict[str, float]] = {}
    held: dict[str, str] = {}
    k = 0
    while pending or live:
        if k >= cfg.max_rounds:
            raise RuntimeError(f"{name}: jobs left after {k} rounds")
        now = k * cfg.round_s
        while pending and pending[0].arrival_s <= now + 1e-9:
            live.append(pending.pop(0))
        owners = policy.assign(now, live, held, known, done)
        by_job: dict[str, list[str]] = {}
        for n, j in owners.items():
            by_job.setdefault(j, []).append(n)
        _record_shares(run, trace, live, by_job)
        for job in list(live):
            mine = by_job.get(job.job_id, [])
            if not mine:
                continue
            run.first_round.setdefault(job.job_id, k)
            old = [n for n in mine if held.get(n) == job.job_id]
            new = [n for n in mine if held.get(n) != job.job_id]
            run.node_moves += len(new)
            r0 = sum(trace.rate[(n, job.job_id)] for n in old)
            r1 = sum(trace.rate[(n, job.job_id)] for n in new)
            bench = min(cfg.bench_s, cfg.round_s)
            left = job.size - done[job.job_id]
            work = r0 * cfg.round_s + r1 * (cfg.round_s - bench)
            for n in new:  # the benchmark (and the round's own timing) tells its rate
                known.setdefault(n, {})[job.job_id] = trace.measured[(n, job.job_id)]
            if work < left:
                done[job.job_id] += work
                continue
            if r0 * bench >= left:
                t = left / r0
            else:
                t = bench + (left - r0 * bench) / (r0 + r1)
            done[job.job_id] = job.size
            run.finish_s[job.job_id] = now + t
            live.remove(job)
        live_ids = {j.job_id for j in live}
        held = {n: j for n, j in owners.items() if j in live_ids}
        k += 1
    run.rounds = k
    run.done = done
    if isinstance(policy, Ours):
        run.pass_ms = policy.pass_ms
    return run


def _record_shares(
    run: Run, trace: Trace, live: Sequence[TraceJob], by_job: Mapping[str, list[str]]
) -> None:
    run.high_nodes.append(sum(len(by_job.get(j.job_id, [])) for j in live if j.tier == Tier.HIGH))
    for target, only_normal in ((run.demand, False), (run.demand_normal, True)):
        row: dict[str, tuple[int, int, float]] = {}
        for job in live:
            if only_normal and job.tier != Tier.NORMAL:
                continue
            mine = by_job.get(job.job_id, [])
            want, got, value = row.get(job.tenant, (0, 0, 0.0))
            row[job.tenant] = (
                want + job.max_nodes,
                got + len(mine),
                value + sum(trace.node_eq[(n, job.job_id)] for n in mine),
            )
        target.append(row)


# -- figures ------------------------------------------------------------------------------------


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one gets everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares > 0 else 1.0


def windowed_jain(
    rows: Sequence[Mapping[str, tuple[int, int, float]]],
    weights: Mapping[str, float],
    window: int,
) -> tuple[float | None, int]:
    """Mean over windows of Jain's index of (node-equivalents / weight) across the tenants that
    got less than they asked for in every round of the window (at least two of them);
    (None, 0) when no window is contended."""
    out = []
    for start in range(0, len(rows) - window + 1, window):
        chunk = rows[start : start + window]
        tenants = set(weights)
        for row in chunk:
            tenants &= {t for t, (want, got, _) in row.items() if got < want}
        if len(tenants) < 2:
            continue
        out.append(jain([sum(row[t][2] for row in chunk) / weights[t] for t in sorted(tenants)]))
    return (statistics.fmean(out) if out else None), len(out)


def high_priority_wait(cfg: Config, trace: Trace, run: Run) -> int | None:
    """The most round boundaries a high-priority job waited for its first nodes."""
    waits = [
        run.first_round[j.job_id] - math.ceil(j.arrival_s / cfg.round_s - 1e-9)
        for j in trace.jobs
        if j.tier == Tier.HIGH
    ]
    return max(waits) if waits else None


def first_start_wait(cfg: Config, trace: Trace, run: Run) -> int | None:
    """The most round boundaries a normal-priority job waited for its first nodes when its
    tenant held fewer nodes in the round before its arrival than its whole weighted max-min
    share (of the nodes the high tier left, between the tenants with normal jobs then) and
    its other jobs had all they asked for (a tenant's own jobs take turns by expected
    remaining work: that is no fair-share wait); None when no job arrived so."""
    waits = []
    for j in trace.jobs:
        k0 = math.ceil(j.arrival_s / cfg.round_s - 1e-9)
        if j.tier != Tier.NORMAL or k0 >= len(run.demand_normal):
            continue
        row = run.demand_normal[k0]  # the live normal jobs' demand at its arrival
        demand = {t: float(want) for t, (want, _, _) in row.items()}
        capacity = float(cfg.nodes - run.high_nodes[k0])
        share = water_fill(demand, {t: trace.weights[t] for t in demand}, capacity)
        want, before, _ = run.demand_normal[k0 - 1].get(j.tenant, (0, 0, 0.0)) if k0 else (0, 0, 0)
        # the tenant's other jobs had what they asked for: the shortfall is this job's
        if before == want and before < math.floor(share.get(j.tenant, 0.0) + 1e-9):
            waits.append(run.first_round[j.job_id] - k0)
    return max(waits) if waits else None


def figures(cfg: Config, trace: Trace, run: Run) -> dict[str, object]:
    arrival = {j.job_id: j.arrival_s for j in trace.jobs}
    jct = [run.finish_s[j] - arrival[j] for j in arrival]
    by_tier = {
        tier.label: statistics.fmean(
            run.finish_s[j.job_id] - j.arrival_s for j in trace.jobs if j.tier == tier
        )
        for tier in Tier
        if any(j.tier == tier for j in trace.jobs)
    }
    jain_normal, windows = windowed_jain(run.demand_normal, trace.weights, cfg.window_rounds)
    jain_all, windows_all = windowed_jain(run.demand, trace.weights, cfg.window_rounds)
    return {
        "avg_jct_s": statistics.fmean(jct),
        "median_jct_s": statistics.median(jct),
        "avg_jct_s_by_priority": by_tier,
        "makespan_s": max(run.finish_s.values()) - min(arrival.values()),
        "jain_index": jain_normal,
        "jain_windows": windows,
        "jain_index_all_tiers": jain_all,
        "jain_windows_all_tiers": windows_all,
        "high_priority_wait_rounds": high_priority_wait(cfg, trace, run),
        "first_start_wait_rounds": first_start_wait(cfg, trace, run),
        "node_moves": run.node_moves,
        "rounds": run.rounds,
    }


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return round(value, 4 if abs(value) < 10 else 1)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def run_all(cfg: Config) -> tuple[dict[str, object], dict[str, Run], Trace]:
    """Simulate every policy on the seeded trace: (the JSON figures, the runs, the trace)."""
    t0 = time.perf_counter()
    trace = make_trace(cfg)
    runs = {name: simulate(cfg, trace, name) for name in POLICIES}
    per = {name: figures(cfg, trace, r) for name, r in runs.items()}
    ours = per["ours"]
    speedup_fifo = per["fifo"]["avg_jct_s"] / ours["avg_jct_s"]  # type: ignore[operator]
    speedup_equal = per["equal"]["avg_jct_s"] / ours["avg_jct_s"]  # type: ignore[operator]
    jain_ours = ours["jain_index"]
    hp_wait = ours["high_priority_wait_rounds"]
    first_wait = ours["first_start_wait_rounds"]
    passes = runs["ours"].pass_ms
    demand = [sum(w for w, _, _ in row.values()) for row in runs["ours"].demand]
    out: dict[str, object] = {
        "seed": cfg.seed,
        "nodes": cfg.nodes,
        "jobs": cfg.jobs,
        "tenants": cfg.tenants,
        "tenant_weights": trace.weights,
        "round_s": cfg.round_s,
        "bench_s": cfg.bench_s,
        "known_sizes": cfg.known_sizes,
        "protect_s": cfg.protect_s,
        "share_protect_s": cfg.share_protect_s,
        "jobs_by_priority": {
            t.label: sum(j.tier == t for j in trace.jobs) for t in sorted(Tier, reverse=True)
        },
        "overloaded_rounds_share": sum(d > cfg.nodes for d in demand) / len(demand),
        "avg_jct_s": {name: per[name]["avg_jct_s"] for name in POLICIES},
        "makespan_s": {name: per[name]["makespan_s"] for name in POLICIES},
        "jct_speedup_vs_fifo": speedup_fifo,
        "jct_speedup_vs_equal": speedup_equal,
        "jain_index": jain_ours,
        "high_priority_wait_rounds": hp_wait,
        "first_start_wait_rounds": first_wait,
        "goal_first_start_wait_rounds": cfg.goal_first_start_rounds,
        "goals_met": {
            "jct_speedup_vs_fifo": speedup_fifo >= GOAL_JCT_SPEEDUP,
            "jain_index": jain_ours is not None and jain_ours >= GOAL_JAIN,  # type: ignore[operator]
            "high_priority_wait_rounds": hp_wait is not None and hp_wait <= GOAL_HIGH_WAIT_ROUNDS,  # type: ignore[operator]
            "first_start_wait_rounds": first_wait is None
            or first_wait <= cfg.goal_first_start_rounds,  # type: ignore[operator]
        },
        "per_policy": per,
        "scheduler_pass_ms": {
            "mean": statistics.fmean(passes),
            "max": max(passes),
            "passes": len(passes),
        },
    }
    out["bench_seconds"] = time.perf_counter() - t0
    return _rounded(out), runs, trace  # type: ignore[return-value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = Config()
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",") if x.strip()],
        default=[0, 1, 2],
        help="comma-separated seeds (default 0,1,2): medians and worst cases over them; "
        "--seeds '' runs --seed alone with every figure",
    )
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--jobs", type=int, default=d.jobs)
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--round-s", type=float, default=d.round_s)
    p.add_argument("--bench-s", type=float, default=d.bench_s, help="a node's job benchmark")
    p.add_argument("--arrival-s", type=float, default=d.arrival_s)
    p.add_argument("--duration-s", type=float, default=d.duration_s)
    p.add_argument("--window-rounds", type=int, default=d.window_rounds)
    p.add_argument(
        "--unknown-sizes",
        action="store_true",
        help="do not tell the scheduler the jobs' remaining samples",
    )
    a = p.parse_args()
    if not 0 <= a.bench_s <= a.round_s:
        p.error("--bench-s must be between 0 and --round-s")
    if a.nodes < 1 or a.jobs < 1 or a.tenants < 1:
        p.error("--nodes, --jobs and --tenants must be positive")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s bench_scheduler: %(message)s", stream=sys.stderr
    )
    cfg = Config(
        seed=a.seed,
        nodes=a.nodes,
        jobs=a.jobs,
        tenants=a.tenants,
        round_s=a.round_s,
        bench_s=a.bench_s,
        arrival_s=a.arrival_s,
        duration_s=a.duration_s,
        window_rounds=a.window_rounds,
        known_sizes=not a.unknown_sizes,
    )
    seeds = a.seeds if a.seeds else [a.seed]
    outs = []
    for seed in seeds:
        out, _, _ = run_all(replace(cfg, seed=seed))
        for name, fig in out["per_policy"].items():  # type: ignore[attr-defined]
            log.info(
                "seed %d, %s: avg JCT %.0f s, makespan %.0f s, jain %s, high-priority wait %s, "
                "%d node moves",
                seed,
                name,
                fig["avg_jct_s"],
                fig["makespan_s"],
                fig["jain_index"],
                fig["high_priority_wait_rounds"],
                fig["node_moves"],
            )
        outs.append(out)
    print(json.dumps(combine(outs) if len(outs) > 1 else outs[0]))


def combine(outs: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """Several seeds' figures in one line: the median speedups, the worst Jain index and
    high-priority wait, whether the goals hold on those, and each seed's headline figures."""
    speedups = [float(o["jct_speedup_vs_fifo"]) for o in outs]  # type: ignore[arg-type]
    jains = [o["jain_index"] for o in outs if o["jain_index"] is not None]
    waits = [o["high_priority_wait_rounds"] for o in outs]
    speedup = statistics.median(speedups)
    jain_worst = min(jains) if jains else None  # type: ignore[type-var]
    wait_worst = None if None in waits else max(waits)  # type: ignore[type-var]
    first_waits = [
        o["first_start_wait_rounds"] for o in outs if o["first_start_wait_rounds"] is not None
    ]
    first_worst = max(first_waits) if first_waits else None  # type: ignore[type-var]
    first_goal = outs[0]["goal_first_start_wait_rounds"]
    keys = (
        "seed",
        "avg_jct_s",
        "makespan_s",
        "jct_speedup_vs_fifo",
        "jct_speedup_vs_equal",
        "jain_index",
        "high_priority_wait_rounds",
        "first_start_wait_rounds",
        "goals_met",
    )
    first = outs[0]
    return _rounded(  # type: ignore[return-value]
        {
            **{
                k: first[k]
                for k in ("nodes", "jobs", "tenants", "tenant_weights", "round_s", "known_sizes")
            },
            "seeds": [o["seed"] for o in outs],
            "jct_speedup_vs_fifo": speedup,
            "jct_speedup_vs_fifo_range": [min(speedups), max(speedups)],
            "jct_speedup_vs_equal": statistics.median(
                float(o["jct_speedup_vs_equal"])
                for o in outs  # type: ignore[arg-type]
            ),
            "jain_index": jain_worst,
            "high_priority_wait_rounds": wait_worst,
            "first_start_wait_rounds": first_worst,
            "goal_first_start_wait_rounds": first_goal,
            "goals_met": {
                "jct_speedup_vs_fifo": speedup >= GOAL_JCT_SPEEDUP,
                "jain_index": jain_worst is not None and jain_worst >= GOAL_JAIN,
                "high_priority_wait_rounds": wait_worst is not None
                and wait_worst <= GOAL_HIGH_WAIT_ROUNDS,
                "first_start_wait_rounds": first_worst is None or first_worst <= first_goal,  # type: ignore[operator]
            },
            "per_seed": [
                {
                    **{k: o[k] for k in keys},
                    "node_moves": {
                        name: fig["node_moves"]  # type: ignore[index]
                        for name, fig in o["per_policy"].items()  # type: ignore[attr-defined]
                    },
                }
                for o in outs
            ],
        }
    )


if __name__ == "__main__":
    main()
