"""Screening of one round's updates at no extra compute (pure: tensors in, figures out).

Each part is ``(b_i, u_i)``: ``u_i`` is the mean-loss gradient over the node's ``b_i`` samples,
as the parameter server receives it, so it is already a per-sample quantity and is used as
sent; ``b_i`` only says how noisy it should be (mini-batch noise energy falls as ``1/b_i``).
For a local SGD pseudo-gradient the caller divides by the number of inner steps first.

Each node is compared with ``c_i``, the coordinate-wise median of the OTHER nodes (one vote
each: a node with many samples cannot take the centre). Reported per node: the norm ratio
``|u_i| / |c_i|`` and ``cos(u_i, c_i)``; the node is suspicious when its ratio is outside
``[ratio_low, ratio_high]`` or its cosine is below ``min_cosine``. Both bounds are set per node
under the mini-batch noise model ``u_i = g + e_i``, ``E|e_i|^2 = S / b_i``, so that a node with
4 samples is not judged by the spread of nodes with 256. The cosine bound is applied from 4
nodes and learns the noise's spread from earlier rounds: keep ``history`` with
`extend_history`. docs/verification.md derives the bounds and gives the measured rates.

Not caught by screening: a "lazy" node (its gradient over a quarter of its samples) or a
"stale" one (last round's update) looks like an honest, somewhat noisier node; nor, where
mini-batch noise dominates the gradient, a flipped or random update. Recomputation checks
catch those.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np
import torch

Update = Mapping[str, torch.Tensor]

# Coordinates handled at once (temporary memory about nodes x CHUNK float64 values).
CHUNK = 1 << 18
# Direction deviations worth keeping between rounds (see `extend_history`), and the largest
# direction score (in standard deviations) of a node whose deviation is kept.
HISTORY_KEEP = 256
HISTORY_MAX_Z = 3.0
# The direction test needs a centre that one bad node cannot move: three others at least.
DIRECTION_MIN_NODES = 4
# A node's noise energy is credited at least this fraction of S / b (quiet batches exist; an
# estimate near zero would make any deviation look large).
NOISE_FLOOR = 0.25


@dataclass(frozen=True)
class ScreenParams:
    """Thresholds; the defaults are the ones measured in docs/verification.md."""

    min_nodes: int = 3
    # Direction: flag when u_i . c_i is more than this many standard deviations below |g|^2.
    direction_z: float = 5.0
    # The noise share along the centre is read at this quantile of the deviations seen ...
    share_quantile: float = 0.5
    # ... and taken at its upper confidence bound at this level.
    confidence: float = 1e-3
    # A node's noise energy |u - g|^2 is credited up to this many times S / b (more noise than
    # that, as a replaced update shows, does not excuse a deviation).
    noise_cap: float = 16.0
    # Norm: each other node allows the range of norms the sample counts explain, widened by
    # this factor either way (mini-batch norms fluctuate, heavy-tailed batches more so).
    norm_factor: float = 10.0

    def __post_init__(self) -> None:
        if self.min_nodes < 3:
            raise ValueError(f"min_nodes must be at least 3; got {self.min_nodes}")
        if not self.direction_z > 0:
            raise ValueError(f"direction_z must be positive; got {self.direction_z}")
        if not 0 < self.share_quantile < 1:
            raise ValueError(f"share_quantile must be in (0, 1); got {self.share_quantile}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1); got {self.confidence}")
        if not self.noise_cap >= 1:
            raise ValueError(f"noise_cap must be at least 1; got {self.noise_cap}")
        if not self.norm_factor >= 1:
            raise ValueError(f"norm_factor must be at least 1; got {self.norm_factor}")


@dataclass(frozen=True)
class NodeScreen:
    samples: int
    ratio: float  # |u_i| / |c_i|
    cosine: float  # cos(u_i, c_i)
    ratio_low: float  # acceptable ratios (nan when not judged)
    ratio_high: float
    min_cosine: float  # lowest acceptable cosine (nan when not judged)
    # Standard deviations of u_i . c_i from |g|^2 (flagged below -direction_z).
    direction_score: float
    # Position of |u_i| in its band in log scale: -1 and 1 are the bounds.
    norm_score: float
    # (u_i . c_i - |g|^2)^2 over the bound on its variance: a sample of the noise share along
    # the centre, for the history (nan when not judged, or when the node is not among the
    # noisier half of the round, whose samples alone are kept).
    deviation: float
    suspicious: bool
    reason: str


@dataclass(frozen=True)
class Screening:
    judged: bool  # False: too few nodes to judge anyone
    reason: str
    nodes: tuple[NodeScreen, ...]

    @property
    def suspicious(self) -> list[int]:
        """Indices (in the input order) of the nodes flagged."""
        return [i for i, n in enumerate(self.nodes) if n.suspicious]

    def history_samples(self) -> tuple[float, ...]:
        """The direction deviations worth keeping (for `history`): those of nodes not flagged
        and within ``HISTORY_MAX_Z`` standard deviations, so that a node cheating every round
        cannot widen the band it is judged by (an honest node lies beyond 3 deviations in
        0.3 % of rounds: leaving those out barely moves the quantile)."""
        return tuple(
            n.deviation
            for n in self.nodes
            if not n.suspicious and n.deviation >= 0 and abs(n.direction_score) <= HISTORY_MAX_Z
        )


def extend_history(
    history: Sequence[float], screening: Screening, keep: int = HISTORY_KEEP
) -> tuple[float, ...]:
    """The history for the next round: the last ``keep`` deviations of unflagged nodes."""
    return (tuple(history) + screening.history_samples())[-keep:]


def per_step(update: Update, steps: int) -> dict[str, torch.Tensor]:
    """A local SGD pseudo-gradient of ``steps`` inner steps as one step's worth (what `screen`
    compares: nodes cut short by a time box ran fewer steps)."""
    if steps < 1:
        raise ValueError(f"a pseudo-gradient needs at least one inner step; got {steps}")
    return {k: v / steps for k, v in update.items()}


def screen(
    parts: Sequence[tuple[int, Update]],
    params: ScreenParams | None = None,
    history: Sequence[float] = (),
) -> Screening:
    """Screen one round: per node its ratio, cosine, bounds and whether it looks suspicious.

    ``history``: deviations of earlier rounds (`extend_history`). Without it the cosine bound
    rests on this round's few nodes and is far more cautious (an upper confidence bound from
    a handful of samples), so the direction test flags little until some rounds are seen.
    """
    p = params or ScreenParams()
    samples = [int(b) for b, _ in parts]
    if any(b <= 0 for b in samples):
        raise ValueError(f"every part needs a positive sample count; got {samples}")
    if len(parts) < p.min_nodes:
        why = f"{len(parts)} node(s): screening needs at least {p.min_nodes} to judge"
        return Screening(False, why, tuple(_unjudged(b, why) for b in samples))
    n = len(parts)
    figs = _figures(parts, samples)
    bands = [_norm_band(i, figs, p.norm_factor) for i in range(n)]
    plausible = [i for i in range(n) if bands[i][0] <= figs[i].norm2 <= bands[i][1]]
    # The direction test compares the nodes of plausible norm among themselves: a x100 update
    # would otherwise move every other node's centre and the references.
    ref = None
    why_not = f"direction not judged (fewer than {DIRECTION_MIN_NODES} nodes of plausible norm)"
    if len(plausible) >= DIRECTION_MIN_NODES:
        if len(plausible) < n:
            sub = _figures([parts[i] for i in plausible], [samples[i] for i in plausible])
            for k, i in enumerate(plausible):
                figs[i] = sub[k]
        ref = _round_reference([figs[i] for i in plausible], tuple(history), p)
        if ref.signal <= 0:
            ref, why_not = None, "direction not judged (the nodes share no direction)"
    nodes = []
    for i in range(n):
        judged = ref is not None and i in plausible
        noisier = judged and ref is not None and plausible.index(i) in ref.noisier
        nodes.append(_judge(figs[i], bands[i], ref if judged else None, noisier, why_not, p))
    flagged = sum(x.suspicious for x in nodes)
    return Screening(True, f"{n} nodes screened, {flagged} suspicious", tuple(nodes))


# --------------------------------------------------------------------------- judging
@dataclass(frozen=True)
class _Figures:
    """One node against its centre: |u|^2, u.c, |c|^2, and the variance of the centre's
    noise along one direction per unit of per-sample noise energy S."""

    samples: int
    norm2: float
    dot: float
    centre2: float
    centre_var: float

    @property
    def residual2(self) -> float:
        return max(self.norm2 - 2 * self.dot + self.centre2, 0.0)


@dataclass(frozen=True)
class _Reference:
    """The round's references for the direction test, medians over all nodes (one bad node
    moves a median of three or more values by one rank at most)."""

    signal: float  # |g|^2 (<= 0: the nodes share no direction)
    noise: float  # S, the per-sample noise energy
    # The nodes with the fewest samples (half of them, rounded up): their own noise dominates
    # their figures, so they alone estimate S and the share below.
    noisier: frozenset[int]
    share: float  # bound on the share of a node's noise along its centre, in (0, 1]
    reference_var: float  # variance of ``signal``, per unit of ``share``
    noise_cap: float  # the most noise energy a node is credited with, in units of S / b

    def unit(self, f: _Figures) -> float:
        """u . c - |g|^2 = e . c + (g . e_c - the same in the reference). The first term, the
        node's own, is at most |e| |c| (Cauchy-Schwarz: all of its noise along the centre);
        this returns that bound squared. The second, mostly common to all nodes, is covered
        by ``reference_var``.

        The node's noise energy |e|^2 = |u - g|^2 is read from its figures, |u|^2 - 2 u.c +
        |g|^2 (a heavy-tailed batch gets its real size), less the part along the centre (a
        flipped or replaced update is displaced along g: that displacement is what is tested,
        not noise that excuses it); then kept between ``NOISE_FLOOR`` and ``noise_cap`` times
        S / b."""
        model = self.noise / f.samples
        along = (f.dot - self.signal) ** 2 / f.centre2 if f.centre2 > 0 else 0.0
        own = f.norm2 - 2 * f.dot + self.signal - along
        return f.centre2 * min(max(own, NOISE_FLOOR * model), self.noise_cap * model)

    def deviation(self, f: _Figures) -> float:
        unit = self.unit(f)
        return (f.dot - self.signal) ** 2 / unit if unit > 0 else 0.0


def _round_reference(
    figs: list[_Figures], history: tuple[float, ...], p: ScreenParams
) -> _Reference:
    # u_j . c_j has expectation |g|^2 (c_j is independent of u_j).
    signal = _median([f.dot for f in figs])
    # |u_j - c_j|^2 has expectation S (1/b_j + centre_var_j), dominated by the first term for
    # the noisier nodes.
    order = sorted(range(len(figs)), key=lambda j: figs[j].samples)
    noisier = frozenset(order[: (len(figs) + 1) // 2])
    noise = _median(
        [figs[j].residual2 / (1 / figs[j].samples + figs[j].centre_var) for j in noisier]
    )
    ref = _Reference(signal, noise, noisier, 1.0, 0.0, p.noise_cap)
    if signal <= 0 or len(figs) < DIRECTION_MIN_NODES:
        return ref
    # The share of the noise along the centre: an upper confidence bound from a quantile of
    # this round's and earlier rounds' deviations of noisier nodes (each ~ share x
    # chi-square(1)); at most 1.
    seen = sorted(list(history) + [ref.deviation(figs[j]) for j in noisier])
    rank = max(1, math.ceil(p.share_quantile * len(seen)))
    floor = _chi2_order_quantile(len(seen), rank, p.confidence)
    share = min(1.0, seen[rank - 1] / floor) if floor > 0 else 1.0
    # The reference |g|^2 is itself a median of noisy u_j . c_j.
    reference_var = (math.pi / 2) * _median([ref.unit(f) for f in figs]) / len(figs)
    return _Reference(signal, noise, noisier, share, reference_var, p.noise_cap)


def _norm_band(i: int, figs: list[_Figures], factor: float) -> tuple[float, float]:
    """Bounds on |u_i|^2 that a strict majority of the others agree on.

    |u|^2 ~ |g|^2 + S / b is a common term plus one proportional to 1/b: whatever the two
    terms, |u_i|^2 / |u_j|^2 lies between 1 and b_j / b_i. Each other node j allows that
    range widened by ``factor`` either way (in norm, so ``factor**2`` here).
    """
    b = figs[i].samples
    others = [f for j, f in enumerate(figs) if j != i]
    k = len(others) // 2 + 1
    highs = sorted(f.norm2 * max(1.0, f.samples / b) * factor**2 for f in others)
    lows = sorted((f.norm2 * min(1.0, f.samples / b) / factor**2 for f in others), reverse=True)
    return lows[k - 1], highs[k - 1]


def _judge(
    f: _Figures,
    band: tuple[float, float],
    ref: _Reference | None,
    noisier: bool,
    why_not: str,
    p: ScreenParams,
) -> NodeScreen:
    """One node's verdict: its norm against ``band`` (bounds on |u|^2), its direction against
    ``ref`` (None: not judged, because ``why_not``)."""
    b = f.samples
    if f.centre2 <= 0:
        return _unjudged(b, "the others' median is zero: not judged")
    nan = math.nan
    centre = math.sqrt(f.centre2)
    ratio = math.sqrt(f.norm2) / centre
    cosine = f.dot / math.sqrt(f.norm2 * f.centre2) if f.norm2 > 0 else 0.0
    reasons: list[str] = []
    notes: list[str] = []

    low2, high2 = band
    ratio_low, ratio_high = math.sqrt(low2) / centre, math.sqrt(high2) / centre
    norm_score = nan
    if 0 < low2 < high2:
        mid, half = 0.5 * math.log(low2 * high2), 0.5 * math.log(high2 / low2)
        norm_score = (math.log(f.norm2) - mid) / half if f.norm2 > 0 else -math.inf
    bounds = f"[{ratio_low:.3g}, {ratio_high:.3g}]"
    if low2 <= f.norm2 <= high2:
        notes.append(f"norm ratio {ratio:.3g} in {bounds}")
    else:
        reasons.append(f"norm ratio {ratio:.3g} outside {bounds} expected for {b} samples")

    direction_score = min_cosine = deviation = nan
    if ref is None:
        if not reasons:
            notes.append(why_not)
    else:
        sd = math.sqrt(ref.share * (ref.unit(f) + ref.reference_var))
        sd = max(sd, 1e-12 * ref.signal)
        direction_score = (f.dot - ref.signal) / sd
        deviation = ref.deviation(f) if noisier else nan
        if f.norm2 > 0:
            min_cosine = (ref.signal - p.direction_z * sd) / math.sqrt(f.norm2 * f.centre2)
        if direction_score < -p.direction_z:
            reasons.append(
                f"cosine {cosine:.3g} below {min_cosine:.3g} expected for {b} samples "
                f"({direction_score:.1f} standard deviations)"
            )
        else:
            notes.append(f"cosine {cosine:.3g} >= {min_cosine:.3g}")
    return NodeScreen(
        samples=b,
        ratio=ratio,
        cosine=cosine,
        ratio_low=ratio_low,
        ratio_high=ratio_high,
        min_cosine=min_cosine,
        direction_score=direction_score,
        norm_score=norm_score,
        deviation=deviation,
        suspicious=bool(reasons),
        reason="; ".join(reasons or notes),
    )


def _unjudged(b: int, why: str) -> NodeScreen:
    nan = math.nan
    return NodeScreen(b, nan, nan, nan, nan, nan, nan, nan, nan, False, why)


@lru_cache(maxsize=4096)
def _chi2_order_quantile(count: int, rank: int, alpha: float) -> float:
    """A value that the ``rank``-th smallest (1-based) of ``count`` independent chi-square(1)
    variables falls below with probability at most ``alpha``.

    P(X_(rank) <= x) is the chance that at least ``rank`` of the ``count`` fall below x, a
    binomial tail in F = P(chi2 <= x); F is found by bisection. The tail's terms are summed in
    log space over one array (the history makes ``count`` a few hundred, and the count grows
    every round until the history is full: each value is new, a cache alone does not help)."""
    k = np.arange(rank, count + 1, dtype=np.float64)
    log_comb = math.lgamma(count + 1) - np.array(
        [math.lgamma(i + 1) + math.lgamma(count - i + 1) for i in range(rank, count + 1)]
    )
    rest = count - k

    def below(F: float) -> float:  # P(X_(rank) <= x) where P(chi2 <= x) = F
        return float(np.exp(log_comb + k * math.log(F) + rest * math.log1p(-F)).sum())

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if below(mid) < alpha else (lo, mid)
    return NormalDist().inv_cdf((1 + lo) / 2) ** 2 if lo > 0 else 0.0


# --------------------------------------------------------------------------- figures
def _figures(parts: Sequence[tuple[int, Update]], samples: list[int]) -> list[_Figures]:
    """|u_i|^2, u_i . c_i and |c_i|^2 over the whole flat update, with c_i the
    coordinate-wise median of the others (the mean of the two middle values for an even
    count). With three nodes that would be the mean of two, which one bad node controls:
    then c_i is the median of all three."""
    n = len(parts)
    norm2 = torch.zeros(n, dtype=torch.float64)
    dot = torch.zeros(n, dtype=torch.float64)
    centre2 = torch.zeros(n, dtype=torch.float64)
    m = n - 1
    mids = [m // 2] if m % 2 else [m // 2 - 1, m // 2]
    for block in _blocks([upd for _, upd in parts]):
        vals, order = block.sort(dim=0)
        if n == 3:
            centres = vals[1].expand_as(block)
        else:
            rank = torch.empty_like(order).scatter_(
                0, order, torch.arange(n).unsqueeze(1).expand_as(order)
            )
            # Row i: the t-th of the others in sorted order, at t below i's rank, else t + 1.
            picked = [vals.gather(0, t + (rank <= t).long()) for t in mids]
            centres = picked[0] if len(picked) == 1 else (picked[0] + picked[1]) / 2
        norm2 += (block * block).sum(dim=1)
        dot += (block * centres).sum(dim=1)
        centre2 += (centres * centres).sum(dim=1)
    return [
        _Figures(
            samples[i], float(norm2[i]), float(dot[i]), float(centre2[i]), _centre_var(samples, i)
        )
        for i in range(n)
    ]


def _blocks(updates: Sequence[Update]) -> Iterator[torch.Tensor]:
    """The parts' flat updates (names in part 0's order) as float64 blocks of about CHUNK
    coordinates, one row per part: a large tensor in slices, small ones together (a few
    operations a round for a model of many small tensors), memory bounded either way."""
    names = list(updates[0])
    for k, upd in enumerate(updates):
        if set(upd) != set(names):
            raise ValueError(f"part {k}: names {sorted(upd)} differ from part 0's {sorted(names)}")
    pending: list[list[torch.Tensor]] = []  # slices of one block, each one row per part
    size = 0
    for name in names:
        flats = [upd[name].detach().reshape(-1) for upd in updates]
        numel = flats[0].numel()
        if any(x.numel() != numel for x in flats):
            raise ValueError(f"{name}: parts differ in size")
        for lo in range(0, numel, CHUNK):
            hi = min(numel, lo + CHUNK)
            pending.append([x[lo:hi] for x in flats])
            size += hi - lo
            if size >= CHUNK:
                yield _stacked(pending)
                pending, size = [], 0
    if pending:
        yield _stacked(pending)


def _stacked(pending: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack(
        [
            torch.cat([slices[k] for slices in pending]).to(device="cpu", dtype=torch.float64)
            for k in range(len(pending[0]))
        ]
    )


def _centre_var(samples: list[int], i: int) -> float:
    """Noise variance of node i's centre along one direction, per unit of S: the asymptotic
    variance of a median of Gaussians of variances S/b_j, (pi/2) / (sum_j sqrt(b_j))^2, over
    the others (all three nodes for three)."""
    others = samples if len(samples) == 3 else [b for j, b in enumerate(samples) if j != i]
    return (math.pi / 2) / sum(math.sqrt(b) for b in others) ** 2


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    k = len(s)
    return s[k // 2] if k % 2 else 0.5 * (s[k // 2 - 1] + s[k // 2])
