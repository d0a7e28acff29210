"""scripts/bench_scheduler.py on a small trace: every policy finishes every job, no work is
lost, the real scheduler's plans keep their invariants, and the JSON figures are there."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from coordinator.scheduling.cluster_scheduler import Plan, Tier

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_scheduler.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scheduler", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scheduler"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench()


def small(bench: ModuleType, seed: int = 3) -> object:
    return bench.Config(seed=seed, nodes=20, jobs=8, arrival_s=200.0, duration_s=60.0)


def test_small_trace_every_job_finishes_with_its_work_done(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[int] = []
    real_check = Plan.check

    def counting_check(self: Plan, jobs: object, nodes: object) -> None:
        real_check(self, jobs, nodes)  # type: ignore[arg-type]
        owners = [n for p in self.jobs.values() for n in p.nodes]
        assert len(owners) == len(set(owners)), "a node given twice"
        checked.append(len(owners))

    monkeypatch.setattr(Plan, "check", counting_check)
    cfg = small(bench)
    out, runs, trace = bench.run_all(cfg)
    assert checked and len(checked) == runs["ours"].rounds, "ours checks every plan"
    json.loads(json.dumps(out))  # one JSON-serialisable object
    for key in (
        "avg_jct_s",
        "makespan_s",
        "jct_speedup_vs_fifo",
        "jct_speedup_vs_equal",
        "jain_index",
        "high_priority_wait_rounds",
        "first_start_wait_rounds",
        "goal_first_start_wait_rounds",
        "goals_met",
        "scheduler_pass_ms",
        "seed",
        "nodes",
        "jobs",
        "tenants",
        "round_s",
    ):
        assert key in out, key
    assert set(out["avg_jct_s"]) == set(bench.POLICIES)
    assert set(out["makespan_s"]) == set(bench.POLICIES)
    assert set(out["goals_met"]) == {
        "jct_speedup_vs_fifo",
        "jain_index",
        "high_priority_wait_rounds",
        "first_start_wait_rounds",
    }
    assert len(trace.jobs) == 8 and len(trace.node_ids) == 20
    assert any(j.tier == Tier.HIGH for j in trace.jobs)
    for name, run in runs.items():
        assert set(run.finish_s) == {j.job_id for j in trace.jobs}, name
        for job in trace.jobs:
            assert run.done[job.job_id] == pytest.approx(job.size, rel=1e-9), (name, job.job_id)
            assert run.finish_s[job.job_id] > job.arrival_s, (name, job.job_id)
            assert job.job_id in run.first_round, (name, job.job_id)
        assert out["per_policy"][name]["avg_jct_s"] > 0  # type: ignore[index]


def test_no_policy_trains_faster_than_its_nodes_allow(bench: ModuleType) -> None:
    """A job's completion time is at least its work over the sum of the max_nodes fastest
    nodes for it (plus the first benchmark): the simulator cannot create work."""
    cfg = small(bench, seed=5)
    trace = bench.make_trace(cfg)
    for name in bench.POLICIES:
        run = bench.simulate(cfg, trace, name)
        for job in trace.jobs:
            best = sorted((trace.rate[(n, job.job_id)] for n in trace.node_ids), reverse=True)
            bound = job.size / sum(best[: job.max_nodes]) + cfg.bench_s
            assert run.finish_s[job.job_id] - job.arrival_s >= bound - 1e-6, (name, job.job_id)


def test_the_trace_is_seeded(bench: ModuleType) -> None:
    a = bench.make_trace(small(bench, seed=7))
    b = bench.make_trace(small(bench, seed=7))
    c = bench.make_trace(small(bench, seed=8))
    assert a.jobs == b.jobs and a.rate == b.rate
    assert a.jobs != c.jobs


def test_fifo_blocks_younger_jobs_behind_an_older_one_below_its_max(bench: ModuleType) -> None:
    cfg = bench.Config(nodes=4, jobs=2)
    trace = bench.make_trace(cfg)
    old = bench.TraceJob("a", "t0", Tier.NORMAL, 0, 1, 8, 0.0, 1.0)
    young = bench.TraceJob("b", "t0", Tier.HIGH, 0, 1, 1, 1.0, 1.0)
    fifo = bench.Fifo(trace)
    out = fifo.assign(0.0, [old, young], {}, {}, {})
    assert sorted(out.values()) == ["a"] * 4  # the older job takes every node, no priority
    eq = bench.Equal(trace).assign(0.0, [old, young], {}, {}, {})
    assert sorted(eq.values()) == ["a", "a", "a", "b"]  # b capped at max_nodes 1


def test_jain_index() -> None:
    bench = load_bench()
    assert bench.jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert bench.jain([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    rows = [{"t0": (10, 5, 2.0), "t1": (10, 5, 4.0)}] * 4
    value, windows = bench.windowed_jain(rows, {"t0": 1.0, "t1": 2.0}, 2)
    assert windows == 2 and value == pytest.approx(1.0)  # weighted: 2/1 == 4/2
    uncontended = [{"t0": (10, 10, 2.0), "t1": (10, 5, 4.0)}] * 4
    assert bench.windowed_jain(uncontended, {"t0": 1.0, "t1": 2.0}, 2) == (None, 0)


def test_ours_is_told_the_remaining_samples_unless_sizes_are_unknown(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float | None] = []
    real = bench.schedule

    def spying(now_ms: int, jobs: list, *args: object) -> Plan:  # type: ignore[type-arg]
        seen.extend(j.remaining_samples for j in jobs)
        return real(now_ms, jobs, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "schedule", spying)
    cfg = small(bench)
    trace = bench.make_trace(cfg)
    sizes = {j.size for j in trace.jobs}
    run = bench.simulate(cfg, trace, "ours")
    assert seen and all(r is not None and 0 < r <= max(sizes) for r in seen)
    assert sizes & set(seen), "a job's first pass sees its whole size"
    seen.clear()
    unknown = bench.simulate(bench.replace(cfg, known_sizes=False), trace, "ours")
    assert seen and all(r is None for r in seen)
    assert set(unknown.finish_s) == set(run.finish_s) == {j.job_id for j in trace.jobs}
