"""Unit and property tests of coordinator.scheduling.cluster_scheduler (pure: no clock, no I/O)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.scheduling.cluster_scheduler import (
    Holding,
    JobRequest,
    NodeOffer,
    Plan,
    Tenants,
    TenantUsage,
    Tier,
    check_weight,
    effective_rates,
    parse_priority,
    schedule,
    tier_of,
    water_fill,
)
from epochmesh.spec import PRIORITIES

pytestmark = pytest.mark.timeout(120)


def job(
    job_id: str,
    tenant: str = "t",
    tier: Tier = Tier.NORMAL,
    min_nodes: int = 1,
    max_nodes: int = 8,
    at: int = 0,
) -> JobRequest:
    return JobRequest(job_id, tenant, tier, min_nodes, max_nodes, at)


def nodes(n: int, rate: float = 10.0) -> list[NodeOffer]:
    return [NodeOffer(f"n{i:02d}", rate) for i in range(n)]


def holdings_of(plan: Plan, until_ms: int = 0) -> dict[str, Holding]:
    return {n: Holding(j, until_ms) for n, j in plan.owners().items()}


# -- names and small pieces -------------------------------------------------------------------


def test_priorities_parse_and_unknown_ones_are_refused_by_name() -> None:
    assert parse_priority("high") is Tier.HIGH
    assert parse_priority(" Normal ") is Tier.NORMAL
    assert parse_priority("low") is Tier.LOW
    with pytest.raises(ValueError, match="unknown priority 'urgent': use one of high, normal, low"):
        parse_priority("urgent")
    assert tier_of("") is Tier.NORMAL and tier_of("low") is Tier.LOW
    # job.toml's names are the tiers' (epochmesh.spec cannot import the coordinator)
    assert PRIORITIES == tuple(t.label for t in sorted(Tier, reverse=True))


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "2", True])
def test_a_weight_must_be_a_positive_number(bad: object) -> None:
    with pytest.raises(ValueError, match="weight must be a"):
        check_weight(bad)  # type: ignore[arg-type]
    assert check_weight(2) == 2.0


def test_water_fill_is_weighted_max_min() -> None:
    shares = water_fill({"a": 10, "b": 10, "c": 1}, {"a": 1, "b": 3, "c": 1}, 9)
    assert shares["c"] == pytest.approx(1)
    assert shares["a"] == pytest.approx(2)
    assert shares["b"] == pytest.approx(6)
    assert sum(water_fill({"a": 2, "b": 3}, {"a": 1, "b": 1}, 100).values()) == pytest.approx(5)


def test_effective_rates_use_the_jobs_own_benchmark_else_the_scaled_reference() -> None:
    offers = [
        NodeOffer("fast", 100.0, {"j": 50.0}),
        NodeOffer("slow", 50.0, {"j": 25.0}),
        NodeOffer("new", 100.0),  # not benchmarked on j yet: 100 x median(0.5) = 50
    ]
    rates = effective_rates([job("j")], offers)
    mean = (50 + 25 + 50) / 3
    assert rates[("fast", "j")] == pytest.approx(50 / mean)
    assert rates[("slow", "j")] == pytest.approx(25 / mean)
    assert rates[("new", "j")] == pytest.approx(50 / mean)


def test_decayed_usage_halves_per_half_life_and_round_trips() -> None:
    usage = TenantUsage(half_life_s=10)
    usage.add("a", 100.0, now_ms=0)
    assert usage.usage("a", 10_000) == pytest.approx(50)
    usage.add("a", 50.0, now_ms=10_000)
    assert usage.usage("a", 20_000) == pytest.approx(50)
    again = TenantUsage.from_state(json.loads(json.dumps(usage.to_state())))
    assert again.usage("a", 30_000) == pytest.approx(25)
    assert again.usage("nobody", 30_000) == 0
    with pytest.raises(ValueError):
        usage.add("a", -1.0, now_ms=0)
    with pytest.raises(ValueError):
        TenantUsage(half_life_s=0)


# -- the policy, by example -------------------------------------------------------------------


def test_a_lone_job_takes_what_it_wants_and_a_second_tenant_gets_half() -> None:
    cluster = nodes(8)
    a = job("a", "alice", at=1)
    plan = schedule(0, [a], cluster, {}, Tenants())
    assert len(plan.jobs["a"].nodes) == 8
    b = job("b", "bob", at=2)
    plan2 = schedule(1000, [a, b], cluster, holdings_of(plan), Tenants())
    plan2.check([a, b], cluster)
    assert len(plan2.jobs["a"].nodes) == 4 and len(plan2.jobs["b"].nodes) == 4
    moved = [m for m in plan2.moves if m.to_job == "b"]
    assert len(moved) == 4 and all(m.from_job == "a" for m in moved)
    assert all("fair share" in m.reason for m in moved)
    assert "fair share 4.0" in plan2.jobs["b"].reason


def test_weights_split_the_cluster_and_a_tenants_jobs_share_its_part() -> None:
    cluster = nodes(12)
    jobs = [job("a1", "alice", at=1), job("a2", "alice", at=2), job("b", "bob", at=3)]
    plan = schedule(0, jobs, cluster, {}, Tenants(weights={"bob": 2.0}))
    got = {j: len(p.nodes) for j, p in plan.jobs.items()}
    assert got == {"a1": 2, "a2": 2, "b": 8}
    assert plan.jobs["b"].fair_share == pytest.approx(8)


def test_hysteresis_keeps_a_recent_node_with_its_job_within_a_tier() -> None:
    cluster = nodes(4)
    a, b = job("a", "alice", at=1), job("b", "bob", at=2)
    first = schedule(0, [a], cluster, {}, Tenants())
    protected = holdings_of(first, until_ms=5_000)
    during = schedule(1_000, [a, b], cluster, protected, Tenants())
    assert len(during.jobs["a"].nodes) == 4 and during.jobs["b"].waiting
    assert not during.moves
    after = schedule(6_000, [a, b], cluster, protected, Tenants())
    assert len(after.jobs["b"].nodes) == 2


def test_a_new_tenant_takes_its_share_after_the_share_hold_not_the_benchmark_payback() -> None:
    # Tenant A's long job measured on all four nodes (speeds 1, 1, 1/2, 1/2), its nodes held
    # for long (a slow job benchmark to pay back) but against fair shares only until 5 s;
    # tenant B's new job measured nowhere yet.
    speeds = [1.0, 1.0, 0.5, 0.5]
    cluster = [
        NodeOffer(f"n{i}", 100 * s, {"a": 50 * s}, kind="cpu:2") for i, s in enumerate(speeds)
    ]
    a = JobRequest("a", "alice", Tier.NORMAL, 1, 4, 0, attained_s=3000, remaining_samples=1e5)
    b = JobRequest("b", "bob", Tier.NORMAL, 1, 4, 10_000, remaining_samples=4e4)
    held = {f"n{i}": Holding("a", 10**9, 5_000) for i in range(4)}
    tenants = Tenants(usage={"alice": 5000.0})
    during = schedule(3_000, [a, b], cluster, held, tenants)
    assert len(during.jobs["a"].nodes) == 4 and during.jobs["b"].waiting
    after = schedule(6_000, [a, b], cluster, held, tenants)
    after.check([a, b], cluster)
    assert after.jobs["a"].nodes == ["n0", "n1"]  # A keeps its share, its fastest nodes
    assert after.jobs["b"].nodes == ["n2", "n3"]
    assert all(m.from_job == "a" and "fair share" in m.reason for m in after.moves)
    # Once B holds its share, A's nodes are protected again for their whole hold.
    now = {**held, "n2": Holding("b", 20_000, 7_000), "n3": Holding("b", 20_000, 7_000)}
    steady = schedule(8_000, [a, b], cluster, now, tenants)
    assert steady.owners() == after.owners() and not steady.moves


def test_a_higher_tier_preempts_even_protected_nodes_and_lower_tiers_wait() -> None:
    cluster = nodes(4)
    low, normal = job("l", "alice", Tier.LOW, at=1), job("n", "bob", at=2)
    plan = schedule(0, [low, normal], cluster, {}, Tenants())
    assert len(plan.jobs["n"].nodes) == 4 and plan.jobs["l"].waiting
    high = job("h", "carol", Tier.HIGH, min_nodes=3, max_nodes=3, at=3)
    plan2 = schedule(1, [low, normal, high], cluster, holdings_of(plan, 10_000), Tenants())
    plan2.check([low, normal, high], cluster)
    assert len(plan2.jobs["h"].nodes) == 3 and len(plan2.jobs["n"].nodes) == 1
    assert all("preempted for h (priority high)" in m.reason for m in plan2.moves)
    assert "higher priorities" in plan2.jobs["l"].reason


def test_gang_start_reserves_min_nodes_together_and_a_job_that_does_not_fit_waits() -> None:
    cluster = nodes(4)
    a = job("a", "alice", min_nodes=1, max_nodes=3, at=1)
    big = job("big", "bob", min_nodes=3, at=2)
    plan = schedule(0, [a, big], cluster, {}, Tenants())
    plan.check([a, big], cluster)
    # both min_nodes fit (1 + 3): both run, though bob's 3 are above its fair share of 2
    assert len(plan.jobs["big"].nodes) == 3 and len(plan.jobs["a"].nodes) == 1
    running = job("r", "alice", min_nodes=2, max_nodes=4, at=1)
    first = schedule(0, [running], cluster, {}, Tenants())
    plan2 = schedule(1, [running, big], cluster, holdings_of(first), Tenants())
    assert len(plan2.jobs["r"].nodes) == 4 and plan2.jobs["big"].waiting
    assert plan2.jobs["big"].reason == (
        "waits: needs 3 node(s) together (min_nodes); 2 of the 4 left for priority normal "
        "free at its turn (jobs expected to finish sooner and other tenants' fair shares go "
        "first)"
    )
    huge = job("huge", "carol", min_nodes=5, at=3)
    plan3 = schedule(0, [a, big, huge], cluster, {}, Tenants())
    assert plan3.jobs["huge"].reason == (
        "waits: min_nodes 5 exceeds the 4 eligible node(s) in the cluster"
    )


def test_a_job_taken_out_for_its_gang_comes_back_when_an_older_one_leaves_room() -> None:
    cluster = nodes(4)
    small = job("small", "a", max_nodes=1, at=1)
    older_big = job("older", "b", min_nodes=4, at=2)
    newer = job("newer", "c", min_nodes=2, max_nodes=2, at=3)
    plan = schedule(0, [small, older_big, newer], cluster, {}, Tenants())
    plan.check([small, older_big, newer], cluster)
    assert plan.jobs["older"].waiting
    assert len(plan.jobs["newer"].nodes) == 2 and len(plan.jobs["small"].nodes) == 1


def test_a_node_goes_where_it_is_comparatively_fastest() -> None:
    # n0 is 3x faster for A than the others are; n1 is 3x faster for B.
    offers = [
        NodeOffer("n0", 10.0, {"a": 30.0, "b": 10.0}),
        NodeOffer("n1", 10.0, {"a": 10.0, "b": 30.0}),
        NodeOffer("n2", 10.0, {"a": 10.0, "b": 10.0}),
        NodeOffer("n3", 10.0, {"a": 10.0, "b": 10.0}),
    ]
    a, b = job("a", "alice", at=1), job("b", "bob", at=2)
    plan = schedule(0, [a, b], offers, {}, Tenants())
    assert "n0" in plan.jobs["a"].nodes and "n1" in plan.jobs["b"].nodes
    assert len(plan.jobs["a"].nodes) == 2


def test_marginal_nodes_go_to_the_tenant_that_used_less_lately() -> None:
    cluster = nodes(3)
    a, b = job("a", "alice", at=1), job("b", "bob", at=2)
    plan = schedule(0, [a, b], cluster, {}, Tenants(usage={"alice": 100.0, "bob": 10.0}))
    assert len(plan.jobs["b"].nodes) == 2
    plan = schedule(0, [a, b], cluster, {}, Tenants(usage={"alice": 10.0, "bob": 100.0}))
    assert len(plan.jobs["a"].nodes) == 2


# -- properties -------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[JobRequest], list[NodeOffer], dict[str, Holding]]:
    n_nodes = draw(st.integers(0, 12))
    n_jobs = draw(st.integers(0, 6))
    jobs = []
    for i in range(n_jobs):
        lo = draw(st.integers(1, 5))
        jobs.append(
            JobRequest(
                f"j{i}",
                draw(st.sampled_from(["a", "b", "c"])),
                draw(st.sampled_from(list(Tier))),
                lo,
                draw(st.integers(lo, 8)),
                draw(st.integers(0, 100)),
            )
        )
    offers = []
    for i in range(n_nodes):
        rates = {j.job_id: draw(st.floats(0.5, 50)) for j in jobs if draw(st.booleans())}
        offers.append(NodeOffer(f"n{i}", draw(st.floats(0, 50)), rates))
    holdings = {}
    for o in offers:
        if jobs and draw(st.booleans()):
            holdings[o.node_id] = Holding(
                draw(st.sampled_from(jobs)).job_id,
                draw(st.integers(0, 200)),
                draw(st.one_of(st.none(), st.integers(0, 200))),
            )
    return jobs, offers, holdings


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 200))
def test_plans_keep_the_invariants_and_no_lower_tier_starves_a_higher_one(
    scenario: tuple[list[JobRequest], list[NodeOffer], dict[str, Holding]], now: int
) -> None:
    jobs, offers, holdings = scenario
    plan = schedule(now, jobs, offers, holdings, Tenants(weights={"a": 2.0}))
    # a node never given twice, max_nodes and min_nodes (gang) held, waiting = no nodes
    plan.check(jobs, offers)
    owners = plan.owners()
    by_id = {j.job_id: j for j in jobs}
    for j in jobs:
        p = plan.jobs[j.job_id]
        if not p.waiting:
            continue
        assert p.reason.startswith("waits: ")
        if j.min_nodes > len(offers):
            continue
        # a waiting job could not have its min_nodes from nodes that are free or held by
        # lower tiers
        usable = [n for n in (o.node_id for o in offers) if n not in owners]
        usable += [n for n, owner in owners.items() if by_id[owner].tier < j.tier]
        assert len(usable) < j.min_nodes, (j, p.reason)
    for m in plan.moves:
        assert m.from_job != m.to_job and m.reason


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_a_pass_is_deterministic_and_stable(
    scenario: tuple[list[JobRequest], list[NodeOffer], dict[str, Holding]],
) -> None:
    jobs, offers, holdings = scenario
    one = schedule(5, jobs, offers, holdings, Tenants())
    two = schedule(5, list(reversed(jobs)), list(reversed(offers)), holdings, Tenants())
    assert one.owners() == two.owners()
    # Nothing changed since, on nodes alike: the next pass moves no node, even unprotected.
    # (On nodes of different speeds it may: a node's worth then depends on the order nodes
    # are handed out in; the engine's protection bounds how often.)
    alike = [NodeOffer(o.node_id, 10.0) for o in offers]
    unprotected = {n: Holding(h.job_id) for n, h in holdings.items()}
    first = schedule(5, jobs, alike, unprotected, Tenants())
    again = schedule(6, jobs, alike, holdings_of(first), Tenants())
    assert again.owners() == first.owners() and not again.moves


@pytest.mark.parametrize(
    ("weights", "n_nodes"), [((1.0, 3.0), 10), ((1.0, 1.0), 5), ((2.0, 5.0), 9)]
)
def test_weights_are_honoured_in_the_long_run(weights: tuple[float, float], n_nodes: int) -> None:
    """Two tenants with endless demand; nodes that do not divide by the weights rotate, so
    the usage over many passes splits as the weights do (within a few percent)."""
    cluster = nodes(n_nodes)
    a, b = job("a", "alice", at=1, max_nodes=64), job("b", "bob", at=2, max_nodes=64)
    usage = TenantUsage(half_life_s=3600)
    tenants_w = {"alice": weights[0], "bob": weights[1]}
    holdings: dict[str, Holding] = {}
    total = {"alice": 0.0, "bob": 0.0}
    for step in range(400):
        now = step * 10_000
        plan = schedule(now, [a, b], cluster, holdings, Tenants(tenants_w, usage.snapshot(now)))
        plan.check([a, b], cluster)
        holdings = holdings_of(plan)
        for j, tenant in (("a", "alice"), ("b", "bob")):
            usage.add(tenant, plan.jobs[j].value * 10, now)
            total[tenant] += plan.jobs[j].value
    want = weights[0] / sum(weights)
    got = total["alice"] / sum(total.values())
    assert got == pytest.approx(want, abs=0.02), (got, want)


def test_a_high_priority_job_runs_at_the_first_pass_after_it_arrives() -> None:
    cluster = nodes(6)
    lows = [job(f"l{i}", f"t{i}", Tier.LOW, at=i) for i in range(3)]
    plan = schedule(0, lows, cluster, {}, Tenants())
    high = job("h", "vip", Tier.HIGH, min_nodes=6, max_nodes=6, at=10)
    plan2 = schedule(1, [*lows, high], cluster, holdings_of(plan, 10**9), Tenants())
    assert len(plan2.jobs["h"].nodes) == 6
    assert all(plan2.jobs[j.job_id].waiting for j in lows)


def test_a_node_not_benchmarked_on_a_job_is_estimated_from_nodes_of_its_kind() -> None:
    offers = [
        NodeOffer("a1", 100.0, {"j": 300.0}, kind="A"),
        NodeOffer("b1", 100.0, {"j": 100.0}, kind="B"),
        NodeOffer("a2", 100.0, kind="A"),  # 100 x 3.0 (kind A's ratio), not x median 2.0
        NodeOffer("c1", 100.0, kind="C"),  # no node of its kind measured: x median(3, 1) = 2
    ]
    rates = effective_rates([job("j")], offers)
    mean = (300 + 100 + 300 + 200) / 4
    assert rates[("a2", "j")] == pytest.approx(300 / mean)
    assert rates[("c1", "j")] == pytest.approx(200 / mean)


def test_a_job_alone_takes_its_fastest_nodes_and_moves_to_a_much_faster_free_one() -> None:
    offers = [NodeOffer("n0", 1.0, {"a": 10.0}), NodeOffer("n1", 1.0, {"a": 1.0})]
    a = job("a", max_nodes=1)
    assert schedule(0, [a], offers, {}, Tenants()).jobs["a"].nodes == ["n0"]
    # It holds the slow node (its hold has passed): the free one is 10x faster, worth a move.
    plan = schedule(100, [a], offers, {"n1": Holding("a", 0)}, Tenants())
    assert plan.jobs["a"].nodes == ["n0"]
    # ... but not for a node barely faster (a move costs a job benchmark).
    close = [NodeOffer("n0", 1.0, {"a": 1.2}), NodeOffer("n1", 1.0, {"a": 1.0})]
    assert schedule(100, [a], close, {"n1": Holding("a", 0)}, Tenants()).jobs["a"].nodes == ["n1"]


def test_with_nodes_to_spare_each_job_takes_the_nodes_fastest_for_it() -> None:
    rates = {"n0": (1.0, 0.6), "n1": (1.0, 0.6), "n2": (0.33, 1.0), "n3": (0.33, 1.0)}
    rates |= {"n4": (0.6, 0.33), "n5": (0.6, 0.33)}
    offers = [NodeOffer(n, 1.0, {"a": ra, "b": rb}) for n, (ra, rb) in rates.items()]
    a, b = job("a", "alice", max_nodes=2, at=1), job("b", "bob", max_nodes=2, at=2)
    plan = schedule(0, [a, b], offers, {}, Tenants())
    assert sorted(plan.jobs["a"].nodes) == ["n0", "n1"]
    assert sorted(plan.jobs["b"].nodes) == ["n2", "n3"]


def test_within_a_tenant_the_job_with_the_least_service_goes_first() -> None:
    cluster = nodes(4)
    old = JobRequest("old", "t", Tier.NORMAL, 1, 4, 0, attained_s=50_000.0)
    new = JobRequest("new", "t", Tier.NORMAL, 1, 4, 10, attained_s=0.0)
    plan = schedule(0, [old, new], cluster, {}, Tenants())
    # sizes unknown: the new job is expected to finish sooner and takes what it can use
    assert len(plan.jobs["new"].nodes) == 4 and plan.jobs["old"].waiting
    assert "jobs expected to finish sooner" in plan.jobs["old"].reason
    # ... but a protected node keeps the old job running at its min_nodes
    held = {"n00": Holding("old", 10**6)}
    plan = schedule(0, [old, new], cluster, held, Tenants())
    assert plan.jobs["old"].nodes == ["n00"] and len(plan.jobs["new"].nodes) == 3


def test_within_a_tenant_the_job_with_the_least_remaining_work_goes_first() -> None:
    cluster = nodes(6)  # 10 samples/s each
    long = JobRequest("long", "t", Tier.NORMAL, 2, 4, 0, remaining_samples=10_000.0)
    short = JobRequest("short", "t", Tier.NORMAL, 2, 4, 10, remaining_samples=500.0)
    other = JobRequest("other", "u", Tier.NORMAL, 1, 8, 20, remaining_samples=1e9)
    plan = schedule(0, [long, short, other], cluster, {}, Tenants())
    plan.check([long, short, other], cluster)
    # the tenants split 3/3 (fairness first); t's 3 go to its shorter job, and the longer
    # one's gang of 2 does not fit in what is left
    assert len(plan.jobs["short"].nodes) == 3 and len(plan.jobs["other"].nodes) == 3
    assert plan.jobs["long"].waiting
    # remaining work counts in node-equivalent seconds: samples over the job's mean rate
    fast = [NodeOffer(n.node_id, 10.0, {"long": 1000.0, "short": 10.0}) for n in cluster]
    plan = schedule(0, [long, short], fast, {}, Tenants())
    assert len(plan.jobs["long"].nodes) == 4 and len(plan.jobs["short"].nodes) == 2


def test_jobs_swap_nodes_when_both_run_faster() -> None:
    # a holds n0, n1 (3x faster for b); b holds n2, n3 (3x faster for a)
    offers = [
        NodeOffer("n0", 10.0, {"a": 10.0, "b": 30.0}),
        NodeOffer("n1", 10.0, {"a": 10.0, "b": 30.0}),
        NodeOffer("n2", 10.0, {"a": 30.0, "b": 10.0}),
        NodeOffer("n3", 10.0, {"a": 30.0, "b": 10.0}),
    ]
    a, b = job("a", "alice", max_nodes=2, at=1), job("b", "bob", max_nodes=2, at=2)
    held = {"n0": Holding("a"), "n1": Holding("a"), "n2": Holding("b"), "n3": Holding("b")}
    plan = schedule(0, [a, b], offers, held, Tenants())
    plan.check([a, b], offers)
    assert sorted(plan.jobs["a"].nodes) == ["n2", "n3"]
    assert sorted(plan.jobs["b"].nodes) == ["n0", "n1"]
    assert len(plan.moves) == 4 and all("both jobs run faster" in m.reason for m in plan.moves)
    # protected nodes stay (hysteresis); no swap where one job would lose (b: 10 for 30)
    protected = {n: Holding(h.job_id, 10**6) for n, h in held.items()}
    assert not schedule(0, [a, b], offers, protected, Tenants()).moves
    lopsided = [
        NodeOffer(o.node_id, 10.0, {"a": o.job_rates["a"], "b": 40.0 - o.job_rates["b"]})
        for o in offers
    ]
    assert not schedule(0, [a, b], lopsided, held, Tenants()).moves


def test_a_new_tenant_gets_half_however_much_the_first_one_used() -> None:
    cluster = [NodeOffer(f"n{i}", 1000.0, {"a": 100.0}) for i in range(4)]
    a, b = job("a", "alice", at=0), job("b", "bob", at=10)
    held = {f"n{i}": Holding("a") for i in range(4)}
    plan = schedule(10**6, [a, b], cluster, held, Tenants(usage={"alice": 1e6}))
    assert len(plan.jobs["a"].nodes) == 2 and len(plan.jobs["b"].nodes) == 2


def test_absurd_rates_stay_finite() -> None:
    """A tiny reference rate with a real job rate scales other nodes' guesses past float range
    (found by hypothesis): the estimates are clipped, the pass still plans."""
    jobs = [
        JobRequest("j0", "a", Tier.LOW, 1, 1, 0),
        JobRequest("j1", "a", Tier.LOW, 1, 1, 0),
    ]
    offers = [
        NodeOffer("n7", 4.0),
        NodeOffer("n8", 17.0),
        NodeOffer("n9", 5.164082907092123e-306, {"j0": 45.0}),
    ]
    plan = schedule(5, jobs, offers, {}, Tenants())
    plan.check(jobs, offers)
    rates = effective_rates(jobs, offers)
    assert all(math.isfinite(v) and v > 0 for v in rates.values())


# -- the market: price caps and price-performance ------------------------------------------------


def test_a_node_above_a_jobs_max_price_never_serves_it_and_the_job_says_why() -> None:
    offers = [
        NodeOffer("cheap", 10.0, price=1_000_000),
        NodeOffer("dear", 100.0, price=9_000_000),
        NodeOffer("free", 5.0),
    ]
    capped = JobRequest("a", "t", Tier.NORMAL, 1, 8, 0, max_price=2_000_000)
    plan = schedule(0, [capped], offers, {}, Tenants())
    assert sorted(plan.jobs["a"].nodes) == ["cheap", "free"]
    # held, even protected: a node whose price rose above the cap leaves the job
    held = {"dear": Holding("a", 10**6)}
    assert "dear" not in schedule(0, [capped], offers, held, Tenants()).jobs["a"].nodes
    # a cap under every node's price but the donated one: min_nodes 2 cannot be met
    two = JobRequest("b", "t", Tier.NORMAL, 2, 8, 0, max_price=500_000)
    waiting = schedule(0, [two], offers, {}, Tenants()).jobs["b"]
    assert waiting.waiting
    assert waiting.reason == (
        "waits: 1 of the 3 eligible node(s) ask at most its max_price of 0.5 credits/h; it "
        "needs 2 (min_nodes)"
    )


def test_a_budget_job_prefers_samples_per_credit_and_a_deadline_job_speed() -> None:
    offers = [
        NodeOffer("fast-dear", 100.0, price=10_000_000),  # 10 samples/s per credit/h
        NodeOffer("slow-cheap", 40.0, price=1_000_000),  # 40
        NodeOffer("mid", 60.0, price=3_000_000),  # 20
    ]
    thrifty = JobRequest("a", "t", Tier.NORMAL, 1, 2, 0, per_credit=True)
    assert sorted(schedule(0, [thrifty], offers, {}, Tenants()).jobs["a"].nodes) == [
        "mid",
        "slow-cheap",
    ]
    hurried = JobRequest("a", "t", Tier.NORMAL, 1, 2, 0, per_credit=False)
    assert sorted(schedule(0, [hurried], offers, {}, Tenants()).jobs["a"].nodes) == [
        "fast-dear",
        "mid",
    ]


def test_no_swap_gives_a_job_a_node_it_cannot_afford() -> None:
    offers = [
        NodeOffer("n0", 10.0, {"a": 10.0, "b": 30.0}),
        NodeOffer("n1", 10.0, {"a": 30.0, "b": 10.0}, price=5_000_000),
    ]
    a = JobRequest("a", "alice", Tier.NORMAL, 1, 1, 1, max_price=1_000_000)
    b = JobRequest("b", "bob", Tier.NORMAL, 1, 1, 2)
    plan = schedule(0, [a, b], offers, {"n0": Holding("a"), "n1": Holding("b")}, Tenants())
    assert plan.jobs["a"].nodes == ["n0"] and plan.jobs["b"].nodes == ["n1"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_no_job_ever_holds_a_node_above_its_max_price(
    scenario: tuple[list[JobRequest], list[NodeOffer], dict[str, Holding]], data: st.DataObject
) -> None:
    jobs, offers, holdings = scenario
    prices = [0, 1_000_000, 2_000_000, 5_000_000]
    offers = [
        NodeOffer(
            o.node_id, o.reference_rate, o.job_rates, price=data.draw(st.sampled_from(prices))
        )
        for o in offers
    ]
    jobs = [
        JobRequest(
            j.job_id,
            j.tenant,
            j.tier,
            j.min_nodes,
            j.max_nodes,
            j.submitted_ms,
            max_price=data.draw(st.sampled_from([None, *prices])),
            per_credit=data.draw(st.booleans()),
        )
        for j in jobs
    ]
    plan = schedule(50, jobs, offers, holdings, Tenants())
    plan.check(jobs, offers)
    price = {o.node_id: o.price for o in offers}
    for j in jobs:
        for n in plan.jobs[j.job_id].nodes:
            assert j.affords(price[n]), (j, n, price[n])
