"""A job's node-set bookkeeping (coordinator/rounds/node_set.py), without a network: which nodes a
round uses, which leave, exclusion after repeated failures, job-fault verdicts, departures."""

from __future__ import annotations

import pytest

from coordinator.rounds.node_set import JOB_FAULT_NODES, MAX_CONSECUTIVE_FAILURES, JobNodeSet

pytestmark = pytest.mark.timeout(30)

RATES = {"slow": 1.0, "mid": 2.0, "fast": 3.0, "x": 0.5}


def test_members_first_then_the_fastest_up_to_max_nodes() -> None:
    s = JobNodeSet()
    s.join("slow")
    assert s.choose(["fast", "slow", "mid"], 2, RATES.__getitem__) == ["slow", "fast"]
    assert s.held == {"fast", "slow", "mid"}
    assert s.leaving(["slow", "fast"]) == {"mid"}  # given, never chosen: let go


def test_a_node_benchmarked_but_never_joined_leaves_when_no_longer_given() -> None:
    s = JobNodeSet()
    s.choose(["a", "b"], 2, lambda n: 1.0)
    s.asked_benchmark("b", "t-1", now=10.0)
    s.benchmark_answered("b", now=12.5)
    s.join("a")
    assert s.bench_seconds("b", now=99.0) == pytest.approx(2.5)
    # The scheduler gives only "a" now: "b" (held, benchmarked, not a member) must go.
    assert s.leaving(s.choose(["a"], 2, lambda n: 1.0)) == {"b"}
    assert s.leave("b") is False and s.leave("a") is True
    assert s.release_all() == [] and s.members == []


def test_a_benchmark_in_flight_counts_its_time_so_far_and_can_fail() -> None:
    s = JobNodeSet()
    s.asked_benchmark("a", "t-1", now=5.0)
    assert s.bench_seconds("a", now=8.0) == pytest.approx(3.0)
    assert not s.benchmark_due("a", now=8.0, timeout_s=10.0)
    assert s.benchmark_due("a", now=15.0, timeout_s=10.0)
    assert s.is_benchmark_task("a", "t-1") and s.benchmark_task_ids() == {"t-1"}
    assert not s.benchmark_failed("a", "t-other")
    assert s.benchmark_failed("a", "t-1") and s.benchmarking() == []


def test_a_node_is_excluded_after_failures_in_a_row_once() -> None:
    s = JobNodeSet()
    results = [s.note_failure("a") for _ in range(MAX_CONSECUTIVE_FAILURES + 1)]
    assert results == [0] * (MAX_CONSECUTIVE_FAILURES - 1) + [MAX_CONSECUTIVE_FAILURES, 0]
    assert s.is_excluded("a") and s.excluded() == ["a"] and not s.is_excluded("b")


def test_the_job_fails_for_its_own_fault_only_when_enough_nodes_say_so() -> None:
    s = JobNodeSet()
    for n in ("a", "b", "c"):
        s.join(n)
    assert s.job_fault("a", "program crashed") == ""
    verdict = s.job_fault("b", "program crashed again")
    assert JOB_FAULT_NODES == 2 and "2 node(s) (a, b)" in verdict and "crashed" in verdict
    assert s.job_fault("c", "again") == ""  # said once
    s.round_applied()
    assert s.job_faults == {}


def test_a_lone_node_is_enough_for_a_job_of_one_node() -> None:
    s = JobNodeSet()
    s.join("a")
    assert "1 node(s) (a)" in s.job_fault("a", "x" * 400)
    assert len(s.job_faults["a"]) == 300


def test_departures_are_handled_once() -> None:
    s = JobNodeSet()
    s.asked_benchmark("a", "t-1", now=0.0)
    s.went_offline("a", "lease ended")
    s.went_offline("b", "")  # not in the job: nothing to do at the boundary
    assert s.benchmarking() == []
    assert s.take_departures() == {"a": "lease ended"}
    assert s.take_departures() == {}
