"""The coordinator's Prometheus metrics: a collector that turns one `ClusterState` (read at
scrape time from the registry, store, engine and ledger by coordinator/observability/cluster_view.py) into
metric families, beside the gRPC interceptor's metrics (coordinator/observability/grpc_metrics.py).

`cluster_families(state)` is pure; `CoordinatorMetrics` holds the registry the HTTP server
renders, and the count of node events the event log dropped for their node's rate limit
(`attach_event_drops`: a plain counter, read at scrape time without a trip to the loop). Per-job series exist for live jobs and for jobs that ended within the retention
(`ClusterView`'s ``retention_s``), so the output stays bounded however many jobs came and went.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from coordinator.observability.cluster_view import (
    ClusterState,
    job_state_name,
    node_speed,
    node_state_name,
)
from coordinator.observability.grpc_metrics import GrpcMetrics
from coordinator.observability.round_stats import Histogram
from epochmesh.v1 import common_pb2

# A job's name is the submitter's text: cut in labels.
MAX_NAME_LABEL = 64


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    return [(le, float(n)) for le, n in h.cumulative()]


def cluster_families(state: ClusterState) -> Iterator[object]:
    """The metric families of one read of the cluster."""
    nodes = GaugeMetricFamily("epochmesh_nodes", "Nodes by state", labels=["state"])
    by_state: dict[str, int] = {
        node_state_name(s): 0
        for s in common_pb2.NodeState.values()
        if s != common_pb2.NODE_STATE_UNSPECIFIED
    }
    for node in state.nodes:
        name = node_state_name(node.state)
        by_state[name] = by_state.get(name, 0) + 1
    for name, n in sorted(by_state.items()):
        nodes.add_metric([name], n)
    yield nodes

    jobs = GaugeMetricFamily("epochmesh_jobs", "Jobs by state", labels=["state"])
    for name, n in sorted(state.jobs_by_state.items()):
        jobs.add_metric([name], n)
    yield jobs

    speed = GaugeMetricFamily(
        "epochmesh_node_samples_per_second",
        "Each live node's measured speed (observed in rounds, else its reference benchmark)",
        labels=["node", "name"],
    )
    strikes = GaugeMetricFamily(
        "epochmesh_node_strikes", "Strikes of each live node (three quarantine it)", labels=["node"]
    )
    price = GaugeMetricFamily(
        "epochmesh_node_price_micro_per_hour",
        "Each live node's asking price, micro-credits per node-hour",
        labels=["node"],
    )
    for node in state.nodes:
        if node.state == common_pb2.NODE_STATE_OFFLINE:
            continue
        speed.add_metric([node.node_id, node.name[:MAX_NAME_LABEL]], node_speed(node))
        strikes.add_metric([node.node_id], node.strikes)
        price.add_metric([node.node_id], node.price_micro_per_hour)
    yield speed
    yield strikes
    yield price

    events = dict(state.events_by_kind)
    yield CounterMetricFamily(
        "epochmesh_strikes",
        "Strikes given to nodes since start",
        value=events.get("node.strike", 0),
    )
    yield CounterMetricFamily(
        "epochmesh_quarantines",
        "Nodes quarantined since start",
        value=events.get("node.quarantined", 0),
    )
    by_kind = CounterMetricFamily(
        "epochmesh_events", "Cluster events appended since start, by kind", labels=["kind"]
    )
    for kind, n in sorted(events.items()):
        by_kind.add_metric([kind], n)
    yield by_kind
    yield CounterMetricFamily(
        "epochmesh_heartbeats", "Heartbeats handled since start", value=state.heartbeats_total
    )

    rounds = CounterMetricFamily(
        "epochmesh_job_rounds", "Rounds applied, per job", labels=["job", "name"]
    )
    samples = CounterMetricFamily(
        "epochmesh_job_samples", "Samples committed, per job (all epochs)", labels=["job", "name"]
    )
    progress = GaugeMetricFamily(
        "epochmesh_job_progress_ratio",
        "Samples committed over samples in all epochs",
        labels=["job"],
    )
    loss = GaugeMetricFamily("epochmesh_job_loss", "Loss of the job's last round", labels=["job"])
    job_state = GaugeMetricFamily(
        "epochmesh_job_info",
        "1 per job, with its state and owner",
        labels=["job", "state", "owner"],
    )
    spent = CounterMetricFamily(
        "epochmesh_job_spent_micro", "Credits a job's rounds have cost (micro)", labels=["job"]
    )
    for job in state.jobs:
        name = job.name[:MAX_NAME_LABEL]
        rounds.add_metric([job.job_id, name], job.round)
        samples.add_metric([job.job_id, name], job.samples_done)
        total = job.samples_total
        progress.add_metric([job.job_id], job.samples_done / total if total > 0 else 0.0)
        loss.add_metric([job.job_id], job.last_loss)
        job_state.add_metric([job.job_id, job_state_name(job.state), job.owner], 1)
        spent.add_metric([job.job_id], job.spent_micro)
    yield from (rounds, samples, progress, loss, job_state, spent)

    duration = HistogramMetricFamily(
        "epochmesh_round_duration_seconds",
        "Wall time of recorded rounds, per job",
        labels=["job"],
    )
    for job_id, (_, _, hist) in sorted(state.job_rounds.items()):
        duration.add_metric([job_id], _buckets(hist), hist.total)
    yield duration

    compute = HistogramMetricFamily(
        "epochmesh_node_compute_seconds",
        "Compute time of each node's applied parts of rounds",
        labels=["node"],
    )
    communicate = HistogramMetricFamily(
        "epochmesh_node_communicate_seconds",
        "Time of each node's applied parts not spent computing (transfers, waits)",
        labels=["node"],
    )
    for node_id, (comp, comm) in sorted(state.node_parts.items()):
        compute.add_metric([node_id], _buckets(comp), comp.total)
        communicate.add_metric([node_id], _buckets(comm), comm.total)
    yield compute
    yield communicate

    queue = GaugeMetricFamily(
        "epochmesh_scheduler_queue_jobs",
        "Live jobs in the scheduler's queue, by priority and whether they wait for nodes",
        labels=["priority", "waiting"],
    )
    counts: dict[tuple[str, str], int] = {}
    held = 0
    for entry in state.queue.values():
        key = (entry.priority, "true" if entry.waiting else "false")
        counts[key] = counts.get(key, 0) + 1
        held += entry.nodes_held
    for (priority, waiting), n in sorted(counts.items()):
        queue.add_metric([priority, waiting], n)
    yield queue
    yield GaugeMetricFamily(
        "epochmesh_scheduler_nodes_held", "Nodes the scheduler gives to live jobs", value=held
    )

    ledger = GaugeMetricFamily(
        "epochmesh_ledger_balance_micro",
        "Credit ledger balances summed by account kind (mint, platform, tenant, donor, "
        "escrow), micro-credits; they sum to zero",
        labels=["kind"],
    )
    for kind, total in sorted(state.ledger_by_kind.items()):
        ledger.add_metric([kind], total)
    yield ledger


class ClusterCollector(Collector):
    """Reads the cluster at scrape time through ``read_state`` (which runs the read on the
    coordinator's loop and waits for it)."""

    def __init__(self, read_state: Callable[[], ClusterState]) -> None:
        self._read_state = read_state

    def collect(self) -> Iterable[object]:  # type: ignore[override]
        return list(cluster_families(self._read_state()))


class EventDropsCollector(Collector):
    """Node events dropped for their node's rate limit since the start (``read_dropped``:
    coordinator/store/events.py's `EventLog.dropped_total`, an int a scrape may read from its
    thread)."""

    def __init__(self, read_dropped: Callable[[], int]) -> None:
        self._read_dropped = read_dropped

    def collect(self) -> Iterable[object]:  # type: ignore[override]
        return [
            CounterMetricFamily(
                "epochmesh_node_events_dropped",
                "Events nodes caused beyond their rate limit (dropped, not stored) since start",
                value=self._read_dropped(),
            )
        ]


class CoordinatorMetrics:
    """The registry behind ``/metrics``: the gRPC interceptor's metrics, and the cluster's
    and the event log's drops once `attach_cluster` and `attach_event_drops` are called."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.grpc = GrpcMetrics(self.registry)

    def attach_cluster(self, read_state: Callable[[], ClusterState]) -> None:
        self.registry.register(ClusterCollector(read_state))

    def attach_event_drops(self, read_dropped: Callable[[], int]) -> None:
        self.registry.register(EventDropsCollector(read_dropped))

    def render(self) -> bytes:
        return generate_latest(self.registry)
