"""PeerLinks: which ring peers get probed, when again, and what is reported."""

from __future__ import annotations

import asyncio
import time

import pytest

from node_agent.ring.links import MAX_LINKS, PeerLinks
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(20)

PEERS = [("n-000000000a", "127.0.0.1:1"), ("n-000000000b", "127.0.0.1:2")]


async def test_probes_each_due_peer_once_and_reports_fresh_figures() -> None:
    calls: list[tuple[str, str]] = []

    async def probe(address: str, node_id: str) -> tuple[float, float]:
        calls.append((node_id, address))
        if node_id == "n-000000000b":
            raise ConnectionError("unreachable")
        return 0.002, 5e8

    links = PeerLinks(refresh_s=60.0, retry_s=30.0)
    links.refresh(PEERS, probe)
    links.refresh(PEERS, probe)  # a refresh is running: no second one
    await async_wait_until(lambda: links._task is not None and links._task.done(), timeout=5)
    assert calls == [(n, a) for n, a in PEERS]
    [reported] = links.report(["n-000000000a", "n-000000000b", "n-000000000a"])
    assert reported.node_id == "n-000000000a"
    assert reported.rtt_ms == pytest.approx(2.0) and reported.bandwidth_bytes_per_second == 5e8
    # Fresh figure and a recent failure: nothing due now; both due later.
    now = time.monotonic()
    assert links.due(PEERS, now=now) == []
    assert links.due(PEERS, now=now + 31) == [PEERS[1]]
    assert links.due(PEERS, now=now + 61) == PEERS
    links.refresh(PEERS, probe)
    assert links._task is not None and links._task.done()  # nothing was due: no new probe
    await links.close()


async def test_report_is_bounded_and_close_cancels_a_running_probe() -> None:
    links = PeerLinks()
    peers = [(f"n-{i:010x}", f"127.0.0.1:{i + 1}") for i in range(MAX_LINKS + 5)]

    async def fast(address: str, node_id: str) -> tuple[float, float]:
        return 0.001, 1e9

    links.refresh(peers, fast)
    await async_wait_until(lambda: len(links.links) == len(peers), timeout=5)
    assert len(links.report([n for n, _ in peers])) == MAX_LINKS

    started = asyncio.Event()

    async def hangs(address: str, node_id: str) -> tuple[float, float]:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    slow = PeerLinks()
    slow.refresh(PEERS, hangs)
    await asyncio.wait_for(started.wait(), timeout=5)
    await asyncio.wait_for(slow.close(), timeout=5)
    assert slow.report([n for n, _ in PEERS]) == []
