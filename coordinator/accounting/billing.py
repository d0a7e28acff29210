"""The billing rule, in integer micro-credits (pure).

A node earns its hourly price for the time its *applied* samples take at its measured speed
for the job: ``price x samples / rate / 3600``, rounded down. The rate is the coordinator's,
never the node's word alone: a node's claimed benchmark bounds a part only from above (a claim
of being slow is worth nothing before a round observed the node, `handout_rate`), and a part
handed out before its node was observed is billed at no less than the rate the part itself
showed (`settled_rate`). The submitter pays each sample of
an epoch once: samples it already paid for in a round a coordinator restart rolled back are
re-run at the platform's expense (the donor is paid again: it did the work twice). An optional
platform fee, in parts per million of what the submitter pays for, comes on top of it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from epochmesh.v1 import common_pb2

SECONDS_PER_HOUR = 3600
PPM = 1_000_000
# Rates are quantised to micro-samples per second, so that the rule is exact integer arithmetic.
RATE_SCALE = 1_000_000
RATE_QUANTUM = 1_000_000  # billed rates are kept to micro-samples per second


def earned_micro(price_per_hour: int, samples: int, rate: float) -> int:
    """Micro-credits a node at ``price_per_hour`` micro-credits earns for ``samples`` applied
    samples at ``rate`` samples/s (0 for no samples, a free node, or no measured rate)."""
    if price_per_hour < 0 or samples < 0:
        raise ValueError("price and samples must not be negative")
    if samples == 0 or price_per_hour == 0 or not (math.isfinite(rate) and rate > 0):
        return 0
    rate_q = max(1, round(rate * RATE_SCALE))
    return price_per_hour * samples * RATE_SCALE // (rate_q * SECONDS_PER_HOUR)


@dataclass(frozen=True)
class PartCharge:
    """What one applied part of a round moves: the donor earns ``earned``, paid by the
    submitter (``submitter_pays``) and, for re-run samples, the platform (``platform_pays``);
    the submitter pays ``fee`` to the platform on top."""

    node_id: str
    donor: str
    samples: int
    repeat_samples: int
    earned: int
    submitter_pays: int
    platform_pays: int
    fee: int

    @property
    def submitter_total(self) -> int:
        return self.submitter_pays + self.fee


def charge_part(
    node_id: str,
    donor: str,
    price_per_hour: int,
    rate: float,
    samples: int,
    repeat_samples: int = 0,
    fee_ppm: int = 0,
) -> PartCharge:
    """The charge of an applied part of ``samples`` samples, ``repeat_samples`` of which the
    submitter paid for already (in a rolled-back round)."""
    if not 0 <= repeat_samples <= samples:
        raise ValueError("repeat_samples must be within 0..samples")
    if not 0 <= fee_ppm <= PPM:
        raise ValueError("the fee must be within 0..1000000 parts per million")
    earned = earned_micro(price_per_hour, samples, rate)
    submitter = earned_micro(price_per_hour, samples - repeat_samples, rate)
    return PartCharge(
        node_id=node_id,
        donor=donor,
        samples=samples,
        repeat_samples=repeat_samples,
        earned=earned,
        submitter_pays=submitter,
        platform_pays=earned - submitter,
        fee=submitter * fee_ppm // PPM,
    )


class BilledSamples:
    """Which samples of each epoch of a job the submitter has paid for (index runs in, counts
    out): a re-run of a paid sample is the platform's."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self._paid: dict[int, np.ndarray] = {}

    def split(self, epoch: int, runs: np.ndarray) -> tuple[int, int]:
        """(new, repeat) samples of ``runs`` ((k, 2) [start, stop) index rows) in ``epoch``."""
        idx = self._indices(runs)
        paid = self._paid.get(epoch)
        repeat = int(np.count_nonzero(paid[idx])) if paid is not None else 0
        return len(idx) - repeat, repeat

    def mark(self, epoch: int, runs: np.ndarray) -> None:
        """The submitter paid for ``runs`` in ``epoch``."""
        paid = self._paid.setdefault(epoch, np.zeros(self.num_samples, dtype=bool))
        paid[self._indices(runs)] = True

    def unpaid(self, epoch: int, runs: np.ndarray) -> np.ndarray:
        """The indices of ``runs`` the submitter has not paid for in ``epoch`` (ascending)."""
        idx = self._indices(runs)
        paid = self._paid.get(epoch)
        return idx[~paid[idx]] if paid is not None else idx

    def unmark(self, epoch: int, indices: np.ndarray) -> None:
        """The submitter's payment for ``indices`` in ``epoch`` was returned to it (the work
        was found bad): a re-run of them is the submitter's again."""
        paid = self._paid.get(epoch)
        if paid is not None:
            paid[np.asarray(indices, dtype=np.int64)] = False

    def forget_before(self, epoch: int) -> None:
        """Epochs before ``epoch`` are done: no sample of theirs runs again."""
        for e in [e for e in self._paid if e < epoch]:
            del self._paid[e]

    def _indices(self, runs: np.ndarray) -> np.ndarray:
        """The distinct indices ``runs`` cover, ascending: built from the runs (a part's
        samples), not from a mask of the whole epoch, so that billing a part costs its size,
        not the dataset's."""
        runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
        if len(runs) and (int(runs.min()) < 0 or int(runs[:, 1].max()) > self.num_samples):
            raise ValueError("sample runs outside the dataset")
        if len(runs) == 1:  # a part's one segment
            return np.arange(runs[0, 0], max(runs[0, 0], runs[0, 1]), dtype=np.int64)
        runs = runs[runs[:, 1] > runs[:, 0]]
        if len(runs) > 1 and bool((runs[1:, 0] < runs[:-1, 1]).any()):  # not in order, apart
            runs = runs[np.argsort(runs[:, 0], kind="stable")]
            if bool((runs[1:, 0] < runs[:-1, 1]).any()):
                return np.flatnonzero(self._mask(runs))  # overlapping runs: each index once
        lengths = runs[:, 1] - runs[:, 0]
        # Index i of the concatenation lies in run k: start_k + (i - the runs before k's length).
        first = runs[:, 0] - (np.cumsum(lengths) - lengths)
        return np.repeat(first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)

    def _mask(self, runs: np.ndarray) -> np.ndarray:
        delta = np.zeros(self.num_samples + 1, dtype=np.int64)
        np.add.at(delta, runs[:, 0], 1)
        np.add.at(delta, runs[:, 1], -1)
        return np.cumsum(delta[:-1]) > 0


