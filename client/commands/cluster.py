"""Cluster-wide operator commands: ``events`` and ``stats``."""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Iterable

from client.commands.context import Context
from client.commands.output import JOB_STATES, NODE_STATES, to_dict
from client.render import Style, fmt_bytes, fmt_duration, fmt_rate, fmt_time
from client.rpc import ExitCode
from epochmesh.v1 import common_pb2, scheduler_pb2


def event_line(event: common_pb2.Event, style: Style) -> str:
    """One readable line per event: time, id, kind, node, job, message and attributes."""
    parts = [fmt_time(event.time_ms), f"#{event.id}", style.paint(event.kind, "bold")]
    if event.node_id:
        parts.append(f"node={event.node_id}")
    if event.job_id:
        parts.append(f"job={event.job_id}")
    if event.message:
        parts.append(event.message)
    if event.attrs:
        parts.append(" ".join(f"{k}={v}" for k, v in sorted(event.attrs.items())))
    return "  ".join(parts)


def print_events(ctx: Context, events: Iterable[common_pb2.Event]) -> int:
    style = ctx.out_style
    count = 0
    for event in events:
        count += 1
        if ctx.json:
            ctx.emit_json_line(to_dict(event))
        else:
            ctx.emit(event_line(event, style))
            ctx.stdout.flush()
    return count


def cmd_events(ctx: Context) -> int:
    args = ctx.args
    node_id = ctx.get_node(args.node).node_id if args.node else ""
    job_id = ctx.get_job(args.job).job_id if args.job else ""
    kinds = [k.strip() for k in (args.kind or "").split(",") if k.strip()]
    coord = ctx.coordinator
    request = scheduler_pb2.WatchEventsRequest(
        since_id=args.since, follow=args.follow, node_id=node_id, job_id=job_id, kinds=kinds
    )
    stream = coord.stream("WatchEvents", coord.scheduler.WatchEvents, request)
    if args.last and not args.follow:
        stream = iter(deque(stream, maxlen=args.last))
    count = print_events(ctx, stream)
    if count == 0 and not ctx.json:
        ctx.note("no events")
    return ExitCode.OK


def cmd_stats(ctx: Context) -> int:
    coord = ctx.coordinator
    stats = coord.call(
        "ClusterStats", coord.scheduler.ClusterStats, scheduler_pb2.ClusterStatsRequest()
    )
    if ctx.json:
        ctx.emit_json(to_dict(stats))
        return ExitCode.OK
    style = ctx.out_style

    def counts(mapping: dict[str, int], order: tuple[str, ...]) -> str:
        norm = {k.lower().rsplit("_state_", 1)[-1]: v for k, v in mapping.items()}
        keys = [k for k in order if norm.get(k)] + sorted(k for k in norm if k not in order)
        total = sum(norm.values())
        text = ", ".join(f"{norm[k]} {style.state(k)}" for k in keys if norm[k])
        return f"{total}" + (f" ({text})" if text else "")

    rows = [
        ("coordinator", f"{ctx.address.address}, up {fmt_duration(stats.uptime_ms / 1000)}"),
        ("nodes", counts(dict(stats.nodes_by_state), NODE_STATES)),
        ("jobs", counts(dict(stats.jobs_by_state), JOB_STATES)),
        (
            "throughput",
            f"{fmt_rate(stats.total_samples_per_second)} samples/s (each node's on its job, "
            "else its reference benchmark's)",
        ),
        ("blobs", f"{stats.blobs} ({fmt_bytes(stats.blob_bytes)})"),
        ("events", str(stats.events)),
        ("heartbeats", str(stats.heartbeats_total)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        ctx.emit(f"{key.ljust(width)}  {value}")
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "events",
        parents=common,
        help="show the cluster's events",
        description="Show the coordinator's events (JSON lines with --output json).",
    )
    p.add_argument("-f", "--follow", action="store_true", help="keep waiting for new events")
    p.add_argument("--since", type=int, default=0, metavar="ID", help="events after this id")
    p.add_argument("--last", type=int, default=0, metavar="N", help="only the last N events")
    p.add_argument("--node", metavar="NODE", help="only events of this node")
    p.add_argument("--job", metavar="JOB", help="only events of this job")
    p.add_argument("--kind", metavar="K", help="only these kinds (comma-separated)")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser(
        "stats",
        parents=common,
        help="show cluster statistics",
        description="Show node and job counts, total throughput and store sizes.",
    )
    p.set_defaults(func=cmd_stats)
