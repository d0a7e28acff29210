"""Who recomputes a checked chunk: the candidates of other donors, one drawn by verified history.

The job's `Verifier` (coordinator/engine/verifier.py) hands a checked part's drawn chunk to
nodes of donors neither the node's nor an earlier checker's; these functions pick them (weighted
by their reputation records, `coordinator.verification.quorum.checker_weight`, never by a speed
they claim) and cut the chunk's samples out of the part's.
"""

from __future__ import annotations

import random
from collections.abc import Collection

import numpy as np

from coordinator.engine.ports import JobPort
from coordinator.nodes.registry import NodeRegistry
from coordinator.rounds.sample_ranges import index_run_array
from coordinator.verification.quorum import checker_weight
from epochmesh.v1 import common_pb2

NS = common_pb2.NodeState


def donor(registry: NodeRegistry, node_id: str) -> str:
    return registry.donor_of(node_id) or node_id


def device_kind(registry: NodeRegistry, node_id: str) -> str:
    info = registry.get(node_id)
    if info is None or not info.devices:
        return "cpu"
    return info.devices[0].kind or "cpu"


def checker_candidates(
    runner: JobPort, node_id: str, checkers: list[str], tried: Collection[str]
) -> list[str]:
    """Nodes that may recompute a chunk of ``node_id``'s part (checked so far by ``checkers``,
    ``tried`` already): of a donor neither the node's nor an earlier checker's, live and in
    good standing; the job's own nodes first (they hold its program and data), else any other
    such node (it loads them for the check)."""
    registry = runner.ctx.registry
    donors = {donor(registry, node_id)} | {donor(registry, c) for c in checkers}

    def eligible(n: str) -> bool:
        if n in tried or n == node_id or donor(registry, n) in donors:
            return False
        info = registry.get(n)
        if info is None or info.state not in (NS.NODE_STATE_ONLINE, NS.NODE_STATE_BUSY):
            return False
        return not runner.host.is_silent(n)

    members = sorted(n for n in runner.nodes if eligible(n))
    if members:
        return members
    others = registry.list((NS.NODE_STATE_ONLINE, NS.NODE_STATE_BUSY))
    return sorted(n.node_id for n in others if eligible(n.node_id))


def draw_checker(runner: JobPort, candidates: list[str], rng: random.Random) -> str:
    """One of ``candidates``, drawn with probability in proportion to its verified history
    (`checker_weight` of its reputation record): a verdict needs checkers of distinct donors
    that agree, and identities without a record of verified work (Sybils made to be drawn
    together) are drawn seldom while nodes with one are around. Not by speed: a benchmark is
    the node's own claim."""
    registry = runner.ctx.registry
    weights = [checker_weight(registry.reputation(n)) for n in candidates]
    x = rng.random() * sum(weights)
    for n, w in zip(candidates, weights, strict=True):
        x -= w
        if x < 0:
            return n
    return candidates[-1]


def slice_runs(runs: np.ndarray, start: int, end: int) -> np.ndarray:
    """The indices ``start .. end-1`` (positions in the runs' order) as runs."""
    idx = (
        np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs])
        if len(runs)
        else np.zeros(0, np.int64)
    )
    return index_run_array(idx[start:end])
