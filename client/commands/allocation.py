"""``epochmesh allocation JOB``: how a job is split over its nodes, and where their time goes.

Two tables: the split (each node's measured throughput, share of the global batch, local batch
b_i, inner steps H in local SGD, segment of the epoch) and the time (each node's measured RTT and
bandwidth to the coordinator, the seconds it spent computing and communicating for this job,
cumulative, and the computing share), with a total line over all nodes.

While the job runs, everything comes from the coordinator's live allocation (GetAllocation:
NodeAllocation.compute_seconds / communicate_seconds / rtt_ms / bandwidth_bytes_per_second).
A job without one (queued, finished, failed) has its times summed from its recorded rounds
instead (RoundPart.seconds / communicate_seconds of the applied parts), with each node's RTT and
bandwidth from its latest benchmark; ``source`` in the JSON says which.

``--output json``: the Allocation message (proto field names, see client/commands/output.py)
plus ``source`` ("allocation" | "rounds") and ``totals`` {compute_seconds,
communicate_seconds, compute_fraction (null before any time was recorded)}.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from client.commands.context import Context
from client.commands.output import epoch_text, job_state_name, to_dict
from client.render import (
    fmt_bandwidth,
    fmt_rate,
    fmt_rtt,
    fmt_seconds,
    time_split_bar,
)
from client.rpc import CliError, ExitCode
from epochmesh.v1 import common_pb2, job_pb2, scheduler_pb2

APPLIED = ("", "applied")


@dataclass(frozen=True)
class TimeTotals:
    """Seconds computing and communicating, summed over nodes."""

    compute_seconds: float
    communicate_seconds: float

    @property
    def total_seconds(self) -> float:
        return self.compute_seconds + self.communicate_seconds

    @property
    def compute_fraction(self) -> float | None:
        """Share of the recorded time spent computing; None before any time was recorded."""
        total = self.total_seconds
        return self.compute_seconds / total if total > 0 else None

    def to_dict(self) -> dict[str, Any]:
        fraction = self.compute_fraction
        return {
            "compute_seconds": self.compute_seconds,
            "communicate_seconds": self.communicate_seconds,
            "compute_fraction": fraction,
        }


def time_totals(nodes: Iterable[common_pb2.NodeAllocation]) -> TimeTotals:
    compute = communicate = 0.0
    for n in nodes:
        compute += max(0.0, n.compute_seconds)
        communicate += max(0.0, n.communicate_seconds)
    return TimeTotals(compute, communicate)


def nodes_from_rounds(
    records: Sequence[common_pb2.RoundRecord],
    infos: Mapping[str, common_pb2.NodeInfo] | None = None,
) -> list[common_pb2.NodeAllocation]:
    """One NodeAllocation per node that had an applied part in ``records`` (first appearance
    order): compute / communicate seconds summed over its applied parts, local batch and inner
    steps of its last one; name, RTT and bandwidth from ``infos`` (its latest benchmark)."""
    out: dict[str, common_pb2.NodeAllocation] = {}
    for record in records:
        for p in record.parts:
            if p.status not in APPLIED:
                continue
            na = out.get(p.node_id)
            if na is None:
                na = out[p.node_id] = common_pb2.NodeAllocation(node_id=p.node_id)
                info = (infos or {}).get(p.node_id)
                if info is not None:
                    na.name = info.name
                    na.rtt_ms = info.benchmark.rtt_ms
                    na.bandwidth_bytes_per_second = info.benchmark.bandwidth_bytes_per_second
            na.compute_seconds += max(0.0, p.seconds)
            na.communicate_seconds += max(0.0, p.communicate_seconds)
            na.local_batch = p.local_batch
            na.inner_steps = p.inner_steps
    return list(out.values())


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def split_rows(nodes: Sequence[common_pb2.NodeAllocation], with_h: bool) -> list[list[str]]:
    rows = []
    for n in nodes:
        row = [
            n.node_id,
            n.name or "-",
            fmt_rate(n.samples_per_second),
            f"{n.share * 100:.1f}%",
            str(n.local_batch),
        ]
        if with_h:
            row.append(str(n.inner_steps) if n.inner_steps else "-")
        row += [
            str(n.max_batch) if n.max_batch else "-",
            f"{n.segment.start}-{n.segment.stop}" if n.segment.stop > n.segment.start else "-",
            str(n.remaining),
        ]
        rows.append(row)
    return rows


def time_rows(nodes: Sequence[common_pb2.NodeAllocation]) -> list[list[str]]:
    rows = []
    for n in nodes:
        t = TimeTotals(max(0.0, n.compute_seconds), max(0.0, n.communicate_seconds))
        rows.append(
            [
                n.node_id,
                n.name or "-",
                fmt_rtt(n.rtt_ms),
                fmt_bandwidth(n.bandwidth_bytes_per_second),
                fmt_seconds(t.compute_seconds),
                fmt_seconds(t.communicate_seconds),
                percent(t.compute_fraction),
            ]
        )
    return rows


def total_line(totals: TimeTotals) -> str:
    return (
        f"total: computing {fmt_seconds(totals.compute_seconds)}, communicating "
        f"{fmt_seconds(totals.communicate_seconds)}: {percent(totals.compute_fraction)} "
        f"computing {time_split_bar(totals.compute_seconds, totals.communicate_seconds)}"
    )


def _node_infos(ctx: Context) -> dict[str, common_pb2.NodeInfo]:
    coord = ctx.coordinator
    try:
        reply = coord.call("ListNodes", coord.scheduler.ListNodes, scheduler_pb2.ListNodesRequest())
    except CliError as err:
        if err.code != ExitCode.AUTH:
            raise
        return {}  # names and links are a nicety: the times stand without them
    return {n.node_id: n for n in reply.nodes}


def _records(ctx: Context, job_id: str) -> list[common_pb2.RoundRecord]:
    coord = ctx.coordinator
    reply = coord.call(
        "GetRounds",
        coord.jobs.GetRounds,
        job_pb2.GetRoundsRequest(job_id=job_id, since_round=0, limit=0),
    )
    return list(reply.rounds)


def cmd_allocation(ctx: Context) -> int:
    job = ctx.get_job(ctx.args.job)
    coord = ctx.coordinator
    alloc = coord.call(
        "GetAllocation",
        coord.scheduler.GetAllocation,
        scheduler_pb2.GetAllocationRequest(job_id=job.job_id),
    )
    source = "allocation"
    records: list[common_pb2.RoundRecord] = []
    if not alloc.nodes:
        records = _records(ctx, job.job_id)
        if records:
            source = "rounds"
            del alloc.nodes[:]
            alloc.nodes.extend(nodes_from_rounds(records, _node_infos(ctx)))
    totals = time_totals(alloc.nodes)
    if ctx.json:
        ctx.emit_json({**to_dict(alloc), "source": source, "totals": totals.to_dict()})
        return ExitCode.OK
    ctx.emit(
        f"job {job.job_id}  {job_state_name(job.state)}  epoch {epoch_text(job)}  "
        f"round {alloc.round}"
        + (
            f"  deadline {alloc.round_deadline_seconds:.2f}s"
            if alloc.round_deadline_seconds > 0 and source == "allocation"
            else ""
        )
    )
    if not alloc.nodes:
        ctx.note("no nodes are allocated to this job right now, and it has no rounds yet")
        return ExitCode.OK
    if source == "allocation":
        with_h = job.spec.sync == "local_sgd" or any(n.inner_steps > 1 for n in alloc.nodes)
        headers = ["NODE", "NAME", "SAMPLES/S", "SHARE", "B_I"]
        headers += ["H"] if with_h else []
        headers += ["MAX_B", "SEGMENT", "LEFT"]
        right = tuple(i for i, h in enumerate(headers) if h not in ("NODE", "NAME", "SEGMENT"))
        ctx.emit_table(headers, split_rows(alloc.nodes, with_h), right=right, flex=1)
        ctx.emit()
        ctx.emit("time computing vs communicating, this job so far:")
    else:
        ctx.emit(
            f"no live allocation (job {job_state_name(job.state)}); time summed from its "
            f"{len(records)} recorded rounds:"
        )
    ctx.emit_table(
        ["NODE", "NAME", "RTT", "BANDWIDTH", "COMPUTE", "COMMUNICATE", "COMPUTE%"],
        time_rows(alloc.nodes),
        right=(2, 3, 4, 5, 6),
        flex=1,
    )
    ctx.emit(total_line(totals))
    return ExitCode.OK
