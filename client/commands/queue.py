"""The cluster scheduler's queue and its knobs: ``queue``, ``priority`` and ``tenant``."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from client.commands.context import Context
from client.commands.output import closest, job_state_name, to_dict
from client.rpc import CliError, ExitCode
from epochmesh.spec import DEFAULT_PRIORITY, PRIORITIES
from epochmesh.v1 import job_pb2, scheduler_pb2

DEFAULT_WEIGHT = 1.0


def fmt_share(x: float) -> str:
    """Node-equivalents, e.g. ``1.50``."""
    return f"{x:.2f}"


def parse_priority(text: str) -> str:
    """``"High"`` -> ``"high"``; anything else is a usage error with a suggestion."""
    name = text.strip().lower()
    if name in PRIORITIES:
        return name
    close = closest(name, PRIORITIES)
    hint = f"did you mean {close}? " if close else ""
    raise CliError(
        ExitCode.USAGE,
        f"unknown priority {text.strip()!r}",
        f"{hint}choose from: {', '.join(PRIORITIES)}",
    )


def queue_rows(entries: Iterable[scheduler_pb2.QueueEntry]) -> list[list[str]]:
    return [
        [
            e.job_id,
            e.name or "-",
            e.tenant or "-",
            e.priority or DEFAULT_PRIORITY,
            job_state_name(e.state),
            fmt_share(e.fair_share),
            f"{e.nodes_held}/{e.nodes_wanted}",
            e.reason or "-",
        ]
        for e in entries
    ]


def cmd_queue(ctx: Context) -> int:
    coord = ctx.coordinator
    # JobService answers everyone: an operator gets the whole queue, a submitter its own jobs.
    reply = coord.call("GetQueue", coord.jobs.GetQueue, scheduler_pb2.GetQueueRequest())
    if ctx.json:
        ctx.emit_json(to_dict(reply))
        return ExitCode.OK
    others = (
        f"; {reply.other_jobs} live job(s) of other tenants not shown" if reply.other_jobs else ""
    )
    if not reply.jobs:
        ctx.note(f"no live jobs in the queue{others}")
        return ExitCode.OK
    ctx.emit_table(
        ["JOB", "NAME", "TENANT", "PRIORITY", "STATE", "FAIR SHARE", "NODES", "REASON"],
        queue_rows(reply.jobs),
        right=(5, 6),
        flex=1,
        wrap=(7,),  # the reason explains: wrapped, never cut
        paint={4: ctx.out_style.state},
    )
    if others:
        ctx.note(others.removeprefix("; "))
    return ExitCode.OK


def cmd_priority(ctx: Context) -> int:
    priority = parse_priority(ctx.args.priority)
    job = ctx.get_job(ctx.args.job)
    before = job.spec.priority or DEFAULT_PRIORITY
    coord = ctx.coordinator
    updated = coord.call(
        "SetJobPriority",
        coord.jobs.SetJobPriority,
        job_pb2.SetJobPriorityRequest(job_id=job.job_id, priority=priority),
    )
    if ctx.json:
        ctx.emit_json(to_dict(updated))
    else:
        after = updated.spec.priority or DEFAULT_PRIORITY
        change = f"{before} -> {after}" if before != after else f"stays {after}"
        ctx.emit(f"job {updated.job_id} priority {change}")
    return ExitCode.OK


@dataclass
class TenantRow:
    tenant: str
    weight: float
    weight_set: bool  # an operator set it (else the default)
    jobs: int  # live jobs
    nodes: int  # nodes the scheduler gives its jobs now
    fair_share: float  # node-equivalents, its jobs' together


def tenant_rows(reply: scheduler_pb2.GetQueueResponse) -> list[TenantRow]:
    """One row per tenant with an operator-set weight or a live job, by name."""
    weights = dict(reply.tenant_weights)
    rows: dict[str, TenantRow] = {t: TenantRow(t, w, True, 0, 0, 0.0) for t, w in weights.items()}
    for e in reply.jobs:
        row = rows.setdefault(e.tenant, TenantRow(e.tenant, DEFAULT_WEIGHT, False, 0, 0, 0.0))
        row.jobs += 1
        row.nodes += e.nodes_held
        row.fair_share += e.fair_share
    return [rows[t] for t in sorted(rows)]


def cmd_tenant_list(ctx: Context) -> int:
    coord = ctx.coordinator
    reply = coord.call("GetQueue", coord.scheduler.GetQueue, scheduler_pb2.GetQueueRequest())
    rows = tenant_rows(reply)
    if ctx.json:
        ctx.emit_json({"tenants": [asdict(r) for r in rows]})
        return ExitCode.OK
    if not rows:
        ctx.note(
            "no tenants with live jobs or weights; every tenant weighs "
            f"{DEFAULT_WEIGHT:g} until `epochmesh tenant set TENANT --weight W`"
        )
        return ExitCode.OK
    ctx.emit_table(
        ["TENANT", "WEIGHT", "JOBS", "NODES", "FAIR SHARE"],
        [
            [
                r.tenant or "-",
                f"{r.weight:g}" + ("" if r.weight_set else " (default)"),
                str(r.jobs),
                str(r.nodes),
                fmt_share(r.fair_share),
            ]
            for r in rows
        ],
        right=(2, 3, 4),
        flex=0,
    )
    return ExitCode.OK


def cmd_tenant_set(ctx: Context) -> int:
    tenant = ctx.get_tenant(ctx.args.tenant, create=ctx.args.create)
    coord = ctx.coordinator
    reply = coord.call(
        "SetTenantWeight",
        coord.scheduler.SetTenantWeight,
        scheduler_pb2.SetTenantWeightRequest(
            tenant=tenant, weight=ctx.args.weight, create=ctx.args.create
        ),
    )
    if ctx.json:
        ctx.emit_json(to_dict(reply))
    else:
        ctx.emit(f"tenant {reply.tenant} weight {reply.weight:g}")
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "queue",
        parents=common,
        help="show the scheduler's queue",
        description="Show every live job with its tenant, priority, fair share (in "
        "node-equivalents), the nodes it holds out of those it wants, and why. A submitter "
        "sees its own jobs (and how many others there are); an operator sees them all. "
        "--output json: one document with 'jobs', 'tenant_weights' and 'other_jobs'.",
    )
    p.set_defaults(func=cmd_queue)

    p = sub.add_parser(
        "priority",
        parents=common,
        help="change a job's priority tier",
        description="Move a live job to another priority tier: high, normal or low. A job's "
        "owner may lower its priority; only an operator may raise it.",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.add_argument("priority", metavar="PRIORITY", help=" | ".join(PRIORITIES))
    p.set_defaults(func=cmd_priority)

    p = sub.add_parser(
        "tenant",
        help="tenants' weights in the fair share (operators)",
        description="A tenant is the identity that submits jobs (its principal id). Between "
        f"tenants of a tier, nodes are shared in proportion to their weights (default "
        f"{DEFAULT_WEIGHT:g}).",
    )
    actions = p.add_subparsers(dest="tenant_command", metavar="ACTION", required=True)
    q = actions.add_parser(
        "list",
        parents=common,
        help="list tenants with their weights, live jobs and nodes",
        description="List the tenants that have a weight or a live job. --output json: "
        "{'tenants': [{tenant, weight, weight_set, jobs, nodes, fair_share}, ...]}.",
    )
    q.set_defaults(func=cmd_tenant_list)
    q = actions.add_parser(
        "set",
        parents=common,
        help="set a tenant's weight",
        description="Set a tenant's weight: a positive number (it persists). TENANT is a "
        "principal id the coordinator knows (an enrolled user, a job's owner, a weighted "
        "tenant) or a unique prefix of one; an unknown one is refused (exit 3) unless "
        "--create.",
    )
    q.add_argument(
        "tenant", metavar="TENANT", help="the tenant's principal id (u-...) or a unique prefix"
    )
    q.add_argument(
        "--create",
        action="store_true",
        help="weigh TENANT, taken as written, even though the coordinator does not know it",
    )
    q.add_argument(
        "--weight", type=float, required=True, metavar="W", help="a positive number (default 1)"
    )
    q.set_defaults(func=cmd_tenant_set)
