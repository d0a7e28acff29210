"""A coordinator and agents as real processes on this machine, for the demo and benchmarks.

The cluster lives in the library (coordinator/local_cluster.py), where
`epochmesh-coordinator dev` uses it too; the scripts import it from here:

    from local_cluster import LocalCluster, wait_for

    with LocalCluster(work_dir) as cluster:
        cluster.start_coordinator("--split", "equal")
        cluster.start_agent("fast", "--slowdown", "1")
        cluster.login()
        print(cluster.cli("nodes"))
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.local_cluster import BIN, ClusterError, LocalCluster, wait_for
from coordinator.verification.reputation import P_FLOOR

__all__ = ["BIN", "ClusterError", "LocalCluster", "earn_trust", "wait_for"]

log = logging.getLogger("local_cluster")


def earn_trust(
    cluster: LocalCluster,
    job_toml: Path,
    probabilities: Callable[[], dict[str, float]],
    nodes: int,
    limit_s: float,
) -> float:
    """A benchmark's --trusted warm-up: run the job of ``job_toml`` (short rounds on every
    agent) until each of ``nodes`` agents is checked with the floor probability P_FLOOR (its
    verification record: N0 / P_FLOOR verified rounds in a row,
    coordinator/verification/reputation.py; ``probabilities``: each node's now), then cancel
    it, so that the measured runs see what a long-lived cluster's trusted donors cost in
    checks, not new ones'. Returns the warm-up's seconds."""
    job_id = json.loads(cluster.cli("submit", str(job_toml), "--output", "json"))["job_id"]
    log.info("trust warm-up: job %s until every agent is checked with p = %g", job_id, P_FLOOR)
    started = time.monotonic()

    def trusted() -> bool:
        p = probabilities()
        log.info("trust warm-up: check probabilities %s", p)
        return len(p) >= nodes and all(v <= P_FLOOR + 1e-9 for v in p.values())

    try:
        wait_for(trusted, limit_s, "every agent trusted", interval=5.0)
    finally:
        cluster.cli("cancel", job_id)
    took = time.monotonic() - started
    log.info("trust warm-up: done in %.0fs", took)
    return took
