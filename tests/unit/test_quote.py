"""The market as the CLI shows it: `epochmesh.quote` (node choice, time and cost of a job, in
exact micro-credits), the dataset's sample count read from the safetensors header alone, and
the order of `epochmesh offers` (client/commands/market_offers.py), and a submitted job's quote
of what it has left at its own measured rates (`epochmesh.quote.quote_job`)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

from client.commands.market_offers import (
    fmt_job_rates,
    fmt_reliability,
    job_quote_dict,
    market_offers,
    node_offer,
    node_offers,
    quote_dict,
)
from epochmesh.errors import SpecError
from epochmesh.matching import Offer
from epochmesh.money import MICRO
from epochmesh.quote import (
    BENCHMARK_RATE,
    CHEAPEST,
    FASTEST,
    JOB_RATE,
    NO_RATE,
    NOTHING_LEFT,
    JobQuote,
    cost_micro,
    job_offer,
    max_price_of,
    quote,
    quote_job,
)
from epochmesh.spec import parse_spec
from epochmesh.v1 import common_pb2
from epochmesh.wire.safetensors_file import dataset_samples
from tests.fixtures import write_dataset

pytestmark = pytest.mark.timeout(60)

NS = common_pb2.NodeState
FREE = Offer("free", 0, 100.0)
CHEAP = Offer("cheap", 1 * MICRO, 200.0)  # 1 credit/h
DEAR = Offer("dear", 4 * MICRO, 400.0)  # 4 credits/h
OFFERS = [DEAR, FREE, CHEAP]


def spec(**fields: object) -> common_pb2.JobSpec:
    base: dict[str, object] = dict(name="j", epochs=3, global_batch=64, min_nodes=1, max_nodes=8)
    base.update(fields)
    return common_pb2.JobSpec(**base)  # type: ignore[arg-type]


def ids(offers: tuple[Offer, ...] | list[Offer]) -> list[str]:
    return [o.node_id for o in offers]


def test_the_price_cap_is_the_coordinators_rule() -> None:
    assert max_price_of(spec()) == 0  # no budget: donated nodes only
    assert max_price_of(spec(budget_micro=0)) == 0
    assert max_price_of(spec(budget_micro=5)) is None  # a budget: any price
    assert max_price_of(spec(budget_micro=5, max_price_micro_per_hour=7)) == 7
    assert max_price_of(spec(max_price_micro_per_hour=0)) == 0


def test_cheapest_set_time_and_cost_in_exact_micro_credits() -> None:
    # Two nodes at least, any price (a budget): {free, cheap} costs 1e6/300 per sample/s-hour,
    # less than {free, dear} (4e6/500) or anything with more nodes.
    q = quote(spec(min_nodes=2, budget_micro=10 * MICRO), 1090, OFFERS)
    assert q.mode == CHEAPEST and q.fits
    assert ids(q.nodes) == ["cheap", "free"]
    assert q.max_price is None and q.eligible == 3 and (q.min_nodes, q.max_nodes) == (2, 8)
    assert q.rate == 300.0 and q.price_per_hour == MICRO
    assert q.epoch_seconds == pytest.approx(1090 / 300)
    assert q.total_seconds == pytest.approx(3 * 1090 / 300)
    # 1e6 x 1090 / (300 x 3600) = 1009.26 -> 1010; three epochs 3027.78 -> 3028 (not 3 x 1010)
    assert (q.epoch_cost, q.total_cost) == (1010, 3028)
    assert q.budget == 10 * MICRO and q.budget_covers
    assert q.deadline_seconds is None and q.deadline_met is None
    assert q.reason == "the least cost per epoch of 3 nodes"


def test_without_a_budget_only_donated_nodes_and_it_is_free() -> None:
    q = quote(spec(), 1000, OFFERS)
    assert ids(q.nodes) == ["free"] and q.max_price == 0
    assert (q.epoch_cost, q.total_cost) == (0, 0)
    assert q.epoch_seconds == 10.0 and q.total_seconds == 30.0
    assert q.budget is None and q.budget_covers  # nothing to pay
    assert q.reason == "the least cost per epoch of 1 donated node"


def test_a_deadline_takes_the_fastest_within_max_price() -> None:
    s = spec(
        budget_micro=MICRO // 1000,  # 0.001 credits: far too little
        max_price_micro_per_hour=2 * MICRO,
        deadline_seconds=5.0,
        max_nodes=1,
    )
    q = quote(s, 1090, OFFERS)
    assert q.mode == FASTEST and ids(q.nodes) == ["cheap"]  # dear is above max_price
    # 1e6 x 1090 / (200 x 3600) = 1513.89 -> 1514; x3 = 4541.67 -> 4542
    assert (q.epoch_cost, q.total_cost) == (1514, 4542)
    assert q.total_seconds == pytest.approx(16.35)
    assert q.deadline_met is False and not q.budget_covers
    assert q.reason == "the fastest of 2 nodes asking at most 2 credits/h"
    roomy = quote(spec(deadline_seconds=30.0, max_nodes=4), 1000, OFFERS)
    assert ids(roomy.nodes) == ["free"] and roomy.deadline_met is True  # 30 s exactly


def test_max_nodes_is_capped_by_the_global_batch() -> None:
    q = quote(spec(global_batch=1, deadline_seconds=60.0, budget_micro=MICRO), 100, OFFERS)
    assert q.max_nodes == 1 and ids(q.nodes) == ["dear"]


def test_too_few_nodes_fit() -> None:
    q = quote(spec(min_nodes=2), 1000, OFFERS)  # no budget: one donated node
    assert not q.fits and q.nodes == () and not q.budget_covers
    assert q.reason == "1 donated node; the job needs at least 2 (min_nodes)"
    assert math.isinf(q.total_seconds) and q.total_cost == 0
    capped = quote(spec(min_nodes=3, max_price_micro_per_hour=MICRO, budget_micro=1), 10, OFFERS)
    assert capped.reason == (
        "2 nodes asking at most 1 credits/h; the job needs at least 3 (min_nodes)"
    )
    unrated = quote(spec(), 10, [Offer("new", 0, 0.0)])  # no benchmark yet: no rate
    assert not unrated.fits and unrated.eligible == 0


def test_cost_rounds_up_and_is_zero_for_donations() -> None:
    from fractions import Fraction

    assert cost_micro(3600, 1, Fraction(1)) == 1
    assert cost_micro(3601, 1, Fraction(1)) == 2
    assert cost_micro(0, 10**9, Fraction(1, 10**6)) == 0


def test_the_market_section_of_a_job_toml_feeds_the_quote(tmp_path: Path) -> None:
    text = """
