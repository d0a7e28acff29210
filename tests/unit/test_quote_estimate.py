"""The quote of a job not yet submitted (coordinator/market/quote_estimate.py, pure): rates
from the program's FLOPs and the nodes' reference FLOP/s, calibration, the scheduler's node
set, rounds, fixed costs and the billing rule."""

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
    DEFAULT_EFFICIENCY,
    DEFAULT_ROUND_OVERHEAD_S,
    SAME_PROGRAM,
    Cluster,
    History,
    Measured,
    Node,
    Program,
    QuotedJob,
    efficiency,
    estimate,
    job_history,
    predicted_rate,
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


def test_a_nodes_rate_is_its_reference_flops_times_efficiency_over_the_programs() -> None:
    node = Node("n1", "cpu:2", reference_rate=100_000.0)
    rate, source = predicted_rate(node, Program(flops_per_sample=REF * 10), [])
    assert source == DEFAULT
    assert rate == pytest.approx(100_000 / 10 * DEFAULT_EFFICIENCY)
    assert predicted_rate(Node("n2", "cpu:2", 0.0), Program(REF), []) == (0.0, "none")
    assert predicted_rate(node, Program(0.0), []) == (0.0, "none")


def test_calibration_prefers_the_same_program_then_the_device_model() -> None:
    prog = Program(flops_per_sample=REF * 4, sha256="p")
    other = Measured("cpu:2", "q", REF * 2, rate=10.0, reference_rate=100.0)  # eff 0.2
    elsewhere = Measured("gpu", "r", REF, rate=50.0, reference_rate=100.0)  # eff 0.5
    same = Measured("cpu:2", "p", 0.0, rate=5.0, reference_rate=100.0)  # eff 5*4/100 = 0.2
    assert efficiency("cpu:2", prog, [other, elsewhere]) == (pytest.approx(0.2), CALIBRATED)
    assert efficiency("tpu", prog, [other, elsewhere]) == (pytest.approx(0.35), CALIBRATED_ANY)
    same_fast = Measured("cpu:2", "p", 0.0, rate=10.0, reference_rate=100.0)  # eff 0.4
    assert efficiency("cpu:2", prog, [other, same_fast]) == (pytest.approx(0.4), SAME_PROGRAM)
    assert efficiency("cpu:2", prog, [same]) == (pytest.approx(0.2), SAME_PROGRAM)
    assert efficiency("cpu:2", prog, []) == (DEFAULT_EFFICIENCY, DEFAULT)
    # The same program measured at a node's speed predicts that speed again on its model.
    rate, _ = predicted_rate(Node("n", "cpu:2", 100.0), prog, [same_fast])
    assert rate == pytest.approx(10.0)


def test_rounds_time_and_cost_follow_the_spec_and_the_billing_rule() -> None:
    nodes = [
        Node("a", "cpu", reference_rate=1000.0, price=3_000_000),
        Node("b", "cpu", reference_rate=3000.0, price=1_000_000),
    ]
    prog = Program(flops_per_sample=REF, sha256="x", state_bytes=0)
    measured = [Measured("cpu", "x", REF, rate=100.0, reference_rate=1000.0)]  # eff 0.1
    est = estimate(0, job(), prog, nodes, Cluster(), measured)
    assert est.fits and [n.node_id for n in est.nodes] == ["a", "b"]
    rates = {n.node_id: n.rate for n in est.nodes}
    assert rates == {"a": pytest.approx(100.0), "b": pytest.approx(300.0)}
    assert {n.node_id: n.local_batch for n in est.nodes} == {"a": 16, "b": 48}
    # 1000 samples / 64: 15 full rounds and one of 40, per epoch.
    assert est.rounds == 16 * 3 and est.checkpoints == 4
    full = max(16 / 100.0, 48 / 300.0)
    last = max(10 / 100.0, 30 / 300.0)
    epoch = 15 * (full + DEFAULT_ROUND_OVERHEAD_S) + last + DEFAULT_ROUND_OVERHEAD_S
    assert est.epoch_seconds == pytest.approx(epoch)
    assert est.total_seconds == pytest.approx(
        est.start_s + 3 * epoch + est.checkpoints * est.checkpoint_s
    )
    cost = 15 * (earned_micro(3_000_000, 16, 100.0) + earned_micro(1_000_000, 48, 300.0))
    cost += earned_micro(3_000_000, 10, 100.0) + earned_micro(1_000_000, 30, 300.0)
    assert est.epoch_cost == cost and est.total_cost == 3 * cost and est.fee == 0
    # A platform fee comes on top, per part.
    with_fee = estimate(0, job(), prog, nodes, Cluster(), measured, fee_ppm=100_000)
    assert with_fee.total_cost > est.total_cost and with_fee.fee > 0


def test_recorded_jobs_replace_the_default_fixed_costs() -> None:
    # created 0, first round at 5 s, last round ends at 25 s, 100 rounds of 10 s compute.
    history = job_history([(0, 5000, 25_000, 100, 10.0), (0, 0, 0, 0, 0.0)])
    assert history == History(round_overhead_s=pytest.approx(0.1), start_s=5.0, jobs=1)
    assert job_history([]) == History()
    nodes = [Node("a", "cpu", 1000.0)]
    est = estimate(0, job(), Program(REF), nodes, Cluster(), [], history)
    assert est.overhead_source == "recorded" and est.start_s == 5.0
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
