"""What a job not yet submitted would take and cost (pure: no clock, no I/O; ``now_ms`` comes
in): `estimate(...)` predicts each node's step time on the job's own program, picks the nodes
the cluster scheduler would give it, and prices the run by the billing rule.

Speed: a step model. One training step of ``b`` samples on a node takes

    seconds(b) = (passes(b) x fixed + b x flops_per_sample / efficiency) / node_flops

``passes(b)`` (`part_passes`): a round's part is computed in its verification chunks (up to
PART_CHUNKS = 24, of at least two samples each), each a pass of the program that pays the fixed
cost; for a small program that is most of a part's compute (a 4-layer MLP: ~1.7 ms a pass, 40 ms
for a part of 50 or of 128 samples alike), so measured parts are fitted per pass. The job
benchmark's steps are single passes.

``node_flops`` is the node's reference benchmark samples/s times REFERENCE_FLOPS_PER_SAMPLE
(its measured FLOP/s); the program's FLOPs per training sample are counted where it is
exported (epochmesh/program/flops.py). ``fixed`` (a step's cost that does not grow with the
batch: dispatch of every operator, the confined child's round trip, the optimizer hand-over,
in reference FLOPs, so that it scales with the node's speed) and ``efficiency`` (the share of
the reference FLOP/s a program's FLOPs run at) are fitted per device model by least squares
of relative error over measured steps (`fit_step_model`): every applied part of recent jobs
is a point (its local batch x its program's FLOPs, its compute seconds x its node's FLOP/s).
A small program is thus dominated by ``fixed`` and is not predicted too fast, a big one by
its FLOPs. Fits of other programs' steps include one point of the model below them at a
tiny step (the defaults' fixed cost anchors a fit of programs of one size, and of programs
much larger than the one quoted). Where the points come from, first that fits: the same program on the node's device
model (SAME_PROGRAM), any program of known FLOPs on it (CALIBRATED), on any device model
(CALIBRATED_ANY), else DEFAULT_STEP. Points that cannot separate the two terms (one batch x
FLOPs) fit ``efficiency`` under the ``fixed`` of the next source down.

Nodes. The quoted job enters a pass of the cluster scheduler
(`coordinator.scheduling.cluster_scheduler.schedule`) beside the live jobs, with its predicted
rates (at the local batch it would have on the nodes offered) as its measured ones: the nodes
it gets there are the nodes it would get; each round's local batches are
`coordinator.rounds.allocator.split_batch` of the rates at those batches (solved by a few
fixed-point passes, since a node's rate depends on its batch), capped by each node's largest
batch.

Time. ``start + rounds x (slowest part's compute + round overhead) + checkpoints x
checkpoint cost``. Rounds: each epoch ``ceil(samples / global_batch)``, the last one the
remainder. Start: the program check at submission and the job benchmark on each node (the
steps of its plan, JOB_PLAN or with --benchmark quick QUICK_JOB_PLAN, timed by the step model,
plus loading the program; the nodes benchmark at once): the recorded jobs' median start less
their own benchmark, else START_RTTS round trips of the slowest chosen node's measured RTT
to the coordinator (DEFAULT_START_S without one), plus this program's benchmark.

Round overhead: what a round spends outside its slowest part's compute (the hand-out, the
parameters pulled, handed to the confined child and back, the update encoded and pushed, its
commitments, verification, aggregation and the round's record). Profiled on recorded rounds
(scripts/bench_quote.py: per round, compute against wall time), it is a fixed cost per round
plus a cost per byte of the parameters, and does not follow the compute: 0.12-0.15 s a round
for programs of 18-80 kB of parameters, 0.2 s for 0.5 MB, 0.29 s for 2.1 MB on a loaded
2-core VM, whatever their steps' compute (10-100 ms); and it is paid per node (each node's
update is pulled, handed over, pushed, checked and aggregated on its own; the same program's
rounds on two nodes of that VM spent 0.4 s outside compute against 0.2 s on one). So
``overhead = nodes x (fixed + per_byte x state_bytes)``, both parts fitted on the jobs this
coordinator recorded (`job_history`, each job's overhead per node: a line over jobs whose
parameters' sizes spread, else the fixed part under the per-byte cost below).
Before any job is recorded, both come from what the chosen nodes measured
(`default_overhead`): the fixed part is ROUND_RTTS round trips at the slowest measured RTT to
the coordinator (a round is a chain of hand-overs between the coordinator, the agent and its
confined child, each waiting for a turn on a CPU, so the RTT and the round's overhead grow
together with a machine's load, while the reference FLOP/s hardly moves; ROUND_FIXED_FLOPS
reference FLOPs at the slowest node's FLOP/s where no RTT was measured), the per-byte part
ROUND_BYTE_PASSES passes of the parameters at the lowest measured bandwidth to the coordinator
(each pass a copy, an encoding or a transfer of them). Calibrated on a quiet machine, where a
quote is meant to hold (the zen example on one and two agents: 0.07 s of overhead a round at an
RTT of 0.7-0.8 ms, about 90 round trips); under load the rounds slow faster than the RTT (0.16 s
at load 5, 0.83 s at load 18 against 0.8 and 2.7 ms), so a loaded machine's first quote is
low until its first job is recorded. That default is one node's; each further node adds
DEFAULT_NODE_SHARE of it (the nodes' hand-outs and updates overlap, on one coordinator).

Cost. Each round's part on node i earns ``price_i x b_i / rate_i / 3600`` micro-credits,
rounded down (coordinator/accounting/billing.py), at the rate the node shows at that batch
(``b_i / seconds(b_i)``), plus the platform fee, summed over every round.
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
from epochmesh.verification import PART_CHUNKS, chunk_count

QUOTED_JOB = "quote"  # the quoted job's id in the scheduler pass
# Without measured jobs: the step model fitted per pass on this machine's quiet runs of
# scripts/bench_quote.py (a 2-core x86-64 VM without GPU; 1-2 agents with --benchmark quick on
# loopback; the zen transformer, a 4-layer MLP, a conv net and the spirals MLP, 24 recorded
# parts; docs/benchmarks.md): a pass's fixed cost, in reference FLOPs (0.6-3.4 ms a pass there,
# by program), and the share of the reference FLOP/s the programs' FLOPs ran at.
DEFAULT_FIXED_FLOPS = 3.1e7
DEFAULT_EFFICIENCY = 0.46
# Without recorded jobs (scripts/bench_quote.py's zen rounds on the same VM, quiet): a round's
# fixed cost outside compute per node, in reference FLOPs of the slowest chosen node (about
# 0.05 s at the 4.5e10 FLOP/s its reference benchmark measured there) or in round trips to the
# coordinator, and how many passes over the parameters a round makes at that node's measured
# bandwidth to the coordinator (0.06 s per MB at 190 MB/s there); from submission to the first
# round (program check, claim, program load) besides the job benchmark's compute.
ROUND_FIXED_FLOPS = 2.3e9
ROUND_RTTS = 80.0  # a round's fixed cost, in round trips to the coordinator
# Each node past the first adds this share of one node's default overhead (the same runs: 0.07 s
# a round on one agent, 0.08-0.10 s on two).
DEFAULT_NODE_SHARE = 0.3
START_RTTS = 5000.0  # submission to the first round besides the benchmark (4 s at 0.8 ms)
ROUND_BYTE_PASSES = 12.0
FALLBACK_BANDWIDTH = 100e6  # bytes/s, for a node that measured none
DEFAULT_START_S = 4.0
# A checkpoint writes parameters and optimizer state (about 3x the parameters) to the blob
# store: a fixed cost plus the bytes at a disk's speed.
CHECKPOINT_FIXED_S = 0.02
DISK_BYTES_PER_S = 200e6
# The job benchmark (node_agent/training/benchmark.py): per batch size 16, 64 and 256, one
# memory-tracked step, warm-up steps and timed steps, timed steps cut at a number of seconds:
# JOB_PLAN (1 + 2 + 20 steps, 10 s) and, for agents started with --benchmark quick,
# QUICK_JOB_PLAN (1 + 1 + 5 steps, 2 s).
JOB_BENCH_BATCHES = (16, 64, 256)
JOB_BENCH = (3, 20, 10.0)  # untimed steps, timed steps, most seconds of timed steps
QUICK_JOB_BENCH = (2, 5, 2.0)
# A quick agent's reference benchmark runs these batch sizes (QUICK_PLAN), a full one
# (32, 128, 512): how the coordinator tells which job benchmark a node will run.
QUICK_REFERENCE_BATCHES = (16, 64)
# Two points separate the fixed cost from the FLOPs when their batch x FLOPs differ this much.
SPREAD = 1.5
# The batch x FLOPs of the prior's point in a fit of other programs' steps (a tiny step).
ANCHOR_FLOPS = 1e3

# Where a node's step model comes from.
SAME_PROGRAM = "same_program"  # steps of this very program measured on its device model
CALIBRATED = "calibrated"  # steps of other programs measured on its device model
CALIBRATED_ANY = "calibrated_other_devices"  # steps measured on other device models
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
    rtt_s: float = 0.0  # round trip to the coordinator, seconds (0: unknown)
    quick_bench: bool = False  # it runs the short job benchmark

    @property
    def flops(self) -> float:
        """Its measured FLOP/s (0: no reference benchmark)."""
        r = self.reference_rate
        return r * REFERENCE_FLOPS_PER_SAMPLE if math.isfinite(r) and r > 0 else 0.0


@dataclass(frozen=True)
class Measured:
    """A job's measured step on a node of device model ``kind``: ``batch`` samples in
    ``seconds`` of compute (a median over its rounds at that batch)."""

    kind: str
    program: str  # the job's program sha256
    flops_per_sample: float  # 0: unknown
    batch: int
    seconds: float
    reference_rate: float  # the node's reference samples/s


@dataclass(frozen=True)
class StepModel:
    """``seconds(b) = (passes x fixed_flops + b x flops_per_sample / efficiency) / node FLOP/s``."""

    fixed_flops: float
    efficiency: float
    source: str
    points: int = 0  # measured steps it was fitted on

    def seconds(
        self,
        node_flops: float,
        batch: float,
        flops_per_sample: float,
        passes: int | None = None,
    ) -> float:
        """A step of ``batch`` samples run in ``passes`` passes of the program (default:
        `part_passes`, a part of a round cut into its verification chunks), each paying the
        fixed cost."""
        if node_flops <= 0:
            return math.inf
        n = part_passes(batch) if passes is None else passes
        return (n * self.fixed_flops + batch * flops_per_sample / self.efficiency) / node_flops

    def rate(self, node_flops: float, batch: float, flops_per_sample: float) -> float:
        """Samples/s at ``batch`` (0.0 when it cannot be predicted)."""
        s = self.seconds(node_flops, batch, flops_per_sample)
        r = batch / s if s > 0 else 0.0
        return r if math.isfinite(r) and r > 0 else 0.0


DEFAULT_STEP = StepModel(DEFAULT_FIXED_FLOPS, DEFAULT_EFFICIENCY, DEFAULT)


def fit_step_model(
    points: Sequence[tuple[float, float]], source: str, prior: StepModel = DEFAULT_STEP
) -> StepModel | None:
    """The step model of ``points`` ``(batch x FLOPs per sample, seconds x node FLOP/s)``:
    ``y = fixed + x / efficiency`` by least squares of the relative error (each point weighs
    1 / y^2), ``fixed`` >= 0. Points whose ``x`` do not spread by SPREAD keep ``prior``'s
    fixed cost (no more than half a step's) and fit the efficiency alone. None: no usable
    point."""
    pts = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y) and x > 0 and y > 0]
    if not pts:
        return None
    line = relative_line(pts)
    if line is not None and line[1] > 0:
        return StepModel(line[0], 1.0 / line[1], source, len(pts))
    fixed = min(prior.fixed_flops, 0.5 * min(y for _, y in pts))
    k = statistics.median((y - fixed) / x for x, y in pts)
    if not (math.isfinite(k) and k > 0):
        return None
    return StepModel(fixed, 1.0 / k, source, len(pts))


def relative_line(pts: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """``(a, k)`` of ``y = a + k x`` by least squares of the relative error (weights 1 / y^2)
    over points with ``y > 0``, ``a >= 0`` (else the line through the origin); None when the
    ``x`` do not spread by SPREAD or the fit is degenerate."""
    xs = [x for x, _ in pts]
    if not pts or min(xs) <= 0 or max(xs) < SPREAD * min(xs):
        return None
    w = [1.0 / (y * y) for _, y in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts, strict=True))
    det = sw * sxx - sx * sx
    if det <= 0:
        return None
    k = (sw * sxy - sx * sy) / det
    a = (sy - k * sx) / sw
    if a < 0:  # no negative fixed part: the line through the origin
        a, k = 0.0, sxy / sxx
    return (a, k) if math.isfinite(a) and math.isfinite(k) else None


def part_passes(batch: float) -> int:
    """Passes of the program a round's part of ``batch`` samples runs: one per verification
    chunk (epochmesh/verification.py: up to PART_CHUNKS, of at least MIN_CHUNK_SAMPLES each)."""
    return max(1, chunk_count(int(round(batch)), PART_CHUNKS))


def _point(m: Measured, flops: float) -> tuple[float, float]:
    """A measured part as the step model's point per pass (its FLOPs and its seconds x node
    FLOP/s over its passes: ``fixed + x / efficiency`` holds per pass)."""
    n = part_passes(m.batch)
    return m.batch * flops / n, m.seconds * m.reference_rate * REFERENCE_FLOPS_PER_SAMPLE / n


def step_model(kind: str, program: Program, measured: Sequence[Measured]) -> StepModel:
    """The step model of ``program`` on device model ``kind`` (see the module docstring)."""
    ok = [m for m in measured if m.batch > 0 and m.seconds > 0 and m.reference_rate > 0]
    known = [m for m in ok if m.flops_per_sample > 0]
    model = DEFAULT_STEP
    for group, source in (
        (known, CALIBRATED_ANY),
        ([m for m in known if m.kind == kind], CALIBRATED),
    ):
        if not group:
            continue
        # The model below anchors the fixed cost (a point of a tiny step): programs of one
        # size cannot tell it, and a program far smaller than those measured extrapolates.
        anchor = (ANCHOR_FLOPS, model.fixed_flops + ANCHOR_FLOPS / model.efficiency)
        points = [_point(m, m.flops_per_sample) for m in group]
        model = fit_step_model([*points, anchor], source, model) or model
    same = [m for m in ok if program.sha256 and m.program == program.sha256]
    same = [m for m in same if m.kind == kind] or same
    if same:
        # Its own FLOPs (1 per sample when unknown: the fit is then in samples).
        flops = program.flops_per_sample if program.flops_per_sample > 0 else 1.0
        prior = model
        if program.flops_per_sample <= 0:  # the prior's efficiency is per FLOP: not usable
            prior = StepModel(0.0, 1.0, DEFAULT)
        fitted = fit_step_model([_point(m, flops) for m in same], SAME_PROGRAM, prior)
        if fitted is not None:
            return fitted
    return model


def predicted_rate(
    node: Node, program: Program, measured: Sequence[Measured], batch: float = 1.0
) -> tuple[float, str]:
    """The node's predicted samples/s on the program at local batch ``batch`` (0.0: no
    reference benchmark, or the program's FLOPs unknown and no job with the same program
    measured)."""
    model = step_model(node.kind, program, measured)
    return _rate(node, program, model, batch), model.source


def _flops(program: Program, model: StepModel) -> float:
    if model.source == SAME_PROGRAM and program.flops_per_sample <= 0:
        return 1.0
    return program.flops_per_sample


def _rate(node: Node, program: Program, model: StepModel, batch: float) -> float:
    flops = _flops(program, model)
    if node.flops <= 0 or flops <= 0:
        return 0.0
    return model.rate(node.flops, batch, flops)


@dataclass(frozen=True)
class History:
    """Fixed costs measured from recorded jobs (None: none recorded)."""

    round_overhead_s: float | None = None  # the fixed part of a round's overhead
    overhead_per_byte: float | None = None  # seconds per byte of the parameters (None: nodes')
    start_s: float | None = None
    jobs: int = 0


def slowest_rtt(nodes: Sequence[Node]) -> float:
    """The largest measured RTT of ``nodes`` in seconds (0.0: none measured)."""
    return max((n.rtt_s for n in nodes if math.isfinite(n.rtt_s) and n.rtt_s > 0), default=0.0)


def default_overhead(nodes: Sequence[Node]) -> tuple[float, float]:
    """(fixed seconds, seconds per parameter byte) of a round on ``nodes`` before any job is
    recorded: from the slowest node's measured FLOP/s and the lowest measured bandwidth."""
    flops = min((n.flops for n in nodes if n.flops > 0), default=0.0)
    fixed = ROUND_FIXED_FLOPS / flops if flops > 0 else 0.0
    rtt = slowest_rtt(nodes)
    if rtt > 0:
        fixed = ROUND_RTTS * rtt
    bandwidth = min(
        (n.bandwidth for n in nodes if math.isfinite(n.bandwidth) and n.bandwidth > 0),
        default=FALLBACK_BANDWIDTH,
    )
    return fixed, ROUND_BYTE_PASSES / bandwidth


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


