"""The cluster scheduler: which nodes serve which job (pure logic: no clock, no I/O).

`schedule(now_ms, jobs, nodes, holdings, tenants)` returns a `Plan`: every live job's nodes
and the reason for what it got, and the nodes that change hands with the reason for each
move. The engine runs a pass when a job arrives or ends, a node joins or leaves, and at round
boundaries; job runners only use the nodes the plan gives them.

Policy:

- Tiers `high` > `normal` > `low` are served in that order: a tier takes nodes from lower tiers
  (free nodes first), never the other way round.
- Within a tier, weighted max-min fairness between tenants by progressive filling, counted in
  *effective throughput*: a node is worth `rate(node, job) / mean rate of the job over the
  cluster` node-equivalents to a job (its own job benchmark where one exists, else its
  reference benchmark scaled by the job's median measured/reference ratio). The tenant with
  the least value per weight takes the next node; among its jobs the one expected to finish
  soonest (shortest remaining work: `remaining_samples` over the job's mean rate where the
  engine knows it, else least attained service, Tiresias), then the one holding the least.
  Each job takes the node where its comparative advantage is largest (its normalized rate
  over the best normalized rate any other wanting job of the tier has there), so a node much
  faster for job A than for job B tends to go to A (Gavel).
  Ties between tenants go to the one with the least decayed usage per weight (`TenantUsage`,
  Slurm's fair-share half-life).
- Gang start: a job holds either at least `min_nodes` nodes or none. A job with no node
  starts at its turn with its min_nodes together if that many are still free, else it waits.
  Jobs holding protected nodes keep at least their min_nodes (as many as fit).
- Exchange: after filling, two jobs (of any tiers) swap nodes where both run faster and the
  product of their speed-ups is at least EXCHANGE_GAIN; node counts do not change, so no job
  loses and fairness holds (comparative advantage, as Gavel's throughput-maximizing
  placement).
- Hysteresis: a node a job got recently (`Holding.protected_until_ms`) stays with it while the
  job lives, unless a higher tier needs it. The engine sets the protection so that a node
  does not move more than once per few rounds and pays back its job benchmark. A node a job
  holds counts STICKINESS times faster for it when it picks nodes.
- Fair shares first: while a tenant of the tier holds fewer nodes than its fair share (whole
  nodes) and wants more, the nodes of a tenant above its share (beyond its share rounded up,
  the slowest for their jobs first) stay protected only until `Holding.share_until_ms` (the
  engine: a few of the job's rounds, not the benchmark payback), so a new tenant's first job
  takes them at their next round boundary after that and is benchmarked on them then, however
  long its holder's hold.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from epochmesh.money import format_credits

DEFAULT_HALF_LIFE_S = 3600.0
# A node's effective rate never counts as less than this (a node with no measurement at all
# still counts as a little, so that filling makes progress).
MIN_EFFECTIVE = 1e-3
# No node computes more samples/s than this (a guess scaled from absurd figures, e.g. a tiny
# reference rate, is clipped here, so that sums and means stay finite).
MAX_RATE = 1e12
# Usage steers only the nodes that do not divide evenly: a tenant's usage share above (below)
# its fair share adds (takes off) up to 0.4 of a node to its value (less than half: two tenants' offsets together never outweigh a whole node) while filling. The gain sets
# how small a deviation already tips the balance (the long-run error is about
# 1 / (USAGE_GAIN x nodes) of the usage).
MAX_USAGE_OFFSET = 0.4
USAGE_GAIN = 10.0
# A node a job holds counts this much faster for it when it picks nodes: another node must be
# clearly better to be worth a move (and a job benchmark there).
STICKINESS = 1.5
# Two jobs swap nodes when both run faster and the product of their speed-ups is at least
# this: a swap costs each a job benchmark, so a small gain is not worth it.
EXCHANGE_GAIN = 1.5
# Least attained service within a tenant: jobs that have had less than this many
# node-equivalent seconds go first, then each doubling is a class of its own.
SERVICE_QUANTUM_S = 600.0


class Tier(enum.IntEnum):
    LOW = 0
    NORMAL = 1
    HIGH = 2

    @property
    def label(self) -> str:
        return self.name.lower()


PRIORITIES: dict[str, Tier] = {t.label: t for t in Tier}


def parse_priority(name: str) -> Tier:
    """The tier a priority name stands for; ValueError naming the accepted ones."""
    tier = PRIORITIES.get(name.strip().lower()) if isinstance(name, str) else None
    if tier is None:
        accepted = ", ".join(t.label for t in sorted(Tier, reverse=True))
        raise ValueError(f"unknown priority {name!r}: use one of {accepted}")
    return tier


def tier_of(priority: str) -> Tier:
    """A job spec's tier ("" is a job from before priorities: normal)."""
    return parse_priority(priority) if priority else Tier.NORMAL


