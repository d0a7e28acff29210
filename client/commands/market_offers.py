"""The market seen by a submitter: ``offers`` (the nodes, their prices, samples per credit,
reliability and speed on the caller's live jobs) and ``quote`` (what a job.toml would cost and
take on the nodes offered now, or what a submitted job has left)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from client.commands.context import Context
from client.commands.nodes import device_summary, fmt_verified, node_price, node_rate
from client.commands.output import job_state_name, node_status
from client.render import fmt_duration, fmt_rate, fmt_seconds
from client.rpc import CliError, ExitCode
from epochmesh.errors import SpecError
from epochmesh.matching import SECONDS_PER_HOUR, Offer
from epochmesh.money import MICRO, format_credits
from epochmesh.quote import JOB_RATE, JobQuote, Quote, max_price_of, quote, quote_job
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2, scheduler_pb2

NS = common_pb2.NodeState
HIDDEN_STATES = frozenset({NS.NODE_STATE_OFFLINE, NS.NODE_STATE_QUARANTINED})
QUOTE_STATES = (NS.NODE_STATE_ONLINE, NS.NODE_STATE_BUSY)  # the nodes that could take a job
RATES_NOTE = "rates from the reference benchmark; a job's own speed differs"
PREDICTED_NOTE = (
    "JOB SAMPLES/S is predicted for this program at its local batch: a step takes a fixed "
    "cost plus the program's FLOPs at an efficiency, both fitted on the steps measured on "
    "the node's device model (FROM), over the node's reference benchmark FLOP/s"
)
RATE_SOURCES = {
    "same_program": "same program",
    "calibrated": "device model",
    "calibrated_other_devices": "other devices",
    "default_efficiency": "default",
}
JOBS_SHOWN = 2  # per-job speeds in the offers table; the rest as "+N"
JOB_ID_SHOWN = 8  # "j-" and 6 hex: a prefix `status` and `quote` accept


@dataclass(frozen=True)
class NodeOffer:
    node_id: str
    name: str
    state: str
    device: str
    price_micro_per_hour: int  # 0: donated
    samples_per_second: float  # observed when known, else the reference benchmark's
    rate_source: str  # "observed" | "benchmark" | "none"
    samples_per_credit: float | None  # None for a donated node
    # Reliability: parts of rounds applied vs failed (failed, late or rejected), all jobs.
    parts_applied: int
    parts_failed: int
    reliability: float | None  # applied / (applied + failed); None before its first part
    online_since_ms: int  # its latest registration
    uptime_seconds: float | None  # online without a break for; None when offline
    job_samples_per_second: dict[str, float]  # job id -> its measured samples/s on the job
    # Verification record: checks passed in a row, in all, failed; the chance its next round
    # is checked.
    verified_in_a_row: int = 0
    verified_total: int = 0
    failed_checks: int = 0
    check_probability: float = 1.0
    verified: str = "new:0/10"  # in words, as `nodes` shows it

    @property
    def free(self) -> bool:
        return self.price_micro_per_hour <= 0


def node_offer(node: common_pb2.NodeInfo, now: int | None = None) -> NodeOffer:
    """The node's offer; ``now``: wall-clock ms for its uptime (default: the time now)."""
    rate = node_rate(node)
    source = (
        "observed"
        if node.observed_samples_per_second > 0
        else "benchmark"
        if node.benchmark.samples_per_second > 0
        else "none"
    )
    price = max(0, node.price_micro_per_hour)
    per_credit = rate * SECONDS_PER_HOUR * MICRO / price if price > 0 else None
    parts = node.parts_applied + node.parts_failed
    up = None
    if node.state != NS.NODE_STATE_OFFLINE and node.online_since_ms > 0:
        up = max(0, (now_ms() if now is None else now) - node.online_since_ms) / 1000
    return NodeOffer(
        node_id=node.node_id,
        name=node.name,
        state=node_status(node),
        device=device_summary(node),
        price_micro_per_hour=price,
        samples_per_second=rate,
        rate_source=source,
        samples_per_credit=per_credit,
        parts_applied=node.parts_applied,
        parts_failed=node.parts_failed,
        reliability=node.parts_applied / parts if parts > 0 else None,
        online_since_ms=node.online_since_ms,
        uptime_seconds=up,
        job_samples_per_second=dict(sorted(node.job_samples_per_second.items())),
        verified_in_a_row=node.reputation.verified_in_a_row,
        verified_total=node.reputation.verified_total,
        failed_checks=node.reputation.failed_total,
        check_probability=node.reputation.check_probability,
        verified=fmt_verified(node),
    )


