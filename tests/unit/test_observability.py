"""The pure parts of the metrics and the dashboard: round statistics (histograms, series,
shares, pruning), the metric families of one cluster read, who must log in, the sessions,
and the redaction of other tenants' job ids."""

from __future__ import annotations

import pytest

from coordinator.observability.cluster_view import ClusterState, QueueEntry, Viewer, redact_jobs
from coordinator.observability.dashboard_access import (
    Sessions,
    SessionsFull,
    is_loopback_host,
    login_required,
)
from coordinator.observability.metrics import cluster_families
from coordinator.observability.round_stats import Histogram, JobRounds, RoundStats
from epochmesh.v1 import common_pb2

pytestmark = pytest.mark.timeout(30)


def _round(
    n: int, parts: list[tuple[str, str, int, float, float]], ms: int = 500
) -> common_pb2.RoundRecord:
    return common_pb2.RoundRecord(
        round=n,
        epoch=0,
        started_ms=n * 1000,
        finished_ms=n * 1000 + ms,
        loss=1.0 / n,
        parts=[
            common_pb2.RoundPart(
                node_id=node,
                status=status,
                ranges=[common_pb2.SampleRange(start=0, stop=samples)],
                seconds=compute,
                communicate_seconds=comm,
            )
            for node, status, samples, compute, comm in parts
        ],
    )


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0, float("nan"), -1.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert (h.count, h.total) == (4, pytest.approx(3.65))


def test_job_rounds_sum_applied_parts_and_skip_seen_rounds() -> None:
    rounds = JobRounds()
    rounds.add(_round(1, [("a", "applied", 30, 0.2, 0.1), ("b", "applied", 10, 0.2, 0.05)]))
    rounds.add(_round(2, [("a", "applied", 30, 0.3, 0.1), ("b", "late", 10, 9.0, 9.0)]))
    rounds.add(_round(2, [("a", "applied", 999, 1.0, 1.0)]))  # seen: ignored
    assert rounds.cursor == 2 and rounds.rounds == 2 and rounds.samples == 70
    a, b = rounds.nodes["a"], rounds.nodes["b"]
    assert (a.samples, a.compute_seconds, a.communicate_seconds) == (60, 0.5, pytest.approx(0.2))
    assert (b.samples, b.parts_applied, b.parts_failed) == (10, 1, 1)
    assert rounds.shares() == {"a": pytest.approx(60 / 70), "b": pytest.approx(10 / 70)}
    assert [p.round for p in rounds.points_after(1)] == [2]
    assert rounds.points[0].samples_per_second == pytest.approx(40 / 0.5)
    assert rounds.duration.count == 2


def test_round_stats_prune_ended_jobs_and_idle_nodes() -> None:
    stats = RoundStats(retention_ms=1000, max_jobs=2)
    for job in ("j1", "j2", "j3"):
        stats.add(job, [_round(1, [(f"n-{job}", "applied", 8, 0.1, 0.1)])])
    assert set(stats.node_parts) == {"n-j1", "n-j2", "n-j3"}
    # j1 ended long ago, j2 recently; j3 is live; only n-j3 is active.
    dropped = stats.prune({"j1": 0, "j2": 9_500}, ["n-j3"], now_ms=10_000)
    assert dropped == ["j1"]
    assert set(stats.jobs) == {"j2", "j3"}
    assert set(stats.node_parts) == {"n-j3"}  # the others' last parts are older than 1 s
    stats.add("j4", [])
    assert stats.prune({"j2": 9_500}, [], now_ms=10_000) == ["j2"]  # over max_jobs