@dataclass(frozen=True)
class JobRequest:
    job_id: str
    tenant: str
    tier: Tier
    min_nodes: int
    max_nodes: int
    submitted_ms: int
    attained_s: float = 0.0  # node-equivalent seconds of service so far
    # samples still to train (epochs x dataset size - samples done); None: unknown
    remaining_samples: float | None = None
    # The market: a node asking more micro-credits per hour than this never serves the job
    # (None: no cap); `per_credit`: the job prefers the nodes with the most samples/s per
    # credit (a budget without a deadline), else the fastest.
    max_price: int | None = None
    per_credit: bool = False
    # Not "" : the job wants no node for now, and this says why (e.g. its budget ran out).
    hold_reason: str = ""

    def affords(self, price: int) -> bool:
        return self.max_price is None or price <= self.max_price


@dataclass(frozen=True)
class NodeOffer:
    node_id: str
    reference_rate: float  # samples/s of the reference benchmark (0: unknown)
    job_rates: Mapping[str, float] = field(default_factory=dict)  # job_id -> measured samples/s
    kind: str = ""  # device model: nodes of a kind are assumed alike for a job
    price: int = 0  # the donor's asking price, micro-credits per node-hour (0: donated)


@dataclass(frozen=True)
class Holding:
    """A node's current job, and until when it stays there against moves within its tier."""

    job_id: str
    protected_until_ms: int = 0
    # Until when it stays against a tenant of its tier below its fair share, if its own tenant
    # is above its share (None: as long as protected_until_ms).
    share_until_ms: int | None = None

    def protected_against_fair_share(self, now_ms: int) -> bool:
        """Whether, at ``now_ms``, the node still stays with its job against a tenant of its
        tier below its fair share."""
        until = self.protected_until_ms
        if self.share_until_ms is not None:
            until = min(until, self.share_until_ms)
        return until > now_ms


@dataclass
class JobPlan:
    job_id: str
    nodes: list[str]
    fair_share: float  # node-equivalents of weighted max-min between its tier's tenants
    value: float  # node-equivalents its nodes are worth to it
    wanted: int  # max_nodes
    waiting: bool
    reason: str


@dataclass(frozen=True)
class Move:
    node_id: str
    from_job: str  # "" for a node that was free
    to_job: str  # "" for a node left free
    reason: str


@dataclass
class Plan:
    jobs: dict[str, JobPlan]
    moves: list[Move]

    def owners(self) -> dict[str, str]:
        return {n: p.job_id for p in self.jobs.values() for n in p.nodes}

    def check(self, jobs: Sequence[JobRequest], nodes: Sequence[NodeOffer]) -> None:
        """AssertionError unless the plan keeps the scheduler's invariants."""
        offered = {n.node_id for n in nodes}
        seen: set[str] = set()
        by_id = {j.job_id: j for j in jobs}
        assert set(self.jobs) == set(by_id), "a plan covers exactly the live jobs"
        for p in self.jobs.values():
            job = by_id[p.job_id]
            assert not seen & set(p.nodes), f"a node given twice: {seen & set(p.nodes)}"
            seen |= set(p.nodes)
            assert set(p.nodes) <= offered, f"{p.job_id} got nodes nobody offered"
            assert len(p.nodes) <= job.max_nodes, f"{p.job_id} above max_nodes"
            assert p.waiting == (not p.nodes), f"{p.job_id}: waiting means no nodes"
            assert not p.nodes or len(p.nodes) >= job.min_nodes, f"{p.job_id} below min_nodes"


