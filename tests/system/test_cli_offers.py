"""``epochmesh offers`` and ``epochmesh quote``: the real console scripts against a real
coordinator and three benchmarked agents asking different prices (free, 0.5 and 50 credits/h),
plus one that left (offline). Orders, fields, the quote's exact micro-credits, a max_price that
leaves too few nodes (exit 6) and a bad job.toml (exit 2); then a job trains on them: its speeds
and the nodes' parts in `offers`, and `quote JOB` of what it has left."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from epochmesh.money import format_credits
from epochmesh.v1 import common_pb2
from tests.fixtures import write_mlp_job
from tests.procs import start_coordinator, wait_until
from tests.system.test_agent import AgentProc, coordinator_args, list_nodes, wait_node
from tests.system.test_cli_queue import whoami
from tests.system.test_cli_support import Cli, assert_clean_error, engine_available

pytestmark = pytest.mark.timeout(240)

NS = common_pb2.NodeState
PRICES = {"free": 0, "cheap": 500_000, "dear": 50_000_000}  # micro-credits per hour
NUM_SAMPLES = 256  # the tiny MLP job: 2 epochs, global batch 32, 1-4 nodes


@dataclass
class Market:
    op: Cli
    alice: Cli  # a submitter
    ids: dict[str, str]  # agent name -> node id
    rates: dict[str, float]  # agent name -> reference benchmark samples/s
    tmp: Path


def _ready(address: str, ids: dict[str, str]) -> dict[str, float] | None:
    """Reference rates by name once every priced agent is online, benchmarked and priced."""
    by_id = {n.node_id: n for n in list_nodes(address)}
    rates: dict[str, float] = {}
    for name, price in PRICES.items():
        n = by_id.get(ids[name])
        if (
            n is None
            or n.state != NS.NODE_STATE_ONLINE
            or n.benchmark.samples_per_second <= 0
            or n.price_micro_per_hour != price
        ):
            return None
        rates[name] = n.benchmark.samples_per_second
    return rates


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Market]:
    tmp = tmp_path_factory.mktemp("offers")
    with start_coordinator(tmp / "coordinator", *coordinator_args(0.5, 10.0)) as coord:
        # One agent registers and leaves at once: an offline node, shown only with --all.
        with AgentProc(coord.address, tmp / "gone", "--name", "gone", benchmark="off") as gone:
            gone_id = gone.wait_node_id()
            wait_node(coord.address, gone_id, lambda n: n.state == NS.NODE_STATE_ONLINE)
            assert gone.terminate() == 0, str(gone)
        agents = [
            AgentProc(
                coord.address,
                tmp / name,
                "--name",
                name,
                "--price",
                format_credits(price),
            )
            for name, price in PRICES.items()
        ]
        try:
            ids = {name: a.wait_node_id() for name, a in zip(PRICES, agents, strict=True)}
            rates = wait_until(
                lambda: _ready(coord.address, ids),
                timeout=120,
                interval=0.2,
                message="agents never all benchmarked and priced\n"
                + "\n".join(str(a) for a in agents),
            )
            assert isinstance(rates, dict)
            ids["gone"] = gone_id
            yield Market(
                Cli(coord.address, tmp / "op"),
                Cli(coord.address, tmp / "alice", role="submitter"),
                ids,
                rates,
                tmp,
            )
        finally:
            for a in agents:
                a.kill9()


def table(cli: Cli, *args: str) -> tuple[list[list[str]], str]:
    result = cli.run(*args, env=cli.env(NO_COLOR="1", COLUMNS="200"))
    assert result.code == 0, result.stderr
    return [line.split() for line in result.stdout.splitlines()], result.stderr


def test_offers_best_value_first(market: Market) -> None:
    m = market
    result = m.alice.run("offers", "--output", "json")
    assert result.code == 0, result.stderr
    offers = result.json()["offers"]
    assert [o["name"] for o in offers] == ["free", "cheap", "dear"]  # offline left out
    assert [o["node_id"] for o in offers] == [m.ids[n] for n in ("free", "cheap", "dear")]
    assert set(offers[0]) == {
        "node_id", "name", "state", "device", "price_micro_per_hour", "samples_per_second",
        "rate_source", "samples_per_credit", "parts_applied", "parts_failed", "reliability",
        "online_since_ms", "uptime_seconds", "job_samples_per_second", "verified_in_a_row",
        "verified_total", "failed_checks", "check_probability", "verified",
    }  # fmt: skip
    for offer in offers:  # no job has run yet
        assert (offer["parts_applied"], offer["parts_failed"], offer["reliability"]) == (0, 0, None)
        assert (offer["verified_total"], offer["check_probability"]) == (0, 1.0)
        assert offer["job_samples_per_second"] == {}
        assert offer["online_since_ms"] > 0 and offer["uptime_seconds"] >= 0
    free, cheap, dear = offers
    assert [o["price_micro_per_hour"] for o in offers] == [0, 500_000, 50_000_000]
    assert free["samples_per_credit"] is None
    for offer in (cheap, dear):
        assert offer["rate_source"] == "benchmark" and offer["state"] == "online"
        assert offer["samples_per_second"] == m.rates[offer["name"]]
        assert offer["samples_per_credit"] == pytest.approx(
            offer["samples_per_second"] * 3600 * 1_000_000 / offer["price_micro_per_hour"]
        )
    assert cheap["samples_per_credit"] > dear["samples_per_credit"]

    everything = m.op.run("offers", "--all", "--output", "json")
    assert everything.code == 0, everything.stderr
    listed = everything.json()["offers"]
    assert [o["name"] for o in listed] == ["free", "gone", "cheap", "dear"]
    assert listed[1]["state"] == "offline" and listed[1]["rate_source"] == "none"

    rows, _ = table(m.alice, "offers")
    assert rows[0] == [
        "NODE", "NAME", "STATE", "DEVICE", "PRICE", "SAMPLES/S*", "SAMPLES/CREDIT", "RELIABILITY",
        "VERIFIED", "UP", "JOBS",
    ]  # fmt: skip
    assert [r[1] for r in rows[1:]] == ["free", "cheap", "dear"]
    # ... PRICE, SAMPLES/S, SAMPLES/CREDIT, RELIABILITY ("-": no part yet), VERIFIED (new),
    # UP, JOBS ("-")
    assert [(r[-7], r[-5], r[-4], r[-3], r[-1]) for r in rows[1:]][0] == (
        "free", "free", "-", "new:0/10", "-",
    )  # fmt: skip
    assert [r[-7] for r in rows[1:]] == ["free", "0.5/h", "50/h"]


def job(m: Market, name: str, market_toml: str, **cluster: int) -> Path:
    path = write_mlp_job(
        m.tmp / "jobs" / name, num_samples=NUM_SAMPLES, overrides={"cluster": cluster}
    )
    with path.open("a") as f:
        f.write(f"\n[market]\n{market_toml}\n")
    return path


def quote_json(cli: Cli, path: Path) -> dict[str, Any]:
    result = cli.run("quote", str(path), "--output", "json")
    assert result.code == 0, result.stderr
    return dict(result.json())


def expected_cost(price: int, samples: int, *rates: float) -> int:
    return math.ceil(Fraction(price * samples) / (sum(Fraction(r) for r in rates) * 3600))


def test_quote_picks_the_schedulers_nodes_and_prices_them(market: Market) -> None:
    m = market
    # A budget, no max_price: any price; the scheduler gives the job every node (max_nodes 4),
    # each at its predicted speed on the program (no job measured yet: the default efficiency).
    q = quote_json(m.alice, job(m, "two", "budget = 10", min_nodes=2))
    assert q["mode"] == "cheapest" and q["max_price_micro_per_hour"] is None
    assert sorted(n["name"] for n in q["nodes"]) == ["cheap", "dear", "free"]
    for n in q["nodes"]:
        assert n["rate_source"] == "default_efficiency"
        assert n["reference_samples_per_second"] == m.rates[n["name"]]
        assert n["samples_per_second"] > 0
    assert q["samples_per_second"] == pytest.approx(
        sum(n["samples_per_second"] for n in q["nodes"])
    )
    assert q["num_samples"] == NUM_SAMPLES and q["epochs"] == 2
    assert q["rounds"] == 2 * math.ceil(NUM_SAMPLES / 32)
    assert 0 < q["epoch_seconds"] < q["total_seconds"] < math.inf
    # Each round's part is billed rounded down: the tiny job's parts may cost nothing.
    assert q["total_cost_micro"] == 2 * q["epoch_cost_micro"] >= 0
    assert q["budget_micro"] == 10_000_000 and q["budget_covers"] is True
    assert q["deadline_seconds"] is None and q["deadline_met"] is None
    assert q["rates"] == "predicted_for_the_program"

    # The table: the nodes, then the estimate; the caveat on stderr.
    rows, notes = table(m.alice, "quote", str(job(m, "two-table", "budget = 10", min_nodes=2)))
    assert rows[0][:5] == ["NODE", "NAME", "DEVICE", "PRICE", "JOB"]
    assert sorted(r[1] for r in rows[1:4]) == ["cheap", "dear", "free"]
    lines = {r[0]: r[1:] for r in rows[4:] if r}
    assert lines["budget"] == ["10", "credits:", "covers", "it"]
    assert "nodes" in lines and "samples/s" in lines and "total" in lines and "rounds" in lines
    assert "JOB SAMPLES/S is predicted for this program" in notes

    # A deadline within max_price (1 credit/h: free and cheap).
    q = quote_json(m.op, job(m, "deadline", 'budget = 10\nmax_price = 1\ndeadline = "1d"'))
    assert q["mode"] == "fastest" and q["max_price_micro_per_hour"] == 1_000_000
    assert sorted(n["name"] for n in q["nodes"]) == ["cheap", "free"]
    assert q["deadline_seconds"] == 86400 and q["deadline_met"] is True


def test_quote_when_max_price_is_under_every_priced_node(market: Market) -> None:
    m = market
    # Only the donated node fits: it alone trains, for nothing.
    q = quote_json(m.alice, job(m, "capped", "budget = 10\nmax_price = 0.1"))
    assert [n["name"] for n in q["nodes"]] == ["free"]
    assert q["total_cost_micro"] == 0 and q["budget_covers"] is True

    # Two nodes needed, one fits: exit 6, nothing on stdout.
    result = m.alice.run(
        "quote", str(job(m, "capped-two", "budget = 10\nmax_price = 0.1", min_nodes=2))
    )
    assert_clean_error(
        result,
        6,
        "error: no offer fits job tiny-mlp: 1 node asking at most 0.1 credits/h; the job "
        "needs at least 2 (min_nodes)",
        "hint: raise [market] max_price or lower [cluster] min_nodes",
    )
    # No budget and no max_price: donated nodes only.
    result = m.alice.run("quote", str(job(m, "unfunded", "", min_nodes=2)), "--output", "json")
    assert_clean_error(result, 6, "1 donated node; the job needs at least 2", "set [market] budget")


def test_quote_of_a_bad_job_toml_is_a_usage_error(market: Market) -> None:
    m = market
    path = job(m, "typo", "budget = 10")
    path.write_text(path.read_text().replace("global_batch", "global_bach"))
    assert_clean_error(
        m.alice.run("quote", str(path)), 2, "unknown key [train].global_bach", "global_batch"
    )
    assert_clean_error(
        m.alice.run("quote", str(m.tmp / "nowhere" / "job.toml")), 2, "job file not found"
    )
    bad_price = job(m, "bad-price", "max_price = -1")
    assert_clean_error(m.alice.run("quote", str(bad_price)), 2, "must not be negative")
    no_data = job(m, "no-data", "budget = 1")
    (no_data.parent / "train.safetensors").unlink()
    assert_clean_error(m.alice.run("quote", str(no_data)), 2, "dataset file not found")
    # Not a file, not path-like: a submitted job, and there is none of that name.
    assert_clean_error(m.alice.run("quote", "no-such-job"), 3, "unknown job 'no-such-job'")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not engine_available(), reason="needs the training engine")
def test_a_running_job_shows_in_offers_and_is_quoted_on_what_it_has_left(market: Market) -> None:
    """Alice's job trains on the free and cheap nodes (max_price 1 credit/h): `offers` shows
    its measured speed on them (to alice and operators, not to bob) and their parts applied;
    `quote JOB` prices what it has left at those speeds; once cancelled, nothing is left."""
    m = market
    bob = Cli(m.op.address, m.tmp / "bob", role="submitter")
    granted = m.op.run("credits", "grant", whoami(m.alice), "20")
    assert granted.code == 0, granted.stderr
    path = write_mlp_job(
        m.tmp / "jobs" / "running",
        num_samples=NUM_SAMPLES,
        overrides={
            "name": "offers-running",
            "train": {"epochs": 1000},  # runs until cancelled below
            "market": {"budget": "10", "max_price": "1"},
        },
    )
    submitted = m.alice.run("submit", str(path), "--output", "json", timeout=120)
    assert submitted.code == 0, submitted.stderr
    job_id = submitted.json()["job_id"]

    def offers(cli: Cli) -> dict[str, dict[str, Any]]:
        result = cli.run("offers", "--output", "json")
        assert result.code == 0, result.stderr
        return {o["name"]: o for o in result.json()["offers"]}

    def trained() -> bool:
        return any(
            job_id in o["job_samples_per_second"] and o["parts_applied"] > 0
            for o in offers(m.alice).values()
        )

    wait_until(trained, timeout=180, interval=0.5, message=f"job {job_id} never trained")
    rounds = m.alice.run("rounds", job_id, "--output", "json")
    assert rounds.code == 0, rounds.stderr
    applied = {
        p["node_id"] for r in rounds.json_lines() for p in r["parts"] if p["status"] == "applied"
    }
    seen = offers(m.alice)
    by_id = {o["node_id"]: o for o in seen.values()}
    assert applied and applied <= {m.ids["free"], m.ids["cheap"]}
    for node_id in applied:  # counted when their rounds closed, before the records were written
        o = by_id[node_id]
        assert o["parts_applied"] > 0 and o["job_samples_per_second"][job_id] > 0
        assert o["reliability"] == o["parts_applied"] / (o["parts_applied"] + o["parts_failed"])
    assert job_id not in seen["dear"]["job_samples_per_second"]  # above the job's max_price
    measured = {name for name, o in seen.items() if job_id in o["job_samples_per_second"]}
    assert all(job_id not in o["job_samples_per_second"] for o in offers(bob).values())
    assert any(job_id in o["job_samples_per_second"] for o in offers(m.op).values())
    rows, _ = table(m.alice, "offers")
    shown = {r[1]: " ".join(r) for r in rows[1:]}
    assert all(f"{job_id[:8]}:" in shown[name] for name in measured)
    assert all("% of " in shown[by_id[node_id]["name"]] for node_id in applied)

    # The quote of what it has left, by its name: the job's measured rates where known.
    result = m.alice.run("quote", "offers-running", "--output", "json")
    assert result.code == 0, result.stderr
    q = result.json()
    assert (q["job_id"], q["state"], q["ended"]) == (job_id, "running", False)
    assert q["samples_total"] == 1000 * NUM_SAMPLES
    assert q["samples_left"] == q["samples_total"] - q["samples_done"] > 0
    assert q["max_price_micro_per_hour"] == 1_000_000 and q["budget_micro"] == 10_000_000
    assert q["rates"] == "job_measured_else_reference_benchmark" and "budget_covers" not in q
    sources = {n["name"]: n["rate_source"] for n in q["nodes"]}
    assert sources and set(sources) <= {"free", "cheap"} and "job" in sources.values()
    assert {name for name, source in sources.items() if source == "job"} <= measured
    assert q["escrow_micro"] > 0 and q["spent_micro"] >= 0
    assert isinstance(q["escrow_covers"], bool) and q["total_cost_micro"] >= 0
    assert q["total_seconds"] == pytest.approx(q["samples_left"] / q["samples_per_second"])

    rows, notes = table(m.alice, "quote", job_id)
    assert rows[0] == ["NODE", "NAME", "DEVICE", "PRICE", "SAMPLES/S", "RATE"]
    lines = {r[0]: r[1:] for r in rows[rows.index([]) + 1 :] if r}
    assert {"job", "nodes", "samples/s", "epoch", "left", "spent", "escrow"} <= set(lines)
    assert lines["job"][:2] == ["offers-running", f"({job_id}):"]
    assert "at this job's measured speed" in notes
    assert_clean_error(bob.run("quote", job_id), 7)

    # Cancelled: nothing left to train; the job's speeds leave the offers.
    assert m.alice.run("cancel", job_id).code == 0

    def cancelled() -> bool:
        status = m.alice.run("status", job_id, "--output", "json")
        assert status.code == 0, status.stderr
        return bool(status.json()["state"] == "cancelled")

    wait_until(cancelled, timeout=60, interval=0.5, message=f"job {job_id} not cancelled")
    result = m.alice.run("quote", job_id, "--output", "json")
    assert result.code == 0, result.stderr
    ended = result.json()
    assert (ended["state"], ended["ended"], ended["samples_left"]) == ("cancelled", True, 0)
    assert ended["nodes"] == [] and ended["total_cost_micro"] == 0
    assert ended["escrow_covers"] is True and ended["deadline_met"] is None
    text = m.alice.run("quote", job_id, env=m.alice.env(NO_COLOR="1"))
    assert text.code == 0, text.stderr
    assert "cancelled, nothing left to train" in text.stdout and "spent" in text.stdout
    wait_until(
        lambda: all(job_id not in o["job_samples_per_second"] for o in offers(m.op).values()),
        timeout=30,
        interval=0.5,
        message="the cancelled job's speeds still in offers",
    )
