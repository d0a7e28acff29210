"""Price-performance matching (pure): which of the offered nodes a job should train on so that
an epoch costs it the least (`cheapest_nodes`), or takes the least time within a price cap
(`fastest_nodes`, for a job with a deadline).

An epoch of S samples on nodes with rates r_i (samples/s, measured for this job) and hourly
prices p_i takes T = S / sum(r) seconds and costs sum(p) x T / 3600: the cost per sample is
sum(p) / sum(r) / 3600, whatever S. So the cheapest node set (min_nodes..max_nodes of the nodes
priced at most max_price) minimises the ratio sum(p) / sum(r). That is a fractional subset
problem, solved exactly by Dinkelbach's iteration: for a trial ratio l, the set minimising
sum(p_i - l r_i) for each allowed size is its most negative terms; l falls to that set's ratio
until no set beats it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

SECONDS_PER_HOUR = 3600


@dataclass(frozen=True)
class Offer:
    node_id: str
    price_per_hour: int  # micro-credits
    rate: float  # samples/s for the job


def epoch_cost(offers: Sequence[Offer], samples: int) -> tuple[float, float]:
    """(micro-credits, seconds) of ``samples`` samples on ``offers`` together."""
    rate = sum(o.rate for o in offers)
    if rate <= 0:
        return float("inf"), float("inf")
    seconds = samples / rate
    return sum(o.price_per_hour for o in offers) * seconds / SECONDS_PER_HOUR, seconds


def _ratio(offers: Sequence[Offer]) -> Fraction:
    """sum(p) / sum(r), exactly (each rate as the exact value of its float)."""
    return Fraction(sum(o.price_per_hour for o in offers)) / sum(Fraction(o.rate) for o in offers)


def cheapest_nodes(
    offers: Sequence[Offer], min_nodes: int, max_nodes: int, max_price: int | None = None
) -> list[Offer]:
    """The node set of min_nodes..max_nodes offers (each priced at most ``max_price``) with
    the least cost per epoch, by node id among equals; [] when too few offers qualify."""
    usable = sorted(
        (o for o in offers if o.rate > 0 and (max_price is None or o.price_per_hour <= max_price)),
        key=lambda o: o.node_id,
    )
    lo, hi = max(1, min_nodes), min(max_nodes, len(usable))
    if lo > hi:
        return []
    best = sorted(usable, key=lambda o: (-o.rate, o.node_id))[:hi]  # a feasible start
    ratio = _ratio(best)
    while True:
        terms = sorted(
            usable,
            key=lambda o: (Fraction(o.price_per_hour) - ratio * Fraction(o.rate), o.node_id),
        )
        candidate, value, total = best, Fraction(0), Fraction(0)
        for k, o in enumerate(terms[:hi], start=1):
            total += Fraction(o.price_per_hour) - ratio * Fraction(o.rate)
            if k >= lo and total < value:
                candidate, value = terms[:k], total
        if value >= 0:  # no set beats the ratio: it is the optimum
            return sorted(best, key=lambda o: o.node_id)
        best, ratio = candidate, _ratio(candidate)


def fastest_nodes(
    offers: Sequence[Offer], min_nodes: int, max_nodes: int, max_price: int | None = None
) -> list[Offer]:
    """The max_nodes fastest offers priced at most ``max_price`` (a deadline's choice: the
    most samples/s the cap allows), the cheaper and then the lower node id among equal rates;
    by node id; [] when fewer than min_nodes offers qualify."""
    usable = [
        o for o in offers if o.rate > 0 and (max_price is None or o.price_per_hour <= max_price)
    ]
    lo, hi = max(1, min_nodes), min(max_nodes, len(usable))
    if lo > hi:
        return []
    chosen = sorted(usable, key=lambda o: (-o.rate, o.price_per_hour, o.node_id))[:hi]
    return sorted(chosen, key=lambda o: o.node_id)