class TenantUsage:
    """Each tenant's decayed usage in node-equivalent seconds (half-life `half_life_s`)."""

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if not half_life_s > 0:
            raise ValueError(f"the usage half-life must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self._usage: dict[str, tuple[float, int]] = {}  # tenant -> (usage, at_ms)

    def _decayed(self, value: float, at_ms: int, now_ms: int) -> float:
        factor: float = 0.5 ** (max(0, now_ms - at_ms) / 1000 / self.half_life_s)
        return value * factor

    def add(self, tenant: str, node_seconds: float, now_ms: int) -> None:
        if node_seconds < 0 or not math.isfinite(node_seconds):
            raise ValueError(f"usage must be a finite non-negative figure, got {node_seconds}")
        value, at = self._usage.get(tenant, (0.0, now_ms))
        self._usage[tenant] = (self._decayed(value, at, now_ms) + node_seconds, max(at, now_ms))

    def usage(self, tenant: str, now_ms: int) -> float:
        value, at = self._usage.get(tenant, (0.0, now_ms))
        return self._decayed(value, at, now_ms)

    def snapshot(self, now_ms: int) -> dict[str, float]:
        return {t: self.usage(t, now_ms) for t in self._usage}

    def to_state(self) -> dict[str, object]:
        return {
            "half_life_s": self.half_life_s,
            "usage": {t: [v, at] for t, (v, at) in self._usage.items()},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, object]) -> TenantUsage:
        out = cls(float(state["half_life_s"]))  # type: ignore[arg-type]
        usage = state.get("usage", {})
        assert isinstance(usage, Mapping)
        for tenant, (value, at) in usage.items():
            out._usage[str(tenant)] = (float(value), int(at))
        return out


@dataclass(frozen=True)
class Tenants:
    """Operators' weights (default 1) and the decayed usage of a pass."""

    weights: Mapping[str, float] = field(default_factory=dict)
    usage: Mapping[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)


def check_weight(weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"a tenant's weight must be a number, got {weight!r}")
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"a tenant's weight must be a positive number, got {weight}")
    return float(weight)


# -- effective throughput ---------------------------------------------------------------------


def effective_rates(
    jobs: Sequence[JobRequest], nodes: Sequence[NodeOffer]
) -> dict[tuple[str, str], float]:
    """(node_id, job_id) -> node-equivalents: the node's rate for the job over the job's mean
    rate across all nodes. The rate is the node's own job benchmark where there is one, else
    its reference rate times the job's median measured/reference ratio on nodes of the same
    kind (device model), else on all nodes, else 1."""
    return _rate_estimates(jobs, nodes)[0]


def _rate_estimates(
    jobs: Sequence[JobRequest], nodes: Sequence[NodeOffer]
) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """(effective_rates, job_id -> the job's mean estimated samples/s per node; 0: unknown)."""
    out: dict[tuple[str, str], float] = {}
    means: dict[str, float] = {}
    for job in jobs:
        ratios: dict[str, list[float]] = {}
        for n in nodes:
            measured = n.job_rates.get(job.job_id, 0.0)
            if measured > 0 and n.reference_rate > 0:
                ratios.setdefault(n.kind, []).append(measured / n.reference_rate)
        overall = [r for rs in ratios.values() for r in rs]
        scale_all = statistics.median(overall) if overall else 1.0
        scale = {kind: statistics.median(rs) for kind, rs in ratios.items() if kind}
        est = {}
        for n in nodes:
            measured = n.job_rates.get(job.job_id, 0.0)
            if measured > 0:
                est[n.node_id] = min(measured, MAX_RATE)
            else:
                guess = max(0.0, n.reference_rate) * scale.get(n.kind, scale_all)
                est[n.node_id] = min(guess, MAX_RATE) if math.isfinite(guess) else MAX_RATE
        positive = [v for v in est.values() if v > 0]
        mean = statistics.fmean(positive) if positive else 0.0  # each <= MAX_RATE: no overflow
        means[job.job_id] = mean
        for node_id, v in est.items():
            out[(node_id, job.job_id)] = max(MIN_EFFECTIVE, v / mean) if mean > 0 else 1.0
    return out, means


def expected_remaining_s(job: JobRequest, mean_rate: float) -> float:
    """The node-equivalent seconds a job is expected to still need: its remaining samples
    over its mean rate per node where both are known, else (Tiresias' least attained service
    for unknown sizes: the longer a job ran, the longer it is likely to run) its attained
    service rounded up to its service class's upper bound."""
    if job.remaining_samples is not None and mean_rate > 0:
        return max(0.0, job.remaining_samples) / mean_rate
    return SERVICE_QUANTUM_S * 2.0 ** service_class(job.attained_s)


def water_fill(
    demands: Mapping[str, float], weights: Mapping[str, float], capacity: float
) -> dict[str, float]:
    """Weighted max-min shares of `capacity` for `demands` (each share <= its demand)."""
    shares = {k: 0.0 for k in demands}
    active = {k for k, d in demands.items() if d > 0}
    left = capacity
    while active and left > 1e-12:
        total_w = sum(weights[k] for k in active)
        level = left / total_w
        capped = {k for k in active if demands[k] - shares[k] <= level * weights[k]}
        if not capped:
            for k in active:
                shares[k] += level * weights[k]
            break
        for k in capped:
            left -= demands[k] - shares[k]
            shares[k] = demands[k]
        active -= capped
    return shares


