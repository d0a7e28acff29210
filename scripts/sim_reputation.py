"""Simulated spot checks driven by coordinator.verification.reputation (issue 20). Prints one JSON line.

    .venv/bin/python scripts/sim_reputation.py [--seed 0] [--nodes 50] [--rounds 600]
        [--join-every 10] [--cheaters-per-kind 6] [--micro-batches 64]

Pure: no processes, no network. A fleet of ``--nodes`` honest nodes (speeds log-normal, a
part's compute proportional to speed) plus one honest node joining every ``--join-every``
rounds, and ``--cheaters-per-kind`` cheaters of each kind joining at random rounds in the
first quarter: half cheat from their first round (new nodes: the setting of the issue's
acceptance and of bench_verify), half once trusted (from a random round within 50 after their
check probability reached the floor). Each round every node's part (``--micro-batches``
micro-batches) is checked with `should_check` from the coordinator's secret generator; a check
recomputes `checked_micro_batches` of it.

- scaled, flipped, random, stale: every micro-batch of a cheated part is wrong, so any check
  finds it;
- lazy: each round the cheater skips a random 25 % of its micro-batches (fabricating their
  commitments), so a check finds it only when it hits one of those.

A mismatch is recomputed on a third node (its cost counted) and the cheater is quarantined
in that same round; rounds_to_catch = caught round - first cheat round + 1. Checkers are honest
here, and an honest node's check never fails by construction (the recomputation tolerance is
the real system's question, docs/device-tolerance.md): false_accusations is 0 by construction.

overhead_* = check compute (recomputed micro-batches, re-checks included) over training
compute, over the node-rounds in which nodes were new (p = 1), trusted (p at the floor), or all.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.verification.reputation import (
    CHECK_FRACTION,
    N0,
    P_FLOOR,
    RECOMPUTE_COST,
    ReputationRecord,
    check_probability,
    checked_count,
    checked_micro_batches,
    record_failed,
    record_verified,
    should_check,
)

log = logging.getLogger("sim_reputation")

KINDS = ("scaled", "flipped", "random", "lazy", "stale")
ROUND_LIMITS = {"scaled": 2, "flipped": 2, "random": 2, "lazy": 5, "stale": 5}  # the issue's
LAZY_FRACTION = 0.25
TRUSTED_DELAY = 50  # a trusted cheater turns within this many rounds of reaching the floor


@dataclass
class Node:
    node_id: str
    speed: float
    joined: int
    kind: str | None = None  # None: honest
    when: str = ""  # cheaters: "new" or "trusted"
    first_cheat: int | None = None
    caught: int | None = None
    trusted_at: int | None = None
    record: ReputationRecord = field(default_factory=ReputationRecord)

    def cheats_in(self, rnd: int) -> bool:
        if self.kind is None:
            return False
        if self.when == "new":
            return True
        return self.trusted_at is not None and rnd >= self.trusted_at


def _phase(p: float) -> str:
    return "new" if p >= 1.0 else "trusted" if p <= P_FLOOR else "warming"


def _p_miss_one_check(kind: str, n: int) -> float:
    """Probability that one check of a cheated part finds nothing."""
    if kind != "lazy":
        return 0.0
    k = checked_count(n, CHECK_FRACTION)
    m = round(LAZY_FRACTION * n)
    return math.comb(n - m, k) / math.comb(n, k)


def run(
    seed: int = 0,
    nodes: int = 50,
    rounds: int = 600,
    join_every: int = 10,
    cheaters_per_kind: int = 6,
    micro_batches: int = 64,
) -> dict[str, Any]:
    world = random.Random(seed)  # the fleet and the cheaters' choices
    secret = random.Random(seed * 7919 + 1)  # the coordinator's, unknown to the nodes
    fleet: list[Node] = [Node(f"h{i:03d}", world.lognormvariate(0, 0.7), 0) for i in range(nodes)]
    for kind in KINDS:
        for j in range(cheaters_per_kind):
            when = "new" if j % 2 == 0 else "trusted"
            joined = world.randrange(0, max(1, rounds // 4))
            fleet.append(Node(f"{kind}{j}", world.lognormvariate(0, 0.7), joined, kind, when))
    n_lazy = round(LAZY_FRACTION * micro_batches)
    unit_share = RECOMPUTE_COST / micro_batches
    work = {"new": 0.0, "warming": 0.0, "trusted": 0.0}
    check = {"new": 0.0, "warming": 0.0, "trusted": 0.0}
    joined_later = 0
    for rnd in range(rounds):
        if join_every > 0 and rnd > 0 and rnd % join_every == 0:
            fleet.append(Node(f"j{rnd:05d}", world.lognormvariate(0, 0.7), rnd))
            joined_later += 1
        for node in fleet:
            if node.joined > rnd or node.caught is not None:
                continue
            p = check_probability(node.record)
            phase = _phase(p)
            if phase == "trusted" and node.trusted_at is None:
                node.trusted_at = rnd + world.randrange(TRUSTED_DELAY)
            cheating = node.cheats_in(rnd)
            if cheating and node.first_cheat is None:
                node.first_cheat = rnd
            work[phase] += node.speed
            if not should_check(node.record, secret):
                continue
            checked = checked_micro_batches(micro_batches, CHECK_FRACTION, secret)
            check[phase] += node.speed * unit_share * len(checked)
            if not cheating:
                node.record = record_verified(node.record, rnd)
                continue
            if node.kind == "lazy":
                skipped = set(world.sample(range(micro_batches), n_lazy))
                wrong = [i for i in checked if i in skipped]
            else:
                wrong = checked
            if not wrong:
                node.record = record_verified(node.record, rnd)
                continue
            check[phase] += node.speed * unit_share * len(wrong)  # the third node's re-check
            node.record = record_failed(
                node.record, rnd, f"{node.kind}: micro-batches {wrong} differ on two checkers"
            )
            node.caught = rnd
    cheaters = [n for n in fleet if n.kind is not None]
    honest = [n for n in fleet if n.kind is None]

    def catches(when: str) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {k: [] for k in KINDS}
        for n in cheaters:
            if n.when == when and n.caught is not None and n.first_cheat is not None:
                out[str(n.kind)].append(n.caught - n.first_cheat + 1)
        return out

    new, trusted = catches("new"), catches("trusted")
    uncaught = [n.node_id for n in cheaters if n.caught is None]

    def ratio(phase: str) -> float:
        return round(check[phase] / work[phase], 5) if work[phase] else 0.0

    def stat(values: dict[str, list[int]], f: Any) -> dict[str, float | None]:
        return {k: (f(v) if v else None) for k, v in values.items()}

    trusted_mean = {k: 1.0 / (P_FLOOR * (1.0 - _p_miss_one_check(k, micro_batches))) for k in KINDS}
    within = all(v <= ROUND_LIMITS[k] for k, vs in new.items() for v in vs) and all(
        len(vs) > 0 for vs in new.values()
    )
    return {
        "seed": seed,
        "nodes": nodes,
        "joined_later": joined_later,
        "cheaters": len(cheaters),
        "rounds": rounds,
        "micro_batches": micro_batches,
        "checked_micro_batches": checked_count(micro_batches, CHECK_FRACTION),
        "check_fraction": CHECK_FRACTION,
        "p_floor": P_FLOOR,
        "n0": N0,
        "overhead_new": ratio("new"),
        "overhead_warming": ratio("warming"),
        "overhead_trusted": ratio("trusted"),
        "overhead_all": round(sum(check.values()) / sum(work.values()), 5),
        "max_rounds_to_catch": stat(new, max),
        "mean_rounds_to_catch": stat(new, lambda v: round(statistics.fmean(v), 2)),
        "round_limits": ROUND_LIMITS,
        "within_limits": within and not uncaught,
        "p_over_limit": {
            k: float(f"{_p_miss_one_check(k, micro_batches) ** ROUND_LIMITS[k]:.3g}") for k in KINDS
        },
        "max_rounds_to_catch_trusted": stat(trusted, max),
        "mean_rounds_to_catch_trusted": stat(trusted, lambda v: round(statistics.fmean(v), 2)),
        "expected_mean_rounds_to_catch_trusted": {k: round(v, 2) for k, v in trusted_mean.items()},
        "uncaught": uncaught,
        "honest_node_rounds": sum(max(0, rounds - n.joined) for n in honest),
        "false_accusations": sum(1 for n in honest if n.record.failed_total),
        "false_accusations_note": "0 by construction: an honest node's check never fails here",
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=50)
    p.add_argument("--rounds", type=int, default=600)
    p.add_argument("--join-every", type=int, default=10)
    p.add_argument("--cheaters-per-kind", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=64)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    began = time.perf_counter()
    out = run(a.seed, a.nodes, a.rounds, a.join_every, a.cheaters_per_kind, a.micro_batches)
    out["seconds"] = round(time.perf_counter() - began, 2)
    log.info("simulated %d rounds in %.2f s", a.rounds, out["seconds"])
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
