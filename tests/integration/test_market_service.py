"""The credit ledger against a real in-process coordinator (TLS, its own CA) and a real SQLite
file: operators grant, submitters read only their own account, every balance sums to zero,
and the ledger survives a restart; CreditLedger refuses two postings that would together
overspend an account."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from coordinator.accounting.credit_book import Entry, InsufficientCredits, fund_escrow, grant
from coordinator.market.credit_ledger import CreditLedger
from coordinator.store.sqlite import SqliteStore
from epochmesh import identity as idm
from epochmesh.money import MICRO
from epochmesh.v1 import market_pb2, market_pb2_grpc
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(60)

S = grpc.StatusCode


async def status_of(call: object) -> S:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as err:
        return err.code()
    return S.OK


async def test_grants_balances_statements_and_who_may_see_them(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with in_process_coordinator(data) as coord:
        operator = coord.issue_identity("operator")
        alice = coord.issue_identity("submitter")
        bob = coord.issue_identity("submitter")
        async with (
            idm.secure_aio_channel(coord.address, operator) as op_ch,
            idm.secure_aio_channel(coord.address, alice) as alice_ch,
        ):
            op = market_pb2_grpc.MarketServiceStub(op_ch)
            me = market_pb2_grpc.MarketServiceStub(alice_ch)
            # Certificates made directly by the CA: no enrollment made them known, so the
            # first grant asks to create the account; unknown without create: NOT_FOUND.
            unknown = market_pb2.GrantCreditsRequest(account=alice.principal.id, amount_micro=1)
            assert await status_of(op.GrantCredits(unknown)) == S.NOT_FOUND
            granted = await op.GrantCredits(
                market_pb2.GrantCreditsRequest(
                    account=alice.principal.id, amount_micro=25 * MICRO, create=True
                )
            )
            assert granted.entry.to_account == f"tenant:{alice.principal.id}"
            assert granted.entry.from_account == "mint" and granted.balance_micro == 25 * MICRO
            await op.GrantCredits(
                market_pb2.GrantCreditsRequest(
                    account=f"tenant:{alice.principal.id}", amount_micro=500_000
                )
            )
            await op.GrantCredits(
                market_pb2.GrantCreditsRequest(
                    account=f"tenant:{bob.principal.id}", amount_micro=7, create=True
                )
            )

            own = await me.GetBalance(market_pb2.GetBalanceRequest())
            assert [(b.account, b.balance_micro) for b in own.balances] == [
                (f"tenant:{alice.principal.id}", 25_500_000)
            ]
            statement = await me.GetStatement(market_pb2.GetStatementRequest())
            assert [e.amount_micro for e in statement.entries] == [25 * MICRO, 500_000]
            assert all(e.reason.startswith("granted by u-") for e in statement.entries)
            assert statement.entries[0].id < statement.entries[1].id

            # A submitter sees only its own account and grants nothing.
            other = f"tenant:{bob.principal.id}"
            for call in (
                me.GetBalance(market_pb2.GetBalanceRequest(account=other)),
                me.GetBalance(market_pb2.GetBalanceRequest(all=True)),
                me.GetStatement(market_pb2.GetStatementRequest(account=other)),
                me.GetStatement(market_pb2.GetStatementRequest(account="mint")),
                me.GrantCredits(
                    market_pb2.GrantCreditsRequest(account=alice.principal.id, amount_micro=1)
                ),
            ):
                assert await status_of(call) == S.PERMISSION_DENIED
            # Bad input: a clear INVALID_ARGUMENT, and the service keeps serving.
            for req in (
                market_pb2.GrantCreditsRequest(account=alice.principal.id, amount_micro=0),
                market_pb2.GrantCreditsRequest(account=alice.principal.id, amount_micro=-5),
                market_pb2.GrantCreditsRequest(
                    account=alice.principal.id, amount_micro=10**9 * MICRO + 1
                ),
                market_pb2.GrantCreditsRequest(account="", amount_micro=1),
                market_pb2.GrantCreditsRequest(account="mint", amount_micro=1),
                market_pb2.GrantCreditsRequest(account="escrow:j-0123456789", amount_micro=1),
                market_pb2.GrantCreditsRequest(account="wallet:x", amount_micro=1),
            ):
                assert await status_of(op.GrantCredits(req)) == S.INVALID_ARGUMENT, req
            everything = await op.GetBalance(market_pb2.GetBalanceRequest(all=True))
            balances = {b.account: b.balance_micro for b in everything.balances}
            assert balances["mint"] == -(25_500_000 + 7)
            assert sum(balances.values()) == 0

    # Restarted on the same data dir: the ledger is where it was.
    async with in_process_coordinator(data) as coord:
        async with idm.secure_aio_channel(coord.address, operator) as op_ch:
            op = market_pb2_grpc.MarketServiceStub(op_ch)
            again = await op.GetBalance(market_pb2.GetBalanceRequest(all=True))
            assert {b.account: b.balance_micro for b in again.balances} == balances
            one = await op.GetStatement(market_pb2.GetStatementRequest(account=other))
            assert [(e.from_account, e.amount_micro) for e in one.entries] == [("mint", 7)]


async def test_two_postings_cannot_spend_the_same_credits(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "c.db")
    try:
        ledger = CreditLedger(store)
        await ledger.reload()
        await ledger.post([grant("tenant:u-a", 10, at_ms=1)])
        budgets = [fund_escrow(f"j-{i:010d}", "u-a", 10, at_ms=2, reason="budget") for i in (1, 2)]
        results = await asyncio.gather(*(ledger.post([b]) for b in budgets), return_exceptions=True)
        assert sum(isinstance(r, InsufficientCredits) for r in results) == 1
        assert await store.ledger_balances() == {
            "mint": -10,
            "tenant:u-a": 0,
            **{
                b.to_account: 10
                for b, r in zip(budgets, results, strict=True)
                if isinstance(r, list)
            },
        }
        with pytest.raises(ValueError):
            await ledger.post([Entry(3, "tenant:u-a", "platform", 0, "zero")])
        fresh = CreditLedger(store)
        await fresh.reload()
        assert fresh.balances() == ledger.balances()
        assert sum(fresh.balances().values()) == 0
    finally:
        await store.close()