# -- the pass -----------------------------------------------------------------------------------


@dataclass
class _Tier:
    """What progressive filling of one tier works with."""

    rates: Mapping[tuple[str, str], float]
    tenants: Tenants
    offsets: Mapping[str, float]  # tenant -> node-equivalents added to its value (usage)
    available: list[str]  # nodes not taken by higher tiers
    pinned: Mapping[str, str]  # node -> job of this tier that keeps it (hysteresis)
    cost: Mapping[str, int]  # node -> how reluctantly it is taken (see _move_cost)
    held: Mapping[str, str]  # node -> job holding it now
    remaining: Mapping[str, float]  # job -> expected remaining node-equivalent seconds
    prices: Mapping[str, int] = field(default_factory=dict)  # node -> micro-credits per hour

    def allowed(self, node_id: str, job: JobRequest) -> bool:
        return job.affords(self.prices.get(node_id, 0))

    def fill(
        self, jobs: Sequence[JobRequest], started: Collection[str]
    ) -> tuple[dict[str, list[str]], dict[str, int]]:
        """(job_id -> nodes, job_id -> the nodes free at its turn for each job whose gang did
        not fit). The pinned nodes of the `started` jobs and their min_nodes come first; then
        progressive filling, where a job with no node yet starts with its min_nodes together
        at its turn if that many are free, else it waits."""
        assigned: dict[str, list[str]] = {j.job_id: [] for j in jobs}
        tenant_value: dict[str, float] = {j.tenant: self.offsets.get(j.tenant, 0.0) for j in jobs}
        job_value: dict[str, float] = {j.job_id: 0.0 for j in jobs}
        by_id = {j.job_id: j for j in jobs}
        did_not_fit: dict[str, int] = {}

        def give(node_id: str, job: JobRequest) -> None:
            assigned[job.job_id].append(node_id)
            rate = self.rates[(node_id, job.job_id)]
            job_value[job.job_id] += rate
            tenant_value[job.tenant] += rate

        pinned = {n: j for n, j in self.pinned.items() if j in by_id and j in started}
        for node_id, job_id in pinned.items():
            give(node_id, by_id[job_id])
        free = [n for n in self.available if n not in pinned]
        wanting = [j for j in jobs if len(assigned[j.job_id]) < j.max_nodes]
        top2 = self._top2(free, wanting)
        while free and wanting:
            priced_out = [j for j in wanting if not any(self.allowed(n, j) for n in free)]
            if priced_out:  # no free node at or under its max_price
                for j in priced_out:
                    wanting.remove(j)
                    if not assigned[j.job_id]:
                        did_not_fit[j.job_id] = 0
                top2 = self._top2(free, wanting)
                continue
            needy = [
                j for j in wanting if j.job_id in started and len(assigned[j.job_id]) < j.min_nodes
            ]
            if needy:  # started jobs keep their min_nodes first (their sum fits)
                job = needy[0]
            else:
                tenant = min(
                    {j.tenant for j in wanting},
                    key=lambda t: (
                        tenant_value[t] / self.tenants.weight(t),
                        self.tenants.usage.get(t, 0.0) / self.tenants.weight(t),
                        t,
                    ),
                )
                # Within a tenant: the least expected remaining work first (shortest
                # remaining processing time), equal shares between jobs that tie.
                job = min(
                    (j for j in wanting if j.tenant == tenant),
                    key=lambda j: (
                        self.remaining[j.job_id],
                        job_value[j.job_id],
                        j.submitted_ms,
                        j.job_id,
                    ),
                )
                affordable = sum(1 for n in free if self.allowed(n, job))
                if not assigned[job.job_id] and affordable < job.min_nodes:
                    did_not_fit[job.job_id] = affordable  # gang start: all or nothing
                    wanting.remove(job)
                    top2 = self._top2(free, wanting)
                    continue
            # Nodes are scarce while the jobs still wanting could use more than are free:
            # then a node goes where its comparative advantage is largest; else each job
            # takes the nodes fastest for it.
            scarce = len(free) < sum(j.max_nodes - len(assigned[j.job_id]) for j in wanting)
            for _ in range(max(1, job.min_nodes - len(assigned[job.job_id]))):
                mine = [n for n in free if self.allowed(n, job)]
                if not mine:
                    break
                node = max(mine, key=lambda n: self._preference(n, job, top2, scarce))
                free.remove(node)
                give(node, job)
            if len(assigned[job.job_id]) >= job.max_nodes:
                wanting.remove(job)
                top2 = self._top2(free, wanting)
        return assigned, did_not_fit

    def _top2(
        self, free: Sequence[str], wanting: Sequence[JobRequest]
    ) -> dict[str, tuple[tuple[float, str], tuple[float, str]]]:
        """node -> the two best (normalized rate, job) among the wanting jobs."""
        out = {}
        for n in free:
            ranked = sorted(((self.rates[(n, j.job_id)], j.job_id) for j in wanting), reverse=True)
            ranked += [(0.0, "")] * 2
            out[n] = (ranked[0], ranked[1])
        return out

    def _preference(
        self,
        node_id: str,
        job: JobRequest,
        top2: Mapping[str, tuple[tuple[float, str], ...]],
        scarce: bool,
    ) -> tuple[int, float, float, str]:
        """The cheapest node to take first (its own nodes and free ones before other jobs'),
        then the best score: the job's comparative advantage over the other wanting jobs
        while nodes are scarce, else its own speed there (a job that pays per credit: that
        per credit, donated nodes first); a node the job holds scores STICKINESS times higher
        (a move costs a job benchmark)."""
        job_id = job.job_id
        mine = self.rates[(node_id, job_id)]
        own = self.held.get(node_id) == job_id
        if scarce:
            first, second = top2[node_id]
            other = second[0] if first[1] == job_id else first[0]
            score = mine / other if other > 0 else mine
        else:
            score = mine
        if job.per_credit:
            price = self.prices.get(node_id, 0)
            score = score * MAX_RATE if price <= 0 else score / price
        if own:
            score *= STICKINESS
        return (0 if own else -self.cost[node_id], score, mine, node_id)


