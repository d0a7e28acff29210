"""The stall watch names what held the event loop, and lets a loop that keeps running be."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from coordinator.observability.stall_watch import StallWatch

pytestmark = pytest.mark.timeout(30)


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call on the loop: the stall under test


async def _run(hold_s: float, threshold_s: float) -> StallWatch:
    watch = StallWatch(threshold_s)
    watch.start()
    try:
        await asyncio.sleep(0.05)
        _hold_the_loop(hold_s)
        await asyncio.sleep(0.05)
    finally:
        await watch.stop()
    return watch


def test_a_blocking_call_is_reported_with_its_stack(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.observability.stall_watch")
    watch = asyncio.run(_run(0.4, 0.1))
    assert watch.stalls == 1
    busy = [r.getMessage() for r in caplog.records if "busy for" in r.getMessage()]
    assert len(busy) == 1 and "_hold_the_loop" in busy[0], busy
    stalled = [r.getMessage() for r in caplog.records if "stalled for" in r.getMessage()]
    assert len(stalled) == 1
    assert int(stalled[0].split()[-2]) >= 300, stalled


def test_a_loop_that_keeps_running_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.observability.stall_watch")

    async def busy_but_yielding() -> StallWatch:
        watch = StallWatch(0.2)
        watch.start()
        try:
            for _ in range(30):
                await asyncio.sleep(0.005)
        finally:
            await watch.stop()
        return watch

    watch = asyncio.run(busy_but_yielding())
    assert watch.stalls == 0
    assert not caplog.records


def test_the_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StallWatch(0.0)
