"""``epochmesh credits grant``, ``balance`` and ``statement``: the real console script against a
real coordinator, an operator and two submitters. Exit codes: 0, 2 (bad amount or account),
7 (not allowed)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.procs import start_coordinator
from tests.system.test_cli_support import Cli, assert_clean_error

pytestmark = pytest.mark.timeout(120)


@dataclass
class Parties:
    op: Cli
    alice: Cli
    bob: Cli
    alice_id: str
    bob_id: str


def whoami(cli: Cli) -> str:
    result = cli.run("whoami", "--output", "json")
    assert result.code == 0, result.stderr
    return str(result.json()["principal"])


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
