"""The quote of a job not yet submitted (coordinator/market/quote_estimate.py, pure): the step
model (a fixed cost per step plus the program's FLOPs at an efficiency, fitted on measured
steps), the scheduler's node set, rounds, fixed costs and the billing rule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from coordinator.accounting.billing import earned_micro
from coordinator.market.quote_estimate import (
    CALIBRATED,
    CALIBRATED_ANY,
    DEFAULT,
    DEFAULT_NODE_SHARE,
    DEFAULT_STEP,
    ROUND_BYTE_PASSES,
    ROUND_FIXED_FLOPS,
    ROUND_RTTS,
    SAME_PROGRAM,
    START_RTTS,
    Cluster,
    History,
    Measured,
    Node,
    Program,
    QuotedJob,
    StepModel,
    bench_seconds,
    default_overhead,
    estimate,
    fit_step_model,
    job_history,
    part_passes,
    predicted_rate,
    step_model,
)
from coordinator.scheduling.cluster_scheduler import Holding, JobRequest, Tier
from epochmesh.quote import REFERENCE_FLOPS_PER_SAMPLE
from node_agent.training.reference_model import build_reference_model

pytestmark = pytest.mark.timeout(60)

REF = REFERENCE_FLOPS_PER_SAMPLE


def job(**kw: object) -> QuotedJob:
    base: dict[str, object] = dict(
        tenant="t",
        priority=Tier.NORMAL,
        min_nodes=1,
        max_nodes=8,
        global_batch=64,
        epochs=3,
        num_samples=1000,
        checkpoint_every=10,
        max_price=None,
        per_credit=False,
    )
    base.update(kw)
    return QuotedJob(**base)  # type: ignore[arg-type]


def test_the_reference_models_flops_are_counted_as_a_programs_are() -> None:
    model = build_reference_model()
    x, y = torch.randn(8, 128), torch.randint(0, 10, (8,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
    assert counter.get_total_flops() / 8 == REF


def measured(
    kind: str, program: str, flops: float, batch: int, fixed: float, eff: float, ref: float = 100.0
) -> Measured:
    """A round's part of ``batch`` samples as a device of (fixed, eff) and reference rate
    ``ref`` takes it: its verification chunks' passes each pay the fixed cost."""
    seconds = (part_passes(batch) * fixed + batch * flops / eff) / (ref * REF)
    return Measured(kind, program, flops, batch, seconds, ref)


def test_a_step_is_a_fixed_cost_plus_the_programs_flops_at_an_efficiency() -> None:
    node = Node("n1", "cpu:2", reference_rate=100_000.0)
    model = StepModel(fixed_flops=REF * 50, efficiency=0.5, source=DEFAULT)
    # At batch 100 of a 10-reference-FLOP program, a part of 24 chunks: (24 x 50 + 100 x 10 /
    # 0.5) reference samples; one pass (the job benchmark's steps): (50 + 2000).
    assert part_passes(100) == 24 and part_passes(10) == 5 and part_passes(1) == 1
    assert model.seconds(node.flops, 100, REF * 10) == pytest.approx(3200 / 100_000)
    assert model.seconds(node.flops, 100, REF * 10, passes=1) == pytest.approx(2050 / 100_000)
    assert model.rate(node.flops, 100, REF * 10) == pytest.approx(100 / (3200 / 100_000))
    # A small batch is slower per sample: the fixed cost weighs more.
    assert model.rate(node.flops, 10, REF * 10) < model.rate(node.flops, 100, REF * 10)
    rate, source = predicted_rate(node, Program(REF * 10), [], batch=100)
    assert source == DEFAULT
    assert rate == pytest.approx(DEFAULT_STEP.rate(node.flops, 100, REF * 10))
    assert predicted_rate(Node("n2", "cpu:2", 0.0), Program(REF), [])[0] == 0.0
    assert predicted_rate(node, Program(0.0), [])[0] == 0.0


