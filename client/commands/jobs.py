"""Submitter commands on one job (or all of them): ``status``, ``cancel``, ``download``,
``rounds``, ``logs``, ``allocation`` and ``plot``."""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

from client.commands.allocation import cmd_allocation
from client.commands.cluster import print_events
from client.commands.context import Context
from client.commands.output import (
    TERMINAL_JOB_STATES,
    epoch_text,
    has_loss,
    job_fraction,
    job_state_name,
    parse_job_states,
    to_dict,
)
from client.render import (
    ProgressLine,
    fmt_age,
    fmt_bytes,
    fmt_duration,
    fmt_loss,
    fmt_time,
    progress_bar,
)
from client.rpc import CliError, ExitCode
from epochmesh.money import format_credits
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2, job_pb2, scheduler_pb2

RESULT_FILE = "model.safetensors"


def cmd_status(ctx: Context) -> int:
    if ctx.args.job:
        return _status_one(ctx, ctx.get_job(ctx.args.job))
    coord = ctx.coordinator
    states = parse_job_states(ctx.args.state) if ctx.args.state else []
    reply = coord.call(
        "ListJobs",
        coord.jobs.ListJobs,
        job_pb2.ListJobsRequest(states=states, limit=ctx.args.limit),
    )
    jobs = sorted(reply.jobs, key=lambda j: j.created_ms, reverse=True)
    if ctx.json:
        ctx.emit_json({"jobs": [to_dict(j) for j in jobs]})
        return ExitCode.OK
    if not jobs:
        ctx.note("no jobs; submit one with `epochmesh submit JOB.toml`")
        return ExitCode.OK
    now = now_ms()
    rows = [
        [
            j.job_id,
            j.name or "-",
            job_state_name(j.state),
            epoch_text(j),
            f"{job_fraction(j) * 100:5.1f}%",
            fmt_loss(j.last_loss) if has_loss(j) else "-",
            fmt_age(j.created_ms, now),
        ]
        for j in jobs
    ]
    ctx.emit_table(
        ["JOB", "NAME", "STATE", "EPOCH", "DONE", "LOSS", "CREATED"],
        rows,
        right=(3, 4, 5),
        flex=1,
        paint={2: ctx.out_style.state},
    )
    return ExitCode.OK


