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

Peak memory:
- CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`, reset per batch size).
- CPU: the same quantity, counted: the bytes of the CPU tensors alive before the step (model,
  optimizer state, batch; found through the garbage collector) plus the peak of the storages
  its operators allocate (a TorchDispatchMode that adds each new storage and subtracts it when
  it dies). Resident memory (RSS) was the alternative, but in a long-lived process freed
  memory is reused without growing it, so its figure depends on what ran before; tensor bytes
  do not, which keeps --memory-limit (emulated small devices) deterministic. The count leaves
  out allocator overhead and memory outside tensors (e.g. oneDNN scratch space).

Out of memory is an answer, not a crash: `torch.cuda.OutOfMemoryError`, `MemoryError` and the
allocators' RuntimeErrors end the sweep at that batch size (larger sizes are reported as out of
memory too, untried). `--memory-limit` emulates a smaller device: a batch whose measured peak,
or whose peak extrapolated from the smaller batches, exceeds the limit counts as out of memory.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2
from node_agent.core.slowdown import SlowdownController

log = logging.getLogger(__name__)

T = TypeVar("T")
StepFn = Callable[[], None]
StepFactory = Callable[[int], StepFn]

# Fraction of a device's total memory a batch may plan to use when extrapolating the max batch.
MEMORY_HEADROOM = 0.9
# The max batch is never extrapolated beyond this multiple of the largest batch measured.
MAX_EXTRAPOLATION = 16


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


@dataclass(frozen=True)
class Point:
    batch_size: int
    samples_per_second: float
    peak_memory_bytes: int
    out_of_memory: bool
    steps: int = 0
    median_step_seconds: float = 0.0

    def to_proto(self) -> common_pb2.BenchmarkPoint:
        return common_pb2.BenchmarkPoint(
            batch_size=self.batch_size,
            samples_per_second=self.samples_per_second,
            peak_memory_bytes=self.peak_memory_bytes,
            out_of_memory=self.out_of_memory,
        )


class BenchmarkCancelled(Exception):
    """The agent asked the benchmark to stop (drain, task cancelled)."""


class MemoryLimitExceeded(Exception):
    """A batch needs more memory than `--memory-limit` allows (emulated out-of-memory)."""


# -- memory meters ----------------------------------------------------------------------------


class MemoryMeter(Protocol):
    def reset(self) -> None:
        """Start a new peak (called before each batch size)."""

    def track(self, fn: Callable[[], T]) -> T:
        """Run one step with its memory tracked (the first step of each batch size)."""

    def peak_bytes(self) -> int:
        """Peak since the last reset."""


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _storage_of(obj: object) -> tuple[int, int] | None:
    """(data pointer, bytes) of a plain CPU tensor's storage; None for anything else.

    Fake, functional and symbolic tensors (torch.export's machinery runs some) are skipped
    without looking at their sizes: comparing a symbolic size would add a guard and pin it.
    """
    if type(obj) not in _PLAIN_TENSOR_TYPES:
        return None
    try:
        if obj.device.type != "cpu":  # type: ignore[attr-defined]
            return None
        storage = obj.untyped_storage()  # type: ignore[attr-defined]
        key, size = storage.data_ptr(), storage.nbytes()
    except Exception:
        return None  # no real storage (meta, sparse, ...)
    if type(key) is not int or type(size) is not int:
        return None
    return key, size


def live_cpu_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage Python can see (parameters, buffers, batches, ...)."""
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        found = _storage_of(obj)
        if found is not None and found[0] not in seen:
            seen.add(found[0])
            total += found[1]
    return total


class _AllocationTracker(TorchDispatchMode):
    """Counts the storages that operators allocate, and frees them again when they die."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled; skipping would import torch._dynamo (~2 s)

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._finalizers: dict[int, weakref.finalize] = {}  # type: ignore[type-arg]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Outputs sharing an input's storage (views, in-place and out= ops) allocate nothing.
        inputs = {
            found[0]
            for t in tree_flatten((args, kwargs))[0]
            if (found := _storage_of(t)) is not None
        }
        for t in tree_flatten(out)[0]:
            found = _storage_of(t)
            if found is None:
                continue
            key, size = found
            if size == 0 or key in inputs or key in self._finalizers:
                continue
            self.live += size
            self.peak = max(self.peak, self.live)
            storage = t.untyped_storage()
            self._finalizers[key] = weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._finalizers.pop(key, None)


class CpuMemoryMeter:
    """Peak bytes of CPU tensors during a step: the tensors alive before it (model, optimizer
    state, batch) plus the peak of what its operators allocate -- what the CUDA allocator's
    peak counts on a GPU, so both devices report the same quantity."""

    def __init__(self) -> None:
        self._baseline = 0
        self._peak = 0

    def reset(self) -> None:
        self._baseline = 0
        self._peak = 0

    def track(self, fn: Callable[[], T]) -> T:
        baseline = live_cpu_tensor_bytes()
        tracker = _AllocationTracker()
        with tracker:
            result = fn()
        self._peak = max(self._peak, baseline + tracker.peak)
        return result

    def peak_bytes(self) -> int:
        return self._peak


class CudaMemoryMeter:
    """The CUDA caching allocator's peak of allocated bytes on one device."""

    def __init__(self, device: str) -> None:
        self._device = torch.device(device)

    def reset(self) -> None:
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)

    def track(self, fn: Callable[[], T]) -> T:
        return fn()  # the allocator keeps the peak of every step by itself

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._device))


def memory_meter_for(device: str) -> MemoryMeter:
    return CudaMemoryMeter(device) if device.startswith("cuda") else CpuMemoryMeter()


def release_memory(device: str) -> None:
    """Give memory back after an out-of-memory error so the agent can go on."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- out of memory ----------------------------------------------------------------------------

_OOM_MESSAGES = (
    "out of memory",
    "defaultcpuallocator: can't allocate",
    "can't allocate memory",
    "not enough memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception raised by a step means the batch does not fit in memory."""
    if isinstance(exc, MemoryError | MemoryLimitExceeded):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, any torch build
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(m in message for m in _OOM_MESSAGES)
    return False


# -- pure math --------------------------------------------------------------------------------


def fitting(points: Sequence[Point]) -> list[Point]:
    return [p for p in points if not p.out_of_memory]


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of y over x; None without two distinct x."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    mx = statistics.fmean(xs)
    my = statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    return my - slope * mx, slope


def estimate_peak_bytes(points: Sequence[Point], batch_size: int) -> float | None:
    """Peak memory at `batch_size` extrapolated from the batches that fit (None if unknown).

    Two or more points: a straight line through them (memory = fixed part + per-sample part);
    one point: proportional to the batch size (an upper bound for a larger batch).
    """
    fits = [p for p in fitting(points) if p.peak_memory_bytes > 0]
    if not fits:
        return None
    if len(fits) == 1:
        p = fits[0]
        return p.peak_memory_bytes * batch_size / p.batch_size
    line = linear_fit([p.batch_size for p in fits], [p.peak_memory_bytes for p in fits])
    if line is None:
        return float(max(p.peak_memory_bytes for p in fits))
    intercept, slope = line
    return intercept + max(slope, 0.0) * batch_size


def max_batch_size(points: Sequence[Point], capacity_bytes: int | None) -> int:
    """The largest batch that fits in memory.

    After an out-of-memory answer: the largest batch that was measured to fit. Without one:
    the batch at which the memory line through the measured points reaches `capacity_bytes`,
    never below the largest batch measured nor above MAX_EXTRAPOLATION times it; the largest
    batch measured when the capacity or the line is unknown.
    """
    fits = fitting(points)
    if not fits:
        return 0
    largest = max(p.batch_size for p in fits)
    if len(fits) < len(points) or not capacity_bytes:
        return largest
    line = linear_fit([p.batch_size for p in fits], [p.peak_memory_bytes for p in fits])
    if line is None:
        return largest
    intercept, slope = line
    if slope <= 0:
        return largest * MAX_EXTRAPOLATION
    estimate = math.floor((capacity_bytes - intercept) / slope)
    return int(min(max(estimate, largest), largest * MAX_EXTRAPOLATION))


def step_time_estimate(times: Sequence[float], quantile: float = 0.0) -> float:
    """A low quantile of step times (by default the fastest step): the device's own speed,
    least disturbed by whatever else the machine is running."""
    if not times:
        return 0.0
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(len(ordered) * quantile))]


def headline_samples_per_second(points: Sequence[Point]) -> float:
    """The figure the allocator weighs by: the throughput at the largest batch that fits
    (the most work per step, so the least disturbed by per-step overheads and noise)."""
    fits = fitting(points)
    if not fits:
        return 0.0
    return max(fits, key=lambda p: p.batch_size).samples_per_second


def bandwidth_bytes_per_second(
    bytes_moved: int, seconds: Sequence[float], rtt_seconds: float
) -> float:
    """Bandwidth from the durations of transfers of `bytes_moved` bytes each: bytes over the
    median duration less one round trip (a transfer faster than the RTT counts as one RTT)."""
    if not seconds or bytes_moved <= 0:
        return 0.0
    median = statistics.median(seconds)
    transfer = max(median - rtt_seconds, median / 2, 1e-9)
    return bytes_moved / transfer


def memory_capacity(device: common_pb2.Device, memory_limit_bytes: int | None) -> int:
    """Memory one batch may use: the emulated limit, else a share of the device's memory."""
    if memory_limit_bytes:
        return memory_limit_bytes
    return int(device.total_memory_bytes * MEMORY_HEADROOM)


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
