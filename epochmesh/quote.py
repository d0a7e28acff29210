"""What a job would cost and take on the nodes offered now (pure): `quote(spec, num_samples,
offers)` picks the nodes the way the market does and prices the run.

The node set: min_nodes..max_nodes (max_nodes capped by global_batch: every node needs a
sample per round) of the offers priced at most the job's max_price (`max_price_of`), the
cheapest per epoch (`epochmesh.matching.cheapest_nodes`), or with a deadline the fastest
(`fastest_nodes`). On nodes of summed rate R and summed hourly price P an epoch of S samples
takes S / R seconds and costs P x S / R / 3600 micro-credits: what the billing rule charges
(each node its price for the time its share of the samples takes at its rate), rounded up
here since it is an estimate.

A submitted job is quoted on what it has left (`quote_job`): its remaining samples, each node
at the job's own measured samples/s where the coordinator has one (`job_offer`), else at its
reference benchmark's, against the job's escrow and what is left of its deadline.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from epochmesh.matching import SECONDS_PER_HOUR, Offer, cheapest_nodes, fastest_nodes
from epochmesh.money import format_credits
from epochmesh.v1 import common_pb2

# The reference benchmark's model (node_agent/training/reference_model.py: an MLP
# 128-256-256-10) does this many FLOPs per training sample, counted as
# epochmesh/program/flops.py counts a program's: forward 2 x (128x256 + 256x256 + 256x10) =
# 201,728, backward twice that less the first layer's input gradient (2 x 128 x 256). A
# node's reference samples/s times this is its measured FLOP/s.
REFERENCE_FLOPS_PER_SAMPLE = 539_648.0

CHEAPEST = "cheapest"  # the least cost per epoch
FASTEST = "fastest"  # the most samples/s within max_price (a job with a deadline)

# Where a node's rate for a job comes from.
JOB_RATE = "job"  # the job's own measured samples/s on the node
BENCHMARK_RATE = "benchmark"  # the node's reference benchmark
NO_RATE = "none"  # neither: the node cannot be quoted

ENDED_STATES = frozenset(
    {
        common_pb2.JOB_STATE_SUCCEEDED,
        common_pb2.JOB_STATE_FAILED,
        common_pb2.JOB_STATE_CANCELLED,
    }
)
NOTHING_LEFT = "nothing left to train"


def max_price_of(spec: common_pb2.JobSpec) -> int | None:
    """The most a node may ask per hour to serve the job (None: no cap): its max_price, else
    no cap with a budget, else 0 (no budget: only donated nodes). The coordinator's rule."""
    if spec.HasField("max_price_micro_per_hour"):
        return spec.max_price_micro_per_hour
    return None if spec.budget_micro > 0 else 0


@dataclass(frozen=True)
class Quote:
    mode: str  # CHEAPEST | FASTEST
    nodes: tuple[Offer, ...]  # the chosen nodes, by node id; () when too few fit
    reason: str  # why these nodes, or why none
    min_nodes: int
    max_nodes: int  # the spec's, capped by global_batch
    max_price: int | None  # micro-credits per node-hour (None: no cap)
    eligible: int  # offers with a rate priced at most max_price
    num_samples: int  # per epoch
    epochs: int
    total_samples: int  # what the total is of: every epoch's samples, or what a job has left
    rate: float  # samples/s of the chosen nodes together
    price_per_hour: int  # micro-credits, the chosen nodes' prices summed
    epoch_seconds: float
    total_seconds: float
    epoch_cost: int  # micro-credits, rounded up
    total_cost: int  # micro-credits, rounded up (not epoch_cost x epochs)
    budget: int | None  # micro-credits (None: no budget given, i.e. 0)
    deadline_seconds: float | None

    @property
    def fits(self) -> bool:
        return bool(self.nodes)

    @property
    def nothing_left(self) -> bool:
        """No samples to train (a job that is done): no nodes needed, nothing to pay."""
        return self.total_samples <= 0

    @property
    def budget_covers(self) -> bool:
        return (self.fits or self.nothing_left) and self.total_cost <= (self.budget or 0)

    @property
    def deadline_met(self) -> bool | None:
        """None without a deadline."""
        if self.deadline_seconds is None:
            return None
        return self.nothing_left or (self.fits and self.total_seconds <= self.deadline_seconds)


def cost_micro(price_per_hour: int, samples: int, rate: Fraction) -> int:
    """Micro-credits of ``samples`` samples at ``rate`` samples/s on nodes asking
    ``price_per_hour`` together, rounded up."""
    if samples <= 0 or price_per_hour <= 0:
        return 0
    return math.ceil(Fraction(price_per_hour * samples) / (rate * SECONDS_PER_HOUR))


def _eligible_text(n: int, max_price: int | None) -> str:
    """``3 nodes asking at most 2.5 credits/h`` (only nodes with a rate count)."""
    nodes = "node" if n == 1 else "nodes"
    if max_price is None:
        return f"{n} {nodes}"
    if max_price == 0:
        return f"{n} donated {nodes}"
    return f"{n} {nodes} asking at most {format_credits(max_price)} credits/h"