def test_the_fit_recovers_fixed_cost_and_efficiency_across_programs() -> None:
    fixed, eff = DEFAULT_STEP.fixed_flops, 0.4  # the anchor of the fit is on this line
    steps = [
        measured("cpu", p, flops, b, fixed, eff)
        for p, flops in (("small", REF * 2), ("big", REF * 40))
        for b in (32, 128)
    ]
    model = step_model("cpu", Program(REF * 10, "new"), steps)
    assert model.source == CALIBRATED and model.points == 5  # and the anchor
    assert model.fixed_flops == pytest.approx(fixed, rel=1e-4)
    assert model.efficiency == pytest.approx(eff, rel=1e-4)
    # So a third program is predicted as the device runs it, small or big.
    node = Node("n", "cpu", 100.0)
    for flops in (REF * 0.01, REF * 10, REF * 1000):
        truth = 64 / ((part_passes(64) * fixed + 64 * flops / eff) / node.flops)
        assert predicted_rate(node, Program(flops), steps, 64)[0] == pytest.approx(truth, rel=1e-4)
    # Nodes of the same model at another speed: the same fit (both terms scale with it).
    slow = [measured("cpu", "s", REF, b, fixed, eff, ref=25.0) for b in (16, 256)]
    both = step_model("cpu", Program(REF), steps + slow)
    assert both.efficiency == pytest.approx(eff, rel=1e-4)


def test_points_of_one_size_fit_the_efficiency_under_the_prior_fixed_cost() -> None:
    one = [measured("cpu", "p", REF * 1000, 64, REF * 100, 0.5)]
    passes = part_passes(64)  # fitted per pass, as step_model does
    model = fit_step_model(
        [(64 * REF * 1000 / passes, one[0].seconds * 100 * REF / passes)], CALIBRATED
    )
    assert model is not None
    # The default fixed cost is kept (it is under half the step) and the slope fits the rest.
    assert model.fixed_flops == DEFAULT_STEP.fixed_flops
    expected = model.seconds(100 * REF, 64, REF * 1000)
    assert expected == pytest.approx(one[0].seconds)
    # A prior fixed cost over half the step is cut to half of it.
    tiny = fit_step_model([(1.0, DEFAULT_STEP.fixed_flops)], CALIBRATED)
    assert tiny is not None and tiny.fixed_flops == DEFAULT_STEP.fixed_flops / 2
    assert fit_step_model([], CALIBRATED) is None
    assert fit_step_model([(1.0, -1.0), (math.nan, 2.0)], CALIBRATED) is None
    # A negative intercept is clipped: the line through the origin.
    line = fit_step_model([(1.0, 1.0), (2.0, 2.5), (4.0, 5.5)], CALIBRATED)
    assert line is not None and line.fixed_flops == 0.0 and line.efficiency > 0


def test_calibration_prefers_the_same_program_then_the_device_model() -> None:
    prog = Program(flops_per_sample=REF * 4, sha256="p")
    fixed = DEFAULT_STEP.fixed_flops
    other = [measured("cpu:2", "q", REF * 200, b, fixed, 0.2) for b in (16, 64)]
    elsewhere = [measured("gpu", "r", REF * 100, b, fixed, 0.5) for b in (16, 64)]
    # The same program, its FLOPs not recorded with its steps.
    # (Batches whose FLOPs per pass spread: parts under 48 samples run one pass per 2 samples.)
    same = [measured("cpu:2", "p", REF * 4, b, REF * 30, 0.4) for b in (16, 256)]
    same = [Measured(m.kind, m.program, 0.0, m.batch, m.seconds, 100.0) for m in same]
    assert step_model("cpu:2", prog, other + elsewhere).source == CALIBRATED
    assert step_model("cpu:2", prog, other + elsewhere).efficiency == pytest.approx(0.2, rel=0.01)
    assert step_model("tpu", prog, other + elsewhere).source == CALIBRATED_ANY
    mine = step_model("cpu:2", prog, other + same)
    assert mine.source == SAME_PROGRAM
    assert (mine.fixed_flops, mine.efficiency) == (pytest.approx(REF * 30), pytest.approx(0.4))
    assert step_model("cpu:2", prog, []) == DEFAULT_STEP
    # The same program measured predicts its speed again, its FLOPs known or not.
    node = Node("n", "cpu:2", 100.0)
    truth = 32 / ((part_passes(32) * REF * 30 + 32 * REF * 4 / 0.4) / node.flops)
    assert predicted_rate(node, prog, same, 32)[0] == pytest.approx(truth)
    assert predicted_rate(node, Program(0.0, "p"), same, 32) == (pytest.approx(truth), SAME_PROGRAM)


