"""Simulated epochs on many heterogeneous nodes, driven through the REAL allocator, ledger and
throughput estimator. Prints one JSON line of figures.

Model (simulated time, nothing sleeps):
- ``--nodes`` nodes with log-normal true speeds (samples/s, median 100, sigma ``--sigma``).
  Benchmarks (the estimator's seed) are off by up to +-10%.
- Synchronous data-parallel rounds: a round takes max_i(b_i / true_rate_i) over the nodes
  whose update is applied; communication time is not modelled (0).
- Drift ``--drift`` (0.2 = +-20%):
  * "epoch": per epoch each node's speed moves smoothly (geometrically) towards its current
    speed times U(1-d, 1+d), reached at the end of the epoch;
  * "round": every round each node's speed is multiplied by U(1-d, 1+d) (with a weak pull,
    0.95 per round in log space, back to its base speed so speeds stay bounded): a random
    walk, so the best forecast is the last round and its error is the whole jump;
  * "noise": every round each node runs at its base speed times an independent U(1-d, 1+d)
    (stationary jitter: the best forecast is a long average, and it is still off by the
    jitter of the round).
  With 1000 nodes some node is always near the worst case, so for "round" and "noise" any
  forecaster pays about max_i(forecast_i / speed_i) ~ 1/(1-d) = 1.25 per lockstep round;
  only the oracle, which knows the speeds of the round in advance, avoids it.
- Failures: each node dies with probability ``--fail-rate`` per epoch, at a random round of
  it, in the middle of that round: its slices of that round are lost and redone later
  (fail_node), and a fresh node with a new random speed joins the next round (add_node).
  Detection: "lease" (default) = the dead node's lease lapses before the survivors finish, so
  the round closes with the survivors; "deadline" = the round waits for the full deadline.
- A node slower than its deadline is late: the round waits until the deadline, its slices
  return to pending.
- makespan of an epoch = sum of its round times until its last sample is committed.
  ideal = sum over rounds of (samples committed in the round / total true speed of the nodes
  alive in it): a perfectly divisible, instantly re-balanced fluid with the same fleet.

Policies (same speeds, drift and failures for all):
- weighted: b_i from the estimator with split_batch(rounding="min_time") (default for the
  headline figure), segments rebalanced every round;
- weighted_lr: the same with largest-remainder rounding;
- oracle: split_batch(min_time) on the TRUE current speeds (no estimation error): what is
  left is integer rounding, the last partial round and failure redo;
- equal: every node the same b_i (the naive baseline).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

import numpy as np

from coordinator.rounds.allocator import split_batch
from coordinator.rounds.ledger import EpochLedger
from coordinator.rounds.throughput import ThroughputEstimator

POLICIES = ("weighted", "weighted_lr", "oracle", "equal")


@dataclass
class Config:
    nodes: int = 1000
    samples: int = 2_000_000
    batch_per_node: int = 64
    epochs: int = 5
    sigma: float = 0.5
    drift: float = 0.2
    drift_mode: str = "epoch"
    fail_rate: float = 0.02
    detect: str = "lease"
    max_batch: int = 512
    block_size: int = 1000
    seed: int = 0

    @property
    def global_batch(self) -> int:
        return self.nodes * self.batch_per_node

    @property
    def rounds_per_epoch(self) -> int:
        return math.ceil(self.samples / self.global_batch)


def _drift_factors(cfg: Config, rng: np.random.Generator, total_rounds: int) -> np.ndarray:
    """Multiplicative speed factor per (round, slot) relative to the slot's base speed."""
    d = cfg.drift
    n, rpe = cfg.nodes, cfg.rounds_per_epoch
    log_f = np.zeros((total_rounds, n))
    if cfg.drift_mode == "round":
        cur = np.zeros(n)
        for r in range(total_rounds):
            cur = 0.95 * cur + np.log(rng.uniform(1 - d, 1 + d, n))
            log_f[r] = cur
    elif cfg.drift_mode == "noise":
        log_f = np.log(rng.uniform(1 - d, 1 + d, (total_rounds, n)))
    else:
        start = np.zeros(n)
        r = 0
        while r < total_rounds:
            target = start + np.log(rng.uniform(1 - d, 1 + d, n))
            for k in range(rpe):
                if r + k >= total_rounds:
                    break
                log_f[r + k] = start + (target - start) * (k + 1) / rpe
            start = target
            r += rpe
    return np.exp(log_f)


