"""The memory limit a job's program child gets after the job's benchmark (pure)."""

from __future__ import annotations

import pytest

from node_agent.core.measure import Point
from node_agent.sandbox.host import CHILD_OVERHEAD_BYTES, JOB_MEMORY_FACTOR, job_memory_budget

pytestmark = pytest.mark.timeout(10)
MiB = 1 << 20


def point(batch: int, peak: int, oom: bool = False) -> Point:
    return Point(batch, samples_per_second=100.0, peak_memory_bytes=peak, out_of_memory=oom)


def test_the_memory_line_at_the_largest_batch_the_node_gets() -> None:
    points = [point(8, 10 * MiB), point(16, 18 * MiB), point(32, 34 * MiB)]  # 2 MiB + 1 MiB/sample
    assert job_memory_budget(points, 64) == JOB_MEMORY_FACTOR * 66 * MiB + CHILD_OVERHEAD_BYTES


def test_never_below_the_largest_peak_measured() -> None:
    points = [point(8, 40 * MiB), point(16, 30 * MiB)]  # a falling line: noise
    assert job_memory_budget(points, 16) == JOB_MEMORY_FACTOR * 40 * MiB + CHILD_OVERHEAD_BYTES


def test_points_that_ran_out_of_memory_do_not_count() -> None:
    points = [point(8, 10 * MiB), point(64, 0, oom=True)]
    assert job_memory_budget(points, 8) == JOB_MEMORY_FACTOR * 10 * MiB + CHILD_OVERHEAD_BYTES


@pytest.mark.parametrize(
    ("points", "max_batch"),
    [([], 8), ([point(8, 0)], 8), ([point(8, 10 * MiB)], 0), ([point(8, 0, oom=True)], 8)],
)
def test_no_usable_measurement_no_budget(points: list[Point], max_batch: int) -> None:
    assert job_memory_budget(points, max_batch) is None
