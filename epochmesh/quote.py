"""What a job would cost and take on the nodes offered now (pure): `quote(spec, num_samples,
offers)` picks the nodes the way the market does and prices the run.

The node set: min_nodes..max_nodes (max_nodes capped by global_batch: every node needs a
sample per round) of the offers priced at most the job's max_price (`max_price_of`), the
cheapest per epoch (`epochmesh.matching.cheapest_nodes`), or with a deadline the fastest
(`fastest_nodes`). On nodes of summed rate R and summed hourly price P an epoch of S samples
takes S / R seconds and costs P x S / R / 3600 micro-credits: what the billing rule charges
(each node its price for the time its share of the samples takes at its rate), rounded up
here since it is an estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from epochmesh.matching import SECONDS_PER_HOUR, Offer, cheapest_nodes, fastest_nodes
from epochmesh.money import format_credits
from epochmesh.v1 import common_pb2

CHEAPEST = "cheapest"  # the least cost per epoch
FASTEST = "fastest"  # the most samples/s within max_price (a job with a deadline)


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
    def budget_covers(self) -> bool:
        return self.fits and self.total_cost <= (self.budget or 0)

    @property
    def deadline_met(self) -> bool | None:
        """None without a deadline."""
        if self.deadline_seconds is None:
            return None
        return self.fits and self.total_seconds <= self.deadline_seconds


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


def quote(spec: common_pb2.JobSpec, num_samples: int, offers: Sequence[Offer]) -> Quote:
    """The node set the job would get from ``offers`` (rates in samples/s for the job) and
    the time and cost of its ``spec.epochs`` epochs of ``num_samples`` samples on it."""
    deadline = spec.deadline_seconds if spec.HasField("deadline_seconds") else None
    budget = spec.budget_micro if spec.HasField("budget_micro") else None
    max_price = max_price_of(spec)
    lo = max(1, spec.min_nodes)
    hi = min(spec.max_nodes, spec.global_batch)
    mode = FASTEST if deadline is not None else CHEAPEST
    pick = fastest_nodes if mode == FASTEST else cheapest_nodes
    chosen = tuple(pick(offers, lo, hi, max_price))
    eligible = sum(
        1 for o in offers if o.rate > 0 and (max_price is None or o.price_per_hour <= max_price)
    )
    epochs = max(1, spec.epochs)
    within = _eligible_text(eligible, max_price)
    rate = sum((Fraction(o.rate) for o in chosen), Fraction(0))
    price = sum(o.price_per_hour for o in chosen)
    if chosen:
        best = "the fastest" if mode == FASTEST else "the least cost per epoch"
        reason = f"{best} of {within}"
        epoch_seconds = float(num_samples / rate)
        total_seconds = float(num_samples * epochs / rate)
        epoch_cost = cost_micro(price, num_samples, rate)
        total_cost = cost_micro(price, num_samples * epochs, rate)
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
        rate=float(rate),
        price_per_hour=price,
        epoch_seconds=epoch_seconds,
        total_seconds=total_seconds,
        epoch_cost=epoch_cost,
        total_cost=total_cost,
        budget=budget,
        deadline_seconds=deadline,
    )