def node_offers(
    nodes: Iterable[common_pb2.NodeInfo], *, all_states: bool = False, now: int | None = None
) -> list[NodeOffer]:
    """The offers of ``nodes``, best value first: donated nodes (fastest first), then the
    most samples per credit; offline and quarantined nodes only with ``all_states``."""
    at = now_ms() if now is None else now
    offers = [node_offer(n, at) for n in nodes if all_states or n.state not in HIDDEN_STATES]
    return sorted(
        offers,
        key=lambda o: (
            not o.free,
            -(o.samples_per_second if o.free else o.samples_per_credit or 0.0),
            o.name,
            o.node_id,
        ),
    )


def fmt_per_credit(offer: NodeOffer) -> str:
    if offer.samples_per_credit is None:
        return "free"
    return fmt_rate(offer.samples_per_credit) if offer.samples_per_credit > 0 else "-"


def fmt_reliability(offer: NodeOffer) -> str:
    """``98% of 150 parts`` (the share applied, rounded down: 100% only without a failure);
    ``-`` before the node's first part."""
    if offer.reliability is None:
        return "-"
    parts = offer.parts_applied + offer.parts_failed
    percent = offer.parts_applied * 100 // parts
    return f"{percent}% of {parts} part{'s' if parts != 1 else ''}"


def fmt_job_rates(rates: dict[str, float]) -> str:
    """``j-1a2b3c: 812/s j-4d5e6f: 90.5/s +1``: the first JOBS_SHOWN jobs by id."""
    if not rates:
        return "-"
    shown = [
        f"{job[:JOB_ID_SHOWN]}: {fmt_rate(r)}/s" for job, r in list(rates.items())[:JOBS_SHOWN]
    ]
    more = len(rates) - JOBS_SHOWN
    return " ".join(shown) + (f" +{more}" if more > 0 else "")


def cmd_offers(ctx: Context) -> int:
    coord = ctx.coordinator
    reply = coord.call("ListNodes", coord.scheduler.ListNodes, scheduler_pb2.ListNodesRequest())
    offers = node_offers(reply.nodes, all_states=ctx.args.all)
    if ctx.json:
        ctx.emit_json({"offers": [asdict(o) for o in offers]})
        return ExitCode.OK
    if not offers:
        hidden = len(reply.nodes)
        more = f" ({hidden} offline or quarantined: --all shows them)" if hidden else ""
        ctx.note(f"no nodes on offer{more}")
        return ExitCode.OK
    rows = [
        [
            o.node_id,
            o.name or "-",
            o.state,
            o.device,
            "free" if o.free else f"{format_credits(o.price_micro_per_hour)}/h",
            fmt_rate(o.samples_per_second),
            fmt_per_credit(o),
            fmt_reliability(o),
            o.verified,
            "-" if o.uptime_seconds is None else fmt_duration(o.uptime_seconds),
            fmt_job_rates(o.job_samples_per_second),
        ]
        for o in offers
    ]
    ctx.emit_table(
        [
            "NODE",
            "NAME",
            "STATE",
            "DEVICE",
            "PRICE",
            "SAMPLES/S*",
            "SAMPLES/CREDIT",
            "RELIABILITY",
            "VERIFIED",
            "UP",
            "JOBS",
        ],
        rows,
        right=(4, 5, 6, 9),
        flex=1,
        paint={2: ctx.out_style.state},
    )
    return ExitCode.OK


