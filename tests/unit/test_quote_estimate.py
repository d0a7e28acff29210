"""The quote of a job not yet submitted (coordinator/market/quote_estimate.py, pure): the step
model (a fixed cost per step plus the program's FLOPs at an efficiency, fitted on measured
steps), the scheduler's node set, rounds, fixed costs and the billing rule."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from coordinator.accounting.billing import earned_micro
from coordinator.market.quote_estimate import (
    CALIBRATED,
    CALIBRATED_ANY,
    DEFAULT,
    DEFAULT_OVERHEAD_PER_COMPUTE,
    DEFAULT_ROUND_OVERHEAD_S,
    DEFAULT_STEP,
    SAME_PROGRAM,
    Cluster,
    History,
    Measured,
    Node,
    Program,
    QuotedJob,
    StepModel,
    bench_seconds,
    estimate,
    fit_step_model,
    job_history,
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
    """A step of ``batch`` samples as a device of (fixed, eff) and reference rate ``ref``
    takes it."""
    seconds = (fixed + batch * flops / eff) / (ref * REF)
    return Measured(kind, program, flops, batch, seconds, ref)


def test_a_step_is_a_fixed_cost_plus_the_programs_flops_at_an_efficiency() -> None:
    node = Node("n1", "cpu:2", reference_rate=100_000.0)
    model = StepModel(fixed_flops=REF * 50, efficiency=0.5, source=DEFAULT)
    # At batch 100 of a 10-reference-FLOP program: (50 + 100 x 10 / 0.5) reference samples.
    assert model.seconds(node.flops, 100, REF * 10) == pytest.approx(2050 / 100_000)
    assert model.rate(node.flops, 100, REF * 10) == pytest.approx(100 / (2050 / 100_000))
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
        truth = 64 / ((fixed + 64 * flops / eff) / node.flops)
        assert predicted_rate(node, Program(flops), steps, 64)[0] == pytest.approx(truth, rel=1e-4)
    # Nodes of the same model at another speed: the same fit (both terms scale with it).
    slow = [measured("cpu", "s", REF, b, fixed, eff, ref=25.0) for b in (16, 256)]
    both = step_model("cpu", Program(REF), steps + slow)
    assert both.efficiency == pytest.approx(eff, rel=1e-4)


def test_points_of_one_size_fit_the_efficiency_under_the_prior_fixed_cost() -> None:
    one = [measured("cpu", "p", REF * 1000, 64, REF * 100, 0.5)]
    model = fit_step_model([(64 * REF * 1000, one[0].seconds * 100 * REF)], CALIBRATED)
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
    same = [measured("cpu:2", "p", REF * 4, b, REF * 30, 0.4) for b in (16, 64)]
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
    truth = 32 / ((REF * 30 + 32 * REF * 4 / 0.4) / node.flops)
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
    prog = Program(flops_per_sample=REF, sha256="x", state_bytes=0)
    # eff 0.1, no fixed cost: a node does a tenth of its reference samples/s at any batch.
    steps = [measured("cpu", "x", REF, b, 0.0, 0.1, ref=1000.0) for b in (16, 64)]
    est = estimate(0, job(), prog, nodes, Cluster(), steps)
    assert est.fits and [n.node_id for n in est.nodes] == ["a", "b"]
    rates = {n.node_id: n.rate for n in est.nodes}
    assert rates == {"a": pytest.approx(100.0), "b": pytest.approx(300.0)}
    assert {n.node_id: n.local_batch for n in est.nodes} == {"a": 16, "b": 48}
    # 1000 samples / 64: 15 full rounds and one of 40, per epoch.
    assert est.rounds == 16 * 3 and est.checkpoints == 4
    full = max(16 / 100.0, 48 / 300.0)
    last = max(10 / 100.0, 30 / 300.0)
    k = DEFAULT_OVERHEAD_PER_COMPUTE  # a round's overhead grows with its compute
    epoch = 15 * (full * (1 + k) + DEFAULT_ROUND_OVERHEAD_S)
    epoch += last * (1 + k) + DEFAULT_ROUND_OVERHEAD_S
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
    # created 0, first round at 5 s, last round ends at 25 s, 100 rounds of 0.1 s compute:
    # 0.1 s overhead a round. One job: the default per-compute part, the fixed part the rest
    # (never below 0).
    k = DEFAULT_OVERHEAD_PER_COMPUTE
    history = job_history([(0, 5000, 25_000, 100, 10.0, 2.0), (0, 0, 0, 0, 0.0, 0.0)])
    assert history.jobs == 1 and history.overhead_per_compute == k
    assert history.round_overhead_s == pytest.approx(max(0.0, 0.1 - k * 0.1))
    # Its job benchmark took 2 s of its 5 s start: the fixed start is 3 s.
    assert history.start_s == 3.0
    one = job_history([(0, 1000, 2000, 10, 0.01, 0.0)])  # 0.099 s a round over 0.001 compute
    assert one.round_overhead_s == pytest.approx(0.1 - 0.001 - k * 0.001)
    assert job_history([]) == History()
    # Jobs of light and heavy rounds: both parts fitted (here 0.05 s + 2 x compute; a round
    # takes compute x 3 + 0.05 s).
    jobs = [
        (0, 1000, 1000 + round(100 * (c * 3 + 0.05) * 1000), 100, 100 * c, 0.0) for c in (0.01, 0.1)
    ]
    fitted = job_history(jobs)
    assert fitted.round_overhead_s == pytest.approx(0.05, rel=1e-3)
    assert fitted.overhead_per_compute == pytest.approx(2.0, rel=1e-3)
    nodes = [Node("a", "cpu", 1000.0)]
    history = History(round_overhead_s=0.1, overhead_per_compute=0.0, start_s=3.0, jobs=1)
    est = estimate(0, job(), Program(REF), nodes, Cluster(), [], history)
    bench = bench_seconds(nodes[0], DEFAULT_STEP, REF)
    assert est.overhead_source == "recorded" and est.start_s == pytest.approx(3.0 + bench)
    assert est.round_overhead_s == pytest.approx(0.1)


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