def service_class(attained_s: float) -> int:
    """A job's least-attained-service class: 0 below SERVICE_QUANTUM_S node-equivalent
    seconds, then one more per doubling."""
    if attained_s < SERVICE_QUANTUM_S:
        return 0
    return 1 + int(math.log2(attained_s / SERVICE_QUANTUM_S))


def usage_offsets(
    jobs: Sequence[JobRequest], tenants: Tenants, fair: Mapping[str, float], capacity: int
) -> dict[str, float]:
    """Tenant -> node-equivalents added to its value while filling: how far its share of the
    tier's recent usage is above (+) or below (-) its share of the tier's fair shares, in
    nodes times USAGE_GAIN, clamped to MAX_USAGE_OFFSET. So the nodes that do not divide
    evenly go to the tenant that has had less than its share lately, and weights hold in the
    long run."""
    share: dict[str, float] = {}
    for j in jobs:
        share[j.tenant] = share.get(j.tenant, 0.0) + fair.get(j.job_id, 0.0)
    used = {t: max(0.0, tenants.usage.get(t, 0.0)) for t in share}
    total_share, total_used = sum(share.values()), sum(used.values())
    if total_share <= 0 or total_used <= 0:
        return {t: 0.0 for t in share}
    return {
        t: max(
            -MAX_USAGE_OFFSET,
            min(
                MAX_USAGE_OFFSET,
                (used[t] / total_used - share[t] / total_share) * capacity * USAGE_GAIN,
            ),
        )
        for t in share
    }


