"""Measured links from this agent to the other members of its rings.

The coordinator orders a ring by agent -> agent link figures
(`epochmesh.ring.schedule.ring_order`), which only the agents can measure. `PeerLinks` keeps, per
peer node id, the round trip and bandwidth of its last probe (PeerService Ping:
`node_agent.ring.client.probe_link`), probes in the background the members of a new ring
assignment it has no fresh figure for (one at a time, each bounded in time), and lists the fresh
figures for the ring members in the form ReportProgressRequest carries them (`peer_links`, at
most `MAX_LINKS`).

    links = PeerLinks()
    links.refresh(members, probe)        # at the start of a ring task: returns at once
    req.peer_links.extend(links.report(members))

`probe(address, node_id) -> (rtt_s, bandwidth_bytes_per_s)` is the ring transport's probe. A
failed probe is logged and retried at the next refresh after `retry_s`; figures older than
`refresh_s` are measured again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from epochmesh.v1 import agent_pb2

log = logging.getLogger(__name__)

MAX_LINKS = 64  # what the coordinator accepts per report
PROBE_TIMEOUT_S = 10.0

Probe = Callable[[str, str], Awaitable[tuple[float, float]]]


@dataclass(frozen=True)
class Link:
    rtt_s: float
    bandwidth: float
    measured: float  # time.monotonic() of the probe


class PeerLinks:
    def __init__(self, refresh_s: float = 300.0, retry_s: float = 30.0) -> None:
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.links: dict[str, Link] = {}
        self._failed: dict[str, float] = {}  # node id -> when its probe last failed
        self._task: asyncio.Task[None] | None = None

    def due(
        self, members: Sequence[tuple[str, str]], now: float | None = None
    ) -> list[tuple[str, str]]:
        """(node id, address) of the members whose figures are missing or stale, in order."""
        now = time.monotonic() if now is None else now
        out = []
        for node_id, address in members:
            link = self.links.get(node_id)
            if link is not None and now - link.measured < self.refresh_s:
                continue
            failed = self._failed.get(node_id)
            if failed is not None and now - failed < self.retry_s:
                continue
            out.append((node_id, address))
        return out

    def refresh(self, members: Sequence[tuple[str, str]], probe: Probe) -> None:
        """Start probing the due members (the other members of this node's ring) in the
        background, unless a refresh is still running."""
        if self._task is not None and not self._task.done():
            return
        due = self.due(members)
        if due:
            self._task = asyncio.create_task(self._probe_all(due, probe), name="peer-link-probes")

    async def _probe_all(self, due: list[tuple[str, str]], probe: Probe) -> None:
        for node_id, address in due:
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    rtt, bandwidth = await probe(address, node_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: try again later
                log.info("probe of peer %s at %s failed: %r", node_id, address, exc)
                self._failed[node_id] = time.monotonic()
                continue
            if math.isfinite(rtt) and rtt > 0 and math.isfinite(bandwidth) and bandwidth > 0:
                self.links[node_id] = Link(rtt, bandwidth, time.monotonic())
                self._failed.pop(node_id, None)
                log.info(
                    "peer link to %s: rtt %.2f ms, %.1f MB/s", node_id, rtt * 1e3, bandwidth / 1e6
                )

    def report(self, node_ids: Sequence[str]) -> list[agent_pb2.PeerLink]:
        """Fresh figures for `node_ids`, as ReportProgressRequest.peer_links."""
        now = time.monotonic()
        out = []
        for node_id in dict.fromkeys(node_ids):
            link = self.links.get(node_id)
            if link is None or now - link.measured >= self.refresh_s:
                continue
            out.append(
                agent_pb2.PeerLink(
                    node_id=node_id,
                    rtt_ms=link.rtt_s * 1e3,
                    bandwidth_bytes_per_second=link.bandwidth,
                )
            )
            if len(out) == MAX_LINKS:
                break
        return out

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._task = None
