"""Measurements of a training step: its memory, out-of-memory answers, and the maths on them.

The compute benchmark (node_agent.training.benchmark) and the confined program host and child
(node_agent.sandbox) measure with these; the coordinator link (node_agent.link.connection)
estimates bandwidth with them. Nothing here trains or talks to anything.

Peak memory:
- CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`, reset per batch size).
- CPU: the same quantity, counted: the bytes of the CPU tensors alive before the step (model,
  optimizer state, batch; found through the garbage collector) plus the peak of the storages
  its operators allocate (a TorchDispatchMode that adds each new storage and subtracts it when
  it dies). Resident memory (RSS) was the alternative, but in a long-lived process freed
  memory is reused without growing it, so its figure depends on what ran before; tensor bytes
  do not, which keeps --memory-limit (emulated small devices) deterministic. The count leaves
  out allocator overhead and memory outside tensors (e.g. oneDNN scratch space).

`is_out_of_memory` says whether an exception a step raised means the batch does not fit
(`torch.cuda.OutOfMemoryError`, `MemoryError`, the allocators' RuntimeErrors, and
`MemoryLimitExceeded` for an emulated `--memory-limit`). The pure maths (`linear_fit`,
`estimate_peak_bytes`, `max_batch_size`, `headline_samples_per_second`, ...) turn the measured
`Point`s into the figures a BenchmarkResult carries.
"""

from __future__ import annotations

import gc
import math
import statistics
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from epochmesh.v1 import common_pb2

T = TypeVar("T")

# Fraction of a device's total memory a batch may plan to use when extrapolating the max batch.
MEMORY_HEADROOM = 0.9
# The max batch is never extrapolated beyond this multiple of the largest batch measured.
MAX_EXTRAPOLATION = 16


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


class _AllocationTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the storages that operators allocate, and frees them again when they die."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled; skipping would import torch._dynamo (~2 s)

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._finalizers: dict[int, weakref.finalize[..., Any]] = {}

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