def _spec_error(err: Exception, path: Path) -> CliError:
    lines = (str(err).strip() or type(err).__name__).splitlines()
    hint = lines[1].strip() if len(lines) > 1 else f"fix {path} and ask again"
    return CliError(ExitCode.USAGE, lines[0], hint)


def load_job(path: Path) -> tuple[common_pb2.JobSpec, int]:
    """The spec of the job.toml at ``path`` and the samples of its dataset (read from the
    safetensors header only); a bad job.toml or dataset is a usage error (exit 2)."""
    from epochmesh.spec import load_spec
    from epochmesh.wire.safetensors_file import dataset_samples

    try:
        loaded = load_spec(path, check_files=False)
        spec = loaded.spec
        samples = dataset_samples(loaded.data_path, [*spec.inputs, *spec.targets])
    except SpecError as err:
        raise _spec_error(err, path) from None
    return spec, samples


def market_offers(nodes: Iterable[common_pb2.NodeInfo]) -> list[Offer]:
    """Offers of the nodes that could take a job now, at their reference benchmark's rate."""
    return [
        Offer(n.node_id, max(0, n.price_micro_per_hour), n.benchmark.samples_per_second)
        for n in nodes
        if n.state in QUOTE_STATES
    ]


def _credits(micro: int) -> str:
    return f"{format_credits(micro)} credits"


def quote_dict(spec: common_pb2.JobSpec, q: Quote, nodes: dict[str, Any]) -> dict[str, Any]:
    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        "job": spec.name,
        "num_samples": q.num_samples,
        "epochs": q.epochs,
        "mode": q.mode,
        "reason": q.reason,
        "min_nodes": q.min_nodes,
        "max_nodes": q.max_nodes,
        "max_price_micro_per_hour": q.max_price,
        "eligible_nodes": q.eligible,
        "nodes": [
            {
                "node_id": o.node_id,
                "name": nodes[o.node_id].name if o.node_id in nodes else "",
                "price_micro_per_hour": o.price_per_hour,
                "samples_per_second": o.rate,
            }
            for o in q.nodes
        ],
        "samples_per_second": q.rate,
        "price_micro_per_hour": q.price_per_hour,
        "epoch_seconds": finite(q.epoch_seconds),
        "total_seconds": finite(q.total_seconds),
        "epoch_cost_micro": q.epoch_cost,
        "total_cost_micro": q.total_cost,
        "budget_micro": q.budget,
        "budget_covers": q.budget_covers,
        "deadline_seconds": q.deadline_seconds,
        "deadline_met": q.deadline_met,
        "rates": "reference_benchmark",
    }


def _no_fit(spec: common_pb2.JobSpec, q: Quote) -> CliError:
    if q.max_price == 0 and not spec.HasField("max_price_micro_per_hour"):
        hint = (
            "without a budget a job uses donated nodes only: set [market] budget (and "
            "max_price) to use priced ones; `epochmesh offers` lists them"
        )
    elif q.max_price is not None:
        hint = (
            "raise [market] max_price or lower [cluster] min_nodes; `epochmesh offers` lists "
            "the nodes and their prices"
        )
    else:
        hint = "lower [cluster] min_nodes or wait for more nodes (`epochmesh offers`)"
    return CliError(ExitCode.PRECONDITION, f"no offer fits job {spec.name}: {q.reason}", hint)


def quote_lines(spec: common_pb2.JobSpec, q: Quote) -> list[tuple[str, str]]:
    """The key-value lines under the table of nodes."""
    nodes = "node" if len(q.nodes) == 1 else "nodes"
    rows = [
        ("job", f"{spec.name}: {q.epochs} epochs of {q.num_samples} samples"),
        ("nodes", f"{len(q.nodes)} {nodes} ({q.min_nodes}-{q.max_nodes} allowed): {q.reason}"),
        ("samples/s", fmt_rate(q.rate)),
        ("epoch", f"{fmt_seconds(q.epoch_seconds)}, {_credits(q.epoch_cost)}"),
        ("total", f"{fmt_seconds(q.total_seconds)}, {_credits(q.total_cost)}"),
    ]
    covers = "covers it" if q.budget_covers else "does NOT cover it"
    rows.append(("budget", f"{'none' if q.budget is None else _credits(q.budget)}: {covers}"))
    if q.deadline_seconds is not None:
        met = "met" if q.deadline_met else "NOT met"
        rows.append(("deadline", f"{fmt_duration(q.deadline_seconds)}: {met}"))
    return rows