def projected_micro(job: common_pb2.Job) -> int | None:
    """The job's total cost at the rate it has paid so far (None: nothing trained yet)."""
    if job.samples_done <= 0:
        return None
    return -(-job.spent_micro * job.samples_total // job.samples_done)


def cost_text(job: common_pb2.Job) -> str:
    """A live job: ``2.4 credits so far, about 9.6 in total; 97.6 left in its escrow``; an
    ended one: ``9.6 credits`` (what it cost, all told)."""
    if job.state in TERMINAL_JOB_STATES:
        return f"{format_credits(job.spent_micro)} credits"
    text = f"{format_credits(job.spent_micro)} credits so far"
    projected = projected_micro(job)
    if projected is not None:
        text += f", about {format_credits(projected)} in total"
    return text + f"; {format_credits(job.escrow_micro)} left in its escrow"


def _status_one(ctx: Context, job: common_pb2.Job) -> int:
    if ctx.json:
        ctx.emit_json(to_dict(job))
        return ExitCode.OK
    style = ctx.out_style
    state = job_state_name(job.state)
    fraction = job_fraction(job)
    rows: list[tuple[str, str]] = [
        ("job", job.job_id + (f" ({job.name})" if job.name else "")),
        ("state", style.state(state)),
        ("epoch", f"{epoch_text(job)}, {job.round} rounds applied"),
        (
            "progress",
            f"{progress_bar(fraction)} {fraction * 100:.1f}% "
            f"({job.samples_done}/{job.samples_total} samples)",
        ),
    ]
    if has_loss(job):
        rows.append(("loss", fmt_loss(job.last_loss)))
    if job.state == common_pb2.JOB_STATE_RUNNING and job.eta_seconds > 0:
        rows.append(("eta", fmt_duration(job.eta_seconds)))  # none while paused or queued
    if job.spent_micro or job.spec.budget_micro:
        rows.append(("cost", cost_text(job)))
    spec = job.spec
    rows.append(
        (
            "spec",
            f"{spec.epochs} epochs, batch {spec.global_batch}"
            + (f" (passes of {spec.micro_batch})" if spec.micro_batch else "")
            + f", {spec.optimizer} lr {spec.lr:g}, "
            f"{spec.aggregation}, {spec.min_nodes}-{spec.max_nodes} nodes",
        )
    )
    rows.append(("dataset", f"{job.num_samples} samples in {len(job.shards)} shards"))
    rows.append(("created", fmt_time(job.created_ms)))
    rows.append(("updated", fmt_time(job.updated_ms)))
    if job.message:
        rows.append(("message", job.message))
    if job.result.sha256:
        rows.append(("result", f"{fmt_bytes(job.result.size)}, sha256 {job.result.sha256[:16]}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        ctx.emit(f"{key.ljust(width)}  {value}")
    return ExitCode.OK


def cmd_cancel(ctx: Context) -> int:
    job = ctx.get_job(ctx.args.job)
    if job.state in TERMINAL_JOB_STATES:
        raise CliError(
            ExitCode.PRECONDITION,
            f"job {job.job_id} already {job_state_name(job.state)}; nothing to cancel",
            f"see it with `epochmesh status {job.job_id}`",
        )
    coord = ctx.coordinator
    updated = coord.call(
        "CancelJob", coord.jobs.CancelJob, job_pb2.CancelJobRequest(job_id=job.job_id)
    )
    if ctx.json:
        ctx.emit_json(to_dict(updated))
    else:
        ctx.emit(f"job {updated.job_id} {job_state_name(updated.state)}")
    return ExitCode.OK


def _not_downloadable(job: common_pb2.Job) -> CliError:
    state = job_state_name(job.state)
    if job.state in TERMINAL_JOB_STATES:
        why = f": {job.message}" if job.message else ""
        return CliError(
            ExitCode.PRECONDITION,
            f"job {job.job_id} {state}{why}; it has no result to download",
            f"see what happened with `epochmesh logs {job.job_id}`",
        )
    return CliError(
        ExitCode.PRECONDITION,
        f"job {job.job_id} has not finished (state {state}, epoch {epoch_text(job)})",
        f"wait for it with `epochmesh watch {job.job_id}`, then download",
    )


def cmd_download(ctx: Context) -> int:
    out_dir = Path(ctx.args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(
            ExitCode.USAGE, f"{out_dir} exists and is not a directory", "give a directory to -o"
        )
    job = ctx.get_job(ctx.args.job)
    if job.state != common_pb2.JOB_STATE_SUCCEEDED:
        raise _not_downloadable(job)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / RESULT_FILE
    tag = job.result.sha256[:16] or job.job_id
    part = out_dir / f".{RESULT_FILE}.{tag}.part"
    offset = part.stat().st_size if part.exists() else 0
    if job.result.size and offset > job.result.size:
        part.unlink()
        offset = 0
    coord = ctx.coordinator
    progress = ProgressLine(ctx.stderr)
    total = job.result.size
    sha = job.result.sha256
    received = offset
    try:
        with part.open("ab") as fh:
            request = job_pb2.DownloadResultRequest(job_id=job.job_id, offset=offset)
            for msg in coord.stream("DownloadResult", coord.jobs.DownloadResult, request):
                total = msg.total_size or total
                sha = msg.sha256 or sha
                if msg.chunk.data:
                    if msg.chunk.offset != received:
                        raise CliError(
                            ExitCode.INTERNAL,
                            f"download out of order: got offset {msg.chunk.offset}, "
                            f"expected {received}",
                            "run the download again; it resumes",
                        )
                    fh.write(msg.chunk.data)
                    received += len(msg.chunk.data)
                frac = received / total if total else 1.0
                progress.update(
                    f"downloading {job.job_id}: {fmt_bytes(received)} / {fmt_bytes(total)} "
                    f"({frac * 100:.0f}%)",
                    frac,
                )
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        progress.clear()
        raise
    digest = _sha256_file(part)
    if sha and digest != sha:
        part.unlink()
        raise CliError(
            ExitCode.INTERNAL,
            f"downloaded result does not match its sha256 ({digest[:16]} != {sha[:16]})",
            "run the download again",
        )
    os.replace(part, target)
    progress.done(f"downloaded {job.job_id}: {fmt_bytes(received)} -> {target}")
    if ctx.json:
        ctx.emit_json(
            {"job_id": job.job_id, "path": str(target), "size": received, "sha256": digest}
        )
    else:
        ctx.emit(str(target))
    return ExitCode.OK


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_rounds(ctx: Context, job_id: str, since: int = 0) -> list[common_pb2.RoundRecord]:
    coord = ctx.coordinator
    reply = coord.call(
        "GetRounds",
        coord.jobs.GetRounds,
        job_pb2.GetRoundsRequest(job_id=job_id, since_round=since, limit=0),
    )
    return list(reply.rounds)


def round_parts_text(record: common_pb2.RoundRecord) -> str:
    parts = []
    for p in record.parts:
        mark = "" if p.status in ("", "applied") else f"({p.status})"
        parts.append(f"{p.node_id}:{p.local_batch}{mark}")
    return " ".join(parts)


def cmd_rounds(ctx: Context) -> int:
    job = ctx.get_job(ctx.args.job)
    rounds = fetch_rounds(ctx, job.job_id, ctx.args.since)
    if ctx.json:
        for record in rounds:
            ctx.emit_json_line(to_dict(record))
        return ExitCode.OK
    if not rounds:
        ctx.note(f"job {job.job_id} has no rounds yet")
        return ExitCode.OK
    rows = []
    for r in rounds:
        applied = sum(p.local_batch for p in r.parts if p.status in ("", "applied"))
        secs = (r.finished_ms - r.started_ms) / 1000 if r.finished_ms > r.started_ms else 0.0
        rows.append(
            [
                str(r.epoch + 1),
                str(r.round),
                fmt_loss(r.loss),
                str(applied),
                f"{secs:.2f}",
                round_parts_text(r),
            ]
        )
    ctx.emit_table(
        ["EPOCH", "ROUND", "LOSS", "SAMPLES", "SECONDS", "NODE:B_I"],
        rows,
        right=(0, 1, 2, 3, 4),
        flex=5,
    )
    return ExitCode.OK


def cmd_logs(ctx: Context) -> int:
    job = ctx.get_job(ctx.args.job)
    coord = ctx.coordinator
    if ctx.args.follow:
        request = scheduler_pb2.WatchEventsRequest(job_id=job.job_id, follow=True)
        print_events(ctx, coord.stream("WatchEvents", coord.scheduler.WatchEvents, request))
        return ExitCode.OK
    reply = coord.call(
        "GetJobEvents",
        coord.jobs.GetJobEvents,
        job_pb2.GetJobEventsRequest(job_id=job.job_id, limit=ctx.args.limit),
    )
    if print_events(ctx, reply.events) == 0 and not ctx.json:
        ctx.note(f"job {job.job_id} has no events yet")
    return ExitCode.OK


def cmd_plot(ctx: Context) -> int:
    from client.plot import plot_rounds, require_matplotlib

    require_matplotlib()
    out = Path(ctx.args.out)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CliError(ExitCode.USAGE, f"cannot tell the image format of {out}", "name it FILE.png")
    if not out.parent.is_dir():
        raise CliError(ExitCode.USAGE, f"directory {out.parent} does not exist", "create it first")
    job = ctx.get_job(ctx.args.job)
    rounds = fetch_rounds(ctx, job.job_id)
    if not rounds:
        raise CliError(
            ExitCode.PRECONDITION,
            f"job {job.job_id} has no rounds yet; nothing to plot",
            f"wait for it with `epochmesh watch {job.job_id}`",
        )
    plot_rounds(job, rounds, out)
    if ctx.json:
        ctx.emit_json({"job_id": job.job_id, "path": str(out), "rounds": len(rounds)})
    else:
        ctx.emit(str(out))
    if not ctx.json:
        ctx.note(f"plotted loss and throughput of {len(rounds)} rounds of {job.job_id}")
    return ExitCode.OK


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "status",
        parents=common,
        help="list jobs, or show one job",
        description="Without JOB, list the jobs; with JOB, show that job in detail.",
    )
    p.add_argument("job", metavar="JOB", nargs="?", help="job id, unique prefix or unique name")
    p.add_argument("--state", metavar="S", help="only jobs in these states (comma-separated)")
    p.add_argument("--limit", type=int, default=100, metavar="N", help="at most N jobs")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "cancel", parents=common, help="cancel a job", description="Cancel a queued or running job."
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser(
        "download",
        parents=common,
        help="download a finished job's model",
        description=f"Write the trained model of a finished job to DIR/{RESULT_FILE} "
        "(keys exactly make_model().state_dict() keys). Resumes an interrupted download.",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.add_argument("-o", "--out", metavar="DIR", required=True, help="directory to write into")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser(
        "rounds",
        parents=common,
        help="show the recorded rounds of a job",
        description="Show every applied round: epoch, loss and each node's local batch. "
        "With --output json: one JSON object per round (JSON lines).",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.add_argument("--since", type=int, default=0, metavar="R", help="rounds after round R")
    p.set_defaults(func=cmd_rounds)

    p = sub.add_parser(
        "logs",
        parents=common,
        help="show a job's events",
        description="Show a job's events (JSON lines with --output json).",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.add_argument("-f", "--follow", action="store_true", help="keep waiting for new events")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="at most N events")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser(
        "allocation",
        parents=common,
        help="show how a job is split over nodes and where their time goes",
        description="Show each node's measured throughput, share, local batch (and inner "
        "steps in local SGD) and segment, then its RTT and bandwidth to the coordinator and "
        "the seconds it spent computing vs communicating for this job, with a total over all "
        "nodes. A job that is not running shows the times summed from its recorded rounds. "
        "--output json: the allocation plus 'source' and 'totals'.",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.set_defaults(func=cmd_allocation)

    p = sub.add_parser(
        "plot",
        parents=common,
        help="chart a job's loss and throughput (needs matplotlib)",
        description="Write a loss / throughput chart of a job's rounds to FILE.png. Needs the "
        "optional extra: pip install 'epochmesh[plot]'.",
    )
    p.add_argument("job", metavar="JOB", help="job id, unique prefix or unique name")
    p.add_argument("-o", "--out", metavar="FILE", required=True, help="image file (.png)")
    p.set_defaults(func=cmd_plot)