def schedule(
    now_ms: int,
    jobs: Iterable[JobRequest],
    nodes: Iterable[NodeOffer],
    holdings: Mapping[str, Holding],
    tenants: Tenants,
) -> Plan:
    """One scheduling pass (see the module docstring)."""
    jobs = sorted(jobs, key=lambda j: (j.submitted_ms, j.job_id))
    nodes = sorted(nodes, key=lambda n: n.node_id)
    by_id = {j.job_id: j for j in jobs}
    node_ids = [n.node_id for n in nodes]
    offered = set(node_ids)
    rates, mean_rates = _rate_estimates(jobs, nodes)
    prices = {n.node_id: n.price for n in nodes}
    remaining = {j.job_id: expected_remaining_s(j, mean_rates[j.job_id]) for j in jobs}
    # Only holdings of live jobs on offered nodes count.
    held = {n: h for n, h in holdings.items() if n in offered and h.job_id in by_id}
    owner: dict[str, str] = {}
    waiting_reason: dict[str, str] = {}
    fair: dict[str, float] = {}
    for job in jobs:
        if job.hold_reason:
            waiting_reason[job.job_id] = job.hold_reason
    for tier in sorted(Tier, reverse=True):
        tier_jobs = [j for j in jobs if j.tier == tier and not j.hold_reason]
        if not tier_jobs:
            continue
        available = [n for n in node_ids if n not in owner]
        tier_fair = _fair_shares(tier_jobs, len(available), tenants)
        fair.update(tier_fair)
        pinned: dict[str, str] = {}
        pinned_count: Counter[str] = Counter()
        for n in available:
            h = held.get(n)
            if (
                h is not None
                and by_id[h.job_id].tier == tier
                and h.protected_until_ms > now_ms
                and pinned_count[h.job_id] < by_id[h.job_id].max_nodes
                and by_id[h.job_id].affords(prices[n])
            ):
                pinned[n] = h.job_id
                pinned_count[h.job_id] += 1
        in_tier = {n: held[n] for n in available if n in held}
        pinned = _yield_to_fair_shares(pinned, in_tier, tier_jobs, tier_fair, rates, now_ms)
        work = _Tier(
            rates=rates,
            tenants=tenants,
            offsets=usage_offsets(tier_jobs, tenants, tier_fair, len(available)),
            available=available,
            pinned=pinned,
            cost={n: _move_cost(held.get(n), by_id, tier, now_ms) for n in available},
            held={n: h.job_id for n, h in held.items()},
            remaining=remaining,
            prices=prices,
        )
        candidates = []
        for job in tier_jobs:
            affordable = sum(1 for n in node_ids if job.affords(prices[n]))
            if job.min_nodes > len(node_ids):
                waiting_reason[job.job_id] = (
                    f"waits: min_nodes {job.min_nodes} exceeds the {len(node_ids)} eligible "
                    "node(s) in the cluster"
                )
            elif job.min_nodes > affordable:
                waiting_reason[job.job_id] = (
                    f"waits: {affordable} of the {len(node_ids)} eligible node(s) ask at most "
                    f"its max_price of {format_credits(job.max_price or 0)} credits/h; it "
                    f"needs {job.min_nodes} (min_nodes)"
                )
            else:
                candidates.append(job)
        started = _started(candidates, work)
        filled, did_not_fit = work.fill(candidates, started)
        assigned = _keep_held(filled, work.held, rates, work.allowed, by_id)
        for job_id, mine in assigned.items():
            if 0 < len(mine) < by_id[job_id].min_nodes:  # too few it affords: all or nothing
                did_not_fit[job_id] = len(mine)
                assigned[job_id] = []
        for job_id, mine in assigned.items():
            for n in mine:
                owner[n] = job_id
        for job in candidates:
            if not assigned[job.job_id]:
                waiting_reason[job.job_id] = _waiting_reason(
                    job, did_not_fit.get(job.job_id, 0), len(available), len(node_ids)
                )
    # Hysteresis: a node protected for the job it stays with is not exchanged.
    fixed = {
        n for n, h in held.items() if owner.get(n) == h.job_id and h.protected_until_ms > now_ms
    }
    exchanged = _exchange(owner, rates, fixed, lambda n, j: by_id[j].affords(prices[n]))
    plans: dict[str, JobPlan] = {}
    for job in jobs:
        mine = [n for n in node_ids if owner.get(n) == job.job_id]
        value = sum(rates[(n, job.job_id)] for n in mine)
        if mine:
            reason = (
                f"runs on {len(mine)} node(s), worth {value:.1f} node-equivalents; fair share "
                f"{fair[job.job_id]:.1f}"
                + (" (its max_nodes)" if len(mine) == job.max_nodes else "")
            )
        else:
            reason = waiting_reason.get(job.job_id, "waits: no node is free")
        plans[job.job_id] = JobPlan(
            job_id=job.job_id,
            nodes=mine,
            fair_share=fair.get(job.job_id, 0.0),
            value=value,
            wanted=job.max_nodes,
            waiting=not mine,
            reason=reason,
        )
    moves = _moves(held, owner, node_ids, by_id, plans, exchanged)
    return Plan(jobs=plans, moves=moves)


