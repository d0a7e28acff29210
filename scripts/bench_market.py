"""Price-performance matching against the exact optimum and two naive rules. Prints one JSON line.

    .venv/bin/python scripts/bench_market.py [--seed 0] [--fleet 60] [--instances 200]
                                             [--offers 14]

A simulated fleet (``--fleet`` nodes): speeds log-normal over two orders of magnitude, hourly
prices growing a little slower than speed (faster cards cost less per sample, as on public
GPU markets) times a log-normal spread of +-60 % between hosts, and one node in 33 a donation
(price 0). Each instance is a job on ``--offers`` nodes drawn from the fleet (small enough to
enumerate every node set: the exact optimum by brute force), with min_nodes 1-3, max_nodes
min_nodes..8 and a max_price that rules out the dearest fifth to half of them. Cost per epoch
of each rule's node set over the optimum's:

- ours: `epochmesh.matching.cheapest_nodes`;
- cheapest_first: the max_nodes lowest hourly prices;
- fastest_first: the max_nodes fastest nodes.

Instances whose optimum costs nothing (enough donated nodes) or has no node set are counted
apart, and ours must match them too.

The JSON has the median and worst ratio of each (``cost_over_optimal`` is ours, worst case).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import statistics
import time

from epochmesh.matching import Offer, cheapest_nodes, epoch_cost

log = logging.getLogger("bench_market")
SAMPLES = 1_000_000  # per epoch (the ratios do not depend on it)


def fleet(rng: random.Random, size: int) -> list[Offer]:
    out = []
    for i in range(size):
        rate = 10 ** rng.uniform(1, 3)  # 10..1000 samples/s
        price = 0 if rng.random() < 0.03 else int(2_000 * rate**0.85 * rng.lognormvariate(0, 0.5))
        out.append(Offer(f"n{i:03d}", price, rate))
    return out


def optimum(offers: list[Offer], lo: int, hi: int, cap: int) -> float:
    allowed = [o for o in offers if o.price_per_hour <= cap]
    costs = [
        epoch_cost(list(c), SAMPLES)[0]
        for k in range(lo, min(hi, len(allowed)) + 1)
        for c in itertools.combinations(allowed, k)
    ]
    return min(costs, default=float("inf"))


def naive(offers: list[Offer], hi: int, cap: int, key: str) -> list[Offer]:
    allowed = [o for o in offers if o.price_per_hour <= cap]
    if key == "price":
        allowed.sort(key=lambda o: (o.price_per_hour, o.node_id))
    else:
        allowed.sort(key=lambda o: (-o.rate, o.node_id))
    return allowed[:hi]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fleet", type=int, default=60)
    p.add_argument("--instances", type=int, default=200)
    p.add_argument("--offers", type=int, default=14)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rng = random.Random(a.seed)
    nodes = fleet(rng, a.fleet)
    ratios: dict[str, list[float]] = {"ours": [], "cheapest_first": [], "fastest_first": []}
    began = time.perf_counter()
    ours_s = 0.0
    free = unmatched = 0
    for _ in range(a.instances):
        offers = rng.sample(nodes, a.offers)
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 8)
        prices = sorted(o.price_per_hour for o in offers)
        cap = prices[int(len(prices) * rng.uniform(0.5, 0.8))]
        best = optimum(offers, lo, hi, cap)
        t0 = time.perf_counter()
        chosen = cheapest_nodes(offers, lo, hi, max_price=cap)
        ours_s += time.perf_counter() - t0
        if best == float("inf"):  # too few nodes under the cap: no set, for everyone
            unmatched += chosen != []
            continue
        if best == 0:  # enough donated nodes: the epoch costs nothing (no ratio to take)
            free += 1
            unmatched += epoch_cost(chosen, SAMPLES)[0] != 0
            continue
        rules = {
            "ours": chosen,
            "cheapest_first": naive(offers, hi, cap, "price"),
            "fastest_first": naive(offers, hi, cap, "rate"),
        }
        for name, chosen_set in rules.items():
            ratios[name].append(epoch_cost(chosen_set, SAMPLES)[0] / best)
    counted = len(ratios["ours"])
    out = {
        "seed": a.seed,
        "fleet": a.fleet,
        "instances": counted,
        "offers_per_instance": a.offers,
        "cost_over_optimal": round(max(ratios["ours"]), 4),
        "cost_over_optimal_median": round(statistics.median(ratios["ours"]), 4),
        "cheapest_first_over_optimal": round(statistics.median(ratios["cheapest_first"]), 4),
        "cheapest_first_worst": round(max(ratios["cheapest_first"]), 4),
        "fastest_first_over_optimal": round(statistics.median(ratios["fastest_first"]), 4),
        "fastest_first_worst": round(max(ratios["fastest_first"]), 4),
        "free_instances": free,
        "ours_missed_a_free_or_empty_optimum": unmatched,
        "goal_met": max(ratios["ours"]) <= 1.10 and not unmatched,
        "matcher_ms_per_job": round(1000 * ours_s / max(1, counted), 3),
        "seconds": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
