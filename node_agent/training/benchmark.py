"""Compute benchmark: samples/s and peak memory of a model's training step at several batch sizes.

The benchmark is written against a *step factory*: `make_step(batch_size)` prepares a batch and
returns `step()`, one full training step that returns only once the device finished. The same
code therefore measures the built-in reference model and a job's exported program.

Per batch size (see BenchmarkPlan): one memory-tracked step, a few unpadded warm-up steps run
back to back, then a fixed number of timed steps, each through the SlowdownController.

samples/s = batch size / the fastest timed step. A step can be slowed by anything else the
machine runs, but never sped up, so the fast end of the distribution is the device's own speed
and the figure holds still on a loaded machine. (With the mean step, the ratio between
--slowdown 4 and --slowdown 1 came out anywhere from 0.17 to 0.52 on a 2-core VM with a load
average of 5; a fixed step count gives every factor the same number of samples.)

--slowdown F: each timed step is padded to F times the device's *warm* compute time for the
batch (the fastest unpadded step so far), or left as it is if it computed longer than that. A
padded step starts after a sleep, on cold caches, and on a loaded VM computes 10-50% slower
than a warm one; charging F times that cold time would make --slowdown 4 measure 4.5-5 times
slower than --slowdown 1 (measured ratios 0.19-0.22 instead of 0.25). Training steps are
padded by F times their own compute time (SlowdownController.timed_step without a reference).

The headline figure the allocator weighs by is the throughput at the largest batch that fits
(the coordinator re-estimates throughput from observed round times anyway).

Peak memory is measured by node_agent.core.measure (a MemoryMeter per device).

Out of memory is an answer, not a crash: `torch.cuda.OutOfMemoryError`, `MemoryError` and the
allocators' RuntimeErrors end the sweep at that batch size (larger sizes are reported as out of
memory too, untried). `--memory-limit` emulates a smaller device: a batch whose measured peak,
or whose peak extrapolated from the smaller batches, exceeds the limit counts as out of memory.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2
from node_agent.core.measure import (
    MemoryLimitExceeded,
    MemoryMeter,
    Point,
    estimate_peak_bytes,
    headline_samples_per_second,
    is_out_of_memory,
    max_batch_size,
    memory_capacity,
    memory_meter_for,
    release_memory,
    step_time_estimate,
)
from node_agent.core.slowdown import SlowdownController

log = logging.getLogger(__name__)

StepFn = Callable[[], None]
StepFactory = Callable[[int], StepFn]


@dataclass(frozen=True)
class BenchmarkPlan:
    """Per batch size: one memory-tracked step, `warmup_steps` unpadded warm-up steps, then
    timed steps until min_steps and min_seconds are both reached, stopping at max_steps or
    max_seconds (wall time, slowdown included). A fixed step count (min_steps == max_steps,
    min_seconds 0) gives every --slowdown the same number of samples, so that the fastest-step
    estimate is comparable between them."""

    batch_sizes: tuple[int, ...]
    warmup_steps: int = 2
    min_steps: int = 20
    max_steps: int = 20
    min_seconds: float = 0.0
    max_seconds: float = 10.0

    def with_batch_sizes(self, batch_sizes: Sequence[int]) -> BenchmarkPlan:
        sizes = tuple(sorted({int(b) for b in batch_sizes if int(b) > 0}))
        return BenchmarkPlan(
            batch_sizes=sizes or self.batch_sizes,
            warmup_steps=self.warmup_steps,
            min_steps=self.min_steps,
            max_steps=self.max_steps,
            min_seconds=self.min_seconds,
            max_seconds=self.max_seconds,
        )


# Under half a second on a 2-core CPU for the reference model (about F times that with
# --slowdown F).
FULL_PLAN = BenchmarkPlan(batch_sizes=(32, 128, 512), warmup_steps=3, min_steps=60, max_steps=60)
# For tests: a handful of steps, well under 100 ms on a CPU.
QUICK_PLAN = BenchmarkPlan(
    batch_sizes=(16, 64), warmup_steps=1, min_steps=3, max_steps=3, min_seconds=0.0
)
# A job's program, at the batch sizes its BENCHMARK task names.
JOB_PLAN = BenchmarkPlan(batch_sizes=(16, 64, 256), warmup_steps=2, min_steps=20, max_steps=20)
# The same for agents started with --benchmark quick (tests): a few steps per batch size, at
# most 2 s each whatever the --slowdown (the rounds' observed times correct the estimate).
QUICK_JOB_PLAN = BenchmarkPlan(
    batch_sizes=(16, 64, 256), warmup_steps=1, min_steps=5, max_steps=5, max_seconds=2.0
)


class BenchmarkCancelled(Exception):
    """The agent asked the benchmark to stop (drain, task cancelled)."""


def build_result(
    points: Sequence[Point],
    device: common_pb2.Device,
    *,
    slowdown: float,
    memory_limit_bytes: int | None = None,
    rtt_ms: float = 0.0,
    bandwidth: float = 0.0,
    job_id: str = "",
) -> common_pb2.BenchmarkResult:
    return common_pb2.BenchmarkResult(
        job_id=job_id,
        device=device,
        points=[p.to_proto() for p in points],
        max_batch_size=max_batch_size(points, memory_capacity(device, memory_limit_bytes)),
        samples_per_second=headline_samples_per_second(points),
        rtt_ms=rtt_ms,
        bandwidth_bytes_per_second=bandwidth,
        measured_at_ms=now_ms(),
        slowdown=slowdown,
    )


# -- the sweep --------------------------------------------------------------------------------


def _never() -> bool:
    return False


def run_compute_benchmark(
    make_step: StepFactory,
    plan: BenchmarkPlan,
    slowdown: SlowdownController,
    meter: MemoryMeter,
    *,
    memory_limit_bytes: int | None = None,
    should_stop: Callable[[], bool] = _never,
    on_oom: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Point]:
    """Measure every batch size of the plan, smallest first, until one does not fit.

    Raises BenchmarkCancelled when `should_stop()` turns true (checked between steps); any
    error other than out-of-memory propagates.
    """
    sizes = sorted({b for b in plan.batch_sizes if b > 0})
    points: list[Point] = []
    for i, batch_size in enumerate(sizes):
        if should_stop():
            raise BenchmarkCancelled()
        if memory_limit_bytes is not None:
            estimate = estimate_peak_bytes(points, batch_size)
            if estimate is not None and estimate > memory_limit_bytes:
                log.info(
                    "batch %d: estimated peak %.0f bytes exceeds the memory limit %d",
                    batch_size,
                    estimate,
                    memory_limit_bytes,
                )
                points.extend(Point(b, 0.0, 0, True) for b in sizes[i:])
                break
        try:
            point = _measure(
                make_step, batch_size, plan, slowdown, meter, memory_limit_bytes, should_stop, clock
            )
        except BenchmarkCancelled:
            raise
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            log.info("batch %d does not fit: %s", batch_size, exc)
            if on_oom is not None:
                on_oom()
            points.extend(Point(b, 0.0, 0, True) for b in sizes[i:])
            break
        log.debug(
            "batch %d: %.1f samples/s over %d steps, peak %d bytes",
            batch_size,
            point.samples_per_second,
            point.steps,
            point.peak_memory_bytes,
        )
        points.append(point)
    return points


def _measure(
    make_step: StepFactory,
    batch_size: int,
    plan: BenchmarkPlan,
    slowdown: SlowdownController,
    meter: MemoryMeter,
    memory_limit_bytes: int | None,
    should_stop: Callable[[], bool],
    clock: Callable[[], float],
) -> Point:
    def check_limit() -> None:
        if memory_limit_bytes is not None:
            peak = meter.peak_bytes()
            if peak > memory_limit_bytes:
                raise MemoryLimitExceeded(
                    f"peak {peak} bytes exceeds the memory limit {memory_limit_bytes}"
                )

    meter.reset()
    step = make_step(batch_size)
    if should_stop():
        raise BenchmarkCancelled()
    # Warm-up: one tracked step (tracking slows a step: never timed), then unpadded steps back
    # to back, whose fastest is the device's warm compute time for this batch.
    meter.track(step)
    check_limit()
    warm = math.inf
    for _ in range(max(1, plan.warmup_steps)):
        if should_stop():
            raise BenchmarkCancelled()
        t0 = clock()
        step()
        warm = min(warm, clock() - t0)
    times: list[float] = []
    start = clock()
    while len(times) < max(1, plan.max_steps):
        if should_stop():
            raise BenchmarkCancelled()
        t0 = clock()
        slowdown.timed_step(step, pay_back=False, reference_seconds=warm)
        times.append(clock() - t0)
        warm = min(warm, slowdown.last_compute_seconds)
        spent = clock() - start
        if len(times) >= plan.min_steps and spent >= plan.min_seconds:
            break
        if spent >= plan.max_seconds:
            break
    check_limit()
    fast = step_time_estimate(times)
    return Point(
        batch_size=batch_size,
        samples_per_second=batch_size / fast if fast > 0 else 0.0,
        peak_memory_bytes=meter.peak_bytes(),
        out_of_memory=False,
        steps=len(times),
        median_step_seconds=statistics.median(times),
    )


def benchmark_model(
    build: Callable[[], StepFactory],
    device: str,
    plan: BenchmarkPlan,
    slowdown: SlowdownController,
    *,
    memory_limit_bytes: int | None = None,
    should_stop: Callable[[], bool] = _never,
    meter: MemoryMeter | None = None,
) -> list[Point]:
    """Build a model with `build()` and sweep it on `device` (blocking: run it in a thread);
    `meter`: how its steps' memory is counted (by default, in this process on `device`)."""
    meter = meter if meter is not None else memory_meter_for(device)
    make_step = build()
    try:
        return run_compute_benchmark(
            make_step,
            plan,
            slowdown,
            meter,
            memory_limit_bytes=memory_limit_bytes,
            should_stop=should_stop,
            on_oom=lambda: release_memory(device),
        )
    finally:
        del make_step
        release_memory(device)
