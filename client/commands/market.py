"""The credit ledger: ``credits grant``, ``balance`` and ``statement``.

Amounts are read and written as decimal credits (``2.5``); the coordinator keeps integer
micro-credits and `--output json` carries both (``amount`` as text, ``amount_micro``)."""

from __future__ import annotations

import argparse
from typing import Any

from client.commands.context import Context
from client.commands.output import to_dict
from client.render import fmt_time
from client.rpc import CliError, ExitCode
from epochmesh.money import format_credits, parse_credits
from epochmesh.v1 import market_pb2


def amount_arg(text: str) -> int:
    """A positive amount of credits as micro-credits; a usage error (exit 2) otherwise."""
    try:
        return parse_credits(text, "AMOUNT", allow_zero=False)
    except ValueError as exc:
        raise CliError(
            ExitCode.USAGE, str(exc), "give credits as a number, e.g. 100 or 2.5"
        ) from None


def entry_dict(e: market_pb2.LedgerEntry) -> dict[str, Any]:
    return {
        "id": e.id,
        "time_ms": e.time_ms,
        "from": e.from_account,
        "to": e.to_account,
        "amount": format_credits(e.amount_micro),
        "amount_micro": e.amount_micro,
        "job": e.job_id,
        "round": e.round,
        "node": e.node_id,
        "samples": e.samples,
        "reason": e.reason,
    }


def cmd_grant(ctx: Context) -> int:
    amount = amount_arg(ctx.args.amount)
    account = ctx.get_account(ctx.args.account, create=ctx.args.create)
    coord = ctx.coordinator
    reply = coord.call(
        "GrantCredits",
        coord.market.GrantCredits,
        market_pb2.GrantCreditsRequest(
            account=account, amount_micro=amount, create=ctx.args.create
        ),
    )
    if ctx.json:
        ctx.emit_json(
            {
                **entry_dict(reply.entry),
                "balance": format_credits(reply.balance_micro),
                "balance_micro": reply.balance_micro,
            }
        )
    else:
        ctx.emit(
            f"granted {format_credits(amount)} credits to {reply.entry.to_account}: balance "
            f"{format_credits(reply.balance_micro)}"
        )
    return ExitCode.OK


def cmd_balance(ctx: Context) -> int:
    coord = ctx.coordinator
    reply = coord.call(
        "GetBalance",
        coord.market.GetBalance,
        market_pb2.GetBalanceRequest(
            account=ctx.args.account or "",
            all=ctx.args.all or ctx.args.known,
            known=ctx.args.known,
        ),
    )
    rows = [(b.account, b.balance_micro) for b in reply.balances]
    if ctx.json:
        ctx.emit_json(
            {
                "balances": [
                    {"account": a, "balance": format_credits(m), "balance_micro": m}
                    for a, m in rows
                ]
            }
        )
        return ExitCode.OK
    if not rows:
        ctx.note("no account holds credits yet (operators: `epochmesh credits grant`)")
        return ExitCode.OK
    ctx.emit_table(
        ["ACCOUNT", "CREDITS"], [[a, format_credits(m)] for a, m in rows], right=(1,), flex=0
    )
    return ExitCode.OK


def cmd_statement(ctx: Context) -> int:
    job_id = ctx.get_job(ctx.args.job).job_id if ctx.args.job else ""
    coord = ctx.coordinator
    entries: list[market_pb2.LedgerEntry] = []
    while True:  # pages (the coordinator caps each), oldest first, until an empty one
        reply = coord.call(
            "GetStatement",
            coord.market.GetStatement,
            market_pb2.GetStatementRequest(
                account=ctx.args.account or "",
                job_id=job_id,
                after_id=entries[-1].id if entries else 0,
            ),
        )
        if not reply.entries:
            break
        entries.extend(reply.entries)
    if ctx.json:
        ctx.emit_json({"entries": [entry_dict(e) for e in entries]})
        return ExitCode.OK
    if not entries:
        ctx.note("no entries")
        return ExitCode.OK
    ctx.emit_table(
        ["TIME", "FROM", "TO", "CREDITS", "JOB", "ROUND", "NODE", "SAMPLES", "REASON"],
        [
            [
                fmt_time(e.time_ms),
                e.from_account,
                e.to_account,
                format_credits(e.amount_micro),
                e.job_id or "-",
                str(e.round) if e.round else "-",
                e.node_id or "-",
                str(e.samples) if e.samples else "-",
                e.reason,
            ]
            for e in entries
        ],
        right=(3, 5, 7),
        wrap=(8,),  # the reason explains: wrapped, never cut
    )
    return ExitCode.OK


