"""A ring job's link figures: measured agent -> agent links and the nodes' own benchmarks.

`RingRounds` orders its rings and cuts their deadlines from these: the links its members
measure between them (ReportProgress peer_links, kept as (reporter, peer) -> (rtt_s,
bandwidth bytes/s)), else each node's figures towards the coordinator (its job benchmark).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from epochmesh.ring.schedule import link_cost_s
from epochmesh.v1 import common_pb2

# Bandwidth assumed for a node that measured none (bytes/s): 100 Mbit/s.
DEFAULT_BANDWIDTH = 12.5e6

Links = Mapping[tuple[str, str], tuple[float, float]]


def member_links(links: Links, members: list[str]) -> dict[tuple[str, str], float] | None:
    """Link costs among `members` once every pair has been measured from at least one
    end (a partial matrix would make the unmeasured pairs look worst), else None."""
    if len(members) < 3:
        return None
    costs = {
        (a, b): link_cost_s(*links[(a, b)])
        for a in members
        for b in members
        if a != b and (a, b) in links
    }
    pairs = {frozenset(pair) for pair in costs}
    return costs if len(pairs) == len(members) * (len(members) - 1) // 2 else None


def ring_link_bandwidth(links: Links, order: list[str]) -> float:
    """The slowest measured bandwidth of the ring's hops (either direction's measurement;
    inf when none is measured)."""
    known = [
        link[1]
        for i, a in enumerate(order)
        for link in (
            links.get((a, order[(i + 1) % len(order)])),
            links.get((order[(i + 1) % len(order)], a)),
        )
        if link is not None
    ]
    return min(known, default=math.inf) if len(order) > 1 else math.inf


def slowest_bandwidth(bench: Mapping[str, common_pb2.BenchmarkResult], nodes: list[str]) -> float:
    """The least benchmarked bandwidth of ``nodes`` (DEFAULT_BANDWIDTH unless all have one)."""
    figures = [
        bench[n].bandwidth_bytes_per_second
        for n in nodes
        if n in bench and bench[n].bandwidth_bytes_per_second > 0
    ]
    return min(figures) if len(figures) == len(nodes) and figures else DEFAULT_BANDWIDTH


def largest_rtt_s(bench: Mapping[str, common_pb2.BenchmarkResult], nodes: list[str]) -> float:
    """The largest benchmarked round-trip time of ``nodes`` towards the coordinator (0: none)."""
    return max((bench[n].rtt_ms / 1000.0 for n in nodes if n in bench), default=0.0)
