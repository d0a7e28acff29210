"""``epochmesh credits grant``, ``balance`` and ``statement``: the real console script against a
real coordinator, an operator and two submitters. Exit codes: 0, 2 (bad amount or account),
7 (not allowed)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures import write_mlp_job
from tests.procs import start_coordinator, wait_until
from tests.system.test_cli_queue import whoami
from tests.system.test_cli_support import Cli, assert_clean_error, engine_available

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not engine_available(), reason="needs the training engine"),
]


@dataclass
class Parties:
    op: Cli
    alice: Cli
    bob: Cli
    alice_id: str
    bob_id: str


@pytest.fixture(scope="module")
def parties(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parties]:
    tmp = tmp_path_factory.mktemp("market")
    with start_coordinator(tmp / "coordinator") as coord:
        op = Cli(coord.address, tmp / "op")
        alice = Cli(coord.address, tmp / "alice", role="submitter")
        bob = Cli(coord.address, tmp / "bob", role="submitter")
        yield Parties(op, alice, bob, whoami(alice), whoami(bob))


def test_grant_then_balance_and_statement(parties: Parties) -> None:
    p = parties
    granted = p.op.run("credits", "grant", p.alice_id, "12.5")
    assert granted.code == 0, granted.stderr
    assert granted.stdout.strip() == f"granted 12.5 credits to tenant:{p.alice_id}: balance 12.5"
    assert p.op.run("credits", "grant", f"tenant:{p.alice_id}", "0.000001").code == 0

    balance = p.alice.run("balance", "--output", "json")
    assert balance.code == 0, balance.stderr
    assert balance.json() == {
        "balances": [
            {"account": f"tenant:{p.alice_id}", "balance": "12.500001", "balance_micro": 12500001}
        ]
    }
    table = p.alice.run("balance", env=p.alice.env(NO_COLOR="1", COLUMNS="120"))
    assert table.code == 0, table.stderr
    assert table.stdout.split() == ["ACCOUNT", "CREDITS", f"tenant:{p.alice_id}", "12.500001"]

    statement = p.alice.run("statement", "--output", "json")
    assert statement.code == 0, statement.stderr
    entries = statement.json()["entries"]
    assert [(e["from"], e["to"], e["amount"], e["amount_micro"]) for e in entries] == [
        ("mint", f"tenant:{p.alice_id}", "12.5", 12_500_000),
        ("mint", f"tenant:{p.alice_id}", "0.000001", 1),
    ]
    assert set(entries[0]) == {
        "id", "time_ms", "from", "to", "amount", "amount_micro", "job", "round", "node",
        "samples", "reason",
    }  # fmt: skip
    everything = p.op.run("balance", "--all", "--output", "json")
    assert everything.code == 0, everything.stderr
    balances = {b["account"]: b["balance_micro"] for b in everything.json()["balances"]}
    assert balances["mint"] == -sum(v for k, v in balances.items() if k != "mint")


def test_refusals(parties: Parties) -> None:
    p = parties
    for amount in ("-1", "nan", "abc", "0", "1.0000001", "1e12"):
        assert_clean_error(p.op.run("credits", "grant", p.alice_id, amount), 2, "AMOUNT")
    assert_clean_error(p.op.run("credits", "grant", "wallet:x", "1"), 2, "unknown account")
    assert_clean_error(p.alice.run("credits", "grant", p.alice_id, "5"), 7)
    assert_clean_error(p.alice.run("balance", f"tenant:{p.bob_id}"), 7, "not yours")
    assert_clean_error(p.alice.run("balance", "--all"), 7, "operators")
    assert_clean_error(p.alice.run("statement", f"tenant:{p.bob_id}"), 7, "not yours")
    # Nothing of the refused grants landed.
    bob = p.bob.run("balance", "--output", "json")
    assert bob.code == 0, bob.stderr
    assert bob.json()["balances"] == [
        {"account": f"tenant:{p.bob_id}", "balance": "0", "balance_micro": 0}
    ]


def test_a_budget_is_escrowed_at_submit_topped_up_and_refunded_at_cancel(
    parties: Parties, tmp_path: Path
) -> None:
    """No agent: the job waits; its budget sits in its escrow until the cancel returns it."""
    p = parties
    assert p.op.run("credits", "grant", p.bob_id, "3").code == 0
    job_toml = write_mlp_job(
        tmp_path / "job", 64, overrides={"name": "bob-priced", "market": {"budget": "2"}}
    )
    submitted = p.bob.run("submit", str(job_toml), "--output", "json", timeout=120)
    assert submitted.code == 0, submitted.stderr
    job_id = submitted.json()["job_id"]

    def balances(cli: Cli) -> dict[str, int]:
        out = cli.run("balance", "--output", "json")
        assert out.code == 0, out.stderr
        return {b["account"]: b["balance_micro"] for b in out.json()["balances"]}

    escrow, tenant = f"escrow:{job_id}", f"tenant:{p.bob_id}"
    assert balances(p.bob) == {tenant: 1_000_000, escrow: 2_000_000}
    # More than the account holds: refused, nothing stored.
    big = write_mlp_job(
        tmp_path / "big", 64, overrides={"name": "bob-big", "market": {"budget": "5"}}
    )
    refused = p.bob.run("submit", str(big), timeout=120)  # (its progress lines on stderr too)
    assert refused.code == 6 and refused.stdout == "", (refused.code, refused.stderr)
    assert f"error: the budget of 5 credits is more than your account {tenant} holds (1)" in (
        refused.stderr
    )
    assert_clean_error(p.bob.run("budget", job_id, "--add", "1.5"), 6, "holds")
    assert_clean_error(p.alice.run("budget", job_id, "--add", "1"), 7)
    assert_clean_error(p.bob.run("budget", job_id, "--add", "-1"), 2, "AMOUNT")
    added = p.bob.run("budget", job_id, "--add", "0.5")
    assert added.code == 0, added.stderr
    assert balances(p.bob) == {tenant: 500_000, escrow: 2_500_000}
    status = p.bob.run("status", job_id, env=p.bob.env(NO_COLOR="1"))
    assert "0 credits so far; 2.5 left in its escrow" in status.stdout, status.stdout

    assert p.bob.run("cancel", job_id).code == 0

    def refunded() -> bool:
        return balances(p.bob) == {tenant: 3_000_000}

    wait_until(refunded, timeout=30, interval=0.2, message="the refund at cancel")
    statement = p.bob.run("statement", "--job", job_id, "--output", "json")
    assert statement.code == 0, statement.stderr
    assert [(e["from"], e["to"], e["amount_micro"], e["reason"]) for e in
            statement.json()["entries"]] == [
        (tenant, escrow, 2_000_000, "budget"),
        (tenant, escrow, 500_000, "budget top-up"),
        (escrow, tenant, 2_500_000, "refund"),
    ]  # fmt: skip
