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

from coordinator.local_cluster import BIN, ClusterError, LocalCluster, wait_for

__all__ = ["BIN", "ClusterError", "LocalCluster", "wait_for"]