def _exchange(
    owner: dict[str, str],
    rates: Mapping[tuple[str, str], float],
    fixed: Collection[str],
    allowed: Callable[[str, str], bool],
) -> dict[str, tuple[str, str]]:
    """Swap nodes between pairs of jobs (of any tiers) while both jobs gain and together by
    at least EXCHANGE_GAIN (the product of their speed-ups): each job keeps its node count,
    so no tier, tenant or job loses, and a node goes where its comparative advantage is
    (Gavel). `owner` is updated in place; returns node -> (its other node, the job it came
    from) for each node swapped. Nodes in `fixed` stay; a node goes only to a job that
    affords it (`allowed(node, job)`)."""
    by_job: dict[str, list[str]] = {}
    for n, j in sorted(owner.items()):
        if n not in fixed:
            by_job.setdefault(j, []).append(n)
    job_ids = sorted(by_job)
    swapped: dict[str, tuple[str, str]] = {}
    for i, a in enumerate(job_ids):
        for b in job_ids[i + 1 :]:
            while by_job[a] and by_job[b]:
                # The product of the gains is (x's worth to b over to a) x (y's worth to a
                # over to b): the best pair is the best x and the best y on their own.
                x = max(by_job[a], key=lambda n: (rates[(n, b)] / rates[(n, a)], n))
                y = max(by_job[b], key=lambda n: (rates[(n, a)] / rates[(n, b)], n))
                gain_a = rates[(y, a)] / rates[(x, a)]
                gain_b = rates[(x, b)] / rates[(y, b)]
                if gain_a < 1 or gain_b < 1 or gain_a * gain_b < EXCHANGE_GAIN:
                    break
                if not (allowed(x, b) and allowed(y, a)):
                    break
                owner[x], owner[y] = b, a
                swapped[x], swapped[y] = (y, a), (x, b)
                by_job[a].remove(x)  # a node moves at most once a pass
                by_job[b].remove(y)
    return swapped


def _move_cost(
    holding: Holding | None, by_id: Mapping[str, JobRequest], tier: Tier, now_ms: int
) -> int:
    """How reluctantly a tier takes a node: free first, then unprotected nodes of its own or
    a lower tier, then protected nodes of lower tiers."""
    if holding is None:
        return 0
    if by_id[holding.job_id].tier < tier and holding.protected_until_ms > now_ms:
        return 2
    return 1


def _fair_shares(jobs: Sequence[JobRequest], capacity: int, tenants: Tenants) -> dict[str, float]:
    """Each job's weighted max-min share (node-equivalents) of `capacity` nodes: between
    tenants by weight, then equally between a tenant's jobs."""
    demand: dict[str, float] = {}
    for j in jobs:
        demand[j.tenant] = demand.get(j.tenant, 0.0) + j.max_nodes
    weights = {t: tenants.weight(t) for t in demand}
    by_tenant = water_fill(demand, weights, float(capacity))
    out: dict[str, float] = {}
    for tenant, share in by_tenant.items():
        mine = [j for j in jobs if j.tenant == tenant]
        split = water_fill(
            {j.job_id: float(j.max_nodes) for j in mine}, {j.job_id: 1.0 for j in mine}, share
        )
        out.update(split)
    return out


def _yield_to_fair_shares(
    pinned: Mapping[str, str],
    held: Mapping[str, Holding],
    jobs: Sequence[JobRequest],
    fair: Mapping[str, float],
    rates: Mapping[tuple[str, str], float],
    now_ms: int,
) -> dict[str, str]:
    """`pinned` less the nodes a tenant above its fair share keeps only until their
    `share_until_ms` while another tenant of the tier is below its share: when one holds
    fewer whole nodes than its fair share and wants more, each tenant holding more nodes than
    its share rounded up keeps pinned that many (the fastest for their jobs, and those still
    within their share hold) and the rest compete like unprotected ones."""
    tenant_of = {j.job_id: j.tenant for j in jobs}
    share: dict[str, float] = {}
    wants: dict[str, int] = {}
    for j in jobs:
        share[j.tenant] = share.get(j.tenant, 0.0) + fair.get(j.job_id, 0.0)
        wants[j.tenant] = wants.get(j.tenant, 0) + j.max_nodes
    holds = Counter(tenant_of[h.job_id] for h in held.values() if h.job_id in tenant_of)
    below = [t for t in share if holds[t] < math.floor(share[t] + 1e-9) and holds[t] < wants[t]]
    if not below:
        return dict(pinned)
    out = dict(pinned)
    for tenant in sorted(share):
        keep = math.ceil(share[tenant] - 1e-9)
        mine = [n for n, j in pinned.items() if tenant_of.get(j) == tenant]
        if holds[tenant] <= keep or len(mine) <= keep:
            continue
        mine.sort(
            key=lambda n: (
                not held[n].protected_against_fair_share(now_ms),
                -rates[(n, pinned[n])],
                n,
            )
        )
        for n in mine[keep:]:
            if not held[n].protected_against_fair_share(now_ms):
                del out[n]
    return out