def quote(
    spec: common_pb2.JobSpec,
    num_samples: int,
    offers: Sequence[Offer],
    *,
    total_samples: int | None = None,
) -> Quote:
    """The node set the job would get from ``offers`` (rates in samples/s for the job) and
    the time and cost of an epoch of ``num_samples`` samples on it and of the total:
    ``total_samples`` (default: ``spec.epochs`` epochs). Nothing left (``total_samples`` 0):
    no nodes, no cost."""
    deadline = spec.deadline_seconds if spec.HasField("deadline_seconds") else None
    budget = spec.budget_micro if spec.HasField("budget_micro") else None
    max_price = max_price_of(spec)
    lo = max(1, spec.min_nodes)
    hi = min(spec.max_nodes, spec.global_batch)
    mode = FASTEST if deadline is not None else CHEAPEST
    pick = fastest_nodes if mode == FASTEST else cheapest_nodes
    epochs = max(1, spec.epochs)
    total = num_samples * epochs if total_samples is None else max(0, total_samples)
    chosen = tuple(pick(offers, lo, hi, max_price)) if total > 0 else ()
    eligible = sum(
        1 for o in offers if o.rate > 0 and (max_price is None or o.price_per_hour <= max_price)
    )
    within = _eligible_text(eligible, max_price)
    rate = sum((Fraction(o.rate) for o in chosen), Fraction(0))
    price = sum(o.price_per_hour for o in chosen)
    if total == 0:
        reason = NOTHING_LEFT
        epoch_seconds, total_seconds = math.inf, 0.0
        epoch_cost = total_cost = 0
    elif chosen:
        best = "the fastest" if mode == FASTEST else "the least cost per epoch"
        reason = f"{best} of {within}"
        epoch_seconds = float(num_samples / rate)
        total_seconds = float(total / rate)
        epoch_cost = cost_micro(price, num_samples, rate)
        total_cost = cost_micro(price, total, rate)
    else:
        reason = f"{within}; the job needs at least {lo} (min_nodes)"
        epoch_seconds = total_seconds = math.inf
        epoch_cost = total_cost = 0
    return Quote(
        mode=mode,
        nodes=chosen,
        reason=reason,
        min_nodes=lo,
        max_nodes=hi,
        max_price=max_price,
        eligible=eligible,
        num_samples=num_samples,
        epochs=epochs,
        total_samples=total,
        rate=float(rate),
        price_per_hour=price,
        epoch_seconds=epoch_seconds,
        total_seconds=total_seconds,
        epoch_cost=epoch_cost,
        total_cost=total_cost,
        budget=budget,
        deadline_seconds=deadline,
    )


def job_offer(node: common_pb2.NodeInfo, job_id: str = "") -> tuple[Offer, str]:
    """The node's offer for job ``job_id`` and where its rate comes from: the job's own
    measured samples/s on it (JOB_RATE) when the coordinator has one, else its reference
    benchmark's (BENCHMARK_RATE), else no rate (NO_RATE, 0)."""
    price = max(0, node.price_micro_per_hour)
    measured = node.job_samples_per_second.get(job_id, 0.0) if job_id else 0.0
    if measured > 0 and math.isfinite(measured):
        return Offer(node.node_id, price, measured), JOB_RATE
    bench = node.benchmark.samples_per_second
    if bench > 0 and math.isfinite(bench):
        return Offer(node.node_id, price, bench), BENCHMARK_RATE
    return Offer(node.node_id, price, 0.0), NO_RATE


@dataclass(frozen=True)
class JobQuote:
    """What a submitted job has left, on the nodes offered now."""

    job_id: str
    ended: bool  # succeeded, failed or cancelled: it runs no more, nothing is left to train
    samples_done: int
    samples_total: int
    quote: Quote  # of the samples left (none for an ended job)
    sources: Mapping[str, str]  # node id -> JOB_RATE | BENCHMARK_RATE | NO_RATE, every offer
    spent: int  # micro-credits the job's rounds have cost so far
    escrow: int  # micro-credits its escrow holds now
    deadline_left: float | None  # seconds from now to its deadline (negative: passed)

    @property
    def samples_left(self) -> int:
        return self.quote.total_samples

    @property
    def escrow_covers(self) -> bool:
        """The escrow pays for what is left (the platform fee, if any, not counted)."""
        return (self.quote.fits or self.quote.nothing_left) and self.quote.total_cost <= self.escrow

    @property
    def deadline_met(self) -> bool | None:
        """None without a deadline or for an ended job."""
        if self.deadline_left is None or self.ended:
            return None
        q = self.quote
        return q.nothing_left or (q.fits and q.total_seconds <= self.deadline_left)


def quote_job(job: common_pb2.Job, nodes: Iterable[common_pb2.NodeInfo], now_ms: int) -> JobQuote:
    """Quote what ``job`` has left (samples_total - samples_done; nothing for an ended job) on
    ``nodes`` (those that could take it now), each at the job's measured rate, else its
    reference benchmark's; its deadline counts from its submission (``now_ms``: the time)."""
    rated = [job_offer(n, job.job_id) for n in nodes]
    ended = job.state in ENDED_STATES
    left = 0 if ended else max(0, job.samples_total - job.samples_done)
    spec = job.spec
    deadline_left = None
    if spec.HasField("deadline_seconds"):
        deadline_left = spec.deadline_seconds - (now_ms - job.created_ms) / 1000
    return JobQuote(
        job_id=job.job_id,
        ended=ended,
        samples_done=job.samples_done,
        samples_total=job.samples_total,
        quote=quote(spec, job.num_samples, [o for o, _ in rated], total_samples=left),
        sources={o.node_id: source for o, source in rated},
        spent=job.spent_micro,
        escrow=job.escrow_micro,
        deadline_left=deadline_left,
    )
