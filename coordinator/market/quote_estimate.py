"""What a job not yet submitted would take and cost (pure: no clock, no I/O; ``now_ms`` comes
in): `estimate(...)` predicts each node's speed on the job's own program, picks the nodes the
cluster scheduler would give it, and prices the run by the billing rule.

Speed. A node's samples/s on the job is ``its reference FLOP/s x efficiency / the program's
FLOPs per sample``: the reference benchmark's samples/s times REFERENCE_FLOPS_PER_SAMPLE is
the node's measured FLOP/s, and the program's FLOPs per training sample are counted where it
is exported (epochmesh/program/flops.py). Efficiency (the share of the reference FLOP/s a job
reaches) is calibrated: the median over the jobs measured on nodes of the same device model
(a job with the same program first, then any job whose FLOPs are known), else over all device
models, else DEFAULT_EFFICIENCY. A node's job benchmark measures compute alone, and that is
the rate the job is billed at.

Nodes. The quoted job enters a pass of the cluster scheduler
(`coordinator.scheduling.cluster_scheduler.schedule`) beside the live jobs, with its predicted
rates as its measured ones: the nodes it gets there are the nodes it would get; each round's
local batches are `coordinator.rounds.allocator.split_batch` of those rates, capped by each
node's largest batch.

Time. ``start + rounds x (slowest part's compute + round overhead) + checkpoints x
checkpoint cost``. Rounds: each epoch ``ceil(samples / global_batch)``, the last one the
remainder. Start: the program check at submission and the job benchmark on each node (its
steps' samples at the node's predicted rate plus loading the program; the nodes benchmark
at once): as recorded jobs took, else DEFAULT_START_S plus the benchmark's compute. Round
overhead (hand-out, parameter pull, update push, verification, aggregation
and record) and start come from the jobs this coordinator recorded (`History`), else from
the constants below, measured on a 2-core CPU host with scripts/bench_quote.py; the
parameters' transfer (pull and push) over the slowest chosen node's measured bandwidth
comes on top.

Cost. Each round's part on node i earns ``price_i x b_i / rate_i / 3600`` micro-credits,
rounded down (coordinator/accounting/billing.py, at the predicted rate), plus the platform
fee, summed over every round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.accounting.billing import charge_part
from coordinator.rounds.allocator import split_batch
from coordinator.scheduling.cluster_scheduler import (
    Holding,
    JobRequest,
    NodeOffer,
    Tenants,
    Tier,
    schedule,
)
from epochmesh.quote import REFERENCE_FLOPS_PER_SAMPLE

QUOTED_JOB = "quote"  # the quoted job's id in the scheduler pass
# Without a measured job: the share of the reference FLOP/s a program reaches (the zen
# transformer and a 4-layer MLP on a loaded 2-core CPU host, --benchmark quick agents:
# 0.12-0.3 by the billed rates of scripts/bench_quote.py's jobs).
DEFAULT_EFFICIENCY = 0.25
# Without recorded jobs (scripts/bench_quote.py, 2-core CPU host, 1-2 agents on loopback,
# parameter-server rounds with spot checks): seconds a round spends outside compute, and
# from submission to the first round (program check, claim, program load, job benchmark
# setup) besides the benchmark's compute.
DEFAULT_ROUND_OVERHEAD_S = 0.12
DEFAULT_START_S = 4.0
# A checkpoint writes parameters and optimizer state (about 3x the parameters) to the blob
# store: a fixed cost plus the bytes at a disk's speed.
CHECKPOINT_FIXED_S = 0.02
DISK_BYTES_PER_S = 200e6
# The job benchmark (node_agent/training/benchmark.py JOB_PLAN): batch sizes 16, 64 and 256,
# each one tracked step, 2 warm-up and 20 timed steps; agents started with --benchmark quick
# run QUICK_JOB_PLAN (1 and 5).
JOB_BENCH_SAMPLES = (16 + 64 + 256) * 23
QUICK_JOB_BENCH_SAMPLES = (16 + 64 + 256) * 7

# Where a node's rate comes from.
SAME_PROGRAM = "same_program"  # jobs with this very program measured on its device model
CALIBRATED = "calibrated"  # other jobs measured on its device model
CALIBRATED_ANY = "calibrated_other_devices"  # jobs measured on other device models
DEFAULT = "default_efficiency"


@dataclass(frozen=True)
class Node:
    """A node that could take the job now."""

    node_id: str
    kind: str  # device model
    reference_rate: float  # samples/s of the reference benchmark (0: none)
    price: int = 0  # micro-credits per node-hour
    max_batch: int = 0  # largest batch that fits (0: unknown)
    bandwidth: float = 0.0  # bytes/s to the coordinator (0: unknown)
    quick_bench: bool = False  # it runs the short job benchmark


@dataclass(frozen=True)
class Measured:
    """One job's measured samples/s on a node of device model ``kind``."""

    kind: str
    program: str  # the job's program sha256
    flops_per_sample: float  # 0: unknown
    rate: float  # the job's samples/s there
    reference_rate: float  # the node's reference samples/s


