"""Emulated slow devices: `--slowdown F` makes every training step take F times its compute time.

A step that computes for t seconds is followed by a sleep of (F - 1) * t, so a node with F = 4
really delivers a quarter of the samples per second, whatever the machine's load, and the
benchmark (which goes through the same controller) measures exactly that slowed speed. In a
loop of steps (local SGD's inner steps) the host's own work between two steps (slicing the next
batch, the loop) is taken off the sleep: an emulated device that is F times slower than a core
hides it behind its compute, as an accelerator's asynchronous execution hides the host's work.

The factor can change while the agent runs (the fault-tolerance tests make stragglers that way):
write a number to the watch file (DATA_DIR/slowdown, a node_agent.core.watch_file.WatchedValue); the
controller notices the change through a cheap stat() before every step. SIGUSR1 makes the agent
call `reload()` explicitly. The agent writes its initial factor to the file at start, so the
file always shows the factor in force.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from node_agent.core.watch_file import WatchedValue

T = TypeVar("T")


def parse_factor(text: str) -> float:
    """Parse a slowdown factor: a finite number >= 1. Raises ValueError with a clear message."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"slowdown factor must be a number, got {text.strip()!r}") from None
    if not math.isfinite(value) or value < 1.0:
        raise ValueError(f"slowdown factor must be a finite number >= 1, got {value}")
    return value


def padding_seconds(factor: float, compute_seconds: float) -> float:
    """How long to sleep after a step of `compute_seconds` so that it takes `factor` times as long."""
    return max(0.0, (factor - 1.0) * max(0.0, compute_seconds))


class SlowdownController:
    """Stretches steps by a factor that may change at run time. Thread-safe."""

    def __init__(
        self,
        factor: float = 1.0,
        watch_file: Path | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._factor = WatchedValue(
            parse_factor(str(factor)),
            watch_file,
            parse=parse_factor,
            show=lambda value: f"{value:g}",
            what="slowdown factor",
        )
        self._sleep = sleep
        self._clock = clock
        self._compute_clock: Callable[[], float] | None = None
        self._lock = threading.Lock()
        self._overslept = 0.0
        self.last_compute_seconds = 0.0
        # What the last step took on the emulated device: F x its compute time. With
        # measure_cpu_time that leaves out time spent waiting for a shared core (an artifact of
        # several emulated nodes on one CPU, not a property of the device).
        self.last_device_seconds = 0.0
        self.steps = 0
        self.compute_seconds = 0.0
        self.padding_seconds = 0.0
        # Wall time beyond F x compute that no padding absorbed: late wake-ups past the one
        # step's padding that is paid back (a long pause is not paid back on purpose).
        self.unpaid_seconds = 0.0

    @property
    def watch_file(self) -> Path | None:
        return self._factor.path

    @property
    def factor(self) -> float:
        """The factor in force, after picking up any change of the watch file."""
        return self._factor.get()

    def set_factor(self, factor: float) -> None:
        """Change the factor (and the watch file, so that both agree)."""
        self._factor.set(parse_factor(str(factor)))

    def measure_cpu_time(self, cpu_clock: Callable[[], float] = time.process_time) -> None:
        """Count a training step's compute as the CPU time the process spent in it (capped by
        its wall time) rather than its wall time. On a CPU device shared by several emulated
        nodes, wall time also counts the time the step waited for a core while other nodes
        computed; padding that wait by F would make a slowed node slower than F times its
        compute. `last_device_seconds` is then F times that CPU time. (CUDA steps keep wall
        time: their compute is on the GPU.)"""
        self._compute_clock = cpu_clock

    def reload(self) -> None:
        """Re-read the watch file even if its stat did not change (SIGUSR1)."""
        self._factor.reload()

    def timed_step(
        self,
        fn: Callable[[], T],
        *,
        pay_back: bool = True,
        reference_seconds: float | None = None,
        overlap_s: float = 0.0,
    ) -> T:
        """Run `fn`, then sleep so that it takes F times its compute time (wall time, or the
        process's CPU time after `measure_cpu_time`). Exceptions propagate, unpadded.

        `overlap_s`: host-side time the caller spent since its previous step (slicing the
        next batch, its loop) that the emulated device overlaps with its own compute, as an
        accelerator's asynchronous execution hides the host's work: taken off the padding, so
        a loop of steps takes F times their compute rather than that plus the loop.

        `reference_seconds`: the step's known warm compute time (the benchmark measures it). A
        step that computed slower than that (cold caches after the previous sleep) is charged
        the reference: it then takes F times the reference, or its own compute time if longer.
        """
        factor = self.factor
        start = self._clock()
        cpu_start = self._compute_clock() if self._compute_clock is not None else 0.0
        result = fn()
        elapsed = self._clock() - start
        if self._compute_clock is not None and reference_seconds is None:
            compute = min(elapsed, max(0.0, self._compute_clock() - cpu_start))
            self.last_compute_seconds = compute
            self.last_device_seconds = factor * compute
            self.pad(
                compute,
                factor,
                pay_back=pay_back,
                padding=max(0.0, factor * compute - elapsed - overlap_s),
            )
            return result
        self.last_compute_seconds = elapsed
        self.last_device_seconds = factor * elapsed
        if reference_seconds is not None and 0 <= reference_seconds < elapsed:
            target = factor * reference_seconds if factor > 1 else elapsed
            self.pad(
                elapsed,
                factor,
                pay_back=pay_back,
                padding=max(0.0, target - elapsed),
            )
        elif overlap_s > 0:
            self.pad(
                elapsed,
                factor,
                pay_back=pay_back,
                padding=max(0.0, (factor - 1.0) * elapsed - overlap_s),
            )
        else:
            self.pad(elapsed, factor, pay_back=pay_back)
        return result

    def pad(
        self,
        compute_seconds: float,
        factor: float | None = None,
        *,
        pay_back: bool = True,
        padding: float | None = None,
    ) -> float:
        """Sleep after a step the caller timed itself; returns the seconds slept.

        Sleeps overshoot (a loaded machine wakes a sleeper late); with `pay_back` the excess
        is carried over and taken off the following pads, so that over a run of steps the wall
        time is F times the compute time rather than F times plus the wake-up latency of every
        step. The benchmark times single steps and passes pay_back=False: every step of it is
        padded in full.
        """
        f = self.factor if factor is None else factor
        wanted = padding_seconds(f, compute_seconds) if padding is None else max(0.0, padding)
        with self._lock:
            debt = self._overslept if pay_back else 0.0
        request = max(0.0, wanted - debt)
        slept = 0.0
        if request > 0:
            start = self._clock()
            self._sleep(request)
            slept = self._clock() - start
        with self._lock:
            if wanted > 0 and pay_back:
                # Carry at most one step's padding over: a long pause is not paid back.
                over = max(0.0, debt + slept - wanted)
                self._overslept = min(over, wanted)
                self.unpaid_seconds += over - self._overslept
            self.steps += 1
            self.compute_seconds += max(0.0, compute_seconds)
            self.padding_seconds += slept
        return slept
