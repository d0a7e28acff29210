"""A node's verification record and how often its work is spot-checked (issue 20; pure logic).

The check rate follows BOINC's adaptive replication, with a floor: a node is checked every
round until it has ``N0`` verified rounds in a row, then with probability ``N0 / v`` (``v`` =
verified rounds in a row), never below ``P_FLOOR``; a failed check resets it to new. Only a
round that was checked and passed counts as verified. A check recomputes ``CHECK_FRACTION`` of
a part's micro-batches (at least one). The budgets and the relation that ties the constants
to them are in docs/verification.md ("Reputation").

No clock, no I/O: times, rounds and the coordinator's secret random source are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

__all__ = [
    "CHECK_FRACTION",
    "MAX_EVIDENCE_CHARS",
    "N0",
    "NEW_BUDGET",
    "P_FLOOR",
    "RECOMPUTE_COST",
    "TRUSTED_BUDGET",
    "RandomSource",
    "ReputationRecord",
    "check_probability",
    "check_reason",
    "checked_count",
    "checked_micro_batches",
    "expected_overhead",
    "record_failed",
    "record_verified",
    "should_check",
]

# Budgets from the issue: compute spent on checks over the cluster's training compute.
NEW_BUDGET = 0.10
TRUSTED_BUDGET = 0.02
# Recomputing a micro-batch costs what computing it did (same forward and backward, same
# samples). A mismatch is recomputed once more on a third node; honest nodes never mismatch,
# so that re-check is spent on cheaters only and is not part of the budget.
RECOMPUTE_COST = 1.0
# overhead = p x (checked micro-batches / micro-batches) x RECOMPUTE_COST, and the checked
# share is at most CHECK_FRACTION (at least one micro-batch: a part needs at least
# 1 / CHECK_FRACTION micro-batches for the bound to hold). New nodes (p = 1): 0.08 <= 0.10.
# Trusted nodes (p = P_FLOOR): 0.2 x 0.08 = 0.016 <= 0.02. Both keep a fifth of the budget
# spare, for sampling noise around p and for the parts' rounding to whole micro-batches.
CHECK_FRACTION = 0.08
P_FLOOR = 0.2
# Verified rounds in a row before the probability starts to fall; it reaches P_FLOOR at
# N0 / P_FLOOR = 50 verified rounds in a row.
N0 = 10
MAX_EVIDENCE_CHARS = 2000
_EPS = 1e-9


class RandomSource(Protocol):
    """The coordinator's secret randomness (``random.SystemRandom()`` in production, a seeded
    ``random.Random`` or ``numpy.random.Generator`` in tests): only ``random()`` in [0, 1)."""

    def random(self) -> float: ...


def _nonneg_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _opt_nonneg_int(name: str, value: object) -> int | None:
    return None if value is None else _nonneg_int(name, value)


@dataclass(frozen=True)
class ReputationRecord:
    """A node's verification record. Immutable: the ``record_*`` functions return new ones."""

    verified_in_a_row: int = 0  # checked and passed since the last failure (or ever)
    verified_total: int = 0
    failed_total: int = 0
    last_verified_round: int | None = None
    last_failure_round: int | None = None
    last_failure_ms: int | None = None
    last_failure_evidence: str = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError if the record is inconsistent (as a stored one could be)."""
        _nonneg_int("verified_in_a_row", self.verified_in_a_row)
        _nonneg_int("verified_total", self.verified_total)
        _nonneg_int("failed_total", self.failed_total)
        _opt_nonneg_int("last_verified_round", self.last_verified_round)
        _opt_nonneg_int("last_failure_round", self.last_failure_round)
        _opt_nonneg_int("last_failure_ms", self.last_failure_ms)
        if not isinstance(self.last_failure_evidence, str):
            raise ValueError("last_failure_evidence must be a string")
        if self.verified_in_a_row > self.verified_total:
            raise ValueError(
                f"verified_in_a_row ({self.verified_in_a_row}) exceeds verified_total "
                f"({self.verified_total})"
            )
        if (self.verified_total == 0) != (self.last_verified_round is None):
            raise ValueError("last_verified_round is set exactly when verified_total > 0")
        if (self.failed_total == 0) != (self.last_failure_round is None):
            raise ValueError("last_failure_round is set exactly when failed_total > 0")
        if self.failed_total == 0 and (
            self.last_failure_ms is not None or self.last_failure_evidence
        ):
            raise ValueError("a record without failures carries no failure time or evidence")

    @property
    def is_new(self) -> bool:
        return self.verified_in_a_row < N0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (for the store and ``nodes``)."""
        return {
            "verified_in_a_row": self.verified_in_a_row,
            "verified_total": self.verified_total,
            "failed_total": self.failed_total,
            "last_verified_round": self.last_verified_round,
            "last_failure_round": self.last_failure_round,
            "last_failure_ms": self.last_failure_ms,
            "last_failure_evidence": self.last_failure_evidence,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReputationRecord:
        """The inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys and
        inconsistent values are a ValueError."""
        unknown = set(d) - set(cls().to_dict())
        if unknown:
            raise ValueError(f"unknown reputation fields: {sorted(unknown)}")
        return cls(**dict(d))


def check_probability(record: ReputationRecord) -> float:
    """The probability that this round of the node is checked: 1 while new (fewer than N0
    verified rounds in a row), then N0 / verified_in_a_row, never below P_FLOOR.

    With N0 / v the expected run of unchecked rounds (v / N0) grows with the verified record,
    never beyond a tenth of it; the probability is non-increasing in v."""
    v = record.verified_in_a_row
    if v < N0:
        return 1.0
    return max(P_FLOOR, N0 / v)


def check_reason(record: ReputationRecord) -> str:
    """Why :func:`check_probability` is what it is, for events and ``nodes``."""
    p = check_probability(record)
    v = record.verified_in_a_row
    if v < N0:
        after = "" if record.failed_total == 0 else " (reset by a failed check)"
        return f"new: {v} of {N0} verified rounds in a row{after}, checked every round"
    if p == P_FLOOR:
        return f"trusted: {v} verified rounds in a row, checked with the floor probability {p:g}"
    return f"building trust: {v} verified rounds in a row, checked with probability {p:.3g}"


def should_check(record: ReputationRecord, rng: RandomSource) -> bool:
    """Draw whether this round of the node is checked, from the coordinator's secret ``rng``
    (drawn after the node's update and commitment arrived, so nothing it received could tell)."""
    p = check_probability(record)
    return p >= 1.0 or float(rng.random()) < p


def checked_count(n_micro_batches: int, fraction: float = CHECK_FRACTION) -> int:
    """How many of a part's micro-batches a check recomputes: ``floor(fraction x n)``, at
    least one (so at most ``fraction`` of them once ``n >= 1 / fraction``)."""
    if isinstance(n_micro_batches, bool) or not isinstance(n_micro_batches, int):
        raise ValueError(f"n_micro_batches must be an integer, got {n_micro_batches!r}")
    if n_micro_batches < 1:
        raise ValueError(f"a part has at least one micro-batch, got {n_micro_batches}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return max(1, min(n_micro_batches, math.floor(fraction * n_micro_batches + _EPS)))


def checked_micro_batches(n_micro_batches: int, fraction: float, rng: RandomSource) -> list[int]:
    """The micro-batches (indices in ``0 .. n-1``, distinct, ascending) of a part that a check
    recomputes, :func:`checked_count` of them drawn uniformly from ``rng`` alone."""
    k = checked_count(n_micro_batches, fraction)
    pool = list(range(n_micro_batches))
    for i in range(k):  # partial Fisher-Yates: the first k of a uniform permutation
        j = i + min(int(float(rng.random()) * (n_micro_batches - i)), n_micro_batches - i - 1)
        pool[i], pool[j] = pool[j], pool[i]
    return sorted(pool[:k])


def record_verified(record: ReputationRecord, round: int) -> ReputationRecord:
    """The record after a check of ``round`` passed."""
    _nonneg_int("round", round)
    last = record.last_verified_round
    return replace(
        record,
        verified_in_a_row=record.verified_in_a_row + 1,
        verified_total=record.verified_total + 1,
        last_verified_round=round if last is None else max(last, round),
    )


def record_failed(
    record: ReputationRecord, round: int, evidence: str, *, time_ms: int | None = None
) -> ReputationRecord:
    """The record after a check of ``round`` failed (confirmed on a third node): new again
    (checked every round), with the evidence kept (cut to MAX_EVIDENCE_CHARS)."""
    _nonneg_int("round", round)
    _opt_nonneg_int("time_ms", time_ms)
    if not isinstance(evidence, str) or not evidence.strip():
        raise ValueError("a failed check needs its evidence")
    if len(evidence) > MAX_EVIDENCE_CHARS:
        evidence = evidence[: MAX_EVIDENCE_CHARS - 1] + "…"
    return replace(
        record,
        verified_in_a_row=0,
        failed_total=record.failed_total + 1,
        last_failure_round=round,
        last_failure_ms=time_ms,
        last_failure_evidence=evidence,
    )


def expected_overhead(
    probabilities: Sequence[float],
    n_micro_batches: int,
    fraction: float = CHECK_FRACTION,
    *,
    work: Sequence[float] | None = None,
    recompute_cost: float = RECOMPUTE_COST,
) -> float:
    """Expected check compute over training compute for a fleet in one round.

    ``probabilities[i]`` is node i's check probability, ``work[i]`` its share of the round's
    training compute (equal shares when omitted), each part cut into ``n_micro_batches``:
    ``sum_i work_i x p_i x checked_count(n, fraction) / n x recompute_cost / sum_i work_i``."""
    if not probabilities:
        raise ValueError("expected_overhead needs at least one node")
    if any(not 0.0 <= p <= 1.0 for p in probabilities):
        raise ValueError("probabilities must lie in [0, 1]")
    weights = [1.0] * len(probabilities) if work is None else list(work)
    if len(weights) != len(probabilities):
        raise ValueError(f"{len(weights)} work shares for {len(probabilities)} probabilities")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("work shares must be non-negative with a positive sum")
    if recompute_cost < 0:
        raise ValueError(f"recompute_cost must be non-negative, got {recompute_cost}")
    share = checked_count(n_micro_batches, fraction) / n_micro_batches
    checked = sum(w * p for w, p in zip(weights, probabilities, strict=True))
    return checked / sum(weights) * share * recompute_cost
