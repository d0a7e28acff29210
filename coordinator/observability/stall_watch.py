"""Event-loop stalls: how long the coordinator's loop went without running, and where it was.

Every call the coordinator serves runs on one asyncio loop; a callback that holds it (a long
computation, a blocking call, a garbage collection) delays every other call by as long. A
`StallWatch` keeps a tick task on the loop (every TICK_S) and a watchdog thread that looks at
the tick's age: past ``threshold_s`` without a tick, it takes the loop thread's Python stack
(`sys._current_frames`, the thread's own frames: the watchdog gets the interpreter lock at the
loop's next switch interval) and logs it once per stall, with the stall's length when the loop
runs again.

Started by ``epochmesh-coordinator serve --report-stalls MS`` (0, the default: off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

TICK_S = 0.01
# Stacks logged at most this often (a loop stalled by one cause again and again).
MIN_REPORT_GAP_S = 1.0


class StallWatch:
    """Watches one running loop from a daemon thread; see the module docstring."""

    def __init__(self, threshold_s: float) -> None:
        if threshold_s <= 0:
            raise ValueError("threshold_s must be > 0")
        self.threshold_s = threshold_s
        self._last_tick = time.monotonic()
        self._loop_thread = 0
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self.stalls = 0  # stalls seen so far

    def start(self) -> None:
        """From a coroutine on the loop to watch."""
        self._loop_thread = threading.get_ident()
        self._last_tick = time.monotonic()
        self._task = asyncio.create_task(self._tick(), name="stall-watch")
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 1.0)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            gap = now - self._last_tick - TICK_S
            self._last_tick = now
            if gap >= self.threshold_s:
                self.stalls += 1
                log.warning("event loop stalled for %.0f ms", gap * 1000)

    def _watch(self) -> None:
        reported_tick = -1.0
        last_report = -MIN_REPORT_GAP_S
        while not self._stop.wait(self.threshold_s / 4):
            tick = self._last_tick
            now = time.monotonic()
            if now - tick < self.threshold_s or tick == reported_tick:
                continue
            reported_tick = tick
            if now - last_report < MIN_REPORT_GAP_S:
                continue
            last_report = now
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None:
                continue
            stack = "".join(traceback.format_stack(frame, limit=40))
            log.warning(
                "event loop busy for %.0f ms so far, in:\n%s", (now - tick) * 1000, stack.rstrip()
            )