def is_job_file(arg: str) -> bool:
    """Whether ``quote``'s argument names a job.toml (an existing path, or one that looks like
    a path: ``.toml`` or a directory part) rather than a submitted job."""
    return Path(arg).exists() or arg.endswith(".toml") or "/" in arg or os.sep in arg


def cmd_quote(ctx: Context) -> int:
    if is_job_file(ctx.args.spec):
        return _quote_file(ctx, Path(ctx.args.spec))
    return _quote_job(ctx, ctx.args.spec)


def _quote_nodes(ctx: Context) -> list[common_pb2.NodeInfo]:
    coord = ctx.coordinator
    reply = coord.call(
        "ListNodes",
        coord.scheduler.ListNodes,
        scheduler_pb2.ListNodesRequest(states=list(QUOTE_STATES)),
    )
    return list(reply.nodes)


def _emit_lines(ctx: Context, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        ctx.emit(f"{key.ljust(width)}  {value}")


def elapsed_since_process_start() -> float:
    """Seconds since this process started (Linux /proc; 0.0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def program_quote_dict(
    spec: common_pb2.JobSpec,
    samples: int,
    flops: float,
    reply: scheduler_pb2.QuoteJobResponse,
    submit_seconds: float = 0.0,
) -> dict[str, Any]:
    """``quote JOB.toml --output json``: the coordinator's estimate (``job_seconds``, from the
    job's submission) plus this machine's own part of a submit (``submit_seconds``) makes
    ``total_seconds``."""
    total = reply.total_seconds + submit_seconds
    chosen = [n for n in reply.nodes if n.chosen]
    budget = spec.budget_micro if spec.HasField("budget_micro") else None
    deadline = spec.deadline_seconds if spec.HasField("deadline_seconds") else None
    price = sum(n.price_micro_per_hour for n in chosen)
    return {
        "job": spec.name,
        "num_samples": samples,
        "epochs": spec.epochs,
        "mode": "fastest" if deadline is not None else "cheapest",
        "reason": reply.reason,
        "min_nodes": max(1, spec.min_nodes),
        "max_nodes": min(spec.max_nodes, spec.global_batch),
        "max_price_micro_per_hour": max_price_of(spec),
        "nodes": [
            {
                "node_id": n.node_id,
                "name": n.name,
                "price_micro_per_hour": n.price_micro_per_hour,
                "samples_per_second": n.samples_per_second,
                "rate_source": n.rate_source,
                "reference_samples_per_second": n.reference_samples_per_second,
                "local_batch": n.local_batch,
            }
            for n in chosen
        ],
        "samples_per_second": sum(n.samples_per_second for n in chosen),
        "price_micro_per_hour": price,
        "flops_per_sample": flops,
        "reference_flops_per_sample": reply.reference_flops_per_sample,
        "rounds": reply.rounds,
        "checkpoints": reply.checkpoints,
        "start_seconds": reply.start_seconds,
        "round_compute_seconds": reply.round_compute_seconds,
        "round_overhead_seconds": reply.round_overhead_seconds,
        "overhead_source": reply.overhead_source,
        "recorded_jobs": reply.recorded_jobs,
        "epoch_seconds": reply.epoch_seconds,
        "submit_seconds": submit_seconds,
        "job_seconds": reply.total_seconds,
        "total_seconds": total,
        "epoch_cost_micro": reply.epoch_cost_micro,
        "total_cost_micro": reply.total_cost_micro,
        "fee_micro": reply.fee_micro,
        "budget_micro": budget,
        "budget_covers": reply.total_cost_micro <= (budget or 0),
        "deadline_seconds": deadline,
        "deadline_met": None if deadline is None else total <= deadline,
        "rates": "predicted_for_the_program",
    }


def program_quote_lines(d: dict[str, Any]) -> list[tuple[str, str]]:
    """The key-value lines under the table of nodes."""
    n = len(d["nodes"])
    rows = [
        ("job", f"{d['job']}: {d['epochs']} epochs of {d['num_samples']} samples"),
        (
            "nodes",
            f"{n} node{'s' if n != 1 else ''} ({d['min_nodes']}-{d['max_nodes']} allowed): "
            f"{d['reason']}",
        ),
        (
            "program",
            f"{fmt_rate(d['flops_per_sample'])} FLOPs per sample "
            f"(reference benchmark: {fmt_rate(d['reference_flops_per_sample'])})",
        ),
        ("samples/s", f"{fmt_rate(d['samples_per_second'])} (compute, predicted)"),
        (
            "rounds",
            f"{d['rounds']} of {fmt_seconds(d['round_compute_seconds'])} compute + "
            f"{fmt_seconds(d['round_overhead_seconds'])} overhead "
            f"({'recorded' if d['overhead_source'] == 'recorded' else 'default'})",
        ),
        ("submit", f"{fmt_seconds(d['submit_seconds'])} (this machine: start-up, packing, upload)"),
        ("start", f"{fmt_seconds(d['start_seconds'])} (program check, job benchmark)"),
        ("epoch", f"{fmt_seconds(d['epoch_seconds'])}, {_credits(d['epoch_cost_micro'])}"),
        ("total", f"{fmt_seconds(d['total_seconds'])}, {_credits(d['total_cost_micro'])}"),
    ]
    budget = d["budget_micro"]
    covers = "covers it" if d["budget_covers"] else "does NOT cover it"
    rows.append(("budget", f"{'none' if budget is None else _credits(budget)}: {covers}"))
    if d["deadline_seconds"] is not None:
        met = "met" if d["deadline_met"] else "NOT met"
        rows.append(("deadline", f"{fmt_duration(d['deadline_seconds'])}: {met}"))
    return rows


def _quote_file(ctx: Context, path: Path) -> int:
    from client.commands.submit import load_checked, pack
    from client.upload import Uploader

    spec, samples = load_job(path)  # exit 2 before the coordinator is asked
    nodes = _quote_nodes(ctx)
    by_id = {n.node_id: n for n in nodes}
    local = quote(spec, samples, market_offers(nodes))
    if not local.fits:  # too few nodes within the job's max_price whatever their speed
        raise _no_fit(spec, local)
    packed = pack(load_checked(path), path, ctx)  # as submit exports it (export cache)
    coord = ctx.coordinator
    # The coordinator counts the program's FLOPs itself (its program check): it needs the
    # program and its initial state (a later submit finds them uploaded).
    program_ref, state_ref = Uploader(coord).upload_all([packed.program, packed.initial_state])
    # What `submit` will spend on this machine before the job exists: as this command, its
    # start-up, export-cache load, packing and upload (its program check then answered from
    # the check the quote ran).
    submit_s = elapsed_since_process_start()
    reply = coord.call(
        "QuoteJob",
        coord.scheduler.QuoteJob,
        scheduler_pb2.QuoteJobRequest(
            spec=packed.spec,
            num_samples=packed.num_samples,
            program_sha256=program_ref.sha256,
            state_bytes=len(packed.initial_state),
            initial_state_sha256=state_ref.sha256,
        ),
    )
    if not reply.fits:
        raise CliError(
            ExitCode.PRECONDITION,
            f"no offer fits job {spec.name}: {reply.reason}",
            "`epochmesh offers` lists the nodes and their prices; `epochmesh queue` the jobs",
        )
    d = program_quote_dict(packed.spec, packed.num_samples, reply.flops_per_sample, reply, submit_s)
    if ctx.json:
        ctx.emit_json(d)
        return ExitCode.OK
    ctx.emit_table(
        ["NODE", "NAME", "DEVICE", "PRICE", "JOB SAMPLES/S", "FROM", "REF SAMPLES/S", "BATCH"],
        [
            [
                n["node_id"],
                n["name"] or "-",
                device_summary(by_id[n["node_id"]]) if n["node_id"] in by_id else "-",
                node_price(by_id[n["node_id"]]) if n["node_id"] in by_id else "-",
                fmt_rate(n["samples_per_second"]),
                RATE_SOURCES.get(n["rate_source"], n["rate_source"]),
                fmt_rate(n["reference_samples_per_second"]),
                str(n["local_batch"]),
            ]
            for n in d["nodes"]
        ],
        right=(3, 4, 6, 7),
        flex=1,
    )
    ctx.emit()
    _emit_lines(ctx, program_quote_lines(d))
    ctx.note(f"an estimate: {PREDICTED_NOTE}")
    return ExitCode.OK


def job_quote_dict(
    job: common_pb2.Job, jq: JobQuote, nodes: dict[str, common_pb2.NodeInfo]
) -> dict[str, Any]:
    """``quote JOB --output json``: quote_dict's keys for the samples the job has left (no
    budget_covers: the escrow is what pays for them), plus the job's progress, spending,
    escrow and deadline, and each chosen node's rate_source ("job" or "benchmark")."""
    out = quote_dict(job.spec, jq.quote, nodes)
    del out["budget_covers"]
    for n in out["nodes"]:
        n["rate_source"] = jq.sources[n["node_id"]]
    out.update(
        {
            "job_id": job.job_id,
            "state": job_state_name(job.state),
            "ended": jq.ended,
            "samples_done": jq.samples_done,
            "samples_total": jq.samples_total,
            "samples_left": jq.samples_left,
            "spent_micro": jq.spent,
            "escrow_micro": jq.escrow,
            "escrow_covers": jq.escrow_covers,
            "deadline_left_seconds": jq.deadline_left,
            "deadline_met": jq.deadline_met,
            "rates": "job_measured_else_reference_benchmark",
        }
    )
    return out