def _keep_held(
    assigned: Mapping[str, list[str]],
    held: Mapping[str, str],
    rates: Mapping[tuple[str, str], float],
    allowed: Callable[[str, JobRequest], bool],
    by_id: Mapping[str, JobRequest],
) -> dict[str, list[str]]:
    """The same number of nodes per job as `assigned`, but each job keeps the nodes it holds
    now where it can (and may: within its max_price): filling in another order may hand out
    the same counts with nodes swapped, and a swap would cost both jobs a job benchmark for
    nothing."""
    pool = {n for nodes in assigned.values() for n in nodes}
    out: dict[str, list[str]] = {}
    for job_id, nodes in assigned.items():
        job = by_id[job_id]
        keep = sorted(n for n in pool if held.get(n) == job_id and allowed(n, job))
        keep = keep[: len(nodes)]
        out[job_id] = keep
        pool -= set(keep)
    for job_id, nodes in assigned.items():
        want = len(nodes) - len(out[job_id])
        if want <= 0:
            continue
        # the nodes filling chose for it first, then the fastest for it that it affords
        choice = [n for n in nodes if n in pool]
        others = {n for n in pool - set(choice) if allowed(n, by_id[job_id])}
        choice += sorted(others, key=lambda n: (-rates[(n, job_id)], n))
        out[job_id] += choice[:want]
        pool -= set(choice[:want])
    return out


def _started(candidates: Sequence[JobRequest], work: _Tier) -> set[str]:
    """The jobs of a tier that keep running whatever else the tier wants: those holding
    pinned (protected) nodes, each with at least its min_nodes (or its pinned nodes, if more)
    reserved, as long as their sum fits. The tenant with the least reserved per weight goes
    next, its job with the least expected remaining work first. A job left out competes for
    nodes like a waiting one (and its pinned nodes are free)."""
    pinned_count = Counter(work.pinned.values())
    group = [j for j in candidates if pinned_count[j.job_id]]
    capacity = len(work.available)
    started: set[str] = set()
    reserved = 0
    per_tenant: dict[str, float] = {}
    while group:
        tenant = min(
            {j.tenant for j in group},
            key=lambda t: (
                (per_tenant.get(t, 0.0) + work.offsets.get(t, 0.0)) / work.tenants.weight(t),
                work.tenants.usage.get(t, 0.0) / work.tenants.weight(t),
                t,
            ),
        )
        job = min(  # candidates are sorted: the oldest first among equals
            (j for j in group if j.tenant == tenant), key=lambda j: work.remaining[j.job_id]
        )
        group.remove(job)
        need = max(job.min_nodes, pinned_count[job.job_id])
        if reserved + need <= capacity:
            started.add(job.job_id)
            reserved += need
            per_tenant[tenant] = per_tenant.get(tenant, 0.0) + need
    return started


def _waiting_reason(job: JobRequest, free: int, capacity: int, cluster_size: int) -> str:
    """Why a job that could fit in the cluster got no node in this pass."""
    parts = [f"waits: needs {job.min_nodes} node(s) together (min_nodes)"]
    higher = cluster_size - capacity
    if higher:
        parts.append(f"{higher} of the {cluster_size} eligible held by higher priorities")
    parts.append(
        f"{free} of the {capacity} left for priority {job.tier.label} free at its turn (jobs "
        "expected to finish sooner and other tenants' fair shares go first)"
    )
    return "; ".join(parts)


def _moves(
    held: Mapping[str, Holding],
    owner: Mapping[str, str],
    node_ids: Sequence[str],
    by_id: Mapping[str, JobRequest],
    plans: Mapping[str, JobPlan],
    exchanged: Mapping[str, tuple[str, str]],
) -> list[Move]:
    moves = []
    for n in node_ids:
        before = held[n].job_id if n in held else ""
        after = owner.get(n, "")
        if before == after:
            continue
        if n in exchanged:
            other, other_job = exchanged[n]
            reason = (
                f"swapped with {other}, which goes to {other_job}: both jobs run faster "
                "(comparative advantage)"
            )
        elif not before:
            reason = f"free node given to {after}"
        elif not after:
            reason = f"{before} " + (
                "waits (" + plans[before].reason.removeprefix("waits: ") + ")"
                if plans[before].waiting
                else "needs fewer nodes"
            )
        elif by_id[after].tier > by_id[before].tier:
            reason = f"preempted for {after} (priority {by_id[after].tier.label})"
        elif by_id[after].tier < by_id[before].tier:
            reason = f"{before} needs fewer nodes"
        elif plans[before].waiting:
            reason = f"{before} waits ({plans[before].reason.removeprefix('waits: ')})"
        else:
            reason = (
                f"fair share: to tenant {by_id[after].tenant!r} ({after} has a fair share of "
                f"{plans[after].fair_share:.1f} node-equivalents)"
            )
        moves.append(Move(node_id=n, from_job=before, to_job=after, reason=reason))
    return moves