def test_cluster_families_render_every_figure() -> None:
    node = common_pb2.NodeInfo(
        node_id="n-1", name="alpha", state=common_pb2.NODE_STATE_BUSY, strikes=2
    )
    node.benchmark.samples_per_second = 100.0
    offline = common_pb2.NodeInfo(node_id="n-2", state=common_pb2.NODE_STATE_OFFLINE)
    job = common_pb2.Job(
        job_id="j-0000000001",
        name="x" * 100,
        owner="u-1",
        state=common_pb2.JOB_STATE_RUNNING,
        round=7,
        samples_done=70,
        samples_total=140,
        last_loss=0.5,
    )
    h = Histogram((1.0,))
    h.observe(0.5)
    state = ClusterState(
        time_ms=0,
        nodes=[node, offline],
        jobs_by_state={"RUNNING": 1},
        jobs=[job],
        queue={job.job_id: QueueEntry(job.job_id, "normal", False, 1, "")},
        ledger_by_kind={"mint": -5, "tenant": 5},
        heartbeats_total=3,
        events_by_kind={"node.strike": 2, "node.quarantined": 1},
        job_rounds={job.job_id: (7, 70, h)},
        node_parts={"n-1": (h, h)},
    )
    families = {f.name: f for f in cluster_families(state)}  # type: ignore[attr-defined]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples  # type: ignore[attr-defined]
    }
    assert samples[("epochmesh_nodes", (("state", "BUSY"),))] == 1
    assert samples[("epochmesh_nodes", (("state", "OFFLINE"),))] == 1
    assert samples[("epochmesh_nodes", (("state", "ONLINE"),))] == 0
    assert samples[("epochmesh_strikes_total", ())] == 2
    assert samples[("epochmesh_quarantines_total", ())] == 1
    assert samples[("epochmesh_node_strikes", (("node", "n-1"),))] == 2
    assert ("epochmesh_node_strikes", (("node", "n-2"),)) not in samples  # offline: no series
    name = "x" * 64
    assert samples[("epochmesh_job_rounds_total", (("job", job.job_id), ("name", name)))] == 7
    assert samples[("epochmesh_job_progress_ratio", (("job", job.job_id),))] == 0.5
    key = ("epochmesh_round_duration_seconds_bucket", (("job", job.job_id), ("le", "1.0")))
    assert samples[key] == 1
    assert samples[("epochmesh_node_compute_seconds_count", (("node", "n-1"),))] == 1
    assert samples[("epochmesh_scheduler_nodes_held", ())] == 1
    assert samples[("epochmesh_ledger_balance_micro", (("kind", "mint"),))] == -5


def test_who_must_log_in() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("[::1]")
    assert is_loopback_host("localhost") and is_loopback_host("127.0.0.2")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("192.0.2.7")
    assert not is_loopback_host("example.org")
    assert not login_required("127.0.0.1", force=False, insecure=False)
    assert login_required("127.0.0.1", force=True, insecure=False)
    assert login_required("0.0.0.0", force=False, insecure=False)
    assert not login_required("0.0.0.0", force=True, insecure=True)


def test_sessions_expire_and_end() -> None:
    sessions = Sessions(ttl_s=10, max_sessions=2)
    first = sessions.create("u-1", "submitter", now_s=0)
    session = sessions.get(first, now_s=5)
    assert session is not None and session.viewer == Viewer("submitter", "u-1")
    assert sessions.get(first, now_s=11) is None
    a, b = (sessions.create(f"u-{i}", "operator", now_s=0) for i in range(2))
    with pytest.raises(SessionsFull):  # full: nobody's session ends to make room
        sessions.create("u-2", "operator", now_s=1)
    assert sessions.get(a, now_s=1) is not None
    sessions.end(b)
    c = sessions.create("u-2", "operator", now_s=1)
    assert sessions.get(b, now_s=1) is None and sessions.get(c, now_s=1) is not None
    assert sessions.get("", now_s=1) is None and sessions.get("x" * 500, now_s=1) is None


def test_viewers_and_redaction() -> None:
    mine = common_pb2.Job(job_id="j-00000000aa", owner="u-1")
    theirs = common_pb2.Job(job_id="j-00000000bb", owner="u-2")
    submitter = Viewer("submitter", "u-1")
    assert submitter.sees(mine) and not submitter.sees(theirs)
    assert Viewer().sees(theirs) and Viewer("operator", "u-9").owner is None
    text = "node n-1 moves from job j-00000000bb to job j-00000000aa: fair share"
    assert redact_jobs(text, {"j-00000000aa"}) == (
        "node n-1 moves from job another job to job j-00000000aa: fair share"
    )