def test_the_job_benchmark_follows_its_plan() -> None:
    model = StepModel(0.0, 1.0, DEFAULT)
    node = Node("n", "cpu", 1000.0)  # a step of b samples of the reference: b / 1000 s
    full = sum(3 * b / 1000 + min(20 * b / 1000, 10 + b / 1000) for b in (16, 64, 256))
    assert bench_seconds(node, model, REF) == pytest.approx(full)
    quick = Node("q", "cpu", 1000.0, quick_bench=True)
    short = sum(2 * b / 1000 + min(5 * b / 1000, 2 + b / 1000) for b in (16, 64, 256))
    assert bench_seconds(quick, model, REF) == pytest.approx(short)


def test_rounds_time_and_cost_follow_the_spec_and_the_billing_rule() -> None:
    nodes = [
        Node("a", "cpu", reference_rate=1000.0, price=3_000_000),
        Node("b", "cpu", reference_rate=3000.0, price=1_000_000),
    ]
    prog = Program(flops_per_sample=REF, sha256="x", state_bytes=10**6)
    # eff 0.1, no fixed cost: a node does a tenth of its reference samples/s at any batch.
    steps = [measured("cpu", "x", REF, b, 0.0, 0.1, ref=1000.0) for b in (16, 256)]
    est = estimate(0, job(), prog, nodes, Cluster(), steps)
    assert est.fits and [n.node_id for n in est.nodes] == ["a", "b"]
    rates = {n.node_id: n.rate for n in est.nodes}
    assert rates == {"a": pytest.approx(100.0), "b": pytest.approx(300.0)}
    assert {n.node_id: n.local_batch for n in est.nodes} == {"a": 16, "b": 48}
    # 1000 samples / 64: 15 full rounds and one of 40, per epoch.
    assert est.rounds == 16 * 3 and est.checkpoints == 4
    full = max(16 / 100.0, 48 / 300.0)
    last = max(10 / 100.0, 30 / 300.0)
    # Nothing recorded: a round's overhead from the slowest node's speed (a: 1000 samples/s)
    # and, nodes without a measured bandwidth, the fallback's, per byte of the parameters.
    fixed, per_byte = default_overhead(nodes)
    assert fixed == pytest.approx(ROUND_FIXED_FLOPS / (1000.0 * REF))
    # One node's, and DEFAULT_NODE_SHARE of it for the second node.
    overhead = (1 + DEFAULT_NODE_SHARE) * (fixed + per_byte * 10**6)
    assert est.round_overhead_s == pytest.approx(overhead) and est.overhead_source == "default"
    epoch = 15 * (full + overhead) + last + overhead
    assert est.epoch_seconds == pytest.approx(epoch)
    assert est.total_seconds == pytest.approx(
        est.start_s + 3 * epoch + est.checkpoints * est.checkpoint_s
    )
    cost = 15 * (earned_micro(3_000_000, 16, 100.0) + earned_micro(1_000_000, 48, 300.0))
    cost += earned_micro(3_000_000, 10, 100.0) + earned_micro(1_000_000, 30, 300.0)
    assert est.epoch_cost == cost and est.total_cost == 3 * cost and est.fee == 0
    # A platform fee comes on top, per part.
    with_fee = estimate(0, job(), prog, nodes, Cluster(), steps, fee_ppm=100_000)
    assert with_fee.total_cost > est.total_cost and with_fee.fee > 0


def test_a_fixed_step_cost_makes_more_nodes_cost_more_per_sample() -> None:
    # The cost per sample grows as the local batch shrinks: the fixed cost is paid per step.
    prog = Program(REF, "x")
    steps = [measured("cpu", "x", REF, b, REF * 200, 0.5, ref=1000.0) for b in (16, 256)]
    one = estimate(
        0, job(max_nodes=1), prog, [Node("a", "cpu", 1000.0, price=10**6)], Cluster(), steps
    )
    nodes = [Node(n, "cpu", 1000.0, price=10**6) for n in ("a", "b", "c", "d")]
    four = estimate(0, job(), prog, nodes, Cluster(), steps)
    assert len(four.nodes) == 4 and all(n.local_batch == 16 for n in four.nodes)
    assert four.total_cost > one.total_cost
    assert four.round_compute_s > one.round_compute_s / 4


