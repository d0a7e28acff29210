"""MarketService: credits granted by operators, balances and statements.

Who sees what: an operator any account; a submitter its own tenant account (``tenant:<its
principal id>``) and its own jobs' escrows and entries; anything else is PERMISSION_DENIED.
With ``--insecure`` there is no caller identity and every account is open (as for jobs).

A grant names an account the coordinator knows (coordinator/market/accounts.py) or asks to
create it: an unknown one is NOT_FOUND, so a typo or a truncated id opens no account nobody can
use.
"""

from __future__ import annotations

from typing import TypeAlias

import grpc

from coordinator.accounting.credit_book import (
    MINT,
    PLATFORM,
    Entry,
    escrow_account,
    grant,
    tenant_account,
)
from coordinator.api.queries import get_job
from coordinator.core.errors import InvalidArgumentError, PermissionDeniedError
from coordinator.core.ids import check_text
from coordinator.core.principal import current_principal
from coordinator.engine.api import TrainingEngine
from coordinator.market.accounts import gather, known_accounts, require_known
from coordinator.market.credit_ledger import CreditLedger
from coordinator.store.base import Store
from epochmesh.identity import ROLE_SUBMITTER
from epochmesh.money import MAX_CREDITS, MICRO
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2, market_pb2

Ctx: TypeAlias = grpc.aio.ServicerContext

ACCOUNT_KINDS = ("tenant", "donor", "escrow")
MAX_STATEMENT = 10_000


def normalize_account(text: str) -> str:
    """``tenant:<id>``, ``donor:<id>``, ``escrow:<job>``, ``mint`` or ``platform``; a bare
    principal id names its tenant account. InvalidArgumentError otherwise."""
    account = check_text(text.strip(), "account", max_len=160, required=True)
    if account in (MINT, PLATFORM):
        return account
    kind, sep, name = account.partition(":")
    if not sep:
        return tenant_account(account)
    if kind not in ACCOUNT_KINDS or not name:
        raise InvalidArgumentError(
            f"unknown account {account!r}: use tenant:ID, donor:ID, escrow:JOB, mint or "
            "platform (a bare principal id names its tenant account)"
        )
    return account


def check_amount(micro: int) -> int:
    """An amount a caller moves: above 0 and at most MAX_CREDITS (InvalidArgumentError)."""
    if not 0 < micro <= MAX_CREDITS * MICRO:
        raise InvalidArgumentError(
            f"amount must be above 0 and at most {MAX_CREDITS} credits, got {micro} micro-credits"
        )
    return micro


def entry_message(entry_id: int, e: Entry) -> market_pb2.LedgerEntry:
    return market_pb2.LedgerEntry(
        id=entry_id,
        time_ms=e.at_ms,
        from_account=e.from_account,
        to_account=e.to_account,
        amount_micro=e.amount,
        reason=e.reason,
        job_id=e.job_id,
        round=e.round,
        node_id=e.node_id,
        samples=e.samples,
    )


class MarketService:
    def __init__(self, store: Store, ledger: CreditLedger, engine: TrainingEngine) -> None:
        self._store = store
        self._ledger = ledger
        self._engine = engine

    def _submitter(self) -> str | None:
        """The calling submitter's principal id; None for an operator (or --insecure)."""
        principal = current_principal()
        if principal is not None and principal.role == ROLE_SUBMITTER:
            return principal.id
        return None

    def _own_account(self) -> str:
        principal = current_principal()
        if principal is None:
            raise InvalidArgumentError("name an account: the coordinator runs --insecure")
        return tenant_account(principal.id)

    async def _may_read(self, account: str) -> None:
        submitter = self._submitter()
        if submitter is None or account == tenant_account(submitter):
            return
        if account.startswith("escrow:"):
            job = await self._store.get_job(account.removeprefix("escrow:"))
            if job is not None and job.owner == submitter:
                return
        raise PermissionDeniedError(f"account {account} is not yours: you are {submitter}")

    async def GrantCredits(
        self, req: market_pb2.GrantCreditsRequest, ctx: Ctx
    ) -> market_pb2.GrantCreditsResponse:
        account = normalize_account(req.account)
        if account in (MINT, PLATFORM) or account.startswith("escrow:"):
            raise InvalidArgumentError(
                f"credits are granted to a tenant or a donor, not to {account}"
            )
        check_amount(req.amount_micro)
        if not req.create:
            await require_known(self._store, account, f"account {account!r}")
        principal = current_principal()
        by = principal.id if principal is not None else "insecure"
        entry = grant(account, req.amount_micro, now_ms(), reason=f"granted by {by}")
        (entry_id,) = await self._ledger.post([entry])  # the mint may go negative
        return market_pb2.GrantCreditsResponse(
            entry=entry_message(entry_id, entry), balance_micro=self._ledger.balance(account)
        )

    async def GetBalance(
        self, req: market_pb2.GetBalanceRequest, ctx: Ctx
    ) -> market_pb2.GetBalanceResponse:
        submitter = self._submitter()
        if req.all:
            if submitter is not None:
                raise PermissionDeniedError(
                    "only operators can see every account (you are logged in as a submitter)"
                )
            balances = self._ledger.balances()
            if req.known:
                for known in known_accounts(await gather(self._store)):
                    balances.setdefault(known, 0)
            return market_pb2.GetBalanceResponse(
                balances=[
                    market_pb2.AccountBalance(account=a, balance_micro=b)
                    for a, b in sorted(balances.items())
                ]
            )
        if req.account:
            account = normalize_account(req.account)
            await self._may_read(account)
            accounts = [account]
        else:
            account = self._own_account()
            accounts = [account]
            owner = current_principal()
            assert owner is not None
            jobs = await self._store.list_jobs(owner=owner.id)
            accounts += [
                escrow_account(j.job_id)
                for j in jobs
                if self._ledger.balance(escrow_account(j.job_id))
            ]
        return market_pb2.GetBalanceResponse(
            balances=[
                market_pb2.AccountBalance(account=a, balance_micro=self._ledger.balance(a))
                for a in accounts
            ]
        )

    async def GetStatement(
        self, req: market_pb2.GetStatementRequest, ctx: Ctx
    ) -> market_pb2.GetStatementResponse:
        if req.limit < 0 or req.after_id < 0:
            raise InvalidArgumentError("limit and after_id must not be negative")
        limit = min(req.limit or MAX_STATEMENT, MAX_STATEMENT)
        account = ""
        if req.job_id:
            await get_job(self._store, req.job_id)  # the caller's, or PERMISSION_DENIED
        if req.account:
            account = normalize_account(req.account)
            await self._may_read(account)
        elif not req.job_id:
            account = self._own_account()
        rows = await self._store.list_ledger_entries(
            account=account, job_id=req.job_id, after_id=req.after_id, limit=limit
        )
        return market_pb2.GetStatementResponse(entries=[entry_message(i, e) for i, e in rows])

    async def AddBudget(self, req: market_pb2.AddBudgetRequest, ctx: Ctx) -> common_pb2.Job:
        check_amount(req.amount_micro)
        await get_job(self._store, req.job_id)  # the caller's, or PERMISSION_DENIED
        return await self._engine.add_budget(req.job_id, req.amount_micro)