def simulate(cfg: Config, policy: str) -> dict[str, float]:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.nodes
    total_rounds = cfg.epochs * (cfg.rounds_per_epoch + 8) + 16
    base = rng.lognormal(math.log(100.0), cfg.sigma, n)
    factors = _drift_factors(cfg, rng, total_rounds)
    bench_err = rng.uniform(0.9, 1.1, (total_rounds + 1, n))
    new_base = rng.lognormal(math.log(100.0), cfg.sigma, (total_rounds + 1, n))
    # Failures: per epoch, each slot fails with probability fail_rate, at a random round of
    # the epoch's nominal length (rounds past it, i.e. redo rounds, have none).
    fail_at: dict[tuple[int, int], list[int]] = {}
    for e in range(cfg.epochs):
        dies = np.flatnonzero(rng.random(n) < cfg.fail_rate)
        when = rng.integers(0, cfg.rounds_per_epoch, dies.size)
        for slot, k in zip(dies.tolist(), when.tolist(), strict=True):
            fail_at.setdefault((e, k), []).append(slot)

    gen = np.zeros(n, dtype=np.int64)  # generation of the node in each slot
    slot_of: dict[str, int] = {}

    def node_id(slot: int) -> str:
        return f"s{slot}g{gen[slot]}"

    est = ThroughputEstimator()
    for s in range(n):
        nid = node_id(s)
        slot_of[nid] = s
        est.add_node(nid, float(base[s] * factors[0, s] * bench_err[0, s]))
    caps = {nid: cfg.max_batch for nid in slot_of}
    led = EpochLedger(cfg.samples, 0, cfg.seed, block_size=cfg.block_size)
    led.assign_segments(est.rates(list(slot_of)))
    B = cfg.global_batch
    makespan: list[float] = []
    ideal: list[float] = []
    rounds: list[int] = []
    late_total = lost_total = failures = 0
    steals = moved = 0
    rid = 0
    joiners: list[int] = []
    for epoch in range(cfg.epochs):
        t_epoch = ideal_epoch = 0.0
        k = 0
        while not led.complete:
            if rid >= total_rounds:
                raise RuntimeError("simulation ran out of pre-drawn rounds")
            for s in joiners:  # replacements for nodes that died last round
                gen[s] += 1
                base[s] = new_base[rid, s]
                nid = node_id(s)
                slot_of[nid] = s
                caps[nid] = cfg.max_batch
                est.add_node(nid, float(base[s] * factors[rid, s] * bench_err[rid, s]))
                led.add_node(nid, est.estimate(nid))
            joiners = []
            alive = led.nodes
            true = {nid: float(base[slot_of[nid]] * factors[rid, slot_of[nid]]) for nid in alive}
            if policy == "equal":
                batches = split_batch(B, dict.fromkeys(alive, 1.0), caps)
            elif policy == "oracle":
                batches = split_batch(B, true, caps, rounding="min_time")
            else:
                rounding = "largest_remainder" if policy == "weighted_lr" else "min_time"
                batches = split_batch(B, est.planning_rates(alive), caps, rounding=rounding)
            plan = led.plan_round(rid, batches)
            sizes = {nid: sum(b - a for a, b in rs) for nid, rs in plan.items()}
            deadline = est.deadline(sizes)
            dying = set()
            if k < cfg.rounds_per_epoch:
                dying = {node_id(s) for s in fail_at.get((epoch, k), [])} & set(alive)
            times = {nid: b / true[nid] for nid, b in sizes.items()}
            late = {nid for nid, t in times.items() if t > deadline and nid not in dying}
            applied = set(sizes) - late - dying
            round_time = max((times[nid] for nid in applied), default=0.0)
            if late or (dying & set(sizes) and cfg.detect == "deadline"):
                round_time = deadline
            committed = led.commit_round(rid, applied)
            done = sum(b - a for rs in committed.values() for a, b in rs)
            lost_total += sum(sizes.get(nid, 0) for nid in dying)
            late_total += sum(sizes[nid] for nid in late)
            for nid in sorted(applied):
                est.observe(nid, sizes[nid], times[nid])
            for nid in sorted(late):
                est.observe_late(nid, sizes[nid], deadline)
            for nid in sorted(dying):
                led.fail_node(nid)
                est.remove_node(nid)
                joiners.append(slot_of.pop(nid))
                failures += 1
            led.rebalance(est.rates(led.nodes))
            t_epoch += round_time
            ideal_epoch += done / sum(true.values())
            rid += 1
            k += 1
        led.check()
        steals += led.stats["steals"]
        moved += led.stats["moved"]
        makespan.append(t_epoch)
        ideal.append(ideal_epoch)
        rounds.append(k)
        led = led.next_epoch()
    ratios = [m / i for m, i in zip(makespan, ideal, strict=True)]
    return {
        "makespan_over_ideal": round(sum(makespan) / sum(ideal), 4),
        "per_epoch": [round(r, 4) for r in ratios],
        "rounds_per_epoch": rounds,
        "failures": failures,
        "redo_samples": lost_total + late_total,
        "late_samples": late_total,
        "steals": steals,
        "moved_by_rebalance": moved,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--samples", type=int, default=2_000_000)
    p.add_argument("--batch-per-node", type=int, default=64)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--sigma", type=float, default=0.5)
    p.add_argument("--drift", type=float, default=0.2)
    p.add_argument("--fail-rate", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="skip the secondary scenarios")
    a = p.parse_args()
    base = Config(
        nodes=a.nodes,
        samples=a.samples,
        batch_per_node=a.batch_per_node,
        epochs=a.epochs,
        sigma=a.sigma,
        drift=a.drift,
        fail_rate=a.fail_rate,
        seed=a.seed,
    )
    t0 = time.perf_counter()
    results = {pol: simulate(base, pol) for pol in POLICIES}
    out: dict[str, object] = {
        "nodes": base.nodes,
        "samples": base.samples,
        "global_batch": base.global_batch,
        "epochs": base.epochs,
        "speed_sigma": base.sigma,
        "drift": f"+-{base.drift:.0%} per epoch (smooth)",
        "fail_rate_per_epoch": base.fail_rate,
        "failure_detection": base.detect,
        "makespan_over_ideal": results["weighted"]["makespan_over_ideal"],
        "largest_remainder_makespan_over_ideal": results["weighted_lr"]["makespan_over_ideal"],
        "oracle_makespan_over_ideal": results["oracle"]["makespan_over_ideal"],
        "equal_split_makespan_over_ideal": results["equal"]["makespan_over_ideal"],
        "weighted": results["weighted"],
    }
    if not a.quick:
        short = {**base.__dict__, "epochs": min(base.epochs, 3)}
        for mode in ("round", "noise"):
            cfg = Config(**{**short, "drift_mode": mode})
            out[f"per_{mode}_{'drift' if mode == 'round' else 'jitter'}"] = {
                pol: simulate(cfg, pol)["makespan_over_ideal"] for pol in ("weighted", "oracle")
            }
        cfg = Config(**{**short, "detect": "deadline"})
        out["deadline_detection_makespan_over_ideal"] = simulate(cfg, "weighted")[
            "makespan_over_ideal"
        ]
    out["bench_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