def per_credit(spec: common_pb2.JobSpec) -> bool:
    """Whether the job prefers samples/s per credit (a budget, no deadline) to speed."""
    return spec.budget_micro > 0 and not spec.HasField("deadline_seconds")


def quantized_rate(rate: float) -> float:
    return round(rate * RATE_QUANTUM) / RATE_QUANTUM if rate > 0 else 0.0


def standing_rate(
    observed: Sequence[float], peer_claims: Sequence[float], floor: float = 0.0
) -> float:
    """The samples/s the coordinator can stand behind for a node of a job it has not observed
    yet: the median estimate of the job's observed nodes, else (none observed yet) the median
    of the other nodes' benchmark claims for the job, but never below ``floor``, the node's
    device model's reference floor (coordinator/rounds/claims.py `reference_floor`), which is
    all there is for a node alone in a job (the part's own observation decides at round
    close)."""
    seen = [r for r in observed if math.isfinite(r) and r > 0]
    if seen:
        return float(statistics.median(seen))
    claims = [r for r in peer_claims if math.isfinite(r) and r > 0]
    floor = floor if math.isfinite(floor) and floor > 0 else 0.0
    return max(float(statistics.median(claims)) if claims else 0.0, floor)


def handout_rate(estimate: float, observed: bool, standing: float) -> float:
    """The rate a part is priced at when it is handed out (what the budget check reserves):
    an observed node's estimate; an unobserved node's claim bounded from below by the
    ``standing`` rate (a claim of being slow cannot raise its pay per sample above what a node
    of the job's observed speed earns)."""
    rate = estimate if math.isfinite(estimate) and estimate > 0 else 0.0
    if observed:
        return rate
    return max(rate, standing)


def settled_rate(handout: float, observed_rate: float) -> float:
    """The rate an applied part priced while its node was unobserved is billed at, once the
    round closed and observed it: never below what the part itself showed (pay follows the
    observed rate; never above the hand-out reservation either, since a higher rate pays
    less)."""
    if math.isfinite(observed_rate) and observed_rate > 0:
        return max(handout, observed_rate)
    return handout
