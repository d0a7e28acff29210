"""Unit tests of the node agent's pure logic: backoff, slowdown, device discovery, benchmark
math, the blob cache, identity and configuration. Everything here runs on a CPU-only machine,
including the logic shared with CUDA (fed with data, not by mocking torch)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from epochmesh.money import format_credits
from epochmesh.v1 import agent_pb2, common_pb2
from node_agent.core.config import parse_args, parse_price, parse_size
from node_agent.core.devices import (
    DeviceError,
    assemble,
    cpu_device,
    cpu_model_name,
    cuda_device,
    discover_cuda,
    discover_devices,
    format_driver,
    select_device,
)
from node_agent.core.identity import load_node_id, save_node_id
from node_agent.core.measure import (
    MAX_EXTRAPOLATION,
    CpuMemoryMeter,
    MemoryLimitExceeded,
    Point,
    bandwidth_bytes_per_second,
    estimate_peak_bytes,
    headline_samples_per_second,
    is_out_of_memory,
    linear_fit,
    live_cpu_tensor_bytes,
    max_batch_size,
    memory_capacity,
    step_time_estimate,
)
from node_agent.core.slowdown import SlowdownController, padding_seconds, parse_factor
from node_agent.core.watch_file import WatchedValue
from node_agent.link.cache import BlobCache, CacheError
from node_agent.link.connection import Backoff, is_transient
from node_agent.training.benchmark import (
    QUICK_PLAN,
    BenchmarkCancelled,
    BenchmarkPlan,
    benchmark_model,
    build_result,
    run_compute_benchmark,
)
from node_agent.training.reference_model import reference_step_factory

pytestmark = pytest.mark.timeout(60)


# -- backoff ------------------------------------------------------------------------------------


def test_backoff_full_jitter_grows_to_cap_and_resets() -> None:
    b = Backoff(base=0.2, cap=5.0, rng=random.Random(1))
    ceilings = []
    for _ in range(10):
        ceiling = b.ceiling()
        delay = b.next_delay()
        assert 0.0 <= delay <= ceiling
        ceilings.append(ceiling)
    assert ceilings[:6] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0])
    assert max(ceilings) == 5.0
    b.reset()
    assert b.attempts == 0 and b.ceiling() == pytest.approx(0.2)


def test_backoff_delays_are_spread_not_fixed() -> None:
    b = Backoff(base=1.0, cap=1.0, rng=random.Random(7))
    delays = [b.next_delay() for _ in range(200)]
    assert min(delays) < 0.1 and max(delays) > 0.9  # full jitter covers [0, cap]
    assert 0.4 < sum(delays) / len(delays) < 0.6


def test_backoff_never_overflows_after_many_attempts() -> None:
    b = Backoff(base=0.2, cap=5.0)
    for _ in range(5000):
        assert b.next_delay() <= 5.0


def test_backoff_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        Backoff(base=0.0)
    with pytest.raises(ValueError):
        Backoff(base=2.0, cap=1.0)


def test_network_errors_are_transient() -> None:
    assert is_transient(ConnectionError("reset"))
    assert is_transient(TimeoutError())
    assert not is_transient(ValueError("bad"))


# -- slowdown -----------------------------------------------------------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def work(self, seconds: float) -> None:
        self.now += seconds


def test_slowdown_pads_each_step_by_factor_minus_one() -> None:
    t = FakeTime()
    s = SlowdownController(4.0, sleep=t.sleep, clock=t.clock)
    start = t.now
    result = s.timed_step(lambda: (t.work(0.5), "done")[1])
    assert result == "done"
    assert t.sleeps == [pytest.approx(1.5)]
    assert t.now - start == pytest.approx(2.0)
    assert s.steps == 1 and s.compute_seconds == pytest.approx(0.5)
    assert s.padding_seconds == pytest.approx(1.5)


def test_slowdown_absorbs_the_host_time_between_steps() -> None:
    t = FakeTime()
    s = SlowdownController(4.0, sleep=t.sleep, clock=t.clock)
    start = t.now
    for _ in range(5):
        t.work(0.2)  # the loop's own work between steps (batch slicing)
        s.timed_step(lambda: t.work(0.5), overlap_s=0.2)
    # The device's 4 x 0.5 s per step hides the 0.2 s of host work: 2 s a step, not 2.2 s.
    assert t.now - start == pytest.approx(5 * 2.0)
    assert t.sleeps == [pytest.approx(1.3)] * 5
    # Host work longer than the padding is not hidden: the step takes that long, no sleep.
    t.work(2.0)
    s.timed_step(lambda: t.work(0.5), overlap_s=2.0)
    assert t.sleeps[-1] == pytest.approx(1.3) and len(t.sleeps) == 5


def test_slowdown_pays_back_late_wakeups() -> None:
    t = FakeTime()
    late = 0.05

    def oversleep(seconds: float) -> None:
        t.sleep(seconds + late)  # a loaded machine wakes the sleeper late

    s = SlowdownController(4.0, sleep=oversleep, clock=t.clock)
    start = t.now
    for _ in range(20):
        s.timed_step(lambda: t.work(0.1))
    # 20 steps of 0.1 s at F=4: 8 s, plus at most one step's lateness (not 20 of them)
    assert 8.0 <= t.now - start <= 8.0 + late + 1e-9


def test_slowdown_does_not_pay_back_a_long_pause() -> None:
    t = FakeTime()
    calls = [5.0]

    def sleep(seconds: float) -> None:
        t.sleep(seconds + (calls.pop() if calls else 0.0))

    s = SlowdownController(2.0, sleep=sleep, clock=t.clock)
    s.timed_step(lambda: t.work(0.1))  # oversleeps by 5 s (machine suspended, say)
    s.timed_step(lambda: t.work(0.1))
    s.timed_step(lambda: t.work(0.1))
    # the debt is capped at one step's padding: the third step is padded normally again
    assert t.sleeps[-1] == pytest.approx(0.1)


def test_slowdown_of_one_never_sleeps() -> None:
    t = FakeTime()
    s = SlowdownController(1.0, sleep=t.sleep, clock=t.clock)
    for _ in range(3):
        s.timed_step(lambda: t.work(0.1))
    assert t.sleeps == []


def test_slowdown_step_exception_propagates_unpadded() -> None:
    t = FakeTime()
    s = SlowdownController(3.0, sleep=t.sleep, clock=t.clock)

    def boom() -> None:
        t.work(1.0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        s.timed_step(boom)
    assert t.sleeps == []


def test_slowdown_factor_follows_the_watch_file(tmp_path: Path) -> None:
    t = FakeTime()
    f = tmp_path / "slowdown"
    s = SlowdownController(2.0, f, sleep=t.sleep, clock=t.clock)
    assert f.read_text().strip() == "2"  # the file shows the factor in force
    f.write_text("5\n")
    assert s.factor == 5.0
    s.timed_step(lambda: t.work(1.0))
    assert t.sleeps[-1] == pytest.approx(4.0)
    f.write_text("not a number")
    assert s.factor == 5.0  # invalid content is ignored
    f.write_text("0.5")
    assert s.factor == 5.0  # below 1 is refused
    f.unlink()
    assert s.factor == 5.0  # a removed file keeps the factor
    s.set_factor(1.5)
    assert s.factor == 1.5 and f.read_text().strip() == "1.5"


def test_slowdown_reload_rereads_even_with_identical_stat(tmp_path: Path) -> None:
    f = tmp_path / "slowdown"
    s = SlowdownController(1.0, f)
    st = os.stat(f)
    f.write_text("3")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    s.reload()
    assert s.factor == 3.0


def test_slowdown_real_time_ratio() -> None:
    s = SlowdownController(3.0)

    def busy() -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

    t0 = time.perf_counter()
    s.timed_step(busy)
    elapsed = time.perf_counter() - t0
    assert 0.055 <= elapsed < 0.2


def test_parse_factor() -> None:
    assert parse_factor(" 4 \n") == 4.0
    assert padding_seconds(4.0, 0.25) == pytest.approx(0.75)
    assert padding_seconds(1.0, 5.0) == 0.0
    for bad in ("0.9", "inf", "nan", "x", ""):
        with pytest.raises(ValueError):
            parse_factor(bad)


# -- devices ------------------------------------------------------------------------------------

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R)   Platinum 8480+
flags\t\t: fpu vme

processor\t: 1
model name\t: Intel(R) Xeon(R)   Platinum 8480+
"""

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
CPU implementer\t: 0x41

