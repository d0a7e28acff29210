"""One job's round planning: how many samples each node gets and how long a round may take.

The planner holds what planning needs (the nodes' job benchmarks, the throughput estimator, the
late parts whose updates still tell a node's speed) and turns a node set and the epoch ledger
into a round's parts and deadline. It does no I/O: the runner feeds it benchmarks and round
outcomes and hands its parts out.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from coordinator.rounds.allocator import quotas, split_batch
from coordinator.rounds.claims import capped_benchmarks, confirmed_compute
from coordinator.rounds.ledger import EpochLedger
from coordinator.rounds.round_state import Part, RoundState
from coordinator.rounds.sample_ranges import index_run_array
from coordinator.rounds.throughput import MIN_SLACK, StepModel, ThroughputEstimator
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)

# Time-boxed local SGD rounds (parameter server): each node gets a time box and ranges for
# this much more than the steps the box is sized for; a node faster than its estimate runs more
# steps in the box, a slower one fewer, and nobody waits for the others (see `plan`).
TIME_BOX_EXTRA_STEPS = 0.25
# Local SGD: of the splits whose planned round takes at most this fraction longer than the
# fastest split's, the planner takes the one closest to equal local batches (see
# `RoundPlanner._balanced`).
BALANCE_TOLERANCE = 0.1
# What a node's larger batch would cost is judged on its step model with the fixed fraction
# capped here, not at MAX_FIXED_FRACTION: that cap guards the fastest split against amplified
# noise, but it also makes a node measured at a small batch look slow per sample.
BALANCE_FIXED_FRACTION = 0.95


class RoundPlanner:
    def __init__(
        self, job_id: str, spec: common_pb2.JobSpec, *, split: str, time_boxing: bool
    ) -> None:
        """``split``: the coordinator's --split ("throughput" or "equal"); ``time_boxing``:
        whether local SGD rounds may be time-boxed (parameter server: a ring member's weight
        in the all-reduce is fixed before it steps)."""
        self.job_id = job_id
        self.spec = spec
        self.split = split
        self.time_boxing = time_boxing
        self.estimator = ThroughputEstimator()
        self.bench: dict[str, common_pb2.BenchmarkResult] = {}  # node -> its job benchmark
        # node -> the samples/s below which its claims are not believed (claims.py
        # reference_floor of its device model; set by the runner's JobPay)
        self.reference_of: Callable[[str], float] = lambda _node: 0.0
        self.batches: dict[str, int] = {}  # b_i of the last planned round
        # Seconds a round spends outside the nodes' work (apply, record), smoothed.
        self.overhead_s = 0.0
        # Late parts of recent rounds (task -> node, samples, steps): an update that still
        # comes tells how fast the node really was; such figures wait here for the next plan.
        self._late: dict[str, tuple[str, int, int, float]] = {}
        self._late_figures: list[tuple[str, int, int, float]] = []

    # -- nodes ------------------------------------------------------------------------------------

    def add_node(self, node_id: str, peers: int, num_bytes: int) -> float:
        """Start estimating a benchmarked node that joins a node set of ``peers`` nodes (itself
        included) of a model of ``num_bytes``; returns its rate (samples/s)."""
        peers = max(peers, self.spec.min_nodes)
        # The batch the node will get, roughly: the global batch over the node set it is
        # expected to share it with (at least min_nodes; more as nodes join).
        expected = max(1, self.spec.global_batch // min(peers, max(1, self.spec.max_nodes)))
        rate = self.believed_bench_rate(node_id, expected)
        result = self.bench[node_id]
        comm = 0.0
        if result.bandwidth_bytes_per_second > 0:
            comm = 2 * num_bytes / result.bandwidth_bytes_per_second
        comm += result.rtt_ms / 1000.0
        self.estimator.add_node(
            node_id, rate, comm, step_points=self.bench_points(node_id), rated_batch=expected
        )
        return rate

    def remove_node(self, node_id: str) -> None:
        self.estimator.remove_node(node_id)
        self.batches.pop(node_id, None)

    def bench_rate(self, node_id: str, expected_batch: int) -> float:
        """Samples/s at the benchmarked batch size closest to what the node will compute in one
        pass (its batch, or the job's micro_batch when that is smaller)."""
        if self.spec.micro_batch > 0:
            expected_batch = min(expected_batch, self.spec.micro_batch)
        result = self.bench[node_id]
        fits = [p for p in result.points if not p.out_of_memory and p.samples_per_second > 0]
        if not fits:
            return result.samples_per_second
        best = min(fits, key=lambda p: abs(math.log(p.batch_size / max(1, expected_batch))))
        return float(best.samples_per_second)

    def believed_bench_rate(
        self, node_id: str, expected_batch: int, nodes: list[str] | None = None
    ) -> float:
        """:meth:`bench_rate` capped by what the job observed of its other nodes, or while
        none is observed by the claims of ``nodes`` (coordinator/rounds/claims.py): a benchmark is
        the node's own word."""
        observed = {
            n: self.estimator.estimate(n)
            for n in self.estimator.nodes
            if n != node_id and self.estimator.observations(n) > 0
        }
        claims = {node_id: self.bench_rate(node_id, expected_batch)}
        if not observed:
            for n in nodes or self.estimator.nodes:
                if n in self.bench and n not in claims:
                    claims[n] = self.bench_rate(n, expected_batch)
        floors = {node_id: self.reference_of(node_id)}
        return capped_benchmarks(claims, observed, floors)[node_id]

    def bench_points(self, node_id: str) -> list[tuple[int, float]]:
        """(batch size, samples/s) of the node's job benchmark: the shape of its step time."""
        result = self.bench[node_id]
        return [
            (p.batch_size, p.samples_per_second)
            for p in result.points
            if not p.out_of_memory and p.samples_per_second > 0
        ]

    def max_batch(self, node_id: str) -> int:
        result = self.bench.get(node_id)
        cap = result.max_batch_size if result is not None else 0
        if cap > 0 and 0 < self.spec.micro_batch <= cap:
            # One micro-batch fits the node's memory: it accumulates a local batch of any size.
            return self.spec.global_batch
        return cap if cap > 0 else self.spec.global_batch

    @property
    def inner_steps(self) -> int:
        """H: inner steps per round (local SGD), 1 in sync mode."""
        return max(1, self.spec.inner_steps) if self.spec.sync == "local_sgd" else 1

    @property
    def time_boxed(self) -> bool:
        """Whether local SGD rounds are time-boxed: on the parameter server (a ring member's
        weight in the all-reduce is fixed before it steps), with the throughput split."""
        return self.time_boxing and self.inner_steps > 1 and self.split != "equal"

    def rerate_unobserved(self, nodes: list[str]) -> None:
        """Nodes not yet observed in a round are rated at the batch they will get now that the
        node set grew (rates depend on the batch: per-step costs weigh more in small ones), so
        that equal nodes that joined one by one get equal shares."""
        expected = max(1, self.spec.global_batch // max(1, len(nodes)))
        for n in nodes:
            if n in self.estimator and n in self.bench and self.estimator.observations(n) == 0:
                comm = self.estimator.comm_estimate(n)
                self.estimator.add_node(
                    n,
                    self.believed_bench_rate(n, expected, nodes),
                    comm,
                    step_points=self.bench_points(n),
                    rated_batch=expected,
                )

    def note_late_update(
        self, node_id: str, task_id: str, num_samples: int, compute_s: float
    ) -> bool:
        """An update of a part that was late (the round closed without it): its gradient is of
        no use, but its compute time measures the node (a best-effort node that became fast
        again gets its share back this way). Returns whether ``task_id`` was such a part."""
        entry = self._late.get(task_id)
        if entry is None or entry[0] != node_id:
            return False
        del self._late[task_id]
        if num_samples == entry[1] > 0 and math.isfinite(compute_s) and compute_s > 0:
            # Its own figure, but not below what the coordinator saw: the time since the
            # hand-out less the node's usual time outside compute.
            if node_id in self.estimator:
                seen = time.monotonic() - entry[3] - self.estimator.comm_estimate(node_id)
                compute_s = max(compute_s, seen)
            self._late_figures.append((node_id, num_samples, entry[2], compute_s))
        return True

    def _observe_late_figures(self, node_count: int) -> None:
        figures, self._late_figures = self._late_figures, []
        for node_id, samples, steps, compute_s in figures:
            if node_id in self.estimator:
                self.estimator.observe(node_id, samples, compute_s)
                if self.inner_steps > 1:
                    self.estimator.observe_steps(node_id, samples, steps, compute_s)
        # Remember the late parts of the last few rounds only.
        excess = len(self._late) - 4 * max(1, node_count)
        for task_id in list(self._late)[: max(0, excess)]:
            del self._late[task_id]

    def plan_batches(self, nodes: list[str]) -> tuple[dict[str, int], set[str], dict[str, float]]:
        """b_i of each node, the best-effort nodes, and the nodes' time boxes for H steps
        (local SGD only, see :meth:`_plan_local_sgd_batches`; else empty).

        b_i is in proportion to each node's planning rate (largest remainder).
        Best-effort nodes are those whose proportional share is below one sample: split_batch
        still gives them one (so that they stay measured and get their share back when they
        speed up), but a single sample takes them longer than the round takes the others: the
        deadline is not sized for them and the round does not wait for them (if late, their
        sample returns to pending).

        (Per-node fixed costs per round, ``split_batch(fixed_s=...)``, are not used: on a
        shared host the measured time outside compute is mostly waiting for a core behind the
        other nodes, not a cost of the node's own, and planning with it moved samples from fast
        nodes to slow ones.) Local SGD rounds are planned on each node's per-step time instead
        (:meth:`_plan_local_sgd_batches`), fitted from compute seconds the agents time
        themselves, unless the coordinator runs with ``--split equal``."""
        rates = self.estimator.planning_rates(nodes)
        caps = {n: self.max_batch(n) for n in nodes}
        batch = min(self.spec.global_batch, sum(caps.values()))
        if self.split == "equal":
            rates = dict.fromkeys(rates, 1.0)
        elif self.inner_steps > 1:
            return self._plan_local_sgd_batches(nodes, batch, caps)
        fluid = quotas(batch, rates, caps)
        slow = {n for n in nodes if fluid[n] < 1}
        batches = split_batch(batch, rates, caps)
        return batches, (slow if len(slow) < len(nodes) else set()), {}

    def _plan_local_sgd_batches(
        self, nodes: list[str], batch: int, caps: dict[str, int]
    ) -> tuple[dict[str, int], set[str], dict[str, float]]:
        """Local SGD: b_i from each node's per-step time ``a_i + b * c_i`` (see
        coordinator/rounds/throughput.py), so that every node's H inner steps take the same time
        (min_time rounding: the slowest finisher sets the round's pace), then moved towards
        equal local batches while that costs the round little (:meth:`_balanced`).

        Best-effort nodes: those whose equal-time share is below one sample AND whose round
        (per-round communication + H steps of their b_i) would take more than MIN_SLACK times
        the longest round of the others: waiting for a node that is slow per step costs
        nothing when the round is dominated by time both spend anyway (transfers, RTTs)."""
        h = self.inner_steps
        models = self.estimator.step_models(nodes, batch=batch / max(1, len(nodes)))
        rates = {n: m.rate for n, m in models.items()}
        fixed = {n: m.fixed_s for n, m in models.items()}
        batches = split_batch(batch, rates, caps, rounding="min_time", fixed_s=fixed)
        fluid = quotas(batch, rates, caps, fixed_s=fixed)

        def round_s(n: str) -> float:
            return self.estimator.comm_estimate(n) + h * models[n].step_seconds(batches[n])

        full = [round_s(n) for n in nodes if fluid[n] >= 1]
        limit = MIN_SLACK * max(full) if full else math.inf
        slow = {n for n in nodes if fluid[n] < 1 and round_s(n) > limit}
        slow = slow if len(slow) < len(nodes) else set()
        awaited = [n for n in nodes if n not in slow] or nodes
        costs = self.estimator.step_models(
            nodes, batch=batch / max(1, len(nodes)), cap=BALANCE_FIXED_FRACTION
        )
        batches = self._balanced(batches, awaited, caps, costs)
        # Rounds whose compute is shorter than their communication are not boxed: waiting for
        # a slower node costs little there, and a box of a few milliseconds (a small model) is
        # at the mercy of timer and scheduling noise (measured: first rounds of one step).
        compute = max(h * models[n].step_seconds(batches[n]) for n in awaited)
        if compute < max(self.estimator.comm_estimate(n) for n in awaited):
            return batches, slow, {}
        # The time box: every awaited node's planned round ends at the same moment, the latest
        # of their planned ends; a node's box is that minus its own communication. (Planned
        # on the planning rates: a node not yet observed is known by its job benchmark, which
        # times the device's fastest steps; its discount makes up for that.)
        end = max(round_s(n) for n in awaited)
        boxes = {n: max(end - self.estimator.comm_estimate(n), 1e-3) for n in nodes}
        return batches, slow, boxes

    def _balanced(
        self,
        batches: dict[str, int],
        awaited: list[str],
        caps: dict[str, int],
        costs: dict[str, StepModel],
    ) -> dict[str, int]:
        """``batches`` moved towards equal local batches among the ``awaited`` nodes as far as
        the planned round (a node's communication and H steps of b_i samples on its step model
        in ``costs``, whose fixed fraction is capped at BALANCE_FIXED_FRACTION) stays within
        BALANCE_TOLERANCE of the fastest split's.

        Why: the fastest split equalises the nodes' planned ends, which is all that matters
        for sync rounds (the aggregate gradient is exact for any split), but in local SGD a
        node's inner steps on a few samples each are noisy steps, and where the round's time
        hardly depends on the split (a small model, whose steps cost the same for 1 or 30
        samples, behind links whose transfers dominate) the timing noise alone moved identical
        nodes to b_i 30 and 1 and the job trained worse. A node's planned round is affine in
        its b_i, so the blend weight towards the equal split is found per node in closed
        form."""
        if len(awaited) < 2:
            return batches
        h = self.inner_steps

        def round_s(n: str) -> float:
            return self.estimator.comm_estimate(n) + h * costs[n].step_seconds(batches[n])

        total = sum(batches[n] for n in awaited)
        room = {n: caps[n] for n in awaited}
        equal = quotas(total, dict.fromkeys(awaited, 1.0), room)
        limit = (1.0 + BALANCE_TOLERANCE) * max(round_s(n) for n in awaited)
        weight = 1.0
        for n in awaited:
            grow = equal[n] - batches[n]
            per_sample = h * costs[n].per_sample_s
            if grow > 0 and per_sample > 0:
                weight = min(weight, (limit - round_s(n)) / (per_sample * grow))
        if weight <= 0:
            return batches
        blend = {n: (1.0 - weight) * batches[n] + weight * equal[n] for n in awaited}
        out = dict(batches)
        out.update(split_batch(total, blend, room))
        if out != batches:
            log.debug(
                "job %s: local batches %s balanced to %s (weight %.2f)",
                self.job_id,
                {n: batches[n] for n in awaited},
                {n: out[n] for n in awaited},
                weight,
            )
        return out

    def plan(
        self,
        round_id: int,
        nodes: list[str],
        ledger: EpochLedger,
        new_task_id: Callable[[str], str],
    ) -> tuple[dict[str, Part], float]:
        """Plan the next round: b_i per node (throughput-weighted, sum = global batch), H*b_i
        samples per node from the ledger (fewer at an epoch's end), and the deadline, sized
        in samples from the estimates. Returns (parts by node, deadline). ``new_task_id``
        (prefix -> id) names each part's task."""
        self._observe_late_figures(len(nodes))
        ledger.rebalance(self.estimator.rates(nodes))
        batches, best_effort, planned_boxes = self.plan_batches(nodes)
        h = self.inner_steps
        steps = dict.fromkeys(batches, h)
        boxes: dict[str, float] = {}
        if self.time_boxed and planned_boxes:
            # Time-boxed: ranges for more steps than planned (a node faster than its estimate
            # goes on stepping); the deadline is sized on the planned steps. The rounds left in
            # the epoch are sized alike (no short tail round paying a whole round's
            # communication for a few steps), and the epoch's last round is not boxed: it
            # trains all that is left, so a slower-than-planned box leaves no tail behind.
            per_step = sum(batches.values())
            left = max(1, round(ledger.pending_count / (h * per_step)))
            if left > 1:
                scale = ledger.pending_count / (left * h * per_step)
                h = max(1, round(h * scale))
                boxes = {n: t * h / self.inner_steps for n, t in planned_boxes.items()}
                # A node not yet observed is planned at a discount of its benchmark: should the
                # benchmark be right, its box holds that many times more steps than planned;
                # its ranges cover them (a node that runs out of ranges before its box ends
                # idles until the round closes).
                steps = {
                    n: math.ceil(
                        h
                        * (1 + TIME_BOX_EXTRA_STEPS)
                        * self.estimator.estimate(n)
                        / self.estimator.planning_rate(n)
                    )
                    if n in boxes
                    else h
                    for n in batches
                }
            else:
                h = steps_left = -(-ledger.pending_count // per_step) + 1
                steps = dict.fromkeys(batches, steps_left)
        if boxes:
            log.info(
                "job %s round %d: time boxes %s for about %d steps of b_i %s",
                self.job_id,
                round_id,
                {n: round(t, 3) for n, t in boxes.items()},
                h,
                batches,
            )
        plan = ledger.plan_round(round_id, {n: steps[n] * b for n, b in batches.items()})
        sizes = {n: sum(b - a for a, b in rs) for n, rs in plan.items()}
        planned = {n: min(c, h * batches[n]) for n, c in sizes.items()}
        awaited = {n: b for n, b in planned.items() if n not in best_effort} or planned
        deadline = self.estimator.deadline(awaited, self.overhead_s)
        parts: dict[str, Part] = {}
        for node_id, positions in plan.items():
            samples = sizes[node_id]
            # Sync: the node's batch is what the ledger gave. Local SGD: b_i per inner step,
            # the agent runs ceil(samples / b_i) steps (the last one possibly smaller).
            local_batch = samples if self.inner_steps == 1 else max(1, batches[node_id])
            parts[node_id] = Part(
                node_id=node_id,
                task_id=new_task_id("t-"),
                ranges=index_run_array(ledger.positions_to_indices(positions)),
                local_batch=local_batch,
                samples=samples,
                inner_steps=-(-samples // local_batch),
                required=node_id in awaited,
                budget_s=boxes.get(node_id, 0.0),
                assigned=samples,
            )
        self.batches = {n: p.local_batch for n, p in parts.items()}
        return parts, deadline

    def eta(self, left: int, nodes: list[str], round_s: float) -> float:
        """Seconds to train ``left`` more samples on ``nodes`` at rounds of ``round_s``."""
        rate = sum(self.estimator.rates(nodes).values()) if nodes else 0.0
        if rate <= 0:
            return 0.0
        per_round = self.spec.global_batch * self.inner_steps
        return max(0.0, left / min(rate, per_round / max(round_s, 1e-6)))

    # -- round outcomes -------------------------------------------------------------------------

    def mark_late(self, part: Part, waited_s: float) -> None:
        """The round closed ``waited_s`` after its hand-out without the part."""
        self._late[part.task_id] = (part.node_id, part.samples, part.inner_steps, part.handed_out)
        self.estimator.observe_late(part.node_id, part.samples, waited_s)

    def confirm_compute(self, rs: RoundState) -> None:
        """Replace the compute seconds the round's applied parts report by what the
        coordinator observed of them (coordinator/rounds/claims.py), before anything is fed by
        them: the estimator, the node's statistics, the round record."""
        parts = [p for p in rs.parts.values() if p.status == "applied"]
        believed = confirmed_compute([(p.compute_s, p.window_s()) for p in parts])
        for p, seconds in zip(parts, believed, strict=True):
            if seconds > p.compute_s:
                log.info(
                    "job %s round %d: %s reported %.4fs of compute; %.4fs observed",
                    self.job_id,
                    rs.round,
                    p.node_id,
                    p.compute_s,
                    seconds,
                )
                if p.comm_s is not None:
                    p.comm_s = max(0.0, min(p.comm_s, p.wall_s - seconds))
            elif seconds < p.compute_s:
                log.info(
                    "job %s round %d: %s reported %.4fs of compute in a %.4fs window",
                    self.job_id,
                    rs.round,
                    p.node_id,
                    p.compute_s,
                    seconds,
                )
            p.compute_s = seconds

    def observe(self, rs: RoundState) -> None:
        """Feed the estimator with the applied parts of a closed round."""
        for p in rs.parts.values():
            if p.status != "applied" or p.node_id not in self.estimator:
                continue
            comm = p.communicate_s()
            if self.inner_steps > 1 and 2 * p.samples < p.local_batch * max(1, p.inner_steps):
                # An epoch's last scraps (a sample or two in a step planned for b_i): such a
                # step costs what a full one does, so its samples/s would rate the node far
                # too slow, and the next round planned it a local batch of one.
                self.estimator.observe(p.node_id, 0, 0.0, comm)
            elif p.compute_s > 0 and math.isfinite(p.compute_s):
                self.estimator.observe(p.node_id, p.samples, p.compute_s, comm)
                if self.inner_steps > 1:
                    self.estimator.observe_steps(p.node_id, p.samples, p.inner_steps, p.compute_s)
            else:  # a figure the estimator cannot use: keep the gradient, skip the rate
                log.warning(
                    "job %s round %d: %s reported %r compute seconds; rate not updated",
                    self.job_id,
                    rs.round,
                    p.node_id,
                    p.compute_s,
                )
                self.estimator.observe(p.node_id, 0, 0.0, comm)