def test_recorded_jobs_replace_the_default_fixed_costs() -> None:
    # created 0, first round at 5 s, last round ends at 25 s, 100 rounds of 0.1 s compute,
    # 1 MB of parameters: 0.1 s overhead a round. One job: the per-byte part is the default
    # given (None in the history: the nodes' own), the fixed part the rest (never below 0).
    per_byte = 2e-8
    history = job_history(
        [(0, 5000, 25_000, 100, 10.0, 2.0, 10**6, 1), (0, 0, 0, 0, 0.0, 0.0, 0, 1)], per_byte
    )
    assert history.jobs == 1 and history.overhead_per_byte is None
    assert history.round_overhead_s == pytest.approx(0.1 - per_byte * 10**6)
    # Its job benchmark took 2 s of its 5 s start: the fixed start is 3 s.
    assert history.start_s == 3.0
    one = job_history([(0, 1000, 2000, 10, 0.01, 0.0, 10**8, 1)], per_byte)  # 0.099 s a round
    assert one.round_overhead_s == 0.0  # its bytes' part alone is more: never below 0
    assert job_history([]) == History()
    # Jobs of small and large parameters: both parts fitted (here 0.05 s + 1e-7 s per byte),
    # whatever their compute.
    jobs = [
        (0, 1000, 1000 + round(100 * (c + n * (0.05 + 1e-7 * b)) * 1000), 100, 100 * c, 0.0, b, n)
        for c, b, n in ((0.1, 10**4, 1), (0.01, 10**6, 2))
    ]
    fitted = job_history(jobs, per_byte)  # per node: a job of two nodes pays it twice
    assert fitted.round_overhead_s == pytest.approx(0.05, rel=1e-2)
    assert fitted.overhead_per_byte == pytest.approx(1e-7, rel=1e-2)
    nodes = [Node("a", "cpu", 1000.0)]
    history = History(round_overhead_s=0.1, overhead_per_byte=0.0, start_s=3.0, jobs=1)
    est = estimate(0, job(), Program(REF, state_bytes=10**6), nodes, Cluster(), [], history)
    bench = bench_seconds(nodes[0], DEFAULT_STEP, REF)
    assert est.overhead_source == "recorded" and est.start_s == pytest.approx(3.0 + bench)
    assert est.round_overhead_s == pytest.approx(0.1)


@settings(max_examples=60, deadline=None)
@given(
    fixed=st.floats(0.0, 1.0),
    per_byte=st.floats(0.0, 1e-6),
    sizes=st.lists(st.integers(1, 10**8), min_size=2, max_size=6, unique=True),
    computes=st.lists(st.floats(0.0, 2.0), min_size=6, max_size=6),
)
def test_the_overhead_fit_recovers_its_parts_from_jobs_of_spread_sizes(
    fixed: float, per_byte: float, sizes: list[int], computes: list[float]
) -> None:
    """Jobs whose overhead is exactly fixed + per_byte x bytes give back both parts (when the
    sizes spread), or, sizes too close, the fixed part under the given per-byte cost; never a
    negative part, and the compute does not enter."""
    jobs = []
    for b, c in zip(sizes, computes, strict=False):
        # Enough rounds that the record's whole milliseconds blur an overhead of microseconds a
        # round by well under the tolerance (with 50 rounds a fixed part of 10 us a round read
        # as 20 us, and the relative fit missed by 10 %).
        rounds = 10_000
        wall_ms = round(rounds * (c + fixed + per_byte * b) * 1000) + 1
        jobs.append((0, 1000, 1000 + wall_ms, rounds, rounds * c, 0.0, b, 1))
    h = job_history(jobs, per_byte)
    assert h.jobs == len(jobs) and h.round_overhead_s is not None
    assert h.round_overhead_s >= 0 and (h.overhead_per_byte or 0.0) >= 0
    slope = h.overhead_per_byte if h.overhead_per_byte is not None else per_byte
    for b, c in zip(sizes, computes, strict=False):
        want = fixed + per_byte * b
        got = h.round_overhead_s + slope * b
        assert got == pytest.approx(want, rel=0.05, abs=2e-3), (b, c)


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(1.0, 1e7),
    slower=st.floats(1.0, 100.0),
    bandwidth=st.floats(1e3, 1e11),
    state=st.integers(0, 10**9),
)
def test_the_default_overhead_follows_the_slowest_nodes_measurements(
    rate: float, slower: float, bandwidth: float, state: int
) -> None:
    fast = Node("f", "cpu", rate, bandwidth=bandwidth * 2)
    slow = Node("s", "cpu", rate / slower, bandwidth=bandwidth)
    fixed, per_byte = default_overhead([fast, slow])
    assert fixed == pytest.approx(ROUND_FIXED_FLOPS / slow.flops)
    assert per_byte == pytest.approx(ROUND_BYTE_PASSES / bandwidth)
    # Faster nodes and a wider link never make a round's overhead longer.
    f2, b2 = default_overhead([Node("x", "cpu", rate * 2, bandwidth=bandwidth * 2)])
    assert f2 + b2 * state <= fixed + per_byte * state * (1 + 1e-12)
    assert default_overhead([Node("z", "cpu", 0.0)])[0] == 0.0  # no benchmark: no figure