def cmd_budget(ctx: Context) -> int:
    amount = amount_arg(ctx.args.add)
    job = ctx.get_job(ctx.args.job)
    coord = ctx.coordinator
    updated = coord.call(
        "AddBudget",
        coord.market.AddBudget,
        market_pb2.AddBudgetRequest(job_id=job.job_id, amount_micro=amount),
    )
    if ctx.json:
        ctx.emit_json(to_dict(updated))
    else:
        ctx.emit(
            f"job {updated.job_id}: {format_credits(amount)} credits added; its escrow holds "
            f"{format_credits(updated.escrow_micro)}"
        )
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "credits",
        help="grant credits (operators)",
        description="Credits pay for training: submitters spend them, donors earn them.",
    )
    actions = p.add_subparsers(dest="credits_action", metavar="ACTION", required=True)
    g = actions.add_parser(
        "grant",
        parents=common,
        help="give an account credits (operators)",
        description="Give ACCOUNT (tenant:ID, donor:ID, or a bare principal id for its tenant "
        "account) AMOUNT credits, from the mint. ACCOUNT may be a unique prefix of an account "
        "the coordinator knows (an enrolled user or node, a donor, a tenant with jobs or a "
        "weight, an account with ledger entries: `epochmesh balance --all --known`); an "
        "unknown one is refused (exit 3) unless --create.",
    )
    g.add_argument(
        "account",
        metavar="ACCOUNT",
        help="tenant:ID, donor:ID or a bare principal id (its tenant account); a unique "
        "prefix of a known one",
    )
    g.add_argument("amount", metavar="AMOUNT", help="credits, e.g. 100 or 2.5")
    g.add_argument(
        "--create",
        action="store_true",
        help="open ACCOUNT, taken as written, even though the coordinator does not know it",
    )
    g.set_defaults(func=cmd_grant)

    p = sub.add_parser(
        "balance",
        parents=common,
        help="show credit balances",
        description="Your account's balance and your live jobs' escrows; an operator may "
        "name any account or ask for --all.",
    )
    p.add_argument("account", metavar="ACCOUNT", nargs="?", help="tenant:ID, donor:ID, ...")
    p.add_argument("--all", action="store_true", help="every account (operators)")
    p.add_argument(
        "--known",
        action="store_true",
        help="with --all: also the accounts the coordinator knows at a zero balance (the "
        "accounts a grant may name; operators)",
    )
    p.set_defaults(func=cmd_balance)

    p = sub.add_parser(
        "statement",
        parents=common,
        help="list ledger entries",
        description="The ledger entries of your account (or ACCOUNT, or --job JOB), oldest "
        "first: time, from, to, amount, job, round, node, samples and reason.",
    )
    p.add_argument("account", metavar="ACCOUNT", nargs="?", help="tenant:ID, donor:ID, ...")
    p.add_argument("--job", metavar="JOB", help="only this job's entries")
    p.set_defaults(func=cmd_statement)

    p = sub.add_parser(
        "budget",
        parents=common,
        help="add credits to a job's budget",
        description="Move AMOUNT credits from your account into the job's escrow; a job paused "
        "because its budget ran out resumes.",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.add_argument("--add", metavar="AMOUNT", required=True, help="credits, e.g. 50 or 2.5")
    p.set_defaults(func=cmd_budget)
