"""What recorded rounds add up to, for the metrics endpoint and the dashboard: per job a
bounded series of (round, loss, throughput) points, each node's samples and compute vs
communicate seconds, and histograms of round durations and of each node's part times.

Pure: round records in, figures out; no I/O and no clock (``now_ms`` is passed in). The
caller (coordinator/observability/cluster_view.py) reads the records from the store.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from epochmesh.v1 import common_pb2

# Seconds; a round of a small model takes ~0.05 s, of a local SGD job minutes.
ROUND_SECONDS_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
PART_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
# Points of a job's loss and throughput series kept (the newest).
MAX_POINTS = 2000
APPLIED = "applied"


@dataclass
class Histogram:
    """A Prometheus-style histogram: counts per upper bound (the last one +Inf), sum, count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, ending with ("+Inf", count)."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


@dataclass(frozen=True)
class RoundPoint:
    round: int
    epoch: int
    finished_ms: int
    loss: float
    samples: int  # applied samples
    seconds: float  # wall time of the round
    samples_per_second: float

    def to_dict(self) -> dict[str, float | int]:
        return {
            "round": self.round,
            "epoch": self.epoch,
            "t": self.finished_ms,
            "loss": self.loss if math.isfinite(self.loss) else None,  # type: ignore[dict-item]
            "samples": self.samples,
            "seconds": round(self.seconds, 6),
            "samples_per_second": round(self.samples_per_second, 3),
        }


@dataclass
class NodeTotals:
    """One node's part in one job's rounds."""

    samples: int = 0
    compute_seconds: float = 0.0
    communicate_seconds: float = 0.0
    parts_applied: int = 0
    parts_failed: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "samples": self.samples,
            "compute_seconds": round(self.compute_seconds, 6),
            "communicate_seconds": round(self.communicate_seconds, 6),
            "parts_applied": self.parts_applied,
            "parts_failed": self.parts_failed,
        }


def part_samples(part: common_pb2.RoundPart) -> int:
    return sum(max(0, r.stop - r.start) for r in part.ranges)


@dataclass
class JobRounds:
    """A job's rounds read so far (``cursor``: the highest round number seen)."""

    cursor: int = 0
    rounds: int = 0
    samples: int = 0
    points: deque[RoundPoint] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    nodes: dict[str, NodeTotals] = field(default_factory=dict)
    duration: Histogram = field(default_factory=lambda: Histogram(ROUND_SECONDS_BUCKETS))

    def add(self, record: common_pb2.RoundRecord) -> None:
        if record.round <= self.cursor:
            return  # seen (a store may list a round again after a rollback)
        self.cursor = record.round
        samples = 0
        for part in record.parts:
            totals = self.nodes.setdefault(part.node_id, NodeTotals())
            if part.status == APPLIED:
                n = part_samples(part)
                samples += n
                totals.samples += n
                totals.parts_applied += 1
                totals.compute_seconds += max(0.0, part.seconds)
                totals.communicate_seconds += max(0.0, part.communicate_seconds)
            else:
                totals.parts_failed += 1
        seconds = max(0.0, (record.finished_ms - record.started_ms) / 1000.0)
        self.rounds += 1
        self.samples += samples
        self.duration.observe(seconds)
        self.points.append(
            RoundPoint(
                round=record.round,
                epoch=record.epoch,
                finished_ms=record.finished_ms,
                loss=record.loss,
                samples=samples,
                seconds=seconds,
                samples_per_second=samples / seconds if seconds > 0 else 0.0,
            )
        )

    def points_after(self, since_round: int) -> list[RoundPoint]:
        return [p for p in self.points if p.round > since_round]

    def shares(self) -> dict[str, float]:
        """Each node's fraction of the job's applied samples."""
        total = sum(t.samples for t in self.nodes.values())
        if total <= 0:
            return {n: 0.0 for n in self.nodes}
        return {n: t.samples / total for n, t in self.nodes.items()}


@dataclass
class NodeParts:
    """Histograms of one node's applied parts, over every job."""

    compute: Histogram = field(default_factory=lambda: Histogram(PART_SECONDS_BUCKETS))
    communicate: Histogram = field(default_factory=lambda: Histogram(PART_SECONDS_BUCKETS))
    last_ms: int = 0


class RoundStats:
    """Every tracked job's `JobRounds` and every node's part histograms, with the rules that
    keep them bounded: `prune` drops jobs that ended more than ``retention_ms`` ago and nodes
    that neither are active nor did any work within it."""

    def __init__(self, retention_ms: int = 10 * 60 * 1000, max_jobs: int = 256) -> None:
        self.retention_ms = retention_ms
        self.max_jobs = max_jobs
        self.jobs: dict[str, JobRounds] = {}
        self.node_parts: dict[str, NodeParts] = {}

    def job(self, job_id: str) -> JobRounds:
        rounds = self.jobs.get(job_id)
        if rounds is None:
            rounds = self.jobs[job_id] = JobRounds()
        return rounds

    def cursor(self, job_id: str) -> int:
        rounds = self.jobs.get(job_id)
        return rounds.cursor if rounds is not None else 0

    def add(self, job_id: str, records: Iterable[common_pb2.RoundRecord]) -> int:
        """Adds the records of ``job_id`` beyond its cursor; how many were new."""
        rounds = self.job(job_id)
        new = 0
        for record in records:
            if record.round <= rounds.cursor:
                continue
            rounds.add(record)
            new += 1
            for part in record.parts:
                if part.status != APPLIED:
                    continue
                node = self.node_parts.setdefault(part.node_id, NodeParts())
                node.compute.observe(part.seconds)
                node.communicate.observe(part.communicate_seconds)
                node.last_ms = max(node.last_ms, record.finished_ms)
        return new

    def prune(
        self,
        ended_ms: Mapping[str, int],
        active_nodes: Iterable[str],
        now_ms: int,
        keep: Iterable[str] = (),
    ) -> list[str]:
        """Drops the jobs in ``ended_ms`` (job id -> when it ended) that ended more than the
        retention ago, unless in ``keep``; then the oldest-ended jobs beyond ``max_jobs``;
        then the nodes not in ``active_nodes`` without a part within the retention. Returns
        the dropped job ids."""
        keep_set = set(keep)
        horizon = now_ms - self.retention_ms
        dropped = [
            j for j in self.jobs if j in ended_ms and ended_ms[j] < horizon and j not in keep_set
        ]
        for job_id in dropped:
            del self.jobs[job_id]
        excess = len(self.jobs) - self.max_jobs
        if excess > 0:
            ended = sorted((ended_ms[j], j) for j in self.jobs if j in ended_ms)
            for _, job_id in ended[:excess]:
                del self.jobs[job_id]
                dropped.append(job_id)
        active = set(active_nodes)
        for node_id in [
            n for n, p in self.node_parts.items() if n not in active and p.last_ms < horizon
        ]:
            del self.node_parts[node_id]
        return dropped