@dataclass(frozen=True)
class History:
    """Fixed costs measured from recorded jobs (None: none recorded)."""

    round_overhead_s: float | None = None
    start_s: float | None = None
    jobs: int = 0


@dataclass(frozen=True)
class Program:
    flops_per_sample: float  # one training step's, per sample (0: unknown)
    sha256: str = ""
    state_bytes: int = 0  # the parameters' bytes


@dataclass(frozen=True)
class QuotedJob:
    tenant: str
    priority: Tier
    min_nodes: int
    max_nodes: int  # capped by global_batch
    global_batch: int
    epochs: int
    num_samples: int
    checkpoint_every: int  # rounds (0: none)
    max_price: int | None
    per_credit: bool


@dataclass(frozen=True)
class Cluster:
    """The scheduler's inputs besides the quoted job: the live jobs, their measured rates
    (on the offers) and who holds which node."""

    jobs: Sequence[JobRequest] = ()
    job_rates: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # node->job->r
    holdings: Mapping[str, Holding] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeQuote:
    node_id: str
    rate: float  # predicted samples/s on the job (compute, the billed rate)
    source: str
    price: int
    local_batch: int  # in a full round


@dataclass(frozen=True)
class Estimate:
    nodes: tuple[NodeQuote, ...]  # () when the job would wait
    reason: str  # the scheduler's
    rounds: int
    checkpoints: int
    start_s: float
    round_compute_s: float  # a full round's slowest part
    round_overhead_s: float
    checkpoint_s: float
    epoch_seconds: float
    total_seconds: float
    epoch_cost: int  # micro-credits, fee included
    total_cost: int
    fee: int  # of total_cost
    overhead_source: str  # "recorded" (History) or "default"
    rates: Mapping[str, tuple[float, str]]  # every node's predicted rate and its source

    @property
    def fits(self) -> bool:
        return bool(self.nodes)


def efficiency(kind: str, program: Program, measured: Sequence[Measured]) -> tuple[float, str]:
    """The share of its reference FLOP/s the program reaches on device model ``kind``, and
    where that comes from (see the module docstring)."""
    same = [m for m in measured if program.sha256 and m.program == program.sha256]
    known = [m for m in measured if m.flops_per_sample > 0]

    def ratio(m: Measured) -> float:
        flops = m.flops_per_sample if m.flops_per_sample > 0 else program.flops_per_sample
        return m.rate * flops / (m.reference_rate * REFERENCE_FLOPS_PER_SAMPLE)

    for group, source in (
        ([m for m in same if m.kind == kind], SAME_PROGRAM),
        ([m for m in known if m.kind == kind], CALIBRATED),
        (same, SAME_PROGRAM),
        (known, CALIBRATED_ANY),
    ):
        values = [ratio(m) for m in group if m.rate > 0 and m.reference_rate > 0]
        values = [v for v in values if math.isfinite(v) and v > 0]
        if values:
            return statistics.median(values), source
    return DEFAULT_EFFICIENCY, DEFAULT


def predicted_rate(node: Node, program: Program, measured: Sequence[Measured]) -> tuple[float, str]:
    """The node's predicted samples/s on the program (0.0: no reference benchmark, or the
    program's FLOPs unknown and no job with the same program measured)."""
    if node.reference_rate <= 0 or not math.isfinite(node.reference_rate):
        return 0.0, "none"
    eff, source = efficiency(node.kind, program, measured)
    if program.flops_per_sample <= 0:
        return 0.0, "none"
    rate = node.reference_rate * REFERENCE_FLOPS_PER_SAMPLE * eff / program.flops_per_sample
    return (rate, source) if math.isfinite(rate) and rate > 0 else (0.0, "none")


def _rounds(job: QuotedJob) -> list[tuple[int, int]]:
    """(batch, how many rounds) of an epoch: full rounds, then the remainder."""
    full, rest = divmod(job.num_samples, job.global_batch)
    out = [(job.global_batch, full)] if full else []
    return out + ([(rest, 1)] if rest else [])


