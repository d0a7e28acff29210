"""The market end to end (issue 19), with real processes and TLS: a coordinator with a 1 %
platform fee, three agents asking different prices, an operator and a submitter with their own
credentials, the `epochmesh` CLI.

The submitter's job has a max_price under one agent's price and a budget too small for its
first round: it pauses for its budget, a top-up lets it run a few rounds until it pauses
again, a second top-up lets it finish, and the coordinator is killed with -9 in between. Then:
the node above max_price never trained; every epoch covers every sample once; the statement's
charges equal the billing rule recomputed from the recorded rounds (rolled-back ones too: the
donor keeps its pay, a re-run is the platform's), no charge without a round, no applied part
without its charge; the escrow is refunded; every balance sums to zero.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.accounting.billing import earned_micro
from epochmesh.money import MICRO, parse_credits
from epochmesh.v1 import common_pb2, job_pb2
from tests.fixtures import write_job
from tests.procs import STEADY_LEASES, CoordinatorProc, free_port, start_coordinator, wait_until
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_cluster_scheduling import Jobs
from tests.system.test_fault_tolerance import (
    MODEL,
    applied,
    check_exactly_once,
    job_doc,
    make_dataset,
    part_indices,
)

log = logging.getLogger(__name__)
JS = common_pb2.JobState
pytestmark = pytest.mark.timeout(300)

FEE_PPM = 10_000  # --platform-fee 1
PRICES = {"cheap": "40", "mid": "100", "dear": "200"}  # credits per node-hour
MAX_PRICE = "150"
N, EPOCHS = 240, 4


@pytest.fixture
def market(tmp_path: Path) -> Iterator[tuple[CoordinatorProc, dict[str, AgentProc]]]:
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(
        tmp_path / "coord",
        "--listen",
        address,
        *STEADY_LEASES,
        "--platform-fee",
        "1",
    )
    agents: dict[str, AgentProc] = {}
    try:
        for i, (name, price) in enumerate(PRICES.items()):
            agents[name] = AgentProc(
                address,
                tmp_path / f"agent-{name}",
                "--name",
                name,
                "--price",
                price,
                "--slowdown",
                str(2 + 2 * i),
            )
        wait_until(
            lambda: sum(n.benchmark.samples_per_second > 0 for n in list_nodes(address)) == 3,
            timeout=180,
            interval=0.2,
            message="three agents ready",
        )
        yield coord, agents
    finally:
        for a in agents.values():
            a.kill9()
        coord.kill9()


def next_round_cost(job: common_pb2.Job) -> int:
    """Micro-credits the pause message says the next round could cost."""
    m = re.search(r"could cost ([0-9.]+) credits", job.message)
    assert m is not None, job.message
    return parse_credits(m.group(1))


def wait_budget_pause(jobs: Jobs, job_id: str) -> common_pb2.Job:
    def paused() -> common_pb2.Job | None:
        job = jobs.job(job_id)
        assert job.state not in (JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED), job.message
        assert job.state != JS.JOB_STATE_SUCCEEDED, "the job finished on its first budget"
        ok = job.state == JS.JOB_STATE_PAUSED and job.message.startswith("budget")
        return job if ok else None

    return wait_until(paused, timeout=90, interval=0.1, message=f"{job_id}: a budget pause")


def all_rounds(jobs: Jobs, job_id: str) -> list[common_pb2.RoundRecord]:
    req = job_pb2.GetRoundsRequest(job_id=job_id, include_rolled_back=True)
    return list(jobs.stub.GetRounds(req, timeout=5, wait_for_ready=True).rounds)


def test_prices_budget_pauses_top_ups_a_kill9_and_a_statement_that_adds_up(
    market: tuple[CoordinatorProc, dict[str, AgentProc]], tmp_path: Path
) -> None:
    coord, _ = market
    address = coord.address
    op = Cli(address, tmp_path / "op")
    alice = Cli(address, tmp_path / "alice", role="submitter")
    jobs = Jobs(address)
    whoami = alice.run("whoami", "--output", "json")
    assert whoami.code == 0, whoami.stderr
    tenant = f"tenant:{whoami.json()['principal']}"
    assert op.run("credits", "grant", tenant, "5").code == 0

    doc: dict[str, Any] = job_doc("priced", epochs=EPOCHS, seed=3, max_nodes=3)
    doc["market"] = {"max_price": MAX_PRICE, "budget": "0.000001"}
    job_toml = write_job(tmp_path / "job", MODEL, make_dataset(N), doc)
    out = alice.run("submit", str(job_toml), "--output", "json", timeout=120)
    assert out.code == 0, out.stderr
    job_id = str(json.loads(out.stdout)["job_id"])
    granted = 5 * MICRO

    # A budget of one micro-credit: paused before its first round, its nodes back in the pool.
    first = wait_budget_pause(jobs, job_id)
    assert not applied_rounds(jobs, job_id)
    queue = op.run("queue", "--output", "json")
    assert queue.code == 0, queue.stderr
    entry = next(e for e in queue.json()["jobs"] if e["job_id"] == job_id)
    assert entry["reason"].startswith("budget"), entry
    # A job whose max_price is under every node's price waits, and says why.
    cheapskate: dict[str, Any] = job_doc("cheapskate", epochs=1, seed=3)
    cheapskate["market"] = {"max_price": "1", "budget": "0.5"}
    toml = write_job(tmp_path / "cheapskate", MODEL, make_dataset(48), cheapskate)
    out = alice.run("submit", str(toml), "--output", "json", timeout=120)
    assert out.code == 0, out.stderr
    waiting = str(json.loads(out.stdout)["job_id"])
    why = "waits: 0 of the 3 eligible node(s) ask at most its max_price of 1 credits/h"

    def says_why() -> bool:
        return jobs.job(waiting).message.startswith(why)

    wait_until(says_why, timeout=30, interval=0.2, message="the max_price reason in status")
    queue = alice.run("queue", "--output", "json")
    assert queue.code == 0, queue.stderr
    assert next(e for e in queue.json()["jobs"] if e["job_id"] == waiting)["reason"].startswith(why)
    assert alice.run("cancel", waiting).code == 0
    # Enough for a few rounds: it runs, then pauses again.
    top_up = 6 * next_round_cost(first)
    added = alice.run("budget", job_id, "--add", f"{top_up / MICRO:.6f}")
    assert added.code == 0, added.stderr
    assert "credits added" in added.stdout, added.stdout
    wait_until(
        lambda: applied_rounds(jobs, job_id),
        timeout=60,
        interval=0.1,
        message="rounds after the first top-up",
    )
    wait_budget_pause(jobs, job_id)
    assert 1 <= len(applied_rounds(jobs, job_id)) < EPOCHS * N // 24
    status = alice.run("status", job_id, env=alice.env(NO_COLOR="1"))
    assert status.code == 0 and "credits so far" in status.stdout, status.stdout

    # The rest, then a kill -9 while it trains.
    assert alice.run("budget", job_id, "--add", "4").code == 0
    wait_until(
        lambda: (
            jobs.job(job_id).state == JS.JOB_STATE_RUNNING
            and len(applied_rounds(jobs, job_id)) >= 6
        ),
        timeout=60,
        interval=0.1,
        message="running again after the top-up",
    )
    coord.kill9()
    coord.start()
    jobs.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=180)

    live = jobs.rounds(job_id)
    check_exactly_once(live, N, EPOCHS)
    rounds = all_rounds(jobs, job_id)
    nodes = list_nodes(address)
    names = {n.node_id: n.name for n in nodes}
    donors = {n.node_id: n.labels["donor"] for n in nodes}  # the helpers enroll no donor: itself
    trained = {names[p.node_id] for r in rounds for p in r.parts}
    assert "dear" not in trained and trained, trained

    statement = alice.run("statement", "--job", job_id, "--output", "json")
    assert statement.code == 0, statement.stderr
    entries = statement.json()["entries"]
    escrow, held = f"escrow:{job_id}", f"held:{job_id}"
    # Per (round, node): the donor's pay and the fee, recomputed from the records. The job is
    # verified: pay waits in the held account until a check vouches for it (or the job ends).
    paid: dict[tuple[int, str], int] = defaultdict(int)
    fees: dict[tuple[int, str], int] = defaultdict(int)
    from_escrow: dict[tuple[int, str], int] = defaultdict(int)
    for e in entries:
        key = (e["round"], e["node"])
        if e["to"].startswith("donor:"):
            assert e["to"] == f"donor:{donors[e['node']]}", (e, donors)
            assert e["from"] == held and e["reason"].startswith("verified"), e
            paid[key] += e["amount_micro"]
        elif e["to"] == held:
            if e["from"] == escrow:
                from_escrow[key] += e["amount_micro"]
            else:
                assert e["from"] == "platform" and e["reason"].startswith("re-run"), e
        elif e["to"] == "platform":
            assert e["from"] == escrow and e["reason"] == "platform fee", e
            fees[key] += e["amount_micro"]
    expected: dict[tuple[int, str], int] = {}
    for r in rounds:
        for p in applied(r):
            samples = len(part_indices(p))
            earned = earned_micro(p.price_micro_per_hour, samples, p.billed_rate)
            assert p.price_micro_per_hour == parse_credits(PRICES[names[p.node_id]])
            if earned:
                expected[(r.round, p.node_id)] = earned
    assert paid == expected  # every applied part paid by the rule, nothing else paid
    for key, fee in fees.items():
        assert fee == from_escrow[key] * FEE_PPM // 1_000_000, key
    assert sum(fees.values()) > 0
    reruns = sum(
        e["amount_micro"] for e in entries if e["from"] == "platform" and e["to"] != "platform"
    )
    log.info(
        "%d rounds (%d rolled back), %d entries, donors paid %d micro-credits, re-runs %d",
        len(rounds),
        sum(r.rolled_back for r in rounds),
        len(entries),
        sum(paid.values()),
        reruns,
    )

    # The escrow is refunded; everything adds up.
    spent = sum(
        e["amount_micro"] for e in entries if e["from"] == escrow and e["reason"] != "refund"
    )
    balances = op.run("balance", "--all", "--output", "json")
    assert balances.code == 0, balances.stderr
    by_account = {b["account"]: b["balance_micro"] for b in balances.json()["balances"]}
    assert sum(by_account.values()) == 0
    assert by_account.get(escrow, 0) == 0
    assert by_account.get(held, 0) == 0  # every part paid or forfeited
    assert by_account.get(f"escrow:{waiting}", 0) == 0  # the cancelled job's budget came back
    assert by_account[tenant] == granted - spent
    assert by_account["mint"] == -granted
    done = jobs.job(job_id)
    assert done.spent_micro == spent
    jobs.channel.close()


def applied_rounds(jobs: Jobs, job_id: str) -> list[common_pb2.RoundRecord]:
    return [r for r in jobs.rounds(job_id) if applied(r)]
