"""Aggregation rules over the per-node updates of one round (pure: tensors in, tensors out).

Every rule takes ``parts``: a sequence of ``(weight, update)`` where ``weight`` is the part's
sample count (or any non-negative weight) and ``update`` maps parameter names to tensors (a
mean-loss gradient or a local SGD pseudo-gradient), the same names and shapes in every part.
For distances the whole update is one flat vector (all names together).

- ``mean``: the weighted mean, computed exactly as `ParameterServer.apply` accumulates it, so
  a job aggregated with it stays bit-for-bit equal to a plain replay.
- ``trimmed_mean``: coordinate-wise, trims a fraction ``beta`` of the total weight from each
  end and averages the rest, weighted. Fewer than 3 parts: it applies ``mean`` and says so.
- ``centered_clip``: Karimireddy, He and Jaggi (2021), "Learning from History for Byzantine
  Robust Optimization": ``v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i`` for
  ``iterations`` steps from a centre (the weighted coordinate-wise median, or a given one
  such as the previous aggregate).

`aggregate(rule, parts, **params)` returns an `Aggregate`: the tensors plus, per part, how far
it is from the result and how much of its weight the rule took away.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

Update = Mapping[str, torch.Tensor]
Parts = Sequence[tuple[float, Update]]

# Coordinates handled at once by the coordinate-wise rules (bounds their temporary memory to
# about parts x CHUNK float64 values).
CHUNK = 1 << 18
DEFAULT_BETA = 0.2
DEFAULT_ITERATIONS = 3
DEFAULT_TAU_SCALE = 1.0
MIN_TRIMMED_PARTS = 3


class AggregationRule(StrEnum):
    MEAN = "mean"
    TRIMMED_MEAN = "trimmed_mean"
    CENTERED_CLIP = "centered_clip"


ACCEPTED_RULES = tuple(r.value for r in AggregationRule)


@dataclass(frozen=True)
class PartReport:
    """What a rule did to one part (same order as the input)."""

    weight: float
    # |x_i - aggregate| over the whole flat update.
    distance: float
    # How much of the part the rule set aside, in [0, 1]: 0 for mean; trimmed_mean: the
    # share of coordinates at which its value was trimmed (outside the range of the values
    # kept); centered_clip: 1 - its clip factor min(1, tau / |x_i - v|) in the last
    # iteration.
    damped: float


@dataclass(frozen=True)
class Aggregate:
    rule: AggregationRule  # the rule actually applied (trimmed_mean may fall back to mean)
    tensors: dict[str, torch.Tensor]
    parts: tuple[PartReport, ...]
    note: str = ""  # why the rule differs from the one asked for, or the parameters it chose
    params: dict[str, float] = field(default_factory=dict)


def aggregate(rule: str, parts: Parts, **params: object) -> Aggregate:
    """Aggregate ``parts`` with ``rule`` (one of `ACCEPTED_RULES`).

    Parameters by rule: ``trimmed_mean``: ``beta`` (default 0.2, in [0, 0.5));
    ``centered_clip``: ``tau`` (None: chosen from the spread, see `centered_clip`),
    ``tau_scale`` (1.0), ``iterations`` (3), ``centre`` ("median" or a mapping of tensors).
    An unknown rule or parameter is a ValueError.
    """
    try:
        which = AggregationRule(rule)
    except ValueError:
        raise ValueError(
            f"unknown aggregation rule {rule!r}; accepted: {', '.join(ACCEPTED_RULES)}"
        ) from None
    funcs: dict[AggregationRule, Callable[..., Aggregate]] = {
        AggregationRule.MEAN: mean,
        AggregationRule.TRIMMED_MEAN: trimmed_mean,
        AggregationRule.CENTERED_CLIP: centered_clip,
    }
    allowed = {
        AggregationRule.MEAN: set(),
        AggregationRule.TRIMMED_MEAN: {"beta"},
        AggregationRule.CENTERED_CLIP: {"tau", "tau_scale", "iterations", "centre"},
    }[which]
    unknown = sorted(set(params) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) or "no parameters"
        raise ValueError(f"{which.value} takes {takes}; got {', '.join(unknown)}")
    return funcs[which](parts, **params)


# --------------------------------------------------------------------------- the rules
def mean(parts: Parts) -> Aggregate:
    """The weighted mean ``sum_i (w_i / W) x_i`` with ``W = sum(w for w, _ in parts)``.

    Arithmetic order, identical to `ParameterServer.apply`: for each name, a zero tensor like
    the first part's, then ``acc.add_(x_i.to(acc.dtype), alpha=w_i / W)`` for the parts in
    the order given (``w_i / W`` a Python float). Same parts in the same order: the same bits.
    """
    names, weights = _check(parts)
    total = sum(w for w, _ in parts)
    first = parts[0][1]
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in names:
            acc = torch.zeros_like(first[name])
            for w, upd in parts:
                acc.add_(upd[name].to(acc.dtype), alpha=w / total)
            out[name] = acc
    return Aggregate(
        rule=AggregationRule.MEAN,
        tensors=out,
        parts=_reports(parts, weights, out, [0.0] * len(parts)),
    )


def trimmed_mean(parts: Parts, beta: float = DEFAULT_BETA) -> Aggregate:
    """Coordinate-wise weighted trimmed mean.

    Per coordinate the values are sorted and each part covers a stretch of the unit interval
    as long as its weight share; the stretches below ``beta`` and above ``1 - beta`` are
    removed (a part may be cut partly) and the rest averaged by the length kept. With equal
    weights and ``beta = k / n`` this is the classic trimmed mean dropping k values at each
    end. A part with a weight share of at most ``beta`` can be removed entirely; a heavier
    one cannot. Fewer than 3 parts: the weighted mean (`mean`), with a note.
    """
    beta = float(beta)
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean needs 0 <= beta < 0.5; got {beta}")
    names, weights = _check(parts)
    if len(parts) < MIN_TRIMMED_PARTS:
        plain = mean(parts)
        return Aggregate(
            rule=AggregationRule.MEAN,
            tensors=plain.tensors,
            parts=plain.parts,
            note=(
                f"trimmed_mean needs at least {MIN_TRIMMED_PARTS} parts, got "
                f"{len(parts)}: applied mean"
            ),
            params={"beta": beta},
        )
    share = weights / weights.sum()
    trimmed = torch.zeros(len(parts), dtype=torch.float64)
    coords = 0
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in names:
            flat = torch.empty(parts[0][1][name].numel(), dtype=torch.float64)
            for lo, hi, block in _blocks(parts, name):
                vals, order = block.sort(dim=0)
                w = share[order]
                upper = w.cumsum(dim=0)
                lower = upper - w
                kept = (upper.clamp(max=1.0 - beta) - lower.clamp(min=beta)).clamp(min=0.0)
                flat[lo:hi] = (kept * vals).sum(dim=0) / kept.sum(dim=0)
                # The range of the values kept; a part outside it was trimmed there.
                used = kept > 0
                first = used.float().argmax(dim=0, keepdim=True)
                last = len(parts) - 1 - used.flip(0).float().argmax(dim=0, keepdim=True)
                outside = (block < vals.gather(0, first)) | (block > vals.gather(0, last))
                trimmed += outside.sum(dim=1)
                coords += hi - lo
            out[name] = _like(flat, parts[0][1][name])
    damped = [
        0.0 if share[i] == 0 else float((trimmed[i] / max(coords, 1)).clamp(0.0, 1.0))
        for i in range(len(parts))
    ]
    return Aggregate(
        rule=AggregationRule.TRIMMED_MEAN,
        tensors=out,
        parts=_reports(parts, weights, out, damped),
        params={"beta": beta},
    )


def centered_clip(
    parts: Parts,
    tau: float | None = None,
    tau_scale: float = DEFAULT_TAU_SCALE,
    iterations: int = DEFAULT_ITERATIONS,
    centre: str | Update = "median",
) -> Aggregate:
    """Centred clipping: from ``v_0`` (``centre``), ``iterations`` times
    ``v <- v + sum_i w_i * clip(x_i - v, tau) / W`` with ``clip(z, tau) = z * min(1, tau/|z|)``
    on the whole flat update.

    ``centre``: "median" (the weighted coordinate-wise median: robust while cheaters hold
    under half the weight) or a mapping of tensors (e.g. the previous round's aggregate).

    ``tau`` (when None): ``tau_scale`` times the weighted median of the parts' distances to
    ``v_0``. While cheaters hold under half the weight this median is an honest part's
    distance, so it measures the honest spread: honest parts are clipped little (about half
    of them not at all), and a part however far away moves the result by at most its weight
    share times ``tau`` per iteration. All parts equal: ``tau = 0`` and the result is the
    centre.
    """
    if iterations < 1:
        raise ValueError(f"centered_clip needs iterations >= 1; got {iterations}")
    if tau is not None and not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"centered_clip needs a finite tau >= 0; got {tau}")
    if not (math.isfinite(tau_scale) and tau_scale > 0):
        raise ValueError(f"centered_clip needs tau_scale > 0; got {tau_scale}")
    names, weights = _check(parts)
    share = weights / weights.sum()
    with torch.no_grad():
        if isinstance(centre, str):
            if centre != "median":
                raise ValueError(f"centre must be 'median' or a mapping of tensors; got {centre!r}")
            v = _weighted_median(parts, names, weights)
            centre_name = "median"
        else:
            missing = [n for n in names if n not in centre]
            if missing:
                raise ValueError(f"centre lacks {', '.join(missing)}")
            v = {n: _flat64(centre[n]).clone() for n in names}
            for n in names:
                if v[n].numel() != parts[0][1][n].numel():
                    raise ValueError(
                        f"centre's {n} has {v[n].numel()} values; the parts have "
                        f"{parts[0][1][n].numel()}"
                    )
            centre_name = "given"
        dist = _distances(parts, names, v)
        if tau is None:
            tau = tau_scale * _weighted_median_value(dist, weights)
        scale = torch.ones(len(parts), dtype=torch.float64)
        for iteration in range(iterations):
            if iteration:
                dist = _distances(parts, names, v)
            scale = torch.where(dist > tau, tau / dist.clamp(min=1e-300), 1.0)
            coef = share * scale
            for n in names:
                step = torch.zeros_like(v[n])
                for i, (_, upd) in enumerate(parts):
                    if coef[i] != 0:
                        step.add_(_flat64(upd[n]) - v[n], alpha=float(coef[i]))
                v[n] += step
        out = {n: _like(v[n], parts[0][1][n]) for n in names}
    damped = [0.0 if share[i] == 0 else float(1.0 - scale[i]) for i in range(len(parts))]
    return Aggregate(
        rule=AggregationRule.CENTERED_CLIP,
        tensors=out,
        parts=_reports(parts, weights, out, damped),
        note=f"centre {centre_name}, tau {tau:.4g}, {iterations} iterations",
        params={"tau": float(tau), "iterations": float(iterations)},
    )


# --------------------------------------------------------------------------- helpers
def _check(parts: Parts) -> tuple[list[str], torch.Tensor]:
    """The names (in the first part's order) and the weights; ValueError on bad input."""
    if not parts:
        raise ValueError("aggregation needs at least one part")
    first = parts[0][1]
    names = list(first)
    shapes = {n: tuple(first[n].shape) for n in names}
    for i, (w, upd) in enumerate(parts):
        if not (isinstance(w, int | float) and math.isfinite(w) and w >= 0):
            raise ValueError(f"part {i}: weight must be a finite number >= 0; got {w!r}")
        if set(upd) != set(names):
            raise ValueError(f"part {i}: names {sorted(upd)} differ from part 0's {sorted(names)}")
        for n in names:
            if tuple(upd[n].shape) != shapes[n]:
                raise ValueError(
                    f"part {i}: {n} has shape {tuple(upd[n].shape)}, part 0 {shapes[n]}"
                )
    weights = torch.tensor([float(w) for w, _ in parts], dtype=torch.float64)
    if not weights.sum() > 0:
        raise ValueError("aggregation needs a positive total weight (at least one sample)")
    return names, weights


def _flat64(t: torch.Tensor) -> torch.Tensor:
    """A flat float64 CPU copy (or view) of ``t``: the robust rules compute in float64."""
    return t.detach().reshape(-1).to(device="cpu", dtype=torch.float64)


def _blocks(parts: Parts, name: str) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(lo, hi, values) over the flat coordinates of ``name``: values is parts x (hi - lo)."""
    flats = [upd[name].detach().reshape(-1) for _, upd in parts]
    numel = flats[0].numel()
    for lo in range(0, numel, CHUNK):
        hi = min(numel, lo + CHUNK)
        yield lo, hi, torch.stack([_flat64(f[lo:hi]) for f in flats])


def _median_index(cum: torch.Tensor, half: float, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Along dim 0 of cumulative weights: the first index reaching ``half`` and the first
    passing it (equal unless a value ends exactly at the half)."""
    low = (cum < half).sum(dim=0).clamp(max=last)
    high = (cum <= half).sum(dim=0).clamp(max=last)
    return low, high


def _weighted_median(
    parts: Parts, names: list[str], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Coordinate-wise weighted median (flat float64 per name): the mean of the lowest value
    whose cumulative weight reaches half the total and the lowest whose cumulative weight
    passes it (the usual median for equal weights)."""
    half = float(weights.sum()) / 2
    out: dict[str, torch.Tensor] = {}
    for n in names:
        flat = torch.empty(parts[0][1][n].numel(), dtype=torch.float64)
        for lo, hi, block in _blocks(parts, n):
            vals, order = block.sort(dim=0)
            low, high = _median_index(weights[order].cumsum(dim=0), half, len(parts) - 1)
            flat[lo:hi] = 0.5 * (vals.gather(0, low[None]) + vals.gather(0, high[None]))[0]
        out[n] = flat
    return out


def _weighted_median_value(values: torch.Tensor, weights: torch.Tensor) -> float:
    vals, order = values.sort()
    low, high = _median_index(weights[order].cumsum(dim=0), float(weights.sum()) / 2, len(vals) - 1)
    return float(0.5 * (vals[low] + vals[high]))


def _distances(parts: Parts, names: list[str], v: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """|x_i - v| over the whole flat update, per part."""
    sq = torch.zeros(len(parts), dtype=torch.float64)
    for i, (_, upd) in enumerate(parts):
        for n in names:
            d = _flat64(upd[n]) - v[n]
            sq[i] += d.dot(d)
    return sq.sqrt()


def _like(flat: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return flat.reshape(ref.shape).to(dtype=ref.dtype, device=ref.device)


def _reports(
    parts: Parts, weights: torch.Tensor, out: Mapping[str, torch.Tensor], damped: list[float]
) -> tuple[PartReport, ...]:
    flat_out = {n: _flat64(t) for n, t in out.items()}
    dist = _distances(parts, list(out), flat_out)
    return tuple(
        PartReport(weight=float(weights[i]), distance=float(dist[i]), damped=damped[i])
        for i in range(len(parts))
    )
