"""What the coordinator believes of the speeds nodes report (pure logic).

A node's share of a round and its billed rate follow its samples/s estimate, which is fed by the
compute seconds the node reports and, before its first round, by its benchmark. Both are
claims: a node that says it computes in no time gets most of every batch and nearly all the
aggregation weight, a node that says it is slow is paid more per sample. So neither is taken
beyond what the coordinator observes itself:

- **The compute window.** For every part the coordinator sees when the node took the task
  (NextTask), when it finished pulling the round's parameters, and when its update (or, in a
  ring, its progress report) arrived. The time in between, the window, bounds what the node
  can have spent computing: a reported figure above it is cut to it. Below it, the window also
  holds work that is not computing (decoding the parameters, encoding the update; in a ring the
  all-reduce), which honest nodes of a job share: the round's reference overhead is the median
  over its parts of window minus reported compute (the smaller one with fewer than three
  parts), and a node is credited with at least its window minus that reference, less
  CLAIM_TOLERANCE of it (the timing noise of a busy host: an honest node whose overhead is a
  little above the others' keeps its own figure). A node that under-reports its compute time
  gains at most that tolerance (its window still shows it).
- **Unobserved benchmarks.** A node with no observed round is planned by its benchmark, which
  it ran itself. Its planning rate is capped at BENCHMARK_CAP times the fastest observed node of
  the job, or, while no node is observed yet, BENCHMARK_CAP times the median claim: a liar's
  first round cannot take the batch, and its first observed round replaces the claim. From
  below it is bounded by its device model's reference floor (`reference_floor`): the median
  reference benchmark (samples/s of the reference model) of the registered nodes of its device
  model, its own when it is the only one, divided by BENCHMARK_CAP. A claim of being slow, even
  alone in a job, cannot shrink its share (or, coordinator/accounting/billing.py
  `standing_rate`, swell the budget its first round reserves) below that floor.

  Why the reference and not a job's measured figures: a part's pay follows what its round
  observes anyway (`settled_rate`), so the floor only has to keep an unobserved claim from
  being absurd, and the reference benchmark is the one figure every node has for its device
  model. Each node of a model counts once, so a liar's own reference is one vote among its
  model's. A program much heavier per sample than the reference model (an MLP of 540 kFLOPs)
  runs below the floor: such a node's first round is billed at the floor rather than its
  observed rate, which underpays it for that round only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

__all__ = [
    "BENCHMARK_CAP",
    "CLAIM_TOLERANCE",
    "capped_benchmarks",
    "confirmed_compute",
    "reference_floor",
]

# How many times the fastest observed node (or the median claim) an unobserved node's benchmark
# may say it is: a legitimately faster device gets its full share from its first observed round.
BENCHMARK_CAP = 4.0
# The share of a node's observed compute time it may report below it: a liar is at most
# 1 / (1 - CLAIM_TOLERANCE) = 1.25 times as fast as observed.
CLAIM_TOLERANCE = 0.2


def confirmed_compute(parts: Sequence[tuple[float, float]]) -> list[float]:
    """The compute seconds to believe of each of a round's parts, given as ``(reported
    seconds, window seconds)``; a window <= 0 (not observed) keeps the reported figure."""
    overheads = [max(0.0, w - c) for c, w in parts if w > 0 and math.isfinite(c) and c >= 0]
    if not overheads:
        return [c for c, _ in parts]
    reference = statistics.median(overheads) if len(overheads) >= 3 else min(overheads)
    out = []
    for c, w in parts:
        if w <= 0 or not math.isfinite(w):
            out.append(c)
        elif not math.isfinite(c) or c < 0:
            out.append(c)  # invalid: the caller refuses it
        else:
            out.append(min(w, max(c, (w - reference) * (1.0 - CLAIM_TOLERANCE))))
    return out


def capped_benchmarks(
    claims: Mapping[str, float],
    observed: Mapping[str, float],
    floors: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Planning rates of unobserved nodes (``claims``: samples/s they benchmarked) capped by
    the job's observed nodes' estimates (``observed``) and bounded from below by ``floors``
    (node -> its `reference_floor`), see the module docstring."""
    if observed:
        cap = BENCHMARK_CAP * max(observed.values())
    elif claims:
        cap = BENCHMARK_CAP * statistics.median(claims.values())
    else:
        return {}
    floors = floors or {}
    return {n: max(min(rate, cap), floors.get(n, 0.0)) for n, rate in claims.items()}


def reference_floor(references: Sequence[float]) -> float:
    """The samples/s below which no unobserved node of a device model is believed: the median
    of the model's nodes' reference benchmarks (``references``) / BENCHMARK_CAP; 0 without
    one (see the module docstring)."""
    refs = [r for r in references if math.isfinite(r) and r > 0]
    return float(statistics.median(refs)) / BENCHMARK_CAP if refs else 0.0