def job_quote_lines(job: common_pb2.Job, jq: JobQuote) -> list[tuple[str, str]]:
    """The key-value lines of ``quote JOB``: an ended job's spending only."""
    q = jq.quote
    name = f"{job.name} ({job.job_id})" if job.name else job.job_id
    state = job_state_name(job.state)
    if jq.ended:
        return [
            ("job", f"{name}: {state}, nothing left to train"),
            ("spent", _credits(jq.spent)),
        ]
    rows = [
        (
            "job",
            f"{name}: {state}, {jq.samples_left} of {jq.samples_total} samples left "
            f"(epoch {min(job.epoch + 1, q.epochs)}/{q.epochs}, {q.num_samples} samples each)",
        )
    ]
    if not q.nothing_left:
        nodes = "node" if len(q.nodes) == 1 else "nodes"
        rows += [
            ("nodes", f"{len(q.nodes)} {nodes} ({q.min_nodes}-{q.max_nodes} allowed): {q.reason}"),
            ("samples/s", fmt_rate(q.rate)),
            ("epoch", f"{fmt_seconds(q.epoch_seconds)}, {_credits(q.epoch_cost)}"),
        ]
    rows.append(("left", f"{fmt_seconds(q.total_seconds)}, {_credits(q.total_cost)}"))
    rows.append(("spent", f"{_credits(jq.spent)} so far"))
    covers = "covers what is left" if jq.escrow_covers else "does NOT cover what is left"
    rows.append(("escrow", f"{_credits(jq.escrow)}: {covers}"))
    if jq.deadline_left is not None:
        met = "met" if jq.deadline_met else "NOT met"
        when = (
            f"{fmt_duration(jq.deadline_left)} left"
            if jq.deadline_left >= 0
            else f"passed {fmt_duration(-jq.deadline_left)} ago"
        )
        rows.append(("deadline", f"{when}: {met}"))
    return rows


