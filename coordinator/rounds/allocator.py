"""Throughput-proportional integer allocation: local batches and epoch segments (pure logic).

Everything here is a pure function of its arguments: no clocks, no randomness, no I/O.

The core is :func:`apportion`, bounded proportional apportionment: split an integer ``total``
into integers ``n_i`` with ``lo_i <= n_i <= hi_i``, ``sum(n_i) == total`` exactly and ``n_i``
as close as integers allow to the real quota ``q_i = clamp(lam * w_i, lo_i, hi_i)``, where
``lam`` is chosen so that the quotas sum to ``total`` (water-filling: a node whose
proportional share exceeds its cap is pinned at the cap and the excess flows to the others
in proportion to their weights). Quotas are rounded by the largest-remainder (Hamilton)
method, so every ``n_i`` is ``floor(q_i)`` or ``ceil(q_i)``.

:func:`split_batch` (each round's local batches ``b_i``, ``sum == B``) and :func:`segments`
(contiguous epoch segments) are thin policies on top of it.

Affine round times. A node's round does not take ``b_i / rate_i`` but ``a_i + b_i / rate_i``:
``a_i`` is what the round costs it whatever its batch (parameter pull, update push over its
link, task hand-out; on a shared machine also waiting for a core). With ``fixed_s`` (the
``a_i``), :func:`split_batch` equalizes those times instead: the real quotas are
``q_i = clamp((T - a_i) * rate_i, lo_i, hi_i)`` with ``T`` the common finishing time that makes
them sum to ``B`` (:func:`quotas`; exact, from the breakpoints of that piecewise-linear sum). With
equal ``a_i`` that is the proportional split; a node with a slower link gets fewer samples, and
one with ``a_i >= T`` none but its minimum (a best-effort node: it cannot finish even one sample
before the others finish the round).

Node keys are any hashable; ties are broken by the order of the ``rates`` mapping, so results
are deterministic for a given input.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Mapping
from typing import Literal, TypeVar

__all__ = ["Rounding", "apportion", "equal_split", "quotas", "segments", "split_batch"]

K = TypeVar("K", bound=Hashable)
Rounding = Literal["largest_remainder", "min_time"]


def _check_weight(node: object, w: float) -> float:
    w = float(w)
    if not math.isfinite(w) or w < 0.0:
        raise ValueError(f"rate of node {node!r} must be a finite number >= 0, got {w!r}")
    return w


def _solve_level(total: int, weights: list[float], lo: list[int], hi: list[int]) -> list[float]:
    """Real quotas q_i = clamp(lam * w_i, lo_i, hi_i) with sum(q) == total (all w_i > 0).

    Iterative pinning: distribute what is left over the free nodes in proportion to their
    weights; if the overshoot above the caps outweighs the shortfall below the minimums, the
    true level is higher, so every node above its cap is pinned there; otherwise the level
    is lower and every node below its minimum is pinned there. Repeat (at most n times).
    Weights are rescaled by the free set's maximum each time, so ratios of extreme
    magnitudes neither overflow nor vanish. Requires sum(lo) <= total <= sum(hi).
    """
    n = len(weights)
    q = [0.0] * n
    free = list(range(n))
    left = float(total)
    while free:
        w_max = max(weights[i] for i in free)
        rel = [weights[i] / w_max for i in free]
        scale = left / sum(rel)
        x = [r * scale for r in rel]
        above = sum(max(0.0, xi - hi[i]) for xi, i in zip(x, free, strict=True))
        below = sum(max(0.0, lo[i] - xi) for xi, i in zip(x, free, strict=True))
        if above == 0.0 and below == 0.0:
            for xi, i in zip(x, free, strict=True):
                q[i] = xi
            break
        keep: list[int] = []
        for xi, i in zip(x, free, strict=True):
            if above >= below and xi >= hi[i]:
                q[i] = hi[i]
                left -= hi[i]
            elif above < below and xi <= lo[i]:
                q[i] = lo[i]
                left -= lo[i]
            else:
                keep.append(i)
        free = keep
    return q


def _solve_affine(
    total: int, rates: list[float], fixed: list[float], lo: list[int], hi: list[int]
) -> list[float]:
    """Real quotas q_i = clamp((T - a_i) * r_i, lo_i, hi_i) with sum(q) == total (all r_i > 0).

    sum(q)(T) is continuous, non-decreasing and linear between the breakpoints
    T = a_i + lo_i / r_i and T = a_i + hi_i / r_i: find the segment holding ``total`` and solve
    the line. Requires sum(lo) <= total <= sum(hi).
    """
    n = len(rates)
    try:
        q = _solve_affine_exact(total, rates, fixed, lo, hi)
    except (ArithmeticError, ValueError):
        q = []
    if (
        len(q) == n
        and all(math.isfinite(x) for x in q)
        and abs(sum(q) - total) <= 1e-6 * max(1.0, total)
    ):
        return q
    # Rates so extreme (far beyond any device: e.g. 1e-300 samples/s) that the breakpoints
    # overflow: the fixed costs are negligible against them, split by rate alone.
    return _solve_level(total, rates, lo, hi)


def _solve_affine_exact(
    total: int, rates: list[float], fixed: list[float], lo: list[int], hi: list[int]
) -> list[float]:
    n = len(rates)

    def q_at(t: float) -> list[float]:
        return [float(min(max((t - fixed[i]) * rates[i], lo[i]), hi[i])) for i in range(n)]

    points = sorted(
        {fixed[i] + lo[i] / rates[i] for i in range(n)}
        | {fixed[i] + hi[i] / rates[i] for i in range(n)}
    )
    prev_t, prev_sum = points[0], float(sum(lo))
    if prev_sum >= total:
        return [float(x) for x in lo]
    for t in points[1:]:
        s = sum(q_at(t))
        if s >= total:
            # Linear on [prev_t, t]: the nodes strictly inside their bounds there grow at r_i.
            slope = (s - prev_sum) / (t - prev_t)
            t_star = prev_t + (total - prev_sum) / slope if slope > 0 else t
            return q_at(t_star)
        prev_t, prev_sum = t, s
    return [float(x) for x in hi]


def quotas(
    global_batch: int,
    rates: Mapping[K, float],
    caps: Mapping[K, int] | None = None,
    fixed_s: Mapping[K, float] | None = None,
) -> dict[K, float]:
    """The real (unrounded) split of ``global_batch`` that makes every node finish at the same
    time ``T``: ``q_i = clamp((T - a_i) * rate_i, 0, cap_i)`` with ``a_i = fixed_s[i]``
    (default 0: the proportional split). No minimum of one: a node with ``q_i < 1`` cannot
    finish a single sample by the time the others finish the round (a best-effort node).
    Nodes with rate 0 get 0. Raises ValueError as :func:`split_batch` does."""
    keys = list(rates)
    w = [_check_weight(k, rates[k]) for k in keys]
    a = [_check_fixed(k, (fixed_s or {}).get(k, 0.0)) for k in keys]
    hi_all = [global_batch if caps is None else int(caps[k]) for k in keys]
    active = [i for i in range(len(keys)) if w[i] > 0.0 and hi_all[i] > 0]
    out: dict[K, float] = dict.fromkeys(keys, 0.0)
    if global_batch <= 0:
        return out
    if not active:
        raise ValueError(f"cannot split a batch of {global_batch}: no node has a positive rate")
    hi = [hi_all[i] for i in active]
    if sum(hi) < global_batch:
        raise ValueError(
            f"cannot split {global_batch}: nodes with a positive rate can take at most {sum(hi)} "
            "(sum of their caps)"
        )
    lo = [0] * len(active)
    if any(a[i] > 0.0 for i in active):
        q = _solve_affine(global_batch, [w[i] for i in active], [a[i] for i in active], lo, hi)
    else:
        q = _solve_level(global_batch, [w[i] for i in active], lo, hi)
    for j, i in enumerate(active):
        out[keys[i]] = q[j]
    return out


def _check_fixed(node: object, a: float) -> float:
    a = float(a)
    if not math.isfinite(a) or a < 0.0:
        raise ValueError(f"fixed seconds of node {node!r} must be a finite number >= 0, got {a!r}")
    return a


def apportion(
    total: int,
    weights: Mapping[K, float],
    lo: Mapping[K, int] | None = None,
    hi: Mapping[K, int] | None = None,
    rounding: Rounding = "largest_remainder",
    fixed: Mapping[K, float] | None = None,
) -> dict[K, int]:
    """Split ``total`` into integers proportional to ``weights`` within ``[lo_i, hi_i]``.

    Returns a dict over every key of ``weights`` (same order). Keys with weight 0 get their
    ``lo`` (0 by default). Missing ``lo``/``hi`` entries mean 0 / unbounded.
    ``sum(result) == total`` exactly.

    ``rounding="largest_remainder"`` (Hamilton): each value is the floor or the ceiling of its
    real quota; the units left after the floors go to the largest fractional parts (ties to
    the larger weight, then to mapping order). Fair to every node, but a slow node rounded up
    from 12.02 to 13 runs 8% longer than the fluid optimum, and in a lockstep round the
    slowest finisher sets the pace.

    ``rounding="min_time"``: start from the floors and give each remaining unit to the node
    with the smallest ``(n_i + 1) / w_i`` (D'Hondt-like). This minimizes ``max_i n_i / w_i``
    (the round time when ``w`` are rates) subject to the bounds; fast nodes may get more than
    the ceiling of their quota, slow nodes keep their floor.

    ``fixed`` (seconds per node, default 0): the weights are rates and node ``i`` takes
    ``fixed_i + n_i / w_i`` for ``n_i`` units; the real quotas then equalize those times (see
    the module docstring) and ``min_time`` hands out units by the smallest
    ``fixed_i + (n_i + 1) / w_i``.

    Raises ValueError when the bounds make ``total`` unreachable or an input is invalid.
    """
    if isinstance(total, bool) or int(total) != total or total < 0:
        raise ValueError(f"total must be an integer >= 0, got {total!r}")
    if rounding not in ("largest_remainder", "min_time"):
        raise ValueError(f"unknown rounding {rounding!r}: largest_remainder or min_time")
    total = int(total)
    keys = list(weights)
    w = [_check_weight(k, weights[k]) for k in keys]
    fix = [_check_fixed(k, (fixed or {}).get(k, 0.0)) for k in keys]
    lows = [int((lo or {}).get(k, 0)) for k in keys]
    highs_opt = [(hi or {}).get(k) for k in keys]
    highs = [total if h is None else int(h) for h in highs_opt]
    for k, a, b in zip(keys, lows, highs, strict=True):
        if a < 0 or b < a:
            raise ValueError(f"bounds of node {k!r} are invalid: lo={a}, hi={b}")
    out = dict.fromkeys(keys, 0)
    active = [i for i, x in enumerate(w) if x > 0.0]
    for i, x in enumerate(w):
        if x <= 0.0:
            out[keys[i]] = lows[i]
    rest = total - sum(lows[i] for i in range(len(keys)) if w[i] <= 0.0)
    lo_a = [lows[i] for i in active]
    hi_a = [highs[i] for i in active]
    if rest < sum(lo_a):
        raise ValueError(f"cannot split {total}: the lower bounds alone need {sum(lows)}")
    if rest > sum(hi_a):
        raise ValueError(
            f"cannot split {total}: nodes with a positive rate can take at most {sum(hi_a)} "
            "(sum of their caps)"
        )
    if not active:
        return out
    w_a = [w[i] for i in active]
    f_a = [fix[i] for i in active]
    if any(x > 0.0 for x in f_a):
        q_real = _solve_affine(rest, w_a, f_a, lo_a, hi_a)
    else:
        q_real = _solve_level(rest, w_a, lo_a, hi_a)
    floors = [min(max(math.floor(q), x), y) for q, x, y in zip(q_real, lo_a, hi_a, strict=True)]
    left = rest - sum(floors)
    if rounding == "min_time" and left > 0:
        # Hand the remaining units one by one to the node that would finish them soonest,
        # (b_i + 1) / w_i smallest: greedy completion from the lower quota, which minimizes
        # max_i b_i / w_i (the lockstep round time) among integer splits within the bounds.
        heap = [
            (f_a[j] + (floors[j] + 1) / w_a[j], j)
            for j in range(len(active))
            if floors[j] < hi_a[j]
        ]
        heapq.heapify(heap)
        while left > 0:
            _, j = heapq.heappop(heap)
            floors[j] += 1
            left -= 1
            if floors[j] < hi_a[j]:
                heapq.heappush(heap, (f_a[j] + (floors[j] + 1) / w_a[j], j))
    # Largest remainders first; float noise can only make `left` slightly off, which the
    # bounded loops below absorb while keeping every value within its bounds.
    by_frac = sorted(
        range(len(active)), key=lambda j: (-(q_real[j] - math.floor(q_real[j])), -w_a[j], j)
    )
    while left > 0:
        moved = False
        for j in by_frac:
            if left == 0:
                break
            if floors[j] < hi_a[j]:
                floors[j] += 1
                left -= 1
                moved = True
        if not moved:  # pragma: no cover - excluded by the sum(hi) check above
            raise AssertionError("apportion: no room left")
    while left < 0:  # pragma: no cover - only on pathological float error
        for j in reversed(by_frac):
            if left == 0:
                break
            if floors[j] > lo_a[j]:
                floors[j] -= 1
                left += 1
    for j, i in enumerate(active):
        out[keys[i]] = floors[j]
    return out


def split_batch(
    global_batch: int,
    rates: Mapping[K, float],
    caps: Mapping[K, int] | None = None,
    rounding: Rounding = "largest_remainder",
    fixed_s: Mapping[K, float] | None = None,
) -> dict[K, int]:
    """Local batches ``b_i`` proportional to ``rates`` with ``sum(b_i) == global_batch``.

    - ``b_i <= caps[i]`` (a node's max batch, from its memory); the excess of a capped node is
      redistributed to nodes with room, in proportion to their rates (water-filling).
      ``caps=None`` means uncapped; otherwise ``caps`` must name every node of ``rates``.
    - Largest-remainder rounding: each ``b_i`` is the floor or ceiling of its real quota, so
      rates 4:2:1 with B=128 give 73/37/18. ``rounding="min_time"`` instead minimizes the
      lockstep round time ``max_i b_i / rate_i`` (see :func:`apportion`); use it for
      synchronous rounds where every node waits for the slowest.
    - Minimum of one: let E be the nodes with rate > 0 and cap >= 1. When
      ``global_batch >= len(E)`` every node of E gets ``b_i >= 1`` (a very slow node still
      does one sample, it is not silently dropped; the deadline accounts for it). When
      ``global_batch < len(E)`` (last scraps of an epoch) there is no minimum: the plain
      proportional rounding gives the samples to the fastest nodes and the others get 0 and
      sit that round out.
    - Nodes with rate 0 or cap 0 get 0.
    - ``fixed_s``: each node's per-round cost independent of its batch (seconds, missing = 0).
      Then ``b_i`` equalizes ``fixed_s[i] + b_i / rate_i`` rather than being proportional to
      the rate (see the module docstring and :func:`quotas`), and ``min_time`` minimizes
      ``max_i fixed_s[i] + b_i / rate_i``.

    Raises ValueError if the nodes with a positive rate cannot hold ``global_batch``
    (sum of their caps too small), on a negative/NaN rate, or a cap missing.
    """
    if caps is not None:
        missing = [k for k in rates if k not in caps]
        if missing:
            raise ValueError(f"no cap (max batch) given for nodes {missing!r}")
        for k in rates:
            if int(caps[k]) < 0:
                raise ValueError(f"cap of node {k!r} must be >= 0, got {caps[k]!r}")
    hi: dict[K, int] = {k: int(caps[k]) for k in rates} if caps is not None else {}
    weights = {k: _check_weight(k, r) for k, r in rates.items()}
    eligible = [k for k, r in weights.items() if r > 0.0 and hi.get(k, 1) >= 1]
    for k in rates:
        if k not in eligible:
            weights[k] = 0.0
    if global_batch > 0 and not eligible:
        raise ValueError(f"cannot split a batch of {global_batch}: no node has a positive rate")
    lo = dict.fromkeys(eligible, 1) if global_batch >= len(eligible) else {}
    return apportion(global_batch, weights, lo=lo, hi=hi or None, rounding=rounding, fixed=fixed_s)


def equal_split(
    global_batch: int, nodes: list[K], caps: Mapping[K, int] | None = None
) -> dict[K, int]:
    """The naive baseline: every node the same batch (within one), ignoring speed."""
    return split_batch(global_batch, dict.fromkeys(nodes, 1.0), caps)


def segments(order_len: int, rates: Mapping[K, float], start: int = 0) -> dict[K, tuple[int, int]]:
    """Contiguous half-open segments of ``[start, start + order_len)`` proportional to rates.

    Segments follow the order of ``rates`` and tile the interval exactly (sizes by
    largest-remainder rounding, no minimum). A node with rate 0 gets an empty segment
    ``(p, p)``. Raises ValueError when ``order_len > 0`` and no rate is positive.
    """
    if order_len < 0:
        raise ValueError(f"order_len must be >= 0, got {order_len}")
    if order_len > 0 and not any(_check_weight(k, r) > 0.0 for k, r in rates.items()):
        raise ValueError(f"cannot split {order_len} positions: no node has a positive rate")
    sizes = apportion(order_len, rates)
    out: dict[K, tuple[int, int]] = {}
    pos = start
    for k, n in sizes.items():
        out[k] = (pos, pos + n)
        pos += n
    return out