@settings(max_examples=60, deadline=None)
@given(rtt=st.floats(1e-5, 1.0), other=st.floats(1e-5, 1.0), rate=st.floats(1.0, 1e7))
def test_a_measured_rtt_sets_the_default_round_and_start_costs(
    rtt: float, other: float, rate: float
) -> None:
    """A round and the start are chains of hand-overs: before any record, their fixed parts
    are round trips at the slowest measured RTT (whatever the nodes' FLOP/s)."""
    nodes = [Node("a", "cpu", rate, rtt_s=rtt), Node("b", "cpu", rate * 2, rtt_s=other)]
    fixed, _ = default_overhead(nodes)
    assert fixed == pytest.approx(ROUND_RTTS * max(rtt, other))
    one = [Node("a", "cpu", rate, price=0, rtt_s=rtt)]
    est = estimate(0, job(max_nodes=1), Program(REF, "x"), one, Cluster())
    bench = bench_seconds(one[0], DEFAULT_STEP, REF)
    assert est.start_s == pytest.approx(START_RTTS * rtt + bench)
    assert est.round_overhead_s == pytest.approx(ROUND_RTTS * rtt)  # no parameters
    slower = estimate(
        0, job(max_nodes=1), Program(REF, "x"), [Node("a", "cpu", rate, rtt_s=rtt * 2)], Cluster()
    )
    assert slower.total_seconds > est.total_seconds


@settings(max_examples=40, deadline=None)
@given(
    state=st.integers(0, 10**8),
    more=st.integers(1, 10**8),
    rate=st.floats(10.0, 1e6),
)
def test_a_quote_is_longer_for_more_parameters_and_adds_up(
    state: int, more: int, rate: float
) -> None:
    nodes = [Node("a", "cpu", rate, price=10**6, bandwidth=1e8)]
    small = estimate(0, job(), Program(REF, "x", state), nodes, Cluster())
    big = estimate(0, job(), Program(REF, "x", state + more), nodes, Cluster())
    assert big.round_overhead_s > small.round_overhead_s
    assert big.total_seconds > small.total_seconds
    assert big.total_cost == small.total_cost  # billing counts compute only
    for est in (small, big):
        rounds = est.rounds // 3
        assert est.total_seconds == pytest.approx(
            est.start_s + 3 * est.epoch_seconds + est.checkpoints * est.checkpoint_s
        )
        assert est.epoch_seconds >= rounds * est.round_overhead_s * (1 - 1e-9)


def test_the_node_set_is_the_schedulers() -> None:
    nodes = [Node(n, "cpu", 1000.0, price=p) for n, p in (("a", 0), ("b", 5), ("c", 50))]
    prog = Program(REF)
    # max_nodes 2 without a budget: the fastest two the scheduler gives (all equal: by id).
    est = estimate(0, job(max_nodes=2, max_price=0), prog, nodes, Cluster())
    assert [n.node_id for n in est.nodes] == ["a"]  # only the donated one is affordable
    est = estimate(0, job(max_nodes=2, max_price=10), prog, nodes, Cluster())
    assert sorted(n.node_id for n in est.nodes) == ["a", "b"]
    # A live job holding a and b (protected): the quoted job gets c, or waits for two.
    live = JobRequest("j-live", "other", Tier.NORMAL, 2, 2, submitted_ms=0)
    held = {n: Holding("j-live", protected_until_ms=10**12) for n in ("a", "b")}
    cluster = Cluster(jobs=[live], holdings=held)
    est = estimate(1, job(), prog, nodes, cluster)
    assert [n.node_id for n in est.nodes] == ["c"]
    waits = estimate(1, job(min_nodes=2), prog, nodes, cluster)
    assert not waits.fits and waits.reason.startswith("waits")
    assert math.isinf(waits.total_seconds) and waits.total_cost == 0
