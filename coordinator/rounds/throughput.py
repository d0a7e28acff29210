"""Per-node throughput estimation from observed rounds, and round deadlines (pure logic).

Model. For each node we forecast next round's ``log(samples/s)`` with two predictors and use
whichever has been forecasting better:

- It starts at the node's benchmark (``add_node``); the first observed round replaces it
  (it measures the real pipeline: data, transfers, not synthetic input).
- SLOW: an exponentially weighted moving average in log space, weight ``alpha`` = 0.25.
  Round-to-round noise is damped to ~0.38 of its size (sqrt(alpha / (2 - alpha))); a
  ratio-based average treats "2x faster" and "2x slower" alike. With change detection: an
  observation off by more than ``change_ratio`` (1.5x) only moves the average (a single GC
  pause must not halve a node's share for good), but two in a row in the same direction
  mean the node changed speed (throttling, another tenant, a shared link) and reset the
  average to the mean of those two.
- FAST: the last observation. Right when the speed wanders (a random walk, a ramp): it has
  no lag, while the average lags (1 - alpha) / alpha = 3 rounds behind a trend.
- Each predictor's one-step forecast error is tracked (EWMA of squared log errors, weight
  ERROR_BETA, clipped at log(change_ratio)^2 so one outlier does not dominate); the estimate
  is the predictor with the smaller error (SLOW on ties). So a node with noisy but stationary
  speed is averaged, a drifting one is followed, and a node that becomes 4x slower has its
  share cut by ~1/3 after one round and is at its new speed after two.
- Planning is asymmetric: in a lockstep round one over-loaded node stalls all n nodes,
  while an under-loaded one wastes at most 1/n of the fleet. So batches are sized by
  :meth:`ThroughputEstimator.planning_rates`, which is the estimate except for a node with
  no observed round yet (a joiner known only by its benchmark): UNOBSERVED_DISCOUNT = 0.75
  of its benchmark, i.e. its first round is planned for a benchmark up to 33% optimistic.
- Fixed cost per round (parameter pull + update push, task hand-out; observed by the
  coordinator as the node's round wall time minus its reported compute) is smoothed per node
  with a plain EWMA. It starts from the benchmark's figure (2 x model bytes / bandwidth +
  RTT); a node's first observed round is not used (it carries one-time costs: program load,
  first full parameter pull, shard fetch, which would skew the next rounds' split), its
  second replaces the benchmark's figure. :meth:`planning_fixed_s` gives
  these to ``split_batch(..., fixed_s=...)``, which then equalizes ``a_i + b_i / rate_i``
  across nodes rather than splitting in proportion to the rates alone: a node whose round
  costs more outside compute (a slower link, or on a shared machine the wait for a core)
  gets fewer samples, so that it does not hold up the lockstep round.

Per-step time (local SGD). An inner step of ``b`` samples costs ``a + b * c``: a fixed part
``a`` (optimizer step, kernel launches, Python) and a per-sample part ``c``. Samples/s measured
at a larger batch therefore look faster, and a split in proportion to samples/s hands the node
measured at the larger batch even more (identical nodes drifted to b_i 25/32/39). So local SGD
rounds are planned on the per-step model (:meth:`ThroughputEstimator.step_model`): the LEVEL,
seconds per step at the node's recent batch ``x``, comes from the samples/s estimate above
(``x / rate``: smoothing, change detection and the unobserved discount carry over); the SHAPE,
the fixed fraction ``phi = a / (a + c * x)``, comes from a weighted least-squares line through
the node's recent rounds (``observe_steps``: mean batch and seconds per inner step of each
part; the newest weigh most) when their batch sizes differ enough (relative spread >=
MIN_BATCH_SPREAD) and the fit is sane, else from a line through the node's job benchmark
points (``add_node(step_points=...)``; it has no optimizer step, so it underestimates ``phi``,
which errs towards the plain proportional split), else 0. ``split_batch(fixed_s=a_i,
rates=1/c_i)`` then equalizes every node's H steps. A level that is off by a fraction e moves
the node's b_i by e / (1 - phi) of it (the proportional split: by e): ``phi`` is capped at
MAX_FIXED_FRACTION = 0.5 (at most twice the noise of the levels), and a node without an
observed round (its level a benchmark, on a shared host 10-20% apart between identical nodes)
is planned by samples/s alone. The cap slows convergence when the true ``phi`` is higher, it
does not move the fixed point: where every node's measured step time at its own batch is the
same.

Deadlines (:meth:`ThroughputEstimator.deadline`): a round's deadline is

    max_i( b_i / rate_i * slack_i + comm_i * COMM_SLACK ) + overhead_s,  at least MIN_DEADLINE_S

with ``slack_i = clamp(exp(Z * sigma_i), MIN_SLACK, MAX_SLACK)``, where ``sigma_i`` is the
RMS log error of the node's forecasts and Z = 4 (with log-normal errors a healthy node
misses the deadline with probability ~3e-5 per round). MIN_SLACK = 1.5 matches
``change_ratio``: a node running 1.5x slower than forecast is a straggler, not noise, and
cutting it loose for that round costs only its own b_i samples (they return to the ledger).
MAX_SLACK = 4 bounds the wait for a hung node. A node that has not completed a round yet gets
UNOBSERVED_SLACK = 3: its rate is a benchmark on synthetic input that misses the data pipeline,
parameter transfer and warm-up. The only absolute constant is the floor MIN_DEADLINE_S = 1 s,
which covers task hand-out and event-loop/GC jitter that dominate tiny rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "COMM_SLACK",
    "MAX_FIXED_FRACTION",
    "MIN_BATCH_SPREAD",
    "MAX_SLACK",
    "MIN_DEADLINE_S",
    "MIN_SLACK",
    "UNOBSERVED_DISCOUNT",
    "UNOBSERVED_SLACK",
    "StepModel",
    "ThroughputEstimator",
    "fit_line",
]

MIN_DEADLINE_S = 1.0
MIN_SLACK = 1.5
MAX_SLACK = 4.0
UNOBSERVED_SLACK = 3.0
UNOBSERVED_DISCOUNT = 0.75
COMM_SLACK = 2.0
SLACK_Z = 4.0
ERROR_BETA = 0.1
STATE_VERSION = 1
# Per-step model (local SGD): rounds kept per node, weight per round of age, relative spread
# of batch sizes needed to fit the slope from rounds, cap on the fixed fraction.
STEP_WINDOW = 8
STEP_DECAY = 0.7
MIN_BATCH_SPREAD = 0.1
MAX_FIXED_FRACTION = 0.5


@dataclass
class _Node:
    log_rate: float  # SLOW predictor: EWMA of log(samples/s) with change detection
    fast_log: float  # FAST predictor: the last observation
    err_slow: float = 0.0  # EWMA of squared one-step log errors of each predictor (clipped)
    err_fast: float = 0.0
    observations: int = 0
    comm_s: float = 0.0
    comm_observations: int = 0
    suspect_log: float | None = None  # last observation if it was a big deviation
    suspect_sign: int = 0
    # Per-step model: (mean batch, seconds per step) of recent rounds, oldest first; the job
    # benchmark's line (fixed s, s per sample; fixed < 0: none); the batch the rate refers to
    # before any round is observed.
    steps: list[list[float]] = field(default_factory=list)
    prior_fixed_s: float = -1.0
    prior_per_sample_s: float = 0.0
    rated_batch: float = 0.0


@dataclass(frozen=True)
class StepModel:
    """Seconds of one inner step of ``b`` samples: ``fixed_s + b * per_sample_s``."""

    fixed_s: float
    per_sample_s: float

    def step_seconds(self, batch: float) -> float:
        return self.fixed_s + batch * self.per_sample_s

    @property
    def rate(self) -> float:
        """Marginal samples/s (what split_batch weighs by, with ``fixed_s``)."""
        return 1.0 / self.per_sample_s


def fit_line(
    points: Sequence[tuple[float, float, float]], min_spread: float = MIN_BATCH_SPREAD
) -> tuple[float, float] | None:
    """Weighted least squares ``y = a + c * x`` over ``(x, y, weight)`` points.

    None when the weighted relative spread of ``x`` (std / mean) is below ``min_spread`` (the
    slope is not determined), or the line is not a step-time line (``c <= 0``); ``a`` may be
    negative (noise), callers clamp."""
    w = [p[2] for p in points if p[2] > 0 and p[0] > 0 and math.isfinite(p[1])]
    xs = [p[0] for p in points if p[2] > 0 and p[0] > 0 and math.isfinite(p[1])]
    ys = [p[1] for p in points if p[2] > 0 and p[0] > 0 and math.isfinite(p[1])]
    total = sum(w)
    if len(w) < 2 or total <= 0:
        return None
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / total
    my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / total
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True)) / total
    if mx <= 0 or math.sqrt(sxx) < min_spread * mx:
        return None
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys, strict=True)) / total
    c = sxy / sxx
    if not math.isfinite(c) or c <= 0:
        return None
    return my - c * mx, c


def _positive(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


class ThroughputEstimator:
    """Smoothed samples/s and communication time per node; see the module docstring."""

    def __init__(self, alpha: float = 0.25, change_ratio: float = 1.5) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if change_ratio <= 1.0:
            raise ValueError(f"change_ratio must be > 1, got {change_ratio}")
        self.alpha = alpha
        self.change_ratio = change_ratio
        self._nodes: dict[str, _Node] = {}

    # ----------------------------------------------------------------- membership
    def add_node(
        self,
        node: str,
        samples_per_s: float,
        comm_s: float = 0.0,
        step_points: Iterable[tuple[int, float]] = (),
        rated_batch: float = 0.0,
    ) -> None:
        """Seed (or re-seed, after a new benchmark) a node from its benchmark figures.

        ``comm_s``: expected communication seconds per round, e.g. 2 * model bytes /
        bandwidth + RTT from the benchmark, until rounds are observed.
        ``step_points``: the job benchmark's ``(batch size, samples/s)`` points: the shape of
        the node's per-step time (see the module docstring); ``rated_batch``: the batch size
        ``samples_per_s`` was measured at (0: unknown).
        """
        rate = _positive(f"benchmark rate of node {node!r}", samples_per_s)
        comm = float(comm_s)
        if not math.isfinite(comm) or comm < 0.0:
            raise ValueError(f"comm_s of node {node!r} must be >= 0, got {comm_s!r}")
        st = _Node(log_rate=math.log(rate), fast_log=math.log(rate), comm_s=comm)
        pts = [
            (float(b), float(b) / float(r), 1.0)
            for b, r in step_points
            if b > 0 and math.isfinite(r) and r > 0
        ]
        line = fit_line(pts, min_spread=0.0) if len(pts) >= 2 else None
        if line is not None:
            st.prior_fixed_s = max(0.0, line[0])
            st.prior_per_sample_s = line[1]
        st.rated_batch = float(rated_batch) if rated_batch > 0 else 0.0
        self._nodes[node] = st

    def remove_node(self, node: str) -> None:
        self._nodes.pop(node, None)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    def _get(self, node: str) -> _Node:
        try:
            return self._nodes[node]
        except KeyError:
            raise KeyError(f"node {node!r} has no throughput estimate (add_node first)") from None

    # ----------------------------------------------------------------- observations
    def observe(
        self, node: str, samples: int, compute_s: float, comm_s: float | None = None
    ) -> None:
        """Record one finished round: ``samples`` trained in ``compute_s`` seconds.

        ``comm_s``: seconds the round spent outside compute for this node (parameter pull,
        update push, queueing), when known.

        Raises ValueError when ``compute_s`` is not a finite number > 0 (with samples > 0) or
        ``comm_s`` is negative: figures reported by an agent must be validated first.
        """
        st = self._get(node)
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        secs = _positive("compute_s", compute_s) if samples > 0 else 0.0
        if comm_s is not None:
            c = float(comm_s)
            if not math.isfinite(c) or c < 0.0:
                raise ValueError(f"comm_s must be a finite number >= 0, got {comm_s!r}")
            if st.comm_observations == 0:
                pass  # round one: one-time costs (program load, first full pull), not a trend
            elif st.comm_observations == 1:
                st.comm_s = c  # replaces the benchmark's figure
            else:
                st.comm_s += self.alpha * (c - st.comm_s)
            st.comm_observations += 1
        if samples > 0:
            self._update_rate(st, math.log(samples / secs))

    def observe_steps(self, node: str, samples: int, steps: int, compute_s: float) -> None:
        """Record the per-step figures of a local SGD part: ``samples`` trained in ``steps``
        inner steps in ``compute_s`` seconds (for :meth:`step_model`; the samples/s estimate
        is fed by :meth:`observe` as in sync rounds). Figures that say nothing are ignored."""
        st = self._get(node)
        if samples <= 0 or steps <= 0 or not math.isfinite(compute_s) or compute_s <= 0:
            return
        st.steps.append([samples / steps, compute_s / steps])
        del st.steps[:-STEP_WINDOW]

    def observe_late(self, node: str, samples: int, waited_s: float) -> None:
        """The node did not finish ``samples`` within ``waited_s`` (missed its deadline).

        Its rate is at most samples / waited_s; that bound is fed as an observation when it
        is below the current estimate (it says nothing when it is above).
        """
        st = self._get(node)
        if samples <= 0:
            return
        bound = math.log(samples / _positive("waited_s", waited_s))
        if bound < self._log_estimate(st):
            self._update_rate(st, bound)

    def _update_rate(self, st: _Node, x: float) -> None:
        st.observations += 1
        if st.observations == 1:
            # The first real round replaces the benchmark. If it is slow because of warm-up
            # the node is under-loaded for a round or two, which is cheap.
            st.log_rate = st.fast_log = x
            return
        threshold = math.log(self.change_ratio)
        cap = threshold * threshold
        st.err_slow += ERROR_BETA * (min((x - st.log_rate) ** 2, cap) - st.err_slow)
        st.err_fast += ERROR_BETA * (min((x - st.fast_log) ** 2, cap) - st.err_fast)
        st.fast_log = x
        resid = x - st.log_rate
        if abs(resid) > threshold:
            sign = 1 if resid > 0 else -1
            if st.suspect_log is not None and st.suspect_sign == sign:
                # Second big deviation in the same direction: the node changed speed.
                st.log_rate = 0.5 * (x + st.suspect_log)
                st.suspect_log, st.suspect_sign = None, 0
                return
            st.suspect_log, st.suspect_sign = x, sign
        else:
            st.suspect_log, st.suspect_sign = None, 0
        st.log_rate += self.alpha * resid

    @staticmethod
    def _log_estimate(st: _Node) -> float:
        return st.log_rate if st.err_slow <= st.err_fast else st.fast_log

    # ----------------------------------------------------------------- queries
    def estimate(self, node: str) -> float:
        """Current samples/s estimate of ``node``."""
        return math.exp(self._log_estimate(self._get(node)))

    def rates(self, nodes: Iterable[str] | None = None) -> dict[str, float]:
        """Estimates of ``nodes`` (default: all), in the given order."""
        return {n: self.estimate(n) for n in (self._nodes if nodes is None else nodes)}

    def planning_rate(self, node: str) -> float:
        """The rate to size ``node``'s batch by: its estimate, times UNOBSERVED_DISCOUNT
        while no round of it has been observed (see the module docstring)."""
        st = self._get(node)
        discount = UNOBSERVED_DISCOUNT if st.observations == 0 else 1.0
        return math.exp(self._log_estimate(st)) * discount

    def planning_rates(self, nodes: Iterable[str] | None = None) -> dict[str, float]:
        """``planning_rate`` of ``nodes`` (default: all): what split_batch should weigh by."""
        return {n: self.planning_rate(n) for n in (self._nodes if nodes is None else nodes)}

    def planning_fixed_s(self, nodes: Iterable[str] | None = None) -> dict[str, float]:
        """Per-round seconds of ``nodes`` (default: all) outside compute, for
        ``split_batch(..., fixed_s=...)`` together with :meth:`planning_rates`."""
        return {n: self.comm_estimate(n) for n in (self._nodes if nodes is None else nodes)}

    def fixed_fraction(self, node: str, batch: float, cap: float = MAX_FIXED_FRACTION) -> float:
        """The share ``a / (a + c * batch)`` of a step of ``batch`` samples that does not
        depend on the batch size: from the node's recent rounds when their batch sizes differ
        enough, else from its job benchmark, else 0 (see the module docstring); at most
        ``cap``."""
        st = self._get(node)
        n = len(st.steps)
        pts = [(x, y, STEP_DECAY ** (n - 1 - i)) for i, (x, y) in enumerate(st.steps)]
        line = fit_line(pts)
        if line is None and st.prior_fixed_s >= 0.0:
            line = (st.prior_fixed_s, st.prior_per_sample_s)
        if line is None or batch <= 0:
            return 0.0
        a = max(0.0, line[0])
        t = a + line[1] * batch
        return min(cap, a / t) if t > 0 else 0.0

    def reference_batch(self, node: str) -> float:
        """The batch size the node's samples/s estimate refers to: the (recency-weighted) mean
        per-step batch of its recent local SGD rounds, else the batch it was rated at (0:
        unknown)."""
        st = self._get(node)
        if not st.steps:
            return st.rated_batch
        n = len(st.steps)
        w = [STEP_DECAY ** (n - 1 - i) for i in range(n)]
        return sum(wi * x for wi, (x, _) in zip(w, st.steps, strict=True)) / sum(w)

    def step_model(
        self, node: str, batch: float | None = None, cap: float = MAX_FIXED_FRACTION
    ) -> StepModel:
        """Per-step time of ``node`` for planning local SGD rounds: level from
        :meth:`planning_rate` at the reference batch (``batch`` when the node has none), shape
        from :meth:`fixed_fraction` there (at most ``cap``). Without any batch to refer to: no
        fixed part."""
        x = self.reference_batch(node) or float(batch or 0.0)
        rate = self.planning_rate(node)
        if x <= 0 or self._get(node).observations == 0:
            # No round observed: the level is a benchmark, which on a shared host differs
            # between identical nodes by 10-20%; an affine split would amplify that by
            # 1 / (1 - phi). Plan by samples/s until the node's first round is in.
            return StepModel(0.0, 1.0 / rate)
        t = x / rate
        phi = self.fixed_fraction(node, x, cap)
        return StepModel(phi * t, (1.0 - phi) * t / x)

    def step_models(
        self,
        nodes: Iterable[str] | None = None,
        batch: float | None = None,
        cap: float = MAX_FIXED_FRACTION,
    ) -> dict[str, StepModel]:
        """:meth:`step_model` of ``nodes`` (default: all)."""
        return {
            n: self.step_model(n, batch, cap) for n in (self._nodes if nodes is None else nodes)
        }

    def comm_estimate(self, node: str) -> float:
        """Smoothed communication seconds per round of ``node``."""
        return self._get(node).comm_s

    def observations(self, node: str) -> int:
        return self._get(node).observations

    def noise(self, node: str) -> float:
        """RMS log error of the node's forecasts by the predictor in use (0 until observed)."""
        st = self._get(node)
        return math.sqrt(max(min(st.err_slow, st.err_fast), 0.0))

    def slack(self, node: str) -> float:
        """Multiplier on the node's expected compute time that its deadline allows."""
        st = self._get(node)
        if st.observations == 0:
            return UNOBSERVED_SLACK
        return min(MAX_SLACK, max(MIN_SLACK, math.exp(SLACK_Z * self.noise(node))))

    def expected_seconds(self, node: str, batch: int) -> float:
        """Expected compute + communication seconds of a round of ``batch`` samples."""
        return batch / self.estimate(node) + self.comm_estimate(node)

    def deadline(self, nodes_batches: Mapping[str, int], overhead_s: float = 0.0) -> float:
        """Deadline in seconds for a round giving ``b_i`` samples to each node.

        ``overhead_s``: coordinator-side per-round overhead measured by the caller
        (aggregation, optimizer step), added once. Nodes with ``b_i == 0`` are ignored.
        """
        if not math.isfinite(overhead_s) or overhead_s < 0.0:
            raise ValueError(f"overhead_s must be a finite number >= 0, got {overhead_s!r}")
        worst = 0.0
        for node, b in nodes_batches.items():
            if b <= 0:
                continue
            t = b / self.estimate(node) * self.slack(node) + self.comm_estimate(node) * COMM_SLACK
            worst = max(worst, t)
        return max(MIN_DEADLINE_S, worst + overhead_s)

    # ----------------------------------------------------------------- persistence
    def to_state(self) -> dict[str, Any]:
        """JSON-able snapshot."""
        return {
            "version": STATE_VERSION,
            "alpha": self.alpha,
            "change_ratio": self.change_ratio,
            "nodes": {n: asdict(st) for n, st in self._nodes.items()},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ThroughputEstimator:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported throughput state version {state.get('version')!r}")
        est = cls(alpha=float(state["alpha"]), change_ratio=float(state["change_ratio"]))
        for n, d in dict(state["nodes"]).items():
            est._nodes[str(n)] = _Node(**d)
        return est