def _rounds(job: QuotedJob) -> list[tuple[int, int]]:
    """(batch, how many rounds) of an epoch: full rounds, then the remainder."""
    full, rest = divmod(job.num_samples, job.global_batch)
    out = [(job.global_batch, full)] if full else []
    return out + ([(rest, 1)] if rest else [])


def bench_seconds(node: Node, model: StepModel, flops_per_sample: float) -> float:
    """Seconds the job benchmark's steps take on ``node`` (see JOB_BENCH)."""
    untimed, timed, most = QUICK_JOB_BENCH if node.quick_bench else JOB_BENCH
    total = 0.0
    for b in JOB_BENCH_BATCHES:
        step = model.seconds(node.flops, b, flops_per_sample, passes=1)  # not chunked
        total += untimed * step + min(timed * step, most + step)
    return total


def _split(
    batch: int,
    nodes: Mapping[str, Node],
    models: Mapping[str, StepModel],
    program: Program,
    caps: Mapping[str, int],
) -> tuple[dict[str, int], dict[str, float]]:
    """The local batches of a round of ``batch`` samples and each node's rate at its batch:
    split_batch by the rates at the batches of the previous pass, from an even split."""
    n = len(nodes)
    batches = {i: max(1, batch // n) for i in nodes}
    rates: dict[str, float] = {}
    for _ in range(4):
        rates = {i: _rate(nodes[i], program, models[i], max(1, batches[i])) for i in nodes}
        batches = split_batch(batch, rates, {i: min(caps[i], batch) for i in nodes})
    rates = {i: _rate(nodes[i], program, models[i], batches[i]) for i in nodes if batches[i] > 0}
    return batches, rates


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
    models = {n.node_id: step_model(n.kind, program, measured) for n in nodes}
    by_id = {n.node_id: n for n in nodes}
    # The scheduler ranks nodes by their rate at the local batch they would have.
    offered = sum(1 for n in nodes if n.flops > 0)
    nominal = max(1, math.ceil(job.global_batch / max(1, min(offered, job.max_nodes))))
    rates = {
        n.node_id: (_rate(n, program, models[n.node_id], nominal), models[n.node_id].source)
        for n in nodes
    }
    rates = {k: (r, src if r > 0 else "none") for k, (r, src) in rates.items()}
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
            job_rates={**cluster.job_rates.get(n.node_id, {}), QUOTED_JOB: rates[n.node_id][0]},
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
    offered_nodes = [n for n in nodes if n.node_id in mine.nodes] or list(nodes)
    fixed_default, per_byte_default = default_overhead(offered_nodes)
    base_overhead = (
        history.round_overhead_s if history.round_overhead_s is not None else fixed_default
    )
    per_byte = (
        history.overhead_per_byte if history.overhead_per_byte is not None else per_byte_default
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
    chosen = {n: by_id[n] for n in mine.nodes}
    caps = {n: (by_id[n].max_batch or job.global_batch) for n in chosen}
    # Recorded overheads are per node (fitted on the nodes' rounds as they ran); the default's
    # fixed part is one node's, and further nodes add DEFAULT_NODE_SHARE of it each (their
    # hand-outs and updates overlap but pass through the one coordinator).
    nodes_factor = (
        float(len(chosen))
        if history.round_overhead_s is not None
        else 1.0 + DEFAULT_NODE_SHARE * (len(chosen) - 1)
    )
    overhead = nodes_factor * (base_overhead + per_byte * program.state_bytes)
    epoch_s = 0.0
    epoch_cost = epoch_fee = 0
    rounds = 0
    full_batches: dict[str, int] = {}
    full_rates: dict[str, float] = {}
    full_compute = 0.0
    for batch, count in _rounds(job):
        batches, at = _split(batch, chosen, models, program, caps)
        if batch == job.global_batch:
            full_batches, full_rates = batches, at
        compute = max(b / at[n] for n, b in batches.items() if b > 0)
        full_compute = full_compute or compute
        charges = [
            charge_part(n, "", by_id[n].price, at[n], b, fee_ppm=fee_ppm)
            for n, b in batches.items()
            if b > 0
        ]
        epoch_cost += count * sum(c.submitter_total for c in charges)
        epoch_fee += count * sum(c.fee for c in charges)
        epoch_s += count * (compute + overhead)
        rounds += count
    if not full_batches:  # an epoch smaller than one global batch
        full_batches, full_rates = _split(job.num_samples, chosen, models, program, caps)
    total_rounds = rounds * job.epochs
    checkpoints = total_rounds // job.checkpoint_every if job.checkpoint_every > 0 else 0
    bench = max(bench_seconds(chosen[n], models[n], _flops(program, models[n])) for n in chosen)
    rtt = slowest_rtt(list(chosen.values()))
    default_start = START_RTTS * rtt if rtt > 0 else DEFAULT_START_S
    fixed_start = history.start_s if history.start_s is not None else default_start
    start_s = fixed_start + bench
    total_s = start_s + epoch_s * job.epochs + checkpoints * checkpoint_s
    return Estimate(
        nodes=tuple(
            NodeQuote(
                n,
                full_rates.get(n, rates[n][0]),
                rates[n][1],
                by_id[n].price,
                full_batches.get(n, 0),
            )
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
    jobs: Sequence[tuple[int, int, int, int, float, float, int, float]],
    per_byte_default: float = 0.0,
) -> History:
    """Fixed costs from recorded jobs, each ``(created_ms, first round's start ms, last
    round's finish ms, rounds, summed slowest-part compute seconds, its job benchmark's
    predicted seconds (0: unknown), its parameters' bytes, its nodes per round)``. A job's
    round overhead per node is (wall time of its rounds - their compute) / rounds / nodes;
    over jobs whose parameters' sizes spread,
    ``overhead = fixed + per_byte x bytes`` is fitted (`relative_line`), else the per-byte
    part is ``per_byte_default`` (None in the result: the nodes' own) and the fixed part the
    median of the rest. The start: the median of each job's time from submission to its first
    round (program check, claims, loading) less its benchmark."""
    points = []
    starts = []
    for created, first, last, rounds, compute, bench, state_bytes, nodes in jobs:
        if rounds <= 0 or last <= first or first < created:
            continue
        per_round = compute / rounds
        overhead = max(0.0, (last - first) / 1000 / rounds - per_round) / max(1.0, nodes)
        points.append((float(max(0, state_bytes)), overhead))
        starts.append(max(0.0, (first - created) / 1000 - max(0.0, bench)))
    if not points:
        return History()
    line = relative_line([(b, o) for b, o in points if b > 0 and o > 0])
    per_byte: float | None
    if line is not None and line[1] >= 0 and line[0] > 0:
        fixed, per_byte = line
    else:
        per_byte = None
        fixed = statistics.median(max(0.0, o - per_byte_default * b) for b, o in points)
    return History(
        round_overhead_s=fixed,
        overhead_per_byte=per_byte,
        start_s=statistics.median(starts),
        jobs=len(points),
    )