def estimate(
    now_ms: int,
    job: QuotedJob,
    program: Program,
    nodes: Sequence[Node],
    cluster: Cluster,
    measured: Sequence[Measured] = (),
    history: History | None = None,
    fee_ppm: int = 0,
) -> Estimate:
    """The quote of ``job`` (see the module docstring)."""
    history = history or History()
    rates = {n.node_id: predicted_rate(n, program, measured) for n in nodes}
    by_id = {n.node_id: n for n in nodes}
    request = JobRequest(
        job_id=QUOTED_JOB,
        tenant=job.tenant,
        tier=job.priority,
        min_nodes=max(1, job.min_nodes),
        max_nodes=max(1, job.min_nodes, job.max_nodes),
        submitted_ms=now_ms,
        remaining_samples=float(job.num_samples * job.epochs),
        max_price=job.max_price,
        per_credit=job.per_credit,
    )
    offers = [
        NodeOffer(
            node_id=n.node_id,
            reference_rate=n.reference_rate,
            job_rates={
                **cluster.job_rates.get(n.node_id, {}),
                **({QUOTED_JOB: rates[n.node_id][0]} if rates[n.node_id][0] > 0 else {}),
            },
            kind=n.kind,
            price=n.price,
        )
        for n in nodes
        if rates[n.node_id][0] > 0
    ]
    plan = schedule(
        now_ms,
        [*cluster.jobs, request],
        offers,
        cluster.holdings,
        Tenants(weights=cluster.weights),
    )
    mine = plan.jobs[QUOTED_JOB]
    overhead_source = "recorded" if history.round_overhead_s is not None else "default"
    base_overhead = (
        history.round_overhead_s
        if history.round_overhead_s is not None
        else DEFAULT_ROUND_OVERHEAD_S
    )
    checkpoint_s = CHECKPOINT_FIXED_S + 3 * program.state_bytes / DISK_BYTES_PER_S
    if not mine.nodes:
        return Estimate(
            nodes=(),
            reason=mine.reason,
            rounds=0,
            checkpoints=0,
            start_s=0.0,
            round_compute_s=math.inf,
            round_overhead_s=base_overhead,
            checkpoint_s=checkpoint_s,
            epoch_seconds=math.inf,
            total_seconds=math.inf,
            epoch_cost=0,
            total_cost=0,
            fee=0,
            overhead_source=overhead_source,
            rates=rates,
        )
    chosen = {n: rates[n][0] for n in mine.nodes}
    caps = {n: (by_id[n].max_batch or job.global_batch) for n in chosen}
    bandwidth = min(
        (by_id[n].bandwidth for n in chosen if by_id[n].bandwidth > 0), default=math.inf
    )
    overhead = base_overhead + 2 * program.state_bytes / bandwidth
    epoch_s = 0.0
    epoch_cost = epoch_fee = 0
    rounds = 0
    full_batches: dict[str, int] = {}
    full_compute = 0.0
    for batch, count in _rounds(job):
        batches = split_batch(batch, chosen, {n: min(caps[n], batch) for n in chosen})
        if batch == job.global_batch:
            full_batches = batches
        compute = max(b / chosen[n] for n, b in batches.items())
        full_compute = full_compute or compute
        charges = [
            charge_part(n, "", by_id[n].price, chosen[n], b, fee_ppm=fee_ppm)
            for n, b in batches.items()
            if b > 0
        ]
        epoch_cost += count * sum(c.submitter_total for c in charges)
        epoch_fee += count * sum(c.fee for c in charges)
        epoch_s += count * (compute + overhead)
        rounds += count
    if not full_batches:  # an epoch smaller than one global batch
        full_batches = split_batch(job.num_samples, chosen, caps)
    total_rounds = rounds * job.epochs
    checkpoints = total_rounds // job.checkpoint_every if job.checkpoint_every > 0 else 0
    bench = max(
        (QUICK_JOB_BENCH_SAMPLES if by_id[n].quick_bench else JOB_BENCH_SAMPLES) / chosen[n]
        for n in chosen
    )
    start_s = history.start_s if history.start_s is not None else DEFAULT_START_S + bench
    total_s = start_s + epoch_s * job.epochs + checkpoints * checkpoint_s
    return Estimate(
        nodes=tuple(
            NodeQuote(n, chosen[n], rates[n][1], by_id[n].price, full_batches.get(n, 0))
            for n in sorted(chosen)
        ),
        reason=mine.reason,
        rounds=total_rounds,
        checkpoints=checkpoints,
        start_s=start_s,
        round_compute_s=full_compute,
        round_overhead_s=overhead,
        checkpoint_s=checkpoint_s,
        epoch_seconds=epoch_s,
        total_seconds=total_s,
        epoch_cost=epoch_cost,
        total_cost=epoch_cost * job.epochs,
        fee=epoch_fee * job.epochs,
        overhead_source=overhead_source,
        rates=rates,
    )


def job_history(
    jobs: Sequence[tuple[int, int, int, int, float]],
) -> History:
    """Fixed costs from recorded jobs, each ``(created_ms, first round's start ms, last
    round's finish ms, rounds, summed slowest-part compute seconds)``: the median of each
    job's (wall time of its rounds - their compute) / rounds, and of its time from
    submission to its first round (the program check, claims, the job benchmark)."""
    overheads = []
    starts = []
    for created, first, last, rounds, compute in jobs:
        if rounds <= 0 or last <= first or first < created:
            continue
        overheads.append(max(0.0, ((last - first) / 1000 - compute) / rounds))
        starts.append((first - created) / 1000)
    if not overheads:
        return History()
    return History(
        round_overhead_s=statistics.median(overheads),
        start_s=statistics.median(starts),
        jobs=len(overheads),
    )