def _quote_job(ctx: Context, ref: str) -> int:
    job = ctx.get_job(ref)
    nodes = _quote_nodes(ctx)
    by_id = {n.node_id: n for n in nodes}
    jq = quote_job(job, nodes, now_ms())
    q = jq.quote
    if not jq.ended and not q.nothing_left and not q.fits:
        raise CliError(
            ExitCode.PRECONDITION,
            f"no offer fits job {job.job_id}: {q.reason}",
            "the job waits until enough nodes within its max_price are free; "
            "`epochmesh offers` lists them",
        )
    if ctx.json:
        ctx.emit_json(job_quote_dict(job, jq, by_id))
        return ExitCode.OK
    if q.nodes:
        ctx.emit_table(
            ["NODE", "NAME", "DEVICE", "PRICE", "SAMPLES/S", "RATE"],
            [
                [
                    o.node_id,
                    by_id[o.node_id].name or "-",
                    device_summary(by_id[o.node_id]),
                    node_price(by_id[o.node_id]),
                    fmt_rate(o.rate),
                    "this job" if jq.sources[o.node_id] == JOB_RATE else "reference",
                ]
                for o in q.nodes
            ],
            right=(3, 4),
            flex=1,
        )
        ctx.emit()
    _emit_lines(ctx, job_quote_lines(job, jq))
    if q.nodes:
        measured = sum(1 for o in q.nodes if jq.sources[o.node_id] == JOB_RATE)
        ctx.note(
            f"an estimate: {measured} of {len(q.nodes)} node(s) at this job's measured speed, "
            "the others at their reference benchmark's"
        )
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "offers",
        parents=common,
        help="list the nodes on offer: prices, speed, reliability",
        description="List the nodes with their price per node-hour, SAMPLES/S* (the "
        "node's measured speed on the job it trains now, else its reference benchmark's: a "
        "small built-in MLP, not your job's speed; JOBS has each live job's own measured "
        "speed, `epochmesh quote` predicts a new job's), samples per credit (of SAMPLES/S*), reliability (the share of "
        "their round parts applied, not failed, late or rejected, over all jobs), time "
        "online since they last registered, and their measured samples/s on your live jobs "
        "(operators: every live job), the best value first (donated nodes first). Offline "
        "and quarantined nodes only with --all. --output json: {'offers': [{node_id, name, "
        "state, device, price_micro_per_hour, samples_per_second, rate_source, "
        "samples_per_credit, parts_applied, parts_failed, reliability, online_since_ms, "
        "uptime_seconds, job_samples_per_second: {job id: samples/s}, verified_in_a_row, "
        "verified_total, failed_checks, check_probability, verified}, ...]}. VERIFIED: "
        "the node's spot-check record (`new:3/10`: checked every round until 10 checks in "
        "a row pass; `42@0.24`: checks passed in a row and the chance its next round is "
        "checked; `fail:r17`: its check of round 17 failed).",
    )
    p.add_argument("--all", action="store_true", help="also offline and quarantined nodes")
    p.set_defaults(func=cmd_offers)

    p = sub.add_parser(
        "quote",
        parents=common,
        help="estimate a job's nodes, time and cost",
        description="Pick the nodes a job.toml would get now, as the market does (within "
        "[market] max_price; no max_price: any price with a budget, else donated nodes only; "
        "the least cost per epoch, or the fastest with a deadline), and estimate its time "
        "and cost, and whether its budget and deadline hold. An estimate: rates come from "
        "the reference benchmark, and a job's own speed differs. Given a submitted job "
        "(id, id prefix or name; an argument that is an existing file, ends in .toml or "
        "has a / is a job.toml), quote what it has left instead: each node at the job's "
        "own measured samples/s where known, else its reference benchmark's (RATE "
        "column; rate_source in JSON), against its escrow, with what it spent so far; an "
        "ended job has nothing left (its spending only). Exit 6 when too few nodes fit.",
    )
    p.add_argument("spec", metavar="JOB.toml|JOB", help="a job spec, or a submitted job")
    p.set_defaults(func=cmd_quote)