name = "t"
[data]
train = "d.safetensors"
inputs = ["x"]
targets = ["y"]
[train]
epochs = 2
global_batch = 8
[cluster]
min_nodes = 1
max_nodes = 2
[market]
max_price = 1.5
budget = 0.5
"""
    loaded = parse_spec(text, tmp_path, check_files=False)
    q = quote(loaded.spec, 720, OFFERS)
    assert q.max_price == 1_500_000 and q.budget == 500_000
    assert ids(q.nodes) == ["free"]  # free beats anything priced per epoch
    assert quote_dict(loaded.spec, q, {})["total_cost_micro"] == 0


def test_dataset_samples_reads_only_the_header(tmp_path: Path) -> None:
    path = write_dataset(
        tmp_path / "d.safetensors",
        {"x": torch.zeros(37, 4), "y": torch.zeros(37, dtype=torch.long)},
    )
    assert dataset_samples(path, ["x", "y"]) == 37
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header_only = tmp_path / "h.safetensors"
    header_only.write_bytes(path.read_bytes()[: 8 + n])  # the tensor data cut off
    assert dataset_samples(header_only, ["x"]) == 37


@pytest.mark.parametrize(
    ("tensors", "names", "message"),
    [
        ({"x": torch.zeros(3, 2)}, ["x", "y"], "has no tensor 'y' named in [data]; it has: x"),
        (
            {"x": torch.zeros(3, 2), "y": torch.zeros(4)},
            ["x", "y"],
            "must share their first dimension (the samples); got x: [3, 2], y: [4]",
        ),
        ({"x": torch.zeros(0, 2)}, ["x"], "holds no samples"),
        ({"x": torch.tensor(1.0)}, ["x"], "must share their first dimension"),
    ],
)
def test_dataset_samples_refuses_a_bad_dataset(
    tmp_path: Path, tensors: dict[str, torch.Tensor], names: list[str], message: str
) -> None:
    path = write_dataset(tmp_path / "d.safetensors", tensors)
    with pytest.raises(SpecError) as info:
        dataset_samples(path, names)
    assert message in str(info.value)


def test_dataset_samples_refuses_what_is_not_safetensors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="dataset file not found"):
        dataset_samples(tmp_path / "missing.safetensors", ["x"])
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"hello")
    with pytest.raises(SpecError, match="not a safetensors file: shorter than 8 bytes"):
        dataset_samples(junk, ["x"])
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SpecError, match="header length out of range"):
        dataset_samples(huge, ["x"])
    not_json = tmp_path / "nj.safetensors"
    not_json.write_bytes(struct.pack("<Q", 3) + b"abc")
    with pytest.raises(SpecError, match="header is not JSON"):
        dataset_samples(not_json, ["x"])
    listed = tmp_path / "list.safetensors"
    body = json.dumps([1]).encode()
    listed.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(SpecError, match="not a JSON object"):
        dataset_samples(listed, ["x"])


def node(
    node_id: str,
    price: int,
    bench: float,
    observed: float = 0.0,
    state: int = NS.NODE_STATE_ONLINE,
) -> common_pb2.NodeInfo:
    n = common_pb2.NodeInfo(
        node_id=node_id,
        name=f"name-{node_id}",
        state=state,
        price_micro_per_hour=price,
        observed_samples_per_second=observed,
    )
    n.benchmark.samples_per_second = bench
    return n


def test_offers_donated_first_then_most_samples_per_credit() -> None:
    nodes = [
        node("p1", 2 * MICRO, 1000.0),  # 1.8M samples per credit
        node("p2", MICRO, 400.0, observed=600.0),  # observed 600/s: 2.16M per credit
        node("f-slow", 0, 50.0),
        node("f-fast", 0, 500.0),
        node("gone", 0, 9999.0, state=NS.NODE_STATE_OFFLINE),
        node("bad", 0, 9999.0, state=NS.NODE_STATE_QUARANTINED),
        node("unrated", MICRO, 0.0),
        node("cordoned", 3 * MICRO, 3000.0, state=NS.NODE_STATE_CORDONED),  # 3.6M per credit
    ]
    offers = node_offers(nodes)
    assert [o.node_id for o in offers] == ["f-fast", "f-slow", "cordoned", "p2", "p1", "unrated"]
    by_id = {o.node_id: o for o in offers}
    assert by_id["p2"].samples_per_second == 600.0 and by_id["p2"].rate_source == "observed"
    assert by_id["p2"].samples_per_credit == pytest.approx(2_160_000)
    assert by_id["p1"].rate_source == "benchmark" and by_id["unrated"].rate_source == "none"
    assert by_id["f-fast"].samples_per_credit is None and by_id["f-fast"].free
    assert by_id["unrated"].samples_per_credit == 0.0
    everything = node_offers(nodes, all_states=True)
    assert [o.node_id for o in everything][:3] == ["bad", "gone", "f-fast"]  # ties: by name

    # A quote uses online and busy nodes only, at their reference benchmark's rate.
    quoted = market_offers(nodes)
    assert {o.node_id: o.rate for o in quoted} == {
        "p1": 1000.0,
        "p2": 400.0,
        "f-slow": 50.0,
        "f-fast": 500.0,
        "unrated": 0.0,
    }


# -- a submitted job: what it has left, at its own measured rates -----------------------------

JOB = "j-1a2b3c4d5e"


def rated_node(
    node_id: str, price: int, bench: float, job_rate: float = 0.0, job_id: str = JOB
) -> common_pb2.NodeInfo:
    n = node(node_id, price, bench)
    if job_rate:
        n.job_samples_per_second[job_id] = job_rate
    return n


def submitted(
    state: int = common_pb2.JOB_STATE_RUNNING,
    done: int = 1200,
    *,
    spent: int = 0,
    escrow: int = 0,
    created_ms: int = 0,
    **spec_fields: object,
) -> common_pb2.Job:
    return common_pb2.Job(
        job_id=JOB,
        name="mine",
        state=state,
        spec=spec(**spec_fields),
        num_samples=1000,
        samples_done=done,
        samples_total=3000,
        spent_micro=spent,
        escrow_micro=escrow,
        created_ms=created_ms,
    )


def test_a_node_is_rated_by_the_jobs_own_speed_else_its_reference_benchmark() -> None:
    measured = rated_node("a", MICRO, 200.0, job_rate=100.0)
    assert job_offer(measured, JOB) == (Offer("a", MICRO, 100.0), JOB_RATE)
    assert job_offer(measured) == (Offer("a", MICRO, 200.0), BENCHMARK_RATE)  # a job.toml
    other = rated_node("b", -5, 150.0, job_rate=999.0, job_id="j-99aa00bb11")
    assert job_offer(other, JOB) == (Offer("b", 0, 150.0), BENCHMARK_RATE)
    assert job_offer(node("c", 0, 0.0), JOB) == (Offer("c", 0, 0.0), NO_RATE)
    nan = rated_node("d", 0, 50.0, job_rate=math.nan)
    assert job_offer(nan, JOB) == (Offer("d", 0, 50.0), BENCHMARK_RATE)


# A measured slower on the job than its benchmark says, F faster, B not measured yet.
JOB_NODES = [
    rated_node("a", MICRO, 200.0, job_rate=100.0),
    rated_node("b", MICRO, 150.0),
    rated_node("f", 0, 100.0, job_rate=300.0),
]


def test_a_running_job_is_quoted_on_what_it_has_left_at_its_measured_rates() -> None:
    job = submitted(min_nodes=2, budget_micro=10 * MICRO, spent=700, escrow=1112)
    jq = quote_job(job, JOB_NODES, now_ms=5_000)
    q = jq.quote
    assert not jq.ended and jq.samples_left == 1800 and q.total_samples == 1800
    assert jq.sources == {"a": JOB_RATE, "b": BENCHMARK_RATE, "f": JOB_RATE}
    # At the benchmarks a (200/s) would pair with f; at a's measured 100/s, b (150/s) does.
    assert ids(q.nodes) == ["b", "f"] and q.rate == 450.0 and q.price_per_hour == MICRO
    assert q.epoch_seconds == pytest.approx(1000 / 450) and q.total_seconds == 4.0
    # 1e6 x 1000 / (450 x 3600) = 617.28 -> 618; what is left: 1800 -> 1111.11 -> 1112
    assert (q.epoch_cost, q.total_cost) == (618, 1112)
    assert (jq.spent, jq.escrow) == (700, 1112) and jq.escrow_covers
    assert not quote_job(
        submitted(min_nodes=2, budget_micro=1, escrow=1111), JOB_NODES, 0
    ).escrow_covers
    assert jq.deadline_left is None and jq.deadline_met is None

    # Every node at its benchmark (a job.toml's quote) picks a and f.
    assert ids(quote(job.spec, 1000, [job_offer(n)[0] for n in JOB_NODES]).nodes) == ["a", "f"]


def test_a_jobs_deadline_counts_from_its_submission() -> None:
    def at(now: int) -> JobQuote:
        job = submitted(created_ms=1_000, max_nodes=2, budget_micro=MICRO, deadline_seconds=5.0)
        return quote_job(job, JOB_NODES, now_ms=now)

    on_time = at(2_000)  # 1 s after the submission: 4 s left, and 1800 / 450 takes 4 s
    assert on_time.quote.mode == FASTEST and ids(on_time.quote.nodes) == ["b", "f"]
    assert on_time.deadline_left == 4.0 and on_time.deadline_met is True
    late = at(2_001)
    assert late.deadline_left == pytest.approx(3.999) and late.deadline_met is False
    passed = at(9_000)
    assert passed.deadline_left == -3.0 and passed.deadline_met is False


def test_nothing_left_to_quote() -> None:
    # Done but not yet marked succeeded: no nodes needed, nothing to pay, the deadline holds.
    done = quote_job(submitted(done=3000, deadline_seconds=1.0, escrow=0), JOB_NODES, 10**9)
    assert done.samples_left == 0 and done.quote.nothing_left and not done.ended
    assert done.quote.nodes == () and done.quote.reason == NOTHING_LEFT
    assert (done.quote.total_cost, done.quote.total_seconds) == (0, 0.0)
    assert done.escrow_covers and done.deadline_met is True
    # Ended, even with samples it never trained (cancelled): nothing more will run.
    for state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_CANCELLED):
        ended = quote_job(submitted(state, done=1200, spent=42), JOB_NODES, 0)
        assert ended.ended and ended.samples_left == 0 and ended.spent == 42
        assert ended.quote.nodes == () and ended.escrow_covers and ended.deadline_met is None
    # Nothing fits: a live job that still has samples left.
    stuck = quote_job(submitted(min_nodes=4, budget_micro=MICRO), JOB_NODES, 0)
    assert not stuck.quote.fits and not stuck.escrow_covers
    assert stuck.quote.reason == "3 nodes; the job needs at least 4 (min_nodes)"


def test_a_quote_of_part_of_the_work() -> None:
    q = quote(spec(min_nodes=2, budget_micro=MICRO), 1090, OFFERS, total_samples=545)
    assert q.total_samples == 545 and q.total_seconds == pytest.approx(545 / 300)
    assert (q.epoch_cost, q.total_cost) == (1010, 505)  # 504.63 -> 505
    assert quote(spec(), 1090, OFFERS).total_samples == 3 * 1090


def test_the_job_quote_as_json_and_the_offers_reliability() -> None:
    job = submitted(min_nodes=2, budget_micro=10 * MICRO, spent=700, escrow=1000)
    jq = quote_job(job, JOB_NODES, now_ms=0)
    out = job_quote_dict(job, jq, {n.node_id: n for n in JOB_NODES})
    assert "budget_covers" not in out
    assert [(n["node_id"], n["rate_source"]) for n in out["nodes"]] == [
        ("b", "benchmark"),
        ("f", "job"),
    ]
    assert (out["samples_left"], out["total_cost_micro"], out["escrow_covers"]) == (
        1800,
        1112,
        False,
    )
    assert out["state"] == "running" and out["ended"] is False

    n = rated_node("r", MICRO, 10.0, job_rate=812.0)
    n.parts_applied, n.parts_failed, n.online_since_ms = 29, 71, 1_000
    n.job_samples_per_second["j-99aa00bb11"] = 90.5
    n.job_samples_per_second["j-ffffff0000"] = 1.0
    offer = node_offer(n, 7_201_000)
    assert offer.reliability == 0.29 and fmt_reliability(offer) == "29% of 100 parts"
    assert offer.uptime_seconds == 7200.0
    assert fmt_job_rates(offer.job_samples_per_second) == "j-1a2b3c: 812/s j-99aa00: 90.5/s +1"
    fresh = node_offer(node("s", 0, 1.0, state=NS.NODE_STATE_OFFLINE), 0)
    assert fmt_reliability(fresh) == "-" and fresh.reliability is None
    assert fresh.uptime_seconds is None and fmt_job_rates(fresh.job_samples_per_second) == "-"
