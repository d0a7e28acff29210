"""Donor accounts: a node token's donor (``token create --role node --donor NAME``) is recorded
for every node enrolled with it, the registry answers it (and shows it as the label ``donor``)
across a restart, and a round's applied parts pay ``donor:NAME``; a node enrolled without a
donor earns for its own id."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from coordinator.accounting.credit_book import fund_escrow, grant
from coordinator.main import main as coordinator_main
from coordinator.market.credit_ledger import CreditLedger
from coordinator.market.job_billing import JobBilling
from coordinator.store.base import TokenRecord
from coordinator.store.sqlite import SqliteStore
from coordinator.trust.tokens import create_token
from epochmesh import identity as idm
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.test_job_billing import JOB, PRICE, part
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(60)


async def _register(address: str, ident: idm.Identity, name: str) -> str:
    async with idm.secure_aio_channel(address, ident) as ch:
        agent = agent_pb2_grpc.AgentServiceStub(ch)
        # An agent's own "donor" label never overrides the one its token gave.
        req = agent_pb2.RegisterRequest(name=name, labels={"donor": "mallory", "zone": "z1"})
        reply = await agent.Register(req, timeout=10)
    assert reply.node_id == ident.principal.id
    return reply.node_id


async def _donor_labels(address: str, operator: idm.Identity) -> dict[str, str]:
    async with idm.secure_aio_channel(address, operator) as ch:
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        nodes = (await sched.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=10)).nodes
    return {n.node_id: n.labels["donor"] for n in nodes}


async def test_nodes_of_one_donor_token_share_its_account_across_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    async with in_process_coordinator(data, lease_ttl_s=60.0) as coord:
        assert coord.ca is not None
        operator = coord.issue_identity("operator")
        # The token from the real command line, against the running coordinator's data dir.
        argv = ["token", "create", "--data-dir", str(data), "--role", "node", "--reusable"]
        code = await asyncio.to_thread(coordinator_main, [*argv, "--donor", "alice.lab-1"])
        assert code == 0
        donor_token = capsys.readouterr().out.strip()
        plain_token = await create_token(coord.store, coord.ca, "node", 60)
        enrolled = [
            await asyncio.to_thread(idm.enroll_with_token, coord.address, token, name)
            for token, name in ((donor_token, "a"), (donor_token, "b"), (plain_token, "c"))
        ]
        a, b, c = [
            await _register(coord.address, ident, n)
            for ident, n in zip(enrolled, "abc", strict=True)
        ]
        assert len({a, b, c}) == 3
        assert [coord.registry.donor_of(n) for n in (a, b, c)] == ["alice.lab-1"] * 2 + [c]
        assert coord.registry.donor_of("n-0123456789") == "n-0123456789"  # unknown: itself
        assert await _donor_labels(coord.address, operator) == {
            a: "alice.lab-1",
            b: "alice.lab-1",
            c: c,
        }
        assert coord.registry.require(a).labels["zone"] == "z1"
        assert await coord.store.get_node_donor(a) == "alice.lab-1"
        assert await coord.store.get_node_donor(c) == ""

    async with in_process_coordinator(data, lease_ttl_s=60.0) as coord:
        # Known from the store at load, before any node registers again...
        assert [coord.registry.donor_of(n) for n in (a, b, c)] == ["alice.lab-1"] * 2 + [c]
        # ...and after.
        await _register(coord.address, enrolled[1], "b")
        assert coord.registry.donor_of(b) == "alice.lab-1"
        assert (await _donor_labels(coord.address, operator))[b] == "alice.lab-1"


async def test_applied_parts_pay_the_nodes_donor(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "c.db")
    try:
        ledger = CreditLedger(store)
        await ledger.reload()
        await ledger.post([grant("tenant:u-a", 10_000, at_ms=1)])
        await ledger.post([fund_escrow(JOB, "u-a", 1_000, at_ms=2, reason="budget")])
        donors = {"n1": "alice", "n2": "alice"}
        spec = common_pb2.JobSpec(budget_micro=1_000)
        billing = JobBilling(
            common_pb2.Job(job_id=JOB, owner="u-a", num_samples=100, spec=spec),
            ledger,
            donor_of=lambda n: donors.get(n, n),
        )
        parts = {"n1": part("n1", 0, 10), "n2": part("n2", 10, 30), "n3": part("n3", 30, 40)}
        billing.price_parts(parts, dict.fromkeys(parts, PRICE), dict.fromkeys(parts, 1000.0))
        entries = billing.charge_round(0, 1, parts.values())
        assert [(e.to_account, e.node_id, e.amount) for e in entries] == [
            ("donor:alice", "n1", 100),
            ("donor:alice", "n2", 200),
            ("donor:n3", "n3", 100),
        ]
        await ledger.post(entries)
        billing.written(entries)
        assert ledger.balance("donor:alice") == 300 and ledger.balance("donor:n3") == 100
    finally:
        await store.close()


async def test_schema_7_gives_old_tokens_no_donor(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = await SqliteStore.open(path, target_version=6)
    await old.close()
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO tokens (token_hash, role, created_ms, expires_ms, reusable, uses)"
            " VALUES ('h', 'node', 0, 9999999999999, 1, 0)"
        )
    new = await SqliteStore.open(path)
    try:
        assert await new.redeem_token("h", 1) == TokenRecord("h", "node", 0, 9999999999999, True, 1)
        await new.add_token(TokenRecord("h2", "node", 0, 9999999999999, False, donor="bob"))
        redeemed = await new.redeem_token("h2", 1)
        assert redeemed is not None and redeemed.donor == "bob"
        assert await new.get_node_donor("n-0123456789") == ""
        await new.set_node_donor("n-0123456789", "bob")
        assert await new.get_node_donor("n-0123456789") == "bob"
    finally:
        await new.close()