Hardware\t: BCM2835
"""


@dataclass(frozen=True)
class FakeCudaProps:
    """What torch.cuda.get_device_properties returns, as data."""

    name: str
    total_memory: int
    major: int
    minor: int


H100 = FakeCudaProps("NVIDIA H100 80GB HBM3", 85_045_231_616, 9, 0)
A10 = FakeCudaProps("NVIDIA A10", 23_609_475_072, 8, 6)


def test_cpu_model_name_parsing() -> None:
    assert cpu_model_name(X86_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model_name(ARM_CPUINFO) == "BCM2835"
    assert cpu_model_name(None, fallback="x86_64") == "x86_64"
    assert cpu_model_name("processor : 0\n") == "cpu"


def test_cpu_device_proto() -> None:
    d = cpu_device("Some CPU", 8, 16 << 30)
    assert (d.kind, d.index, d.name, d.cores, d.total_memory_bytes) == (
        "cpu",
        0,
        "Some CPU",
        8,
        16 << 30,
    )
    assert d.compute_capability == "" and d.driver == ""


def test_cuda_device_proto_from_properties() -> None:
    driver = format_driver("550.54.15", "12.4")
    assert driver == "driver 550.54.15, CUDA 12.4"
    d = cuda_device(1, H100, driver)
    assert d.kind == "cuda" and d.index == 1
    assert d.name == "NVIDIA H100 80GB HBM3"
    assert d.total_memory_bytes == 85_045_231_616
    assert d.compute_capability == "9.0"
    assert d.driver == driver
    assert format_driver(None, "12.4") == "CUDA 12.4"
    assert format_driver(None, None) == ""


def test_select_device() -> None:
    assert select_device("auto", 0) == "cpu"
    assert select_device("auto", 2) == "cuda:0"
    assert select_device("cpu", 2) == "cpu"
    assert select_device("cuda:1", 2) == "cuda:1"
    with pytest.raises(DeviceError, match="CUDA is not available"):
        select_device("cuda:0", 0)
    with pytest.raises(DeviceError, match="only 2 GPU"):
        select_device("cuda:2", 2)
    with pytest.raises(DeviceError):
        select_device("tpu", 1)


def test_assemble_registers_every_gpu_and_trains_on_the_selected_one() -> None:
    cpu = cpu_device("cpu", 16, 64 << 30)
    gpus = [cuda_device(0, H100, "d"), cuda_device(1, A10, "d")]
    found = assemble("cuda:1", cpu, gpus)
    assert [d.kind for d in found.devices] == ["cuda", "cuda"]
    assert found.selected.name == "NVIDIA A10" and found.torch_device == "cuda:1"
    assert assemble("auto", cpu, gpus).torch_device == "cuda:0"
    on_cpu = assemble("cpu", cpu, gpus)
    assert list(on_cpu.devices) == [cpu] and on_cpu.torch_device == "cpu"
    no_gpu = assemble("auto", cpu, [])
    assert list(no_gpu.devices) == [cpu] and no_gpu.selected == cpu


def test_discover_devices_on_this_machine() -> None:
    import torch

    found = discover_devices("auto")
    assert found.devices and found.selected in list(found.devices)
    if not torch.cuda.is_available():
        assert found.torch_device == "cpu"
        assert discover_cuda(torch) == []
        cpu = found.selected
        assert cpu.kind == "cpu" and cpu.cores >= 1 and cpu.total_memory_bytes > 0 and cpu.name
        with pytest.raises(DeviceError):
            discover_devices("cuda:0")
    assert discover_devices("cpu").torch_device == "cpu"


# -- benchmark math -----------------------------------------------------------------------------


def pts(*rows: tuple[int, float, int, bool]) -> list[Point]:
    return [Point(b, s, m, oom) for b, s, m, oom in rows]


def test_linear_fit_and_estimate() -> None:
    assert linear_fit([1, 2, 3], [12, 14, 16]) == pytest.approx((10.0, 2.0))
    assert linear_fit([1], [1]) is None
    assert linear_fit([2, 2], [1, 5]) is None
    points = pts((16, 1.0, 1_000 + 16 * 100, False), (64, 1.0, 1_000 + 64 * 100, False))
    assert estimate_peak_bytes(points, 256) == pytest.approx(1_000 + 256 * 100)
    assert estimate_peak_bytes(pts((16, 1.0, 1600, False)), 64) == pytest.approx(6400)
    assert estimate_peak_bytes([], 64) is None


def test_max_batch_after_oom_is_the_largest_that_fit() -> None:
    points = pts((16, 100.0, 10, False), (64, 300.0, 40, False), (256, 0.0, 0, True))
    assert max_batch_size(points, capacity_bytes=10**12) == 64
    assert headline_samples_per_second(points) == 300.0
    assert max_batch_size(pts((16, 0.0, 0, True)), 1000) == 0
    assert headline_samples_per_second(pts((16, 0.0, 0, True))) == 0.0


def test_max_batch_extrapolates_to_capacity_within_bounds() -> None:
    # memory = 1000 + 100 * batch; capacity 100_000 -> (100_000 - 1000) / 100 = 990
    points = pts((16, 1.0, 2_600, False), (64, 1.0, 7_400, False), (256, 1.0, 26_600, False))
    assert max_batch_size(points, capacity_bytes=100_000) == 990
    # never below the largest measured, never above MAX_EXTRAPOLATION times it
    assert max_batch_size(points, capacity_bytes=10_000) == 256
    assert max_batch_size(points, capacity_bytes=10**15) == 256 * MAX_EXTRAPOLATION
    assert max_batch_size(points, capacity_bytes=None) == 256


def test_memory_capacity() -> None:
    gpu = cuda_device(0, H100, "")
    assert memory_capacity(gpu, None) == int(H100.total_memory * 0.9)
    assert memory_capacity(gpu, 1 << 30) == 1 << 30


def test_bandwidth_math() -> None:
    # 1 MiB in a median of 11 ms with 1 ms RTT -> 1 MiB / 10 ms
    assert bandwidth_bytes_per_second(1 << 20, [0.012, 0.011, 0.010], 0.001) == pytest.approx(
        (1 << 20) / 0.010
    )
    # a transfer faster than the RTT estimate is not divided by ~0
    assert bandwidth_bytes_per_second(1000, [0.001], 0.002) == pytest.approx(1000 / 0.0005)
    assert bandwidth_bytes_per_second(1000, [], 0.001) == 0.0


def test_out_of_memory_classification() -> None:
    class OutOfMemoryError(RuntimeError):  # the name torch.cuda.OutOfMemoryError carries
        pass

    assert is_out_of_memory(OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate")
    )
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(MemoryLimitExceeded("x"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_cuda_oom_error_class_is_recognised() -> None:
    import torch

    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))


class FakeMeter:
    """A memory meter fed with data: peak = per_sample * batch of the last step."""

    def __init__(self, per_sample: int, fixed: int = 0) -> None:
        self.per_sample = per_sample
        self.fixed = fixed
        self.batch = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = 0

    def track(self, fn):
        result = fn()
        self.peak = max(self.peak, self.fixed + self.per_sample * self.batch)
        return result

    def peak_bytes(self) -> int:
        return self.peak


def fake_factory(t: FakeTime, meter: FakeMeter, seconds_per_sample: float, oom_at: int = 0):
    def make_step(batch: int):
        if oom_at and batch >= oom_at:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")

        def step() -> None:
            meter.batch = batch
            t.work(0.001 + seconds_per_sample * batch)

        return step

    return make_step


PLAN = BenchmarkPlan(batch_sizes=(16, 64, 256, 1024), warmup_steps=1, min_steps=4, min_seconds=0.0)


def run_fake(
    slowdown: float = 1.0, oom_at: int = 0, limit: int | None = None, per_sample: int = 1000
):
    t = FakeTime()
    meter = FakeMeter(per_sample)
    s = SlowdownController(slowdown, sleep=t.sleep, clock=t.clock)
    return run_compute_benchmark(
        fake_factory(t, meter, 1e-4, oom_at),
        PLAN,
        s,
        meter,
        memory_limit_bytes=limit,
        clock=t.clock,
    )


def test_sweep_measures_every_batch_size() -> None:
    points = run_fake()
    assert [p.batch_size for p in points] == [16, 64, 256, 1024]
    assert not any(p.out_of_memory for p in points)
    for p in points:
        assert p.steps == 4
        assert p.samples_per_second == pytest.approx(p.batch_size / (0.001 + 1e-4 * p.batch_size))
        assert p.peak_memory_bytes == 1000 * p.batch_size


def test_step_time_estimate_ignores_steps_slowed_by_other_work() -> None:
    assert step_time_estimate([0.5, 0.1, 0.3]) == 0.1
    times = [0.020] * 12 + [0.010] * 2 + [0.5]  # a loaded machine slows most steps
    assert step_time_estimate(times) == 0.010
    assert step_time_estimate(times, quantile=0.5) == 0.020
    assert step_time_estimate([]) == 0.0


def test_sweep_slowdown_divides_throughput_exactly() -> None:
    fast, slow = run_fake(1.0), run_fake(4.0)
    for f, s in zip(fast, slow, strict=True):
        assert s.samples_per_second == pytest.approx(f.samples_per_second / 4)


def test_sweep_stops_at_a_real_oom_error() -> None:
    points = run_fake(oom_at=256)
    assert [(p.batch_size, p.out_of_memory) for p in points] == [
        (16, False),
        (64, False),
        (256, True),
        (1024, True),
    ]
    assert max_batch_size(points, 10**12) == 64


def test_memory_limit_by_estimate_and_by_measurement() -> None:
    # limit 100 kB at 1 kB/sample: 64 fits, 256 is estimated at 256 kB -> OOM without running
    points = run_fake(limit=100_000)
    assert [(p.batch_size, p.out_of_memory) for p in points] == [
        (16, False),
        (64, False),
        (256, True),
        (1024, True),
    ]
    # limit 50 kB: 16 fits (16 kB); 64 is estimated (proportional) at 64 kB -> OOM
    points = run_fake(limit=50_000)
    assert [p.out_of_memory for p in points] == [False, True, True, True]
    # limit below the smallest batch: measured after the warm-up step
    points = run_fake(limit=1_000)
    assert all(p.out_of_memory for p in points)
    assert max_batch_size(points, 1_000) == 0


def test_sweep_can_be_cancelled() -> None:
    t = FakeTime()
    meter = FakeMeter(1)
    s = SlowdownController(1.0, sleep=t.sleep, clock=t.clock)
    calls = iter(range(100))
    with pytest.raises(BenchmarkCancelled):
        run_compute_benchmark(
            fake_factory(t, meter, 1e-4),
            PLAN,
            s,
            meter,
            should_stop=lambda: next(calls) >= 3,
            clock=t.clock,
        )


def test_sweep_propagates_errors_that_are_not_oom() -> None:
    def make_step(batch: int):
        def step() -> None:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

        return step

    t = FakeTime()
    with pytest.raises(RuntimeError, match="shapes"):
        run_compute_benchmark(make_step, PLAN, SlowdownController(1.0), FakeMeter(1), clock=t.clock)


def test_build_result_fills_every_field() -> None:
    points = pts((16, 100.0, 10, False), (64, 300.0, 40, False), (256, 0.0, 0, True))
    device = cpu_device("cpu", 2, 1 << 30)
    r = build_result(points, device, slowdown=2.0, rtt_ms=0.5, bandwidth=1e9, job_id="j-1")
    assert r.job_id == "j-1" and r.device == device
    assert [p.batch_size for p in r.points] == [16, 64, 256] and r.points[2].out_of_memory
    assert r.max_batch_size == 64 and r.samples_per_second == 300.0
    assert (r.rtt_ms, r.bandwidth_bytes_per_second, r.slowdown) == (0.5, 1e9, 2.0)
    assert r.measured_at_ms > 0


def test_reference_model_benchmark_on_cpu() -> None:
    points = benchmark_model(
        lambda: reference_step_factory("cpu"), "cpu", QUICK_PLAN, SlowdownController(1.0)
    )
    assert [p.batch_size for p in points] == list(QUICK_PLAN.batch_sizes)
    for p in points:
        assert not p.out_of_memory and p.samples_per_second > 0 and p.peak_memory_bytes >= 0


def test_reference_model_memory_limit_on_cpu() -> None:
    # The model alone (~0.8 MB of weights and momentum) exceeds a 64 kB device.
    points = benchmark_model(
        lambda: reference_step_factory("cpu"),
        "cpu",
        QUICK_PLAN,
        SlowdownController(1.0),
        memory_limit_bytes=64 << 10,
    )
    assert all(p.out_of_memory for p in points)


def test_cpu_memory_meter_counts_tensor_bytes() -> None:
    import torch

    held = torch.zeros(1 << 20, dtype=torch.uint8)  # alive before the step: counted

    def step() -> torch.Tensor:
        a = torch.ones(4 << 20, dtype=torch.uint8)  # 4 MiB temporary, freed inside the step
        a.add_(1)  # in place: allocates nothing
        del a
        b = torch.ones(2 << 20, dtype=torch.uint8)  # 2 MiB, returned
        return b.view(-1, 2)  # a view: allocates nothing

    meter = CpuMemoryMeter()
    meter.reset()
    before = live_cpu_tensor_bytes()
    out = meter.track(step)
    peak = meter.peak_bytes()
    assert before >= held.numel()
    # the peak is the live bytes before plus the 4 MiB temporary (the 2 MiB come after it)
    assert peak == pytest.approx(before + (4 << 20), abs=64 << 10)
    del out
    meter.reset()
    assert meter.peak_bytes() == 0


def test_cpu_memory_meter_grows_with_batch_size() -> None:
    points = benchmark_model(
        lambda: reference_step_factory("cpu"),
        "cpu",
        BenchmarkPlan(batch_sizes=(64, 256, 1024), warmup_steps=1, min_steps=1, min_seconds=0.0),
        SlowdownController(1.0),
    )
    mem = [p.peak_memory_bytes for p in points]
    assert mem[0] < mem[1] < mem[2]
    # activations grow linearly: the line through the points is nearly exact
    intercept, slope = linear_fit([64, 256, 1024], mem)
    assert slope > 0 and abs(intercept + slope * 256 - mem[1]) < 0.05 * mem[1]


# -- cache --------------------------------------------------------------------------------------


class Server:
    """Serves blobs to the cache the way FetchBlob does (1 MiB chunks, from an offset)."""

    def __init__(self, blobs: dict[str, bytes], chunk: int = 1 << 20) -> None:
        self.blobs = blobs
        self.chunk = chunk
        self.calls: list[tuple[str, int]] = []
        self.fail_after_chunks: int | None = None
        self.corrupt = False

    async def fetch(self, sha: str, offset: int) -> AsyncIterator[agent_pb2.FetchBlobResponse]:
        self.calls.append((sha, offset))
        data = self.blobs[sha]
        if self.corrupt:
            data = b"\xff" + data[1:]
        sent = 0
        for start in range(offset, len(data), self.chunk):
            if self.fail_after_chunks is not None and sent >= self.fail_after_chunks:
                raise ConnectionError("connection reset")
            await asyncio.sleep(0)
            yield agent_pb2.FetchBlobResponse(
                total_size=len(data),
                chunk=common_pb2.DataChunk(offset=start, data=data[start : start + self.chunk]),
            )
            sent += 1


def blob(n: int, seed: int = 0) -> tuple[common_pb2.BlobRef, bytes]:
    data = random.Random(seed).randbytes(n)
    return common_pb2.BlobRef(sha256=hashlib.sha256(data).hexdigest(), size=n), data


async def test_cache_downloads_once_and_reuses(tmp_path: Path) -> None:
    ref, data = blob(3 * (1 << 20) + 5)
    server = Server({ref.sha256: data})
    cache = BlobCache(tmp_path / "cache")
    p1 = await cache.get(ref, server.fetch)
    p2 = await cache.get(ref, server.fetch)
    assert p1 == p2 == tmp_path / "cache" / ref.sha256
    assert p1.read_bytes() == data
    assert len(server.calls) == 1 and cache.downloads == 1 and cache.hits == 1
    assert not (tmp_path / "cache" / f"{ref.sha256}.part").exists()
    # a new process (new cache object) verifies and reuses the entry
    again = BlobCache(tmp_path / "cache")
    assert await again.get(ref, server.fetch) == p1 and len(server.calls) == 1


async def test_cache_detects_corruption_even_with_mtime_restored(tmp_path: Path) -> None:
    ref, data = blob(100_000, seed=3)
    server = Server({ref.sha256: data})
    cache = BlobCache(tmp_path)
    path = await cache.get(ref, server.fetch)
    st = os.stat(path)
    with open(path, "r+b") as f:  # same size, one byte flipped, mtime put back
        f.seek(500)
        f.write(bytes([data[500] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    path2 = await cache.get(ref, server.fetch)
    assert path2.read_bytes() == data
    assert cache.corrupt_entries == 1 and len(server.calls) == 2


async def test_cache_resumes_an_interrupted_download(tmp_path: Path) -> None:
    ref, data = blob(5 * (1 << 20), seed=4)
    server = Server({ref.sha256: data})
    server.fail_after_chunks = 2
    cache = BlobCache(tmp_path)
    with pytest.raises(ConnectionError):
        await cache.get(ref, server.fetch)
    part = tmp_path / f"{ref.sha256}.part"
    assert part.stat().st_size == 2 << 20
    server.fail_after_chunks = None
    path = await cache.get(ref, server.fetch)
    assert path.read_bytes() == data
    assert server.calls == [(ref.sha256, 0), (ref.sha256, 2 << 20)]
    assert cache.bytes_fetched == len(data)


async def test_cache_rejects_bytes_that_do_not_match(tmp_path: Path) -> None:
    ref, data = blob(10_000, seed=5)
    server = Server({ref.sha256: data})
    server.corrupt = True
    cache = BlobCache(tmp_path)
    with pytest.raises(CacheError, match="hash"):
        await cache.get(ref, server.fetch)
    assert list(tmp_path.iterdir()) == []
    server.corrupt = False
    assert (await cache.get(ref, server.fetch)).read_bytes() == data


async def test_cache_rejects_bad_references(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path)
    server = Server({})
    with pytest.raises(CacheError, match="64 hex"):
        await cache.get(common_pb2.BlobRef(sha256="../../etc/passwd"), server.fetch)
    ref, data = blob(100)
    server.blobs[ref.sha256] = data
    wrong_size = common_pb2.BlobRef(sha256=ref.sha256, size=99)
    with pytest.raises(CacheError, match="serves 100 bytes"):
        await cache.get(wrong_size, server.fetch)


# -- identity and configuration -----------------------------------------------------------------


def test_identity_roundtrip(tmp_path: Path) -> None:
    assert load_node_id(tmp_path) == ""
    save_node_id(tmp_path, "n-0123456789")
    assert load_node_id(tmp_path) == "n-0123456789"
    (tmp_path / "node.json").write_text("{not json")
    assert load_node_id(tmp_path) == ""


def test_parse_args_and_sizes(tmp_path: Path) -> None:
    config = parse_args(["--coordinator", "127.0.0.1:1", "--data-dir", str(tmp_path)])
    assert config.device == "auto" and config.slowdown == 1.0 and config.benchmark == "full"
    assert config.cache_dir == tmp_path.resolve() / "cache"
    config = parse_args(
        [
            "--coordinator=h:2",
            f"--data-dir={tmp_path}",
            "--device=cuda:1",
            "--slowdown=4",
            "--memory-limit=512M",
            "--label=zone=eu",
            "--log-level=debug",
        ]
    )
    assert (config.device, config.slowdown, config.memory_limit_bytes) == ("cuda:1", 4.0, 512 << 20)
    assert config.labels == {"zone": "eu"} and config.log_level == "DEBUG"
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("1024") == 1024
    with pytest.raises(ValueError):
        parse_size("lots")
    for bad in (["--slowdown", "0.5"], ["--device", "gpu"], ["--memory-limit", "x"]):
        with pytest.raises(SystemExit):
            parse_args(["--coordinator", "h:1", "--data-dir", str(tmp_path), *bad])


def test_price_is_parsed_exactly_into_micro_credits(tmp_path: Path) -> None:
    base = ["--coordinator", "h:1", "--data-dir", str(tmp_path)]
    assert parse_args(base).price_micro_per_hour == 0  # default: donated
    for text, micro in (("2.5", 2_500_000), ("0", 0), ("0.000001", 1), ("12", 12_000_000)):
        assert parse_args([*base, "--price", text]).price_micro_per_hour == micro
    assert parse_args([*base, f"--price= {0.1}"]).price_micro_per_hour == 100_000
    assert parse_args(base).price_file == tmp_path.resolve() / "price"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("-1", "must not be negative"),
        ("-0.5", "must not be negative"),
        ("nan", "finite"),
        ("inf", "finite"),
        ("abc", "must be a number of credits"),
        ("", "must be a number of credits"),
        ("0.0000001", "more than 6 decimals"),
    ],
)
def test_a_bad_price_refuses_to_start_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, why: str
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--coordinator", "h:1", "--data-dir", str(tmp_path), f"--price={text}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --price: the price" in err and why in err, err
    with pytest.raises(ValueError, match=why):
        parse_price(text)


def test_price_follows_its_watch_file_and_keeps_the_old_one_on_bad_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "price"
    price = WatchedValue(2_500_000, f, parse=parse_price, show=format_credits, what="price")
    assert f.read_text().strip() == "2.5"  # the file shows the price in force
    f.write_text("4\n")
    assert price.get() == 4_000_000
    for bad in ("-1", "nan", "", "abc"):
        f.write_text(bad)
        assert not price.reload() and price.get() == 4_000_000
        assert "keeping price 4" in caplog.text
    st = os.stat(f)
    f.write_text("1.5")  # the same size and mtime as "abc": only reload() sees it
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert price.get() == 4_000_000
    assert price.reload() and price.get() == 1_500_000
    f.write_text("0")
    assert price.get() == 0
    f.unlink()
    assert price.get() == 0  # a removed file keeps the price
    price.set(1_250_000)
    assert price.get() == 1_250_000 and f.read_text().strip() == "1.25"


def test_cpu_time_slowdown_does_not_pad_time_spent_waiting() -> None:
    """With measure_cpu_time, a step pays F times the CPU it used: time it spent waiting for a
    core (wall time beyond its CPU time) is not multiplied."""
    from node_agent.core.slowdown import SlowdownController

    wall = [0.0]
    cpu = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        wall[0] += seconds

    ctl = SlowdownController(4.0, sleep=sleep, clock=lambda: wall[0])
    ctl.measure_cpu_time(lambda: cpu[0])

    def waited_for_a_core() -> None:  # 0.01 s of CPU spread over 0.05 s of wall time
        cpu[0] += 0.01
        wall[0] += 0.05

    ctl.timed_step(waited_for_a_core)
    assert ctl.last_compute_seconds == pytest.approx(0.01)
    assert ctl.last_device_seconds == pytest.approx(0.04)
    assert sum(slept) == 0.0  # 4 x 0.01 s of CPU is less than the 0.05 s already spent

    def had_a_core() -> None:
        cpu[0] += 0.05
        wall[0] += 0.05

    ctl.timed_step(had_a_core)
    assert ctl.last_device_seconds == pytest.approx(0.2)
    assert sum(slept) == pytest.approx(0.15)
